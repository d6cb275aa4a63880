"""The one place where megatron-lbp reaches into megatron-core's structure.

Everything that knows about Megatron's modules, optimizer configuration or
parallel state lives here, so that a megatron-core upgrade touches one file.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from megatron_lbp.core import patching
from megatron_lbp.integration.capabilities import (META_DEVICE_MESSAGE, READS_RELEASED_WEIGHTS,
                                                   conflicting_flag_message,
                                                   released_weights_message)
from megatron_lbp.core.config import EngineOptions, HierConfigError
from megatron_lbp.core.vocabulary import SPLIT_WITH_FULL_RECOMPUTE

# Megatron flags that pick another data-parallel implementation.
CONFLICTING_FLAGS = (
    ("use_megatron_fsdp", "--use-megatron-fsdp"),
    ("use_torch_fsdp2", "--use-torch-fsdp2"),
    ("use_custom_fsdp", "--use-custom-fsdp"),
)


def check_megatron_args(args: Any) -> None:
    """Refuse Megatron flags the hierarchy cannot serve, naming both flags (one line each).

    The command-line forms are refused earlier, before Megatron parses them
    (megatron_lbp.integration.capabilities.UNSERVABLE); these checks hold for arguments that
    reach Megatron another way.
    """
    for attr, flag in CONFLICTING_FLAGS:
        if getattr(args, attr, False):
            raise ValueError(conflicting_flag_message(flag))
    if getattr(args, "init_model_with_meta_device", False):
        raise ValueError(META_DEVICE_MESSAGE)
    for flag, what in READS_RELEASED_WEIGHTS.items():
        if getattr(args, flag[2:].replace("-", "_"), None) not in (None, False):
            raise ValueError(released_weights_message(flag, what))
    if (getattr(args, "expert_model_parallel_size", 1) or 1) > 1 or getattr(args, "num_experts", None):
        raise ValueError("--hier-partition does not support expert-parallel (MoE) models yet "
                         "(--num-experts / --expert-model-parallel-size)")
    if (getattr(args, "hier_layer_unit", "whole") == "split"
            and getattr(args, "recompute_granularity", None) == "full"):
        raise ValueError(f"--hier-layer-unit split with --recompute-granularity full: "
                         f"{SPLIT_WITH_FULL_RECOMPUTE}; use selective or no recomputation, "
                         "or --hier-layer-unit whole")
    for attr, flag in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                       ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                       ("context_parallel_size", "--context-parallel-size")):
        if (getattr(args, attr, 1) or 1) > 1:
            raise ValueError(f"--hier-partition supports data parallelism only for now: "
                             f"{flag}={getattr(args, attr)} must be 1")


def extra_weight_users(model: torch.nn.Module) -> dict[torch.nn.Module, list[torch.nn.Parameter]]:
    """Modules that use a weight they do not own: GPT's output layer with tied embeddings.

    megatron-core's GPTModel passes the word-embedding weight to its output
    layer as an argument (``share_embeddings_and_output_weights``), so the
    embedding's bucket must stay gathered until the output layer has run.
    """
    users = {}
    for m in model.modules():
        if (getattr(m, "share_embeddings_and_output_weights", False)
                and getattr(m, "post_process", True)
                and hasattr(m, "output_layer")
                and getattr(m.output_layer, "weight", None) is None):
            users[m.output_layer] = [m.shared_embedding_or_output_weight()]
    return users


def gather_units(model: torch.nn.Module, layer_unit: str = "whole") -> list:
    """The gather units of a megatron-core model: embedding, each transformer layer, output.

    A transformer layer is one unit because its forward brackets every use of
    its weights: its linear modules return their bias (skip_bias_add) for the
    layer to add later, so the layer, not the linear module, must keep them
    gathered. The output unit is the decoder's final norm plus the output
    layer (which, with tied embeddings, owns no weight and computes with the
    embedding unit's, declared by :func:`extra_weight_users`). Anything else
    that holds parameters is left to the engine's "other" units.

    ``layer_unit="split"`` (--hier-layer-unit) declares each layer as two units
    (:func:`split_layer_units`).
    """
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding)
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    from megatron_lbp.engine.grouping import UnitSpec

    specs = []
    for m in model.modules():
        if isinstance(m, LanguageModelEmbedding):
            specs.append(UnitSpec("embedding", (m,)))
        elif isinstance(m, BaseTransformerLayer):
            number = getattr(m, "layer_number", None)
            layer = None if number is None else number - 1
            if layer_unit == "split":
                specs += split_layer_units(m, layer)
            else:
                specs.append(UnitSpec("layer", (m,), layer))
        elif hasattr(m, "output_layer") and hasattr(m, "decoder"):
            norm = getattr(m.decoder, "final_layernorm", None)
            modules = tuple(x for x in (norm, m.output_layer) if x is not None)
            if modules:
                specs.append(UnitSpec("output", modules))
    return specs


# megatron-core 0.19.2 TransformerLayer, in forward order: _forward_attention runs these, then
# self_attn_bda (adds linear_proj's bias); _forward_mlp runs pre_mlp_layernorm, mlp, mlp_bda
# (adds linear_fc2's bias).
ATTENTION_HALF = ("input_layernorm", "self_attention", "pre_cross_attn_layernorm", "cross_attention")
MLP_HALF = ("pre_mlp_layernorm", "mlp")


def split_layer_units(layer: torch.nn.Module, number: int | None) -> list:
    """A transformer layer as two gather units (--hier-layer-unit split), in forward order.

    attention: the input norm and self-attention (and cross-attention's modules, GPT's
    are parameterless identities); the layer adds linear_proj's bias in self_attn_bda,
    after self-attention returns, so the unit is held until the pre-MLP norm has run.
    mlp: the pre-MLP norm and the MLP; the layer adds linear_fc2's bias in mlp_bda, so
    the unit is held until the layer's forward ends. Refused unless these modules own
    every parameter of the layer (another layer class would need its own halves).
    """
    from megatron_lbp.engine.grouping import UnitSpec

    missing = [n for n in ATTENTION_HALF + MLP_HALF if not isinstance(getattr(layer, n, None),
                                                                      torch.nn.Module)]
    halves = [[getattr(layer, n) for n in names if getattr(layer, n, None) is not None]
              for names in (ATTENTION_HALF, MLP_HALF)]
    covered = {id(p) for half in halves for m in half for p in m.parameters()}
    stray = [n for n, p in layer.named_parameters() if id(p) not in covered]
    if missing or stray:
        raise HierConfigError(
            f"--hier-layer-unit split: {type(layer).__name__} "
            + (f"has no {', '.join(missing)}" if missing else
               f"holds parameters outside its attention and MLP halves ({', '.join(stray[:3])})")
            + "; use --hier-layer-unit whole")
    attention, mlp = (tuple(m for m in half if any(True for _ in m.parameters()))
                      for half in halves)
    return [UnitSpec("attention", attention, number, held_by=(layer.pre_mlp_layernorm,)),
            UnitSpec("mlp", mlp, number, held_by=(layer,))]


def check_lookup_only_embeddings(units: list) -> None:
    """Refuse --hier-embedding-backward-gather skip unless every parameter of the embedding
    units is a plain lookup's table, whose backward reads no weight values.

    megatron-core 0.19.2: VocabParallelEmbedding.forward is ``F.embedding`` (or
    ``weight[ids]`` in deterministic mode), whose backward needs the indices and the
    table's shape only, unless GTP wraps the weight (``gtp_remat_size > 1``:
    GTPEmbeddingWeight, a custom autograd function); position and token-type tables
    are ``torch.nn.Embedding``.
    """
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    for spec in units:
        if spec.kind != "embedding":
            continue
        for top in spec.modules:
            for name, m in top.named_modules():
                if not any(True for _ in m.parameters(recurse=False)):
                    continue
                lookup = (isinstance(m, torch.nn.Embedding) and not m.sparse
                          or isinstance(m, VocabParallelEmbedding)
                          and getattr(m, "gtp_remat_size", 1) <= 1)
                if not lookup:
                    raise HierConfigError(
                        f"--hier-embedding-backward-gather skip: the embedding unit's module "
                        f"{name or type(top).__name__} ({type(m).__name__}) is not a plain "
                        "lookup table, so its backward may read the weights; use 'gather'")


def optimizer_param_groups(model_chunks: Iterable[torch.nn.Module], opt_config: Any) -> list[dict]:
    """Megatron's own parameter groups (weight-decay and lr multipliers per parameter)."""
    from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides

    return _get_param_groups(list(model_chunks), opt_config,
                             get_standard_config_overrides(opt_config))


def wrap_model(config: Any, model: torch.nn.Module, hier, options: EngineOptions):
    """HierDataParallel around a megatron-core model, with its tied-weight users declared.

    A model built by :func:`build_sharded` holds no weights yet: the engine lays
    out its buckets, then the construction runs again and leaves each rank
    only its slices (engine/materialize.py).

    Megatron's schedules run every micro-batch but the last inside
    ``config.no_sync_func``; megatron.training sets it only for its own DDP
    classes (training.py, with --overlap-grad-reduce), so the engine's goes in
    here: it is how the engine knows the last micro-batch, whose backward
    carries the step's network reductions.
    """
    from megatron_lbp.engine import materialize
    from megatron_lbp.engine.data_parallel import HierDataParallel

    construction = materialize.construction_of(model)
    fill = None
    if construction is not None:
        _check_mixed_precision_wrapper(model, construction.cast_dtype)
        construction.check_untouched(model)

        def fill(ddp):
            construction.materialize(ddp.write_weights)
    else:
        for name, p in model.named_parameters():
            if materialize.is_placeholder(p):
                raise materialize.ShardedInitError(
                    f"parameter {name} holds no values and no sharded construction is recorded "
                    "for this model (was it built by megatron_adapter.build_sharded?)")
    units = gather_units(model, options.layer_unit)
    if options.embedding_backward_gather == "skip":
        check_lookup_only_embeddings(units)
    ddp = HierDataParallel(config, model, hier, options, extra_weight_users=extra_weight_users(model),
                           units=units, materialize=fill)
    if construction is not None:
        materialize.forget(model)
    if getattr(config, "no_sync_func", None) is None and hasattr(config, "no_sync_func"):
        config.no_sync_func = ddp.no_sync
    return ddp


# --- sharded initialization: megatron-core's side ---------------------------------------
def mixed_precision_dtype(config: Any) -> torch.dtype | None:
    """What Megatron's Float16Module casts every floating-point parameter to (None: no wrapper)."""
    if getattr(config, "fp16", False):
        return torch.float16
    if getattr(config, "bf16", False):
        return torch.bfloat16
    return None


def model_device() -> torch.device:
    """Where megatron.training puts the model: the current GPU/GCD, or the CPU of a CPU run."""
    from megatron_lbp.integration import compat

    if torch.cuda.is_available() and not compat.cpu_runtime_active():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_sharded(builder, config: Any) -> torch.nn.Module:
    """``builder()`` (a model provider) run so that no weight stays resident (see engine/materialize.py).

    ``config``: anything with Megatron's ``fp16``/``bf16`` (the training args or
    the TransformerConfig): placeholders take the dtype Float16Module will cast to.
    """
    from megatron_lbp.engine import materialize

    return materialize.build_sharded(builder, cast_dtype=mixed_precision_dtype(config),
                                     device=model_device(), rng_snapshot=RngSnapshot.take)


def _check_mixed_precision_wrapper(model: torch.nn.Module, cast_dtype) -> None:
    from megatron.core.transformer.module import Float16Module

    from megatron_lbp.engine.materialize import ShardedInitError

    if (cast_dtype is not None) != isinstance(model, Float16Module):
        raise ShardedInitError(
            "sharded initialization: the model was built for "
            f"{'a ' + str(cast_dtype) + ' Float16Module' if cast_dtype else 'no mixed-precision wrapper'}"
            f" but is wrapped as {type(model).__name__}; build with --no-hier-sharded-init")


class RngSnapshot:
    """Every generator model construction draws from: torch's CPU and device generators and
    megatron-core's CUDA RNG tracker states (model-parallel, data-parallel, expert)."""

    def __init__(self, cpu, device, tracker) -> None:
        self.cpu, self.device, self.tracker = cpu, device, tracker

    @classmethod
    def take(cls) -> "RngSnapshot":
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        from megatron_lbp.integration import compat

        device = None
        if torch.cuda.is_available() and not compat.cpu_runtime_active():
            device = torch.cuda.get_rng_state_all()
        tracker = {name: _copy_rng(state) for name, state in get_cuda_rng_tracker().get_states().items()}
        return cls(torch.get_rng_state(), device, tracker)

    def restore(self) -> None:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.cuda.set_rng_state_all(self.device)
        tracker = get_cuda_rng_tracker()
        states = tracker.get_states()
        for name, saved in self.tracker.items():
            if isinstance(states.get(name), torch.Generator):
                states[name].set_state(saved)   # graph-safe trackers keep generator objects
            else:
                states[name] = saved.clone()
        tracker.set_states(states)

    def equals(self, other: "RngSnapshot") -> bool:
        return (torch.equal(self.cpu, other.cpu)
                and self.tracker.keys() == other.tracker.keys()
                and all(torch.equal(self.tracker[k], other.tracker[k]) for k in self.tracker))


def _copy_rng(state):
    return state.get_state() if isinstance(state, torch.Generator) else state.clone()


def build_optimizer(opt_config: Any, model_chunks: list, options: EngineOptions):
    """HierDistributedOptimizer with Megatron's param groups and, for fp16, its loss scaler."""
    from megatron_lbp.engine.optimizer import HierDistributedOptimizer

    grad_scaler = None
    if getattr(opt_config, "fp16", False):
        from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

        if opt_config.loss_scale:
            grad_scaler = ConstantGradScaler(opt_config.loss_scale)
        else:
            grad_scaler = DynamicGradScaler(
                initial_scale=opt_config.initial_loss_scale, min_scale=opt_config.min_loss_scale,
                growth_factor=2.0, backoff_factor=0.5, growth_interval=opt_config.loss_scale_window,
                hysteresis=opt_config.hysteresis)
    return HierDistributedOptimizer(opt_config, model_chunks,
                                    optimizer_param_groups(model_chunks, opt_config),
                                    grad_scaler=grad_scaler, comm_report=options.comm_report)


def data_parallel_group():
    """Megatron's data-parallel group when model-parallel state is up, else None (the world)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_group()
    return None


GPT2_BPE = patching.declare(
    __name__, "gpt2 bpe from files", "megatron.core.tokenizers.text.libraries:MegatronHFTokenizer",
    "every training start (arguments.py is imported)",
    "GPT2BPETokenizer from --vocab-file/--merge-file without the network megatron-core's path needs")


def install_gpt2_bpe_from_files() -> None:
    """``--tokenizer-type GPT2BPETokenizer`` built from ``--vocab-file``/``--merge-file`` alone (idempotent).

    megatron-core 0.19.2 builds that type as its "megatron" library,
    ``MegatronHFTokenizer``, which cannot work offline: it calls transformers'
    ``AutoTokenizer.from_pretrained("gpt2", vocab_file=..., merges_file=...)``.
    Without transformers installed that fails with "name 'AutoTokenizer' is not
    defined"; with it, "gpt2" is still a Hugging Face hub name whose config and
    tokenizer files are fetched (or read from a hub cache), and compute nodes
    have neither; given no files at all, it downloads GPT-2's with wget. Here the
    two files make the tokenizer directly (megatron_lbp.integration.gpt2_bpe).

    megatron-core looks the library class up by name on
    ``megatron.core.tokenizers.text.libraries`` each time it builds a tokenizer
    (``MegatronTokenizerText._restore_model``), so replacing that name reaches
    every builder: megatron.training's global tokenizer, the dataset config of
    pretrain_gpt.py (ours and Megatron-LM's) and python -m megatron_lbp.preprocess_data.
    The BERT word-piece types, which share the class, keep megatron-core's.
    """
    def make(original):
        def megatron_library(tokenizer_path, vocab_file=None, merges_file=None, **kwargs):
            if tokenizer_path == "GPT2BPETokenizer" and vocab_file and merges_file:
                from megatron_lbp.integration.gpt2_bpe import GPT2BPE

                return GPT2BPE(vocab_file, merges_file,
                               additional_special_tokens=kwargs.get("additional_special_tokens") or (),
                               include_special_tokens=kwargs.get("include_special_tokens", True))
            return original(tokenizer_path, vocab_file, merges_file, **kwargs)
        return megatron_library

    patching.apply(GPT2_BPE, make)


def gpt_model_config(args):
    """megatron.training's GPTModelConfig for ``args``, with ``--openai-gelu`` applied.

    megatron-core 0.19.2 parses ``--openai-gelu`` and never reads it: the MLP
    computes the erf GELU (``F.gelu``) unfused, and the tanh approximation
    only when ``--bias-gelu-fusion`` is on (``bias_gelu_impl``), so the same
    flags compute different functions on different devices. GPT-2's weights were trained
    with the tanh form; the flag now selects it, unfused, everywhere
    (megatron-core's own ``openai_gelu``; the fused kernel accepts only ``F.gelu``).
    """
    from megatron.training.argument_utils import gpt_config_from_args

    cfg = gpt_config_from_args(args)
    if getattr(args, "openai_gelu", False) and not getattr(args, "swiglu", False):
        from megatron.core.transformer.utils import openai_gelu

        cfg.transformer.activation_func = openai_gelu
        cfg.transformer.bias_activation_fusion = False
    return cfg
