"""Part C: the engine against stock megatron-core at world size 1.

Two layers of the 20B layer shape, bf16, the engine with sharded initialization, with
and without full recomputation, against megatron-core's DDP + DistributedOptimizer on the
same model, data and seed. Per configuration: each step's loss, step and host time, peak
memory (set against ``python -m megatron_lbp.plan`` at world size 1) and the host
synchronisations a step makes. A group of one sends nothing: this shows overhead, memory
and synchronisations, not collectives. :func:`compare` runs on any device; the tests run
it on CPU with a tiny shape.
"""
from __future__ import annotations

import gc
import statistics
import time
import warnings
from typing import Any

import torch

HIER_ARGV = ["--hier-preset", "lbp", "--hier-gpus-per-node", "1", "--hier-gcds-per-package", "1"]
STEPS = 4                       # the first is a warm-up, not timed
LOSS_RTOL = 2e-2                # bf16: both paths round differently, the same maths
STEP_TIME_RATIO_MAX = 1.5       # engine/stock at world size 1: overhead, no communication


def twenty_b_layers(num_layers: int = 2, recompute: bool = False):
    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec

    return TinyGPTSpec(num_layers=num_layers, hidden_size=6144, num_attention_heads=64,
                       vocab_size=50304, seq_length=2048, params_dtype=torch.bfloat16,
                       recompute=recompute, use_cpu_initialization=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(trainer, step: int) -> torch.Tensor:
    """One optimizer step as megatron.training runs it, without reading the loss on the host."""
    from megatron_lbp.testing.tiny_gpt import forward_loss, global_batch

    model = trainer.model
    model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    tokens = global_batch(step, 0, trainer.spec, trainer.train, trainer.dp_size)
    loss = forward_loss(model, tokens.to(_device()))
    loss.backward()
    model.finish_grad_sync()
    trainer.optimizer.step()
    return loss.detach()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def train_one(name: str, spec, steps: int = STEPS) -> dict[str, Any]:
    """Build ``name`` ("stock" or "engine") and train ``steps`` steps; its figures."""
    from megatron_lbp.testing.tiny_gpt import TrainSpec, setup_hier, setup_stock

    device = _device()
    train = TrainSpec(steps=steps, micro_batch_size=1, micro_batches=1)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    trainer = setup_stock(spec, train) if name == "stock" else setup_hier(spec, train, HIER_ARGV)
    losses, wall, host, syncs = [], [], [], []
    for step in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda" and step > 0:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = _step(trainer, step)
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        losses.append(float(loss))
        if step > 0:
            host.append(t1 - t0)
            wall.append(t2 - t0)
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    counted = device.type == "cuda"   # the sync debug mode is CUDA's; CPU has nothing to count
    out = {"losses": losses, "step_s": statistics.median(wall), "host_s": statistics.median(host),
           "syncs_per_step": syncs[-1] if counted and syncs else None,
           "syncs_by_step": syncs if counted else None}
    if device.type == "cuda":
        # above what was allocated before the build (what an earlier configuration left)
        out.update(start_allocated_bytes=start,
                   end_allocated_bytes=torch.cuda.memory_allocated(device) - start,
                   max_allocated_bytes=torch.cuda.max_memory_allocated(device) - start,
                   max_reserved_bytes=torch.cuda.max_memory_reserved(device))
    if name == "engine":
        out["memory_bytes"] = dict(trainer.optimizer.last_step_report["memory_bytes"])
    del trainer
    gc.collect()
    return out


def plan_bytes(spec) -> dict[str, int]:
    """``python -m megatron_lbp.plan`` for the engine's configuration at world size 1."""
    from megatron_lbp.launch.plan import plan_json

    plan = plan_json(["--world-size", "1", "--gpus-per-node", "1", "--gcds-per-package", "1",
                      "--num-layers", str(spec.num_layers), "--hidden-size", str(spec.hidden_size),
                      "--vocab-size", str(spec.vocab_size),
                      "--num-attention-heads", str(spec.num_attention_heads),
                      "--seq-length", str(spec.seq_length),
                      "--params-dtype", "bf16" if spec.params_dtype == torch.bfloat16 else "fp32",
                      "--recompute", "full" if spec.recompute else "none", "--preset", "lbp"],
                     knob_table=False)
    return {"total": plan["memory_bytes"]["total"], "transient_peak": plan["transient_bytes"]["peak"]}


def compare(spec, steps: int = STEPS) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Stock then engine on ``spec``; the checks and the figures."""
    stock = train_one("stock", spec, steps)
    engine = train_one("engine", spec, steps)
    plan = plan_bytes(spec)
    tag = "full recompute" if spec.recompute else "no recompute"
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(stock["losses"], engine["losses"])]
    ratio = engine["step_s"] / stock["step_s"]
    checks = [
        {"name": f"{tag}: losses agree with stock megatron-core", "ok": max(diffs) <= LOSS_RTOL,
         "detail": f"stock {stock['losses']} engine {engine['losses']} (largest relative "
                   f"difference {max(diffs):.2e}, bound {LOSS_RTOL})"},
        {"name": f"{tag}: step time within {STEP_TIME_RATIO_MAX}x of stock",
         "ok": ratio <= STEP_TIME_RATIO_MAX,
         "detail": f"engine {engine['step_s']:.4f} s, stock {stock['step_s']:.4f} s, ratio {ratio:.3f}"},
        {"name": f"{tag}: engine's persistent bytes as planned",
         "ok": engine["memory_bytes"]["total"] == plan["total"],
         "detail": f"measured {engine['memory_bytes']['total']}, plan {plan['total']}"},
    ]
    if "max_allocated_bytes" in engine:
        floor = plan["total"]
        checks.append({
            "name": f"{tag}: allocator holds at least the plan's persistent bytes at step end",
            "ok": engine["end_allocated_bytes"] >= floor,
            "detail": f"allocated {engine['end_allocated_bytes']}, plan persistent {floor}; "
                      f"peak allocated {engine['max_allocated_bytes']} against plan persistent "
                      f"+ transient {plan['total'] + plan['transient_peak']} (activations "
                      f"are the rest)"})
    return checks, {"recompute": spec.recompute, "stock": stock, "engine": engine, "plan": plan,
                    "step_time_ratio": round(ratio, 4), "loss_rel_diff_max": max(diffs)}


def init_world_of_one(backend: str) -> None:
    from megatron_lbp.gpucheck.part_b import init_world_of_one as init

    init(backend)


def run(opts) -> dict[str, Any]:
    torch.cuda.set_device(0)
    init_world_of_one("nccl")
    checks, figures = [], {}
    for recompute in (False, True):
        c, f = compare(twenty_b_layers(recompute=recompute))
        checks += c
        figures["full_recompute" if recompute else "no_recompute"] = f
    return {"checks": checks, "figures": figures}
