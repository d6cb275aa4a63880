"""A tiny megatron-core GPT, its data and two training loops: stock Megatron and a plain reference.

Everything here runs inside a rank started by :mod:`megatron_lbp.testing.multirank`
(or any process with torch.distributed up). The stock loop is the yardstick every
partitioning scheme of this project is compared with: megatron-core's own
``DistributedDataParallel`` + ``DistributedOptimizer`` as megatron.training
drives them. The reference loop is the same model, data and maths in one
process with ``torch.optim.AdamW`` and ``clip_grad_norm_``: no Megatron
optimizer or DDP code at all, so agreement proves the stock path is right on
CPU before anything of ours is measured against it.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_lbp.integration import compat


@dataclass(frozen=True)
class TinyGPTSpec:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 32
    seed: int = 1234
    params_dtype: torch.dtype = torch.float32
    # Full activation recomputation, one layer per checkpoint: each layer's
    # forward runs again inside the backward pass (forward pre-hooks fire there).
    recompute: bool = False
    # Selective recomputation of these megatron-core modules (--recompute-modules, e.g.
    # "core_attn", "layernorm", "mlp"); empty: none. Their forward runs again inside the
    # backward, through megatron-core's checkpoint functions.
    recompute_modules: tuple[str, ...] = ()
    # Megatron's two weight-init paths: the whole weight drawn from the CPU
    # generator (--use-cpu-initialization), or on the device under the CUDA
    # RNG tracker (on CPU ranks through megatron_lbp.integration.compat's mappings).
    use_cpu_initialization: bool = True
    # Megatron's --gradient-accumulation-fusion: the linear layers' weight
    # gradients go through fused_weight_gradient_mlp_cuda into param.main_grad.
    gradient_accumulation_fusion: bool = False
    # The architecture, as Megatron's flags describe it. The defaults are the
    # project's test GPT (RoPE, tied output layer); ARCHITECTURES names others,
    # Megatron's own defaults among them.
    position_embedding_type: str = "rope"        # --position-embedding-type: rope|learned_absolute|none
    tied_output: bool = True                     # not --untie-embeddings-and-output-weights
    normalization: str = "LayerNorm"             # --normalization: LayerNorm|RMSNorm
    swiglu: bool = False                         # --swiglu (gated SiLU MLP)
    num_query_groups: int | None = None          # --group-query-attention --num-query-groups
    add_bias_linear: bool = True                 # not --disable-bias-linear
    ffn_hidden_size: int | None = None           # --ffn-hidden-size (None: 4 x hidden)
    init_method_std: float = 0.02                # --init-method-std
    xavier_init: bool = False                    # --init-method-xavier-uniform


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 6
    micro_batch_size: int = 2          # sequences per rank per micro-batch
    micro_batches: int = 1             # gradient accumulation steps
    lr: float = 1e-3
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    data_seed: int = 99
    bucket_size: int | None = None     # DDP bucket size in elements (None: Megatron's default)
    overlap_grad_reduce: bool = False
    # Real text instead of random counting sequences: the shipped corpus through
    # the shipped tokenizer (vocabulary 4096; TinyGPTSpec.vocab_size must cover it).
    text: bool = False


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)       # global mean loss per step
    grad_norms: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # final full weights
    step_reports: list[dict] = field(default_factory=list)   # engine only: traffic and memory per step
    extra: dict = field(default_factory=dict)


def init_megatron_state(tp: int = 1, pp: int = 1, seed: int = 1234) -> None:
    """Model-parallel state and RNG as megatron.training's initialize does it, on CPU if needed."""
    from megatron.core import parallel_state, tensor_parallel

    compat.enable()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# Architectures Megatron's flags describe, by name (fields of TinyGPTSpec). The
# equivalence and sharded-init tests run over them, so the suite exercises
# Megatron's defaults and the Llama-style models users bring, not only the
# project's own test GPT.
ARCHITECTURES: dict[str, dict] = {
    "test-gpt": {},                                               # RoPE, tied, LayerNorm, GeLU
    "megatron-defaults": dict(position_embedding_type="learned_absolute"),
    "gpt2-untied-xavier": dict(position_embedding_type="learned_absolute", tied_output=False,
                               xavier_init=True),
    "llama": dict(normalization="RMSNorm", swiglu=True, num_query_groups=2,
                  add_bias_linear=False, tied_output=False, ffn_hidden_size=96),
    # No linear biases here: the key part of a QKV bias gets an analytically zero
    # gradient (softmax ignores a shift shared by every key), so Adam turns its
    # rounding noise into whole updates and the fp32 weight bound would measure noise.
    "nope-rmsnorm-std": dict(position_embedding_type="none", normalization="RMSNorm",
                             init_method_std=0.05, add_bias_linear=False),
    "gqa-swiglu-bias-learned": dict(position_embedding_type="learned_absolute", swiglu=True,
                                    num_query_groups=1),
}


def tiny_gpt_config(spec: TinyGPTSpec = TinyGPTSpec()):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    arch = {}
    if spec.swiglu:
        arch.update(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    if spec.num_query_groups is not None:
        arch["num_query_groups"] = spec.num_query_groups
    if spec.ffn_hidden_size is not None:
        arch["ffn_hidden_size"] = spec.ffn_hidden_size
    if spec.xavier_init:
        # what megatron.training's --init-method-xavier-uniform means (compat.xavier_init_flag)
        arch.update(init_method=torch.nn.init.xavier_uniform_,
                    output_layer_init_method=torch.nn.init.xavier_uniform_)
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        use_cpu_initialization=spec.use_cpu_initialization,
        gradient_accumulation_fusion=spec.gradient_accumulation_fusion,
        params_dtype=spec.params_dtype,
        bf16=spec.params_dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.init_method_std,
        normalization=spec.normalization,
        add_bias_linear=spec.add_bias_linear,
        **arch,
        **(dict(recompute_granularity="full", recompute_method="uniform",
                recompute_num_layers=1) if spec.recompute else {}),
        **(dict(recompute_granularity="selective", recompute_modules=list(spec.recompute_modules))
           if spec.recompute_modules else {}),
    )


def tiny_gpt_provider(spec: TinyGPTSpec, config):
    """The model provider (what megatron.training's get_model calls): seed, then GPTModel."""
    def provide():
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        torch.manual_seed(spec.seed)
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization=spec.normalization),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length,
            position_embedding_type=spec.position_embedding_type,
            share_embeddings_and_output_weights=spec.tied_output,
        )

    return provide


def build_tiny_gpt(spec: TinyGPTSpec = TinyGPTSpec(), sharded: bool = False):
    """megatron-core GPTModel with the local (non-Transformer-Engine) layer spec, tied embeddings.

    ``sharded``: built by megatron_adapter.build_sharded (no weight resident;
    the engine's wrapping materializes this rank's slices).
    """
    config = tiny_gpt_config(spec)
    provide = tiny_gpt_provider(spec, config)
    if sharded:
        from megatron_lbp.integration import megatron_adapter

        model = megatron_adapter.build_sharded(provide, config)
    else:
        model = provide()
    if config.bf16:
        # What megatron.training does: every parameter in bf16 (norms included),
        # inputs cast on the way in and the loss back to fp32 on the way out.
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model, config


def global_batch(step: int, micro: int, spec: TinyGPTSpec, train: TrainSpec, dp_size: int):
    """Tokens of one micro-batch for all DP ranks together: [dp_size * micro_batch_size, seq+1].

    Drawn from a generator seeded by (data_seed, step, micro) so every rank and
    the reference see the same numbers without sharing files. With
    ``train.text``: consecutive windows of the tokenized corpus instead (see
    :func:`text_batch`).
    """
    if train.text:
        return text_batch(step, micro, spec, train, dp_size)
    g = torch.Generator().manual_seed(train.data_seed * 1_000_003 + step * 1009 + micro)
    rows = dp_size * train.micro_batch_size
    # A little structure (each row counts up from a random start) so the loss can fall.
    start = torch.randint(0, spec.vocab_size, (rows, 1), generator=g)
    noise = torch.randint(0, 3, (rows, spec.seq_length + 1), generator=g)
    return (start + torch.arange(spec.seq_length + 1) + noise) % spec.vocab_size


_TEXT_CHUNK = 1 << 16  # tokens are produced in multiples of this, so callers share a cache entry


@functools.lru_cache(maxsize=4)
def text_tokens(min_tokens: int) -> torch.Tensor:
    """The first >= ``min_tokens`` tokens of the shipped corpus (fewer if it is shorter).

    Documents of data_src/python-docs-3.11.jsonl.gz in file order, each encoded
    by tokenizer/lbp_bpe.model (SentencePiece BPE, vocabulary 4096) and ended by
    its ``</s>``: the same stream megatron_lbp.integration.data's demo dataset holds. Once
    per process and length (~0.3 s per 100k tokens); deterministic.
    """
    import gzip
    import json

    import sentencepiece as spm

    from megatron_lbp.integration.data import CORPUS, ensure_tokenizer

    sp = spm.SentencePieceProcessor(model_file=str(ensure_tokenizer()))
    want = -(-min_tokens // _TEXT_CHUNK) * _TEXT_CHUNK
    ids: list[int] = []
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            ids.extend(sp.encode(json.loads(line)["text"]))
            ids.append(sp.eos_id())
            if len(ids) >= want:
                break
    return torch.tensor(ids, dtype=torch.long)


TEXT_VOCAB = 4096


def text_batch(step: int, micro: int, spec: TinyGPTSpec, train: TrainSpec, dp_size: int):
    """Real-text micro-batch for all DP ranks: [dp_size * micro_batch_size, seq+1] token ids.

    Row r of (step, micro) is window number ``(step*micro_batches + micro)*rows + r``
    of seq+1 consecutive corpus tokens, so a run reads the corpus from its start
    without repeating a window until it wraps around.
    """
    if spec.vocab_size < TEXT_VOCAB:
        raise ValueError(f"TrainSpec.text needs TinyGPTSpec.vocab_size >= {TEXT_VOCAB} (the "
                         f"tokenizer's vocabulary), got {spec.vocab_size}")
    rows, width = dp_size * train.micro_batch_size, spec.seq_length + 1
    tokens = text_tokens(train.steps * train.micro_batches * rows * width)
    first = ((step * train.micro_batches + micro) * rows) * width
    index = (first + torch.arange(rows * width)) % tokens.numel()
    return tokens[index].view(rows, width)


def forward_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of ``tokens`` ([b, s+1]) through a Megatron GPTModel."""
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    b, s = inputs.shape
    position_ids = torch.arange(s, device=inputs.device).unsqueeze(0).expand(b, s)
    per_token = model(inputs, position_ids, attention_mask=None, labels=labels)
    return per_token.float().mean()


def _gpt_of(model):
    """The GPTModel inside megatron's Float16Module (bf16/fp16), or the model itself."""
    from megatron.core.transformer.module import Float16Module

    return model.module if isinstance(model, Float16Module) else model


def _gathered_params(model) -> dict[str, torch.Tensor]:
    """Final weights by the GPT's own parameter names (no Float16Module prefix), in fp32."""
    return {name: p.detach().float().clone() for name, p in _gpt_of(model).named_parameters()}


@dataclass
class Trainer:
    """A wrapped model with its optimizer and schedule, and the loop megatron.training would run."""

    spec: TinyGPTSpec
    train: TrainSpec
    model: torch.nn.Module            # the data-parallel wrapper
    inner: torch.nn.Module            # the GPT model it wraps
    optimizer: object
    scheduler: object
    dp_rank: int
    dp_size: int
    dp_group: object = None
    hier: object = None
    device: torch.device | None = None   # where the model's inputs go (None: left on the CPU)

    def run(self, steps, probe=None, result: TrainResult | None = None) -> TrainResult:
        """Train the given step numbers; ``probe(model, optimizer, step, micro)`` after each backward."""
        result = result or TrainResult()
        train = self.train
        for step in steps:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            local_loss = torch.zeros((), device=self.device)

            def micro_batch(micro: int) -> None:
                nonlocal local_loss
                tokens = global_batch(step, micro, self.spec, train, self.dp_size)
                lo = self.dp_rank * train.micro_batch_size
                rows = tokens[lo:lo + train.micro_batch_size]
                loss = forward_loss(self.model, rows if self.device is None else rows.to(self.device))
                loss = loss / train.micro_batches
                loss.backward()
                local_loss += loss.detach()
                if hasattr(self.model, "take_overlap_samples"):
                    # the engine's in-flight count at each unit's compute start (docs/design.md §6)
                    result.extra.setdefault("overlap_samples", []).extend(
                        self.model.take_overlap_samples())
                if probe is not None:
                    result.extra.setdefault("probes", []).append(
                        probe(self.model, self.optimizer, step, micro))

            # As Megatron's forward_backward_no_pipelining: every micro-batch but the
            # last inside no_sync() (entered even when there is only one).
            with self.model.no_sync():
                for micro in range(train.micro_batches - 1):
                    micro_batch(micro)
            micro_batch(train.micro_batches - 1)
            self.model.finish_grad_sync()
            ok, grad_norm, _ = self.optimizer.step()
            assert ok, f"step {step}: the optimizer skipped the update"
            self.scheduler.step(increment=1)
            dist.all_reduce(local_loss, group=self.dp_group)
            result.losses.append(local_loss.item() / self.dp_size)
            result.grad_norms.append(float(grad_norm))
            report = getattr(self.optimizer, "last_step_report", None)
            if report is not None:
                result.step_reports.append(report)
        return result

    def final_params(self) -> dict[str, torch.Tensor]:
        """Every parameter by the GPT's names, gathered; the engine's must cover them all."""
        if self.hier is None:
            return _gathered_params(self.inner)
        names = dict(_gpt_of(self.inner).named_parameters())
        params = {n: t.float() for n, t in self.model.state_dict().items() if n in names}
        missing = sorted(set(names) - set(params))
        assert not missing, f"the engine's state dict lacks parameters {missing[:3]}..."
        return params


def setup_stock(spec: TinyGPTSpec, train: TrainSpec, *, build_model=None,
                optimizer_config=None) -> Trainer:
    """megatron-core DDP + DistributedOptimizer over the default data-parallel group.

    ``build_model(spec)`` and ``optimizer_config``: as in :func:`setup_hier`."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides

    init_megatron_state(seed=spec.seed)
    model, config = (build_model or build_tiny_gpt)(spec)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=train.overlap_grad_reduce,
        use_distributed_optimizer=True,
        bucket_size=train.bucket_size,
    )
    ddp_model = DistributedDataParallel(config, ddp_config, model)
    opt_config = optimizer_config or _optimizer_config(spec, train, distributed=True)
    optimizer = get_megatron_optimizer(
        opt_config, [ddp_model], config_overrides=get_standard_config_overrides(opt_config))
    return Trainer(spec, train, ddp_model, model, optimizer, constant_schedule(optimizer, opt_config),
                   parallel_state.get_data_parallel_rank(),
                   parallel_state.get_data_parallel_world_size(),
                   parallel_state.get_data_parallel_group(),
                   device=next(model.parameters()).device)


def setup_hier(spec: TinyGPTSpec, train: TrainSpec, hier_argv: list[str], *,
               build_model=None, optimizer_config=None, peer_env=None) -> Trainer:
    """The same model through HierDataParallel + HierDistributedOptimizer; ``hier_argv``: --hier-* flags.

    ``build_model(spec, sharded=...)`` and ``optimizer_config`` replace the fp32 tiny GPT
    and its optimizer config (the fp16 runs use a Float16Module model and a loss scaler).
    ``peer_env``: every rank's launcher environment, for a world of torch's fake process
    group (process_groups.build_hier_groups)."""
    import argparse

    from megatron_lbp.integration import megatron_adapter
    from megatron_lbp.core.config import add_hier_arguments, engine_options_from_args
    from megatron_lbp.engine.process_groups import build_hier_groups

    init_megatron_state(seed=spec.seed)
    argv = list(hier_argv)
    if train.bucket_size is not None and "--hier-bucket-size" not in argv:
        argv += ["--hier-bucket-size", str(train.bucket_size)]
    args = add_hier_arguments(argparse.ArgumentParser()).parse_args(argv)
    hier = build_hier_groups(args, dp_group=megatron_adapter.data_parallel_group(),
                             peer_env=peer_env)
    options = engine_options_from_args(args)
    model, config = (build_model or build_tiny_gpt)(spec, sharded=options.sharded_init)
    ddp_model = megatron_adapter.wrap_model(config, model, hier, options)
    opt_config = optimizer_config or _optimizer_config(spec, train, distributed=True)
    optimizer = megatron_adapter.build_optimizer(opt_config, [ddp_model], options)
    return Trainer(spec, train, ddp_model, model, optimizer, constant_schedule(optimizer, opt_config),
                   hier.dp_index, len(hier.dp_ranks), hier.dp_group, hier,
                   device=megatron_adapter.model_device())


def train_stock_megatron(spec: TinyGPTSpec, train: TrainSpec) -> TrainResult:
    trainer = setup_stock(spec, train)
    result = trainer.run(range(train.steps))
    result.params = trainer.final_params()
    return result


def train_hier(spec: TinyGPTSpec, train: TrainSpec, hier_argv: list[str],
               probe=None) -> TrainResult:
    """train_stock_megatron's loop through the engine; probes land in ``result.extra["probes"]``."""
    trainer = setup_hier(spec, train, hier_argv)
    result = trainer.run(range(train.steps), probe=probe)
    result.params = trainer.final_params()
    hier = trainer.hier
    result.extra.update({"bucket_numels": trainer.model.bucket_numels(),
                         "config": hier.config.as_dict(), "links": dict(hier.link_classes),
                         "comm_stats": dataclasses.asdict(trainer.model.comm.stats)})
    result.extra.setdefault("probes", [])
    return result


def train_several(spec: TinyGPTSpec, train: TrainSpec, configs: dict, probe=None,
                  faults: dict | None = None) -> dict:
    """Several trainings one after another in the same ranks: one process start-up for all.

    ``configs``: name -> ``--hier-*`` argv for the engine, or None for stock
    Megatron (run first if it comes first, before any engine code has run here).
    ``faults``: name -> a callable returning a context manager that breaks the
    engine while that configuration trains (tests of the tests inject faults
    this way, in the rank; nothing in the engine knows about them).
    Each value is that run's TrainResult, or the traceback of what it raised, so
    a configuration that fails on every rank fails only its own test.
    """
    import contextlib
    import traceback

    out = {}
    for name, argv in configs.items():
        fault = (faults or {}).get(name)
        try:
            with fault() if fault is not None else contextlib.nullcontext():
                out[name] = (train_stock_megatron(spec, train) if argv is None
                             else train_hier(spec, train, argv, probe=probe))
        except Exception:  # noqa: BLE001 - reported as this configuration's result
            out[name] = f"{name} raised on rank {dist.get_rank()}:\n{traceback.format_exc()}"
    return out


def trained(result, name: str):
    """One configuration's TrainResult from train_several's answer; its traceback fails the test."""
    value = result[name]
    assert not isinstance(value, str), value
    return value


def megatron_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """torch optimizer groups by Megatron's standard rule: no weight decay on biases and 1-D
    parameters (norms); parameters that need no gradient are left out."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def train_reference(spec: TinyGPTSpec, train: TrainSpec, dp_size: int) -> TrainResult:
    """The same training in one process: full global batch, torch AdamW, clip_grad_norm_."""
    init_megatron_state(seed=spec.seed)
    model, _ = build_tiny_gpt(spec)
    optimizer = torch.optim.AdamW(
        megatron_param_groups(model, train.weight_decay),
        lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
    )
    result = TrainResult()
    for step in range(train.steps):
        optimizer.zero_grad()
        total = torch.zeros(())
        for micro in range(train.micro_batches):
            tokens = global_batch(step, micro, spec, train, dp_size)
            # DP averages per-rank mean losses; with equal tokens per rank that is the global mean.
            loss = forward_loss(model, tokens) / train.micro_batches
            loss.backward()
            total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip_grad)
        optimizer.step()
        result.losses.append(total.item())
        result.grad_norms.append(float(grad_norm))
    result.params = _gathered_params(model)
    return result


def constant_schedule(optimizer, opt_config):
    """Megatron's param scheduler at constant lr and weight decay.

    megatron.training always runs one; it is also what applies each group's
    ``wd_mult`` (no decay on biases and norms), so a loop without it decays every
    parameter.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=opt_config.lr, max_lr=opt_config.lr, min_lr=opt_config.lr,
        lr_warmup_steps=0, lr_decay_steps=1, lr_decay_style="constant",
        start_wd=opt_config.weight_decay, end_wd=opt_config.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant",
    )


def _optimizer_config(spec: TinyGPTSpec, train: TrainSpec, distributed: bool):
    from megatron.core.optimizer import OptimizerConfig

    bf16 = spec.params_dtype == torch.bfloat16
    return OptimizerConfig(
        optimizer="adam",
        lr=train.lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=train.adam_eps,
        clip_grad=train.clip_grad,
        bf16=bf16,
        params_dtype=spec.params_dtype,
        use_distributed_optimizer=distributed,
    )



def architecture(name: str, **overrides) -> TinyGPTSpec:
    """The TinyGPTSpec of a named architecture (ARCHITECTURES), with field overrides."""
    if name not in ARCHITECTURES:
        raise KeyError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    return dataclasses.replace(TinyGPTSpec(), **{**ARCHITECTURES[name], **overrides})
