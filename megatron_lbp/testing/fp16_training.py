"""fp16 training with Megatron's dynamic loss scaling, through stock Megatron and through the engine.

The tiny GPT as megatron.training builds it for ``--fp16`` (Float16Module, fp32 gradient
accumulation and master weights, a DynamicGradScaler from Megatron's loss-scale flags). The
loop scales each micro-batch's loss as Megatron's schedules do, steps the scheduler only
after an applied update, and records per step the scale, whether the update was applied
or skipped, and the gradient norm. Runs inside ranks started by
:mod:`megatron_lbp.testing.multirank`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_lbp.testing.tiny_gpt import (Trainer, TinyGPTSpec, TrainSpec, forward_loss,
                                           global_batch, setup_hier, setup_stock, tiny_gpt_config,
                                           tiny_gpt_provider)

FP16_SPEC = TinyGPTSpec(params_dtype=torch.float16)


@dataclass(frozen=True)
class LossScaleSpec:
    """Megatron's dynamic loss-scaling flags (``--loss-scale`` unset)."""

    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass
class Fp16Result:
    losses: list[float] = field(default_factory=list)         # global mean, unscaled, every step
    scales: list[float] = field(default_factory=list)         # loss scale each step ran with
    applied: list[bool] = field(default_factory=list)         # False: skipped (inf/nan gradient)
    grad_norms: list[float | None] = field(default_factory=list)  # None on a skipped step
    params: dict[str, torch.Tensor] = field(default_factory=dict)   # final weights, plain names
    extra: dict = field(default_factory=dict)


def fp16_model(spec: TinyGPTSpec, sharded: bool = False):
    """The tiny GPT for ``--fp16``: fp16 parameters in Megatron's Float16Module."""
    from megatron.core.transformer.module import Float16Module

    if spec.params_dtype != torch.float16:
        raise ValueError(f"fp16_model needs TinyGPTSpec(params_dtype=torch.float16), got {spec.params_dtype}")
    config = dataclasses.replace(tiny_gpt_config(spec), fp16=True)
    provide = tiny_gpt_provider(spec, config)
    if sharded:
        from megatron_lbp.integration import megatron_adapter

        model = megatron_adapter.build_sharded(provide, config)
    else:
        model = provide()
    return Float16Module(config, model), config


def fp16_optimizer_config(train: TrainSpec, scaling: LossScaleSpec):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=train.lr, weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
        clip_grad=train.clip_grad, fp16=True, bf16=False, params_dtype=torch.float16,
        loss_scale=None, initial_loss_scale=scaling.initial_loss_scale,
        min_loss_scale=scaling.min_loss_scale, loss_scale_window=scaling.loss_scale_window,
        hysteresis=scaling.hysteresis, use_distributed_optimizer=True)


def setup_stock_fp16(spec: TinyGPTSpec, train: TrainSpec, scaling: LossScaleSpec) -> Trainer:
    """megatron-core DDP + DistributedOptimizer (+ its DynamicGradScaler) over the data-parallel group."""
    return setup_stock(spec, train, build_model=fp16_model,
                       optimizer_config=fp16_optimizer_config(train, scaling))


def setup_hier_fp16(spec: TinyGPTSpec, train: TrainSpec, scaling: LossScaleSpec,
                    hier_argv: list[str]) -> Trainer:
    """The same model through the engine (HierDataParallel + HierDistributedOptimizer with the scaler)."""
    return setup_hier(spec, train, hier_argv, build_model=fp16_model,
                      optimizer_config=fp16_optimizer_config(train, scaling))


def run_fp16(trainer: Trainer, steps) -> Fp16Result:
    """Train ``steps`` with loss scaling; a skipped step is recorded, not an error."""
    result = Fp16Result()
    train = trainer.train
    for step in steps:
        trainer.model.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        scale = float(trainer.optimizer.get_loss_scale().item())
        local_loss = torch.zeros(())
        for micro in range(train.micro_batches):
            tokens = global_batch(step, micro, trainer.spec, train, trainer.dp_size)
            lo = trainer.dp_rank * train.micro_batch_size
            loss = forward_loss(trainer.model, tokens[lo:lo + train.micro_batch_size])
            loss = loss / train.micro_batches
            (loss * trainer.optimizer.get_loss_scale()).backward()
            local_loss += loss.detach().float()
        trainer.model.finish_grad_sync()
        applied, grad_norm, _ = trainer.optimizer.step()
        if applied:
            trainer.scheduler.step(increment=1)
        dist.all_reduce(local_loss, group=trainer.dp_group)
        result.losses.append(local_loss.item() / trainer.dp_size)
        result.scales.append(scale)
        result.applied.append(bool(applied))
        result.grad_norms.append(float(grad_norm) if applied else None)
    result.params = final_weights(trainer)
    return result


def plain_name(name: str) -> str:
    """A weight's name without Float16Module's ``module.`` (the engine's state dict drops it)."""
    return name[len("module."):] if name.startswith("module.") else name


def final_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Full fp32 copies of every weight, keyed by :func:`plain_name`, stock or engine alike.

    (Trainer.final_params matches the engine's state-dict names against the
    wrapped model's parameter names, which differ under Float16Module.)
    """
    names = {plain_name(n) for n, _ in trainer.inner.named_parameters()}
    if trainer.hier is None:
        return {plain_name(n): p.detach().float().clone() for n, p in trainer.inner.named_parameters()}
    return {plain_name(k): v.detach().float().clone() for k, v in trainer.model.state_dict().items()
            if plain_name(k) in names}


def train_stock_fp16(spec: TinyGPTSpec, train: TrainSpec, scaling: LossScaleSpec) -> Fp16Result:
    return run_fp16(setup_stock_fp16(spec, train, scaling), range(train.steps))


def train_hier_fp16(spec: TinyGPTSpec, train: TrainSpec, scaling: LossScaleSpec,
                    hier_argv: list[str], before_training=None) -> Fp16Result:
    """train_stock_fp16's loop through the engine; ``before_training(trainer)`` runs once first."""
    trainer = setup_hier_fp16(spec, train, scaling, hier_argv)
    if before_training is not None:
        before_training(trainer)
    return run_fp16(trainer, range(train.steps))


__all__ = ["FP16_SPEC", "LossScaleSpec", "Fp16Result", "fp16_model", "fp16_optimizer_config",
           "setup_stock_fp16", "setup_hier_fp16", "run_fp16", "train_stock_fp16",
           "train_hier_fp16", "final_weights", "plain_name"]
