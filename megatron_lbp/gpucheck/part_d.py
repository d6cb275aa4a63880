"""Part D: the plan's memory at the flagship's world size, in one process.

One process poses as rank 0 of 384 over torch's fake process group (collectives return
at once, move no data), builds the whole hierarchy, wraps a megatron-core GPT of the 20B
layer shape in the engine with sharded initialization, trains two steps and reads the
bytes it holds per state from the storages (engine/memory.py); each state must agree with
the plan command's own code (``launch/plan.plan_json``) within 5%. It cannot show communication (the loss is
meaningless) nor activations. Memory depends on the layer shape and the groups, not on
the tokens, so on CPU ``--tokens`` is cut, never the layer shape.
"""
from __future__ import annotations

import gc
import os
import resource
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

# The 20B profile (scripts/frontier_gpt20b.sh, scripts/launch/frontier_body.sh): GPT-NeoX-20B's
# layer, RoPE, tied output layer, LayerNorm, linear biases, vocabulary padded to 50304.
FLAGSHIP = dict(world_size=384, gpus_per_node=8, num_layers=44, hidden_size=6144,
                num_attention_heads=64, vocab_size=50304, seq_length=2048)
# The two configurations the 20B profile chooses between (lbp P=2 G=8 O=384).
VARIANTS = {
    "int8-secondary": ["--hier-preset", "lbp", "--hier-secondary-group-size", "8",
                       "--hier-secondary-dtype", "int8"],
    "no-secondary": ["--hier-preset", "lbp", "--hier-secondary-group-size", "0"],
}
STATES = ("primary", "secondary", "grad", "optimizer", "total")
TOLERANCE = 0.05
STEPS = 2          # on a GPU; on CPU one (a bf16 input-gradient matmul of one 20B layer's MLP
                   # takes ~45 s here: torch's CPU path without native bf16)


@dataclass(frozen=True)
class Shape:
    num_layers: int
    tokens: int                     # tokens per micro-batch (one sequence)
    world_size: int = FLAGSHIP["world_size"]
    gpus_per_node: int = FLAGSHIP["gpus_per_node"]
    hidden_size: int = FLAGSHIP["hidden_size"]
    num_attention_heads: int = FLAGSHIP["num_attention_heads"]
    vocab_size: int = FLAGSHIP["vocab_size"]
    seq_length: int = FLAGSHIP["seq_length"]


def plan_argv(shape: Shape, variant: str) -> list[str]:
    """``python -m megatron_lbp.plan`` flags for this shape and variant (bf16, full recompute)."""
    return ["--world-size", str(shape.world_size), "--gpus-per-node", str(shape.gpus_per_node),
            "--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden_size),
            "--vocab-size", str(shape.vocab_size),
            "--num-attention-heads", str(shape.num_attention_heads),
            "--seq-length", str(shape.seq_length), "--params-dtype", "bf16",
            "--recompute", "full", *VARIANTS[variant]]


def _rank_env(rank: int, shape: Shape) -> dict[str, str]:
    """What torchrun would give rank ``rank``: consecutive nodes of ``gpus_per_node``."""
    g = shape.gpus_per_node
    return {"RANK": str(rank), "WORLD_SIZE": str(shape.world_size), "LOCAL_RANK": str(rank % g),
            "LOCAL_WORLD_SIZE": str(g), "GROUP_RANK": str(rank // g)}


def fake_world(shape: Shape, device: torch.device) -> None:
    """This process as rank 0 of ``shape.world_size`` over the fake backend, with Megatron's
    model-parallel state (TP = PP = 1) and no gloo side groups (gloo needs a real store)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_lbp.integration import compat

    os.environ.update(_rank_env(0, shape))
    compat.enable()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", rank=0, world_size=shape.world_size, store=FakeStore())
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)


def measure(shape: Shape, variant: str, device: torch.device, steps: int = STEPS
            ) -> dict[str, Any]:
    """Build, train ``steps`` steps and compare with the plan: this variant's part-D record."""
    from megatron_lbp.launch.plan import plan_json
    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, setup_hier

    plan = plan_json(plan_argv(shape, variant), knob_table=False)
    spec = TinyGPTSpec(num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                       num_attention_heads=shape.num_attention_heads,
                       vocab_size=shape.vocab_size, seq_length=shape.tokens,
                       params_dtype=torch.bfloat16, recompute=True,
                       use_cpu_initialization=device.type == "cpu")
    train = TrainSpec(steps=steps, micro_batch_size=1, micro_batches=1)
    t0 = time.perf_counter()
    host = socket.gethostname()
    trainer = setup_hier(spec, train, VARIANTS[variant],
                         peer_env=lambda rank: _rank_env(rank, shape))
    built_s = time.perf_counter() - t0
    hier = trainer.hier
    step_times = []
    for step in range(steps):
        t = time.perf_counter()
        _one_step(trainer, step, device)
        step_times.append(time.perf_counter() - t)
    report = trainer.optimizer.last_step_report["memory_bytes"]
    rows = {}
    for state in STATES:
        rows[state] = _row(report[state], plan["memory_bytes"][state])
    rows["peak_transient"] = _row(report["peak_transient"], plan["transient_bytes"]["peak"])
    units_match = trainer.model.bucket_numels() == _plan_unit_numels(shape)
    out = {
        "variant": variant,
        "plan_command": "python -m megatron_lbp.plan " + " ".join(plan_argv(shape, variant)),
        "group_sizes": {"P": hier.config.param_group_size, "S": hier.config.secondary_group_size,
                        "G": hier.config.grad_group_size, "O": hier.config.optim_group_size},
        "link_classes": dict(hier.link_classes),
        "host": host,
        "bytes": rows,
        "units_match_plan": units_match,
        "build_s": round(built_s, 2),
        "step_s": [round(s, 2) for s in step_times],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if device.type == "cuda":
        out["allocator"] = {"max_allocated_bytes": torch.cuda.max_memory_allocated(device),
                            "max_reserved_bytes": torch.cuda.max_memory_reserved(device),
                            "plan_total_plus_transient_bytes":
                                plan["memory_bytes"]["total"] + plan["transient_bytes"]["peak"]}
    out["ok"] = units_match and all(r["within_tolerance"] for r in rows.values())
    del trainer
    gc.collect()
    return out


def _one_step(trainer, step: int, device: torch.device) -> None:
    """Trainer.run's step without its loss check: over the fake backend the gradients are
    whatever the buffers held, so a step the optimizer skips as non-finite still counts (its
    memory report is written either way)."""
    from megatron_lbp.testing.tiny_gpt import forward_loss, global_batch

    model, train = trainer.model, trainer.train
    model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    # Rank 0's rows only: the whole global batch at 384 ranks is never needed.
    tokens = global_batch(step, 0, trainer.spec, train, 1)
    forward_loss(model, tokens.to(device)).backward()
    model.finish_grad_sync()
    trainer.optimizer.step()


def _row(measured: int, planned: int) -> dict[str, Any]:
    ratio = measured / planned if planned else (1.0 if measured == 0 else float("inf"))
    return {"measured": int(measured), "plan": int(planned), "ratio": round(ratio, 6),
            "within_tolerance": abs(ratio - 1.0) <= TOLERANCE}


def _plan_unit_numels(shape: Shape) -> list[int]:
    from megatron_lbp.core import costs

    return [n for _, n in costs.gpt_units(shape.num_layers, shape.hidden_size, shape.vocab_size,
                                          seq_length=shape.seq_length,
                                          num_attention_heads=shape.num_attention_heads,
                                          position_embedding_type="rope")]


def run(opts) -> dict[str, Any]:
    """One variant (a fake world is one per process): its checks and figures."""
    kind = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    shape = Shape(num_layers=opts.layers or FLAGSHIP["num_layers"],
                  tokens=opts.tokens or FLAGSHIP["seq_length"])
    fake_world(shape, device)
    record = measure(shape, opts.variant, device, opts.steps or STEPS)
    rows = record["bytes"]
    checks = [{"name": f"{opts.variant}: {state} bytes within {TOLERANCE:.0%} of the plan",
               "ok": r["within_tolerance"],
               "detail": f"measured {r['measured']}, plan {r['plan']} (ratio {r['ratio']})"}
              for state, r in rows.items()]
    checks.append({"name": f"{opts.variant}: gather units as the plan counts them",
                   "ok": record["units_match_plan"], "detail": str(record["units_match_plan"])})
    return {"checks": checks, "figures": {"shape": asdict(shape), **record}}
