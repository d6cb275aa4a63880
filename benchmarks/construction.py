"""Bytes each rank holds while the model is built: sharded initialization against a whole-model build.

On gloo ranks (CPU), the tiny megatron-core GPT is built, wrapped by the
engine and given its optimizer twice per rank, once with sharded
initialization (``--hier-sharded-init``, the default: megatron_lbp/engine/
materialize.py) and once building the whole model first
(``--no-hier-sharded-init``). The allocator's own events measure each rank's
peak bytes above what it held before (engine/memory.AllocationPeak); the
bound is primary + secondary + master + optimizer + 2 x the largest bucket;
``plan`` is ``costs.construction_peak_bytes`` for the engine's buckets (the
device-init path: it leaves out the CPU-init path's host-side fp32 master
weight, which here shares the CPU with everything else). Then one optimizer
step runs, and its loss is printed beside stock Megatron's (DDP + distributed
optimizer, built the plain way).

    python -m benchmarks construction [--ranks 8] [--preset zero3]
        [--init device|cpu] [--bucket-size 20000] [--layers 8] [--hidden 64]
        [--architecture test-gpt|megatron-defaults|llama|...] [--json]

The engine's buckets are its gather units (one per transformer layer, the
embedding, the rest); --bucket-size only cuts parameters outside them.
"""
from __future__ import annotations
from megatron_lbp.projection import json_out

import argparse
import gc
import sys
from typing import Any


def measure_rank(spec, train, hier_argv) -> dict[str, Any]:
    """On one rank: construction peak and first-step losses, sharded and whole-model."""
    from megatron_lbp.core import costs
    from megatron_lbp.engine.memory import AllocationPeak
    from megatron_lbp.testing.tiny_gpt import setup_hier

    out = {}
    for label, extra in (("sharded", []), ("whole", ["--no-hier-sharded-init"])):
        gc.collect()
        with AllocationPeak() as peak:
            trainer = setup_hier(spec, train, list(hier_argv) + extra)
        mem = trainer.optimizer.memory_bytes()
        buckets = trainer.model.buckets
        wb = buckets[0].primary.element_size()
        largest = max(b.full_nbytes for b in buckets)
        numels = [b.numel for b in buckets]
        dtype_name = {4: "fp32", 2: "bf16"}
        plan = costs.construction_peak_bytes(
            trainer.hier.config, numels, param_dtype=dtype_name[wb],
            grad_dtype=dtype_name[buckets[0].grad_shard.element_size()])
        out[label] = {
            "peak_bytes": peak.peak_bytes,
            "bound_bytes": mem["primary"] + mem["secondary"] + mem["optimizer"] + 2 * largest,
            "plan_bytes": plan,
            "memory_bytes": {k: mem[k] for k in ("primary", "secondary", "grad", "optimizer")},
            "largest_bucket_bytes": largest,
            "model_bytes": sum(numels) * wb,
            "primary_fraction": sum(b.primary.numel() for b in buckets)
                                / sum(b.layout.padded_numel for b in buckets),
            "losses": trainer.run(range(1)).losses,
        }
        del trainer
    return out


def measure(ranks: int, preset: str, cpu_init: bool, bucket_size: int, layers: int,
            hidden: int, arch: str = "test-gpt") -> dict[str, Any]:
    from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
    from megatron_lbp.testing.tiny_gpt import TrainSpec, architecture, train_stock_megatron

    spec = architecture(arch, num_layers=layers, hidden_size=hidden,
                        use_cpu_initialization=cpu_init)
    train = TrainSpec(steps=1, micro_batches=2, bucket_size=bucket_size)
    per_rank = run_on_ranks(measure_rank, ranks, spec, train, ["--hier-preset", preset],
                            rank_env=rank_location_env(min(ranks, 4)))
    stock = run_on_ranks(train_stock_megatron, ranks, spec, train)[0]
    return {"ranks": per_rank, "stock_losses": stock.losses, "preset": preset, "architecture": arch,
            "init": "cpu" if cpu_init else "device", "bucket_size": bucket_size}


def render(result: dict[str, Any]) -> str:
    largest = result["ranks"][0]["sharded"]["largest_bucket_bytes"]
    lines = [f"construction peak per rank, preset {result['preset']}, "
             f"{result['init']}-init path, {result['architecture']}, largest gather unit {largest:,} bytes "
             f"(bytes; bound = primary + secondary + master + optimizer + 2 x largest unit)",
             f"  {'rank':>4} {'sharded':>10} {'bound':>10} {'plan':>10} {'whole':>10} "
             f"{'model':>10}  first loss sharded / whole / stock"]
    for r, res in enumerate(result["ranks"]):
        s, w = res["sharded"], res["whole"]
        lines.append(f"  {r:>4} {s['peak_bytes']:>10,} {s['bound_bytes']:>10,} "
                     f"{s['plan_bytes']:>10,} {w['peak_bytes']:>10,} {s['model_bytes']:>10,}  "
                     f"{s['losses'][0]!r} / {w['losses'][0]!r} / {result['stock_losses'][0]!r}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from megatron_lbp.testing.tiny_gpt import ARCHITECTURES

    p = argparse.ArgumentParser(prog="python -m benchmarks construction",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--preset", default="zero3")
    p.add_argument("--init", choices=("device", "cpu"), default="device",
                   help="Megatron's init path: on the device under the CUDA RNG tracker, or "
                        "--use-cpu-initialization (default device)")
    p.add_argument("--bucket-size", type=int, default=20000)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--architecture", default="test-gpt", choices=list(ARCHITECTURES),
                   help="a named architecture of megatron_lbp.testing.tiny_gpt (default test-gpt; "
                        "megatron-defaults: learned absolute positions, initialised after attach)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.bucket_size < 1:
        p.error("--ranks and --bucket-size must be >= 1")
    result = measure(args.ranks, args.preset, args.init == "cpu", args.bucket_size,
                     args.layers, args.hidden, args.architecture)
    json_out.emit(result) if args.json else print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
