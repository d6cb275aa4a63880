"""A megatron-core GPT trained under ``deepspeed.initialize``, step for step like the stock yardstick.

Same model and seed (testing/tiny_gpt), same batches, and the optimizer maths of stock
Megatron's DistributedOptimizer at constant LR: torch's AdamW as DeepSpeed's client
optimizer (no DeepSpeed CPU-Adam build), weight decay on every weight but biases and 1-D
parameters, global norm clipping. DeepSpeed owns the rest: partitioning, gathers,
gradient reduction and accumulation (``engine.backward`` scales each loss by 1/K).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lbp.deepspeed_baseline import environment
from megatron_lbp.deepspeed_baseline.schemes import ds_config, features
from megatron_lbp.testing import tiny_gpt
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainResult, TrainSpec, megatron_param_groups


def import_deepspeed(ranks_per_node: int | None = None):
    """``deepspeed``, imported after its environment is set, without its unused CPU
    shared-memory comm op (environment.skip_shm_comm_op)."""
    environment.prepare(ranks_per_node)
    import deepspeed

    environment.skip_shm_comm_op(deepspeed)

    return deepspeed


def tie_output_to_embedding(deepspeed, model: torch.nn.Module) -> None:
    """Tell ZeRO-3 that the output layer uses the embedding's weight (tied embeddings).

    Megatron passes ``embedding.word_embeddings.weight`` into ``output_layer``'s
    forward as an argument; ZeRO-3 gathers a module's own parameters only, so
    without this the output layer would see the weight released after the
    embedding's forward.
    """
    gpt = tiny_gpt._gpt_of(model)
    if getattr(gpt, "share_embeddings_and_output_weights", False):
        deepspeed.zero.register_external_parameter(gpt.output_layer,
                                                   gpt.embedding.word_embeddings.weight)


@dataclass
class DeepSpeedTrainer:
    spec: TinyGPTSpec
    train: TrainSpec
    scheme: str
    engine: object                    # deepspeed.DeepSpeedEngine
    inner: torch.nn.Module            # the GPT model it wraps
    dp_rank: int
    dp_size: int
    config: dict

    def micro_batch(self, step: int, micro: int) -> torch.Tensor:
        """Forward, backward and (at the last micro-batch) the optimizer step; this rank's loss / K."""
        train = self.train
        tokens = tiny_gpt.global_batch(step, micro, self.spec, train, self.dp_size)
        lo = self.dp_rank * train.micro_batch_size
        loss = tiny_gpt.forward_loss(self.engine, tokens[lo:lo + train.micro_batch_size])
        self.engine.backward(loss)          # scales by 1/gradient_accumulation_steps
        self.engine.step()                  # updates only at the accumulation boundary
        return loss.detach() / train.micro_batches

    def run(self, steps, probe=None, result: TrainResult | None = None) -> TrainResult:
        """Train the given step numbers (the engine trainers' call; ``probe`` is not served)."""
        if probe is not None:
            raise ValueError("DeepSpeedTrainer.run: a probe between backward passes is not served")
        result = result or TrainResult()
        for step in steps:
            local_loss = torch.zeros(())
            for micro in range(self.train.micro_batches):
                local_loss += self.micro_batch(step, micro)
            if not self.engine.was_step_applied():
                raise RuntimeError(f"step {step}: DeepSpeed did not apply the optimizer step")
            dist.all_reduce(local_loss)
            result.losses.append(local_loss.item() / self.dp_size)
            result.grad_norms.append(float(self.engine.get_global_grad_norm()))
        return result

    def collectives_visible(self):
        """A context in which torch.distributed's (possibly wrapped) collectives are the ones
        DeepSpeed calls (:func:`collectives_visible`). Enter it inside the wrapping context."""
        return collectives_visible()

    def final_params(self) -> dict[str, torch.Tensor]:
        """Every parameter by the GPT's own names, gathered from its partitions, in fp32."""
        import deepspeed

        gpt = tiny_gpt._gpt_of(self.inner)
        named = list(gpt.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {name: p.detach().float().clone() for name, p in named}


@contextlib.contextmanager
def collectives_visible():
    """deepspeed.comm's torch backend binds all_gather_into_tensor and reduce_scatter_tensor
    when it starts (``TorchBackend.all_gather_function`` / ``reduce_scatter_function``), so
    the wrapper, which replaces torch.distributed's attributes, would not see ZeRO-3's
    parameter gathers and gradient reduce-scatters; point them at the (wrapped) attributes
    for the block. Enter it inside the wrapping context (count_collectives, a recorder)."""
    import torch.distributed as dist
    from deepspeed.comm import comm

    cdb = comm.cdb
    saved = (cdb.all_gather_function, cdb.reduce_scatter_function)
    names = (saved[0].__name__, saved[1].__name__)
    cdb.all_gather_function = getattr(dist, names[0])
    cdb.reduce_scatter_function = getattr(dist, names[1])
    try:
        yield
    finally:
        cdb.all_gather_function, cdb.reduce_scatter_function = saved


def setup_deepspeed(spec: TinyGPTSpec, train: TrainSpec, scheme: str, *, ranks_per_node: int,
                    build_model=None, zero_overrides: dict | None = None) -> DeepSpeedTrainer:
    """The tiny GPT (or ``build_model(spec)``'s) under ``deepspeed.initialize`` with ``scheme``.

    ``zero_overrides``: entries replacing the scheme's ``zero_optimization`` ones (a test
    separating qwZ from qgZ switches one of them off this way).
    """
    want = features(scheme)
    deepspeed = import_deepspeed(ranks_per_node)
    if want["qwz"] or want["qgz"] or any((zero_overrides or {}).get(k) for k in (
            "zero_quantized_weights", "zero_quantized_gradients")):
        from megatron_lbp.deepspeed_baseline import cpu_quantizer

        if cpu_quantizer.needed():
            cpu_quantizer.install()
    tiny_gpt.init_megatron_state(seed=spec.seed)
    model, _ = (build_model or tiny_gpt.build_tiny_gpt)(spec)
    dp_size = dist.get_world_size()
    config = ds_config(scheme, micro_batch_size=train.micro_batch_size,
                       micro_batches=train.micro_batches, dp_size=dp_size,
                       ranks_per_node=ranks_per_node, clip_grad=train.clip_grad,
                       bf16=spec.params_dtype == torch.bfloat16,
                       reduce_bucket_size=train.bucket_size)
    config["zero_optimization"].update(zero_overrides or {})
    optimizer = torch.optim.AdamW(megatron_param_groups(model, train.weight_decay), lr=train.lr,
                                  betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)
    tie_output_to_embedding(deepspeed, model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           dist_init_required=False)
    return DeepSpeedTrainer(spec, train, scheme, engine, model, dist.get_rank(), dp_size, config)


def train_deepspeed(spec: TinyGPTSpec, train: TrainSpec, scheme: str, *,
                    ranks_per_node: int, zero_overrides: dict | None = None) -> TrainResult:
    trainer = setup_deepspeed(spec, train, scheme, ranks_per_node=ranks_per_node,
                              zero_overrides=zero_overrides)
    result = trainer.run(range(train.steps))
    result.params = trainer.final_params()
    result.extra["config"] = trainer.config
    return result
