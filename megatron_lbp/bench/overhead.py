"""Engine overhead on one unshaped node: step time of lbp vs stock Megatron, side by side.

Both schemes train the same tiny GPT on the same gloo ranks of this machine,
alternating runs (stock, engine, stock, engine, ...) so that machine noise hits
both alike. Each run reports the median wall time of its steps after warm-up
(every rank times the step between two barriers; rank 0's figure is used);
the result is the median over runs of each, and their ratio. Both use
Megatron's default bucket size (40M elements), so the tiny model is one bucket
in each and both issue the same number of collectives per step.

    python -m megatron_lbp.bench overhead [--ranks 8] [--runs 3] [--steps 6] [--json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

WARMUP_STEPS = 2


def _time_steps(kind: str, spec, train, argv: list[str]) -> list[float]:
    import torch.distributed as dist

    from megatron_lbp.testing.tiny_gpt import setup_hier, setup_stock

    trainer = setup_stock(spec, train) if kind == "stock" else setup_hier(spec, train, argv)
    times = []
    for step in range(train.steps):
        dist.barrier()
        t0 = time.perf_counter()
        trainer.run([step])
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times[WARMUP_STEPS:]


def measure(ranks: int = 8, runs: int = 3, steps: int = 6, hidden: int = 128, layers: int = 4,
            seq: int = 128, bucket_size: int | None = None, gpus_per_node: int | None = None) -> dict:
    from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec

    spec = TinyGPTSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                       vocab_size=1024, seq_length=seq)
    train = TrainSpec(steps=steps + WARMUP_STEPS, micro_batch_size=2, micro_batches=2,
                      bucket_size=bucket_size)
    node = gpus_per_node or ranks
    argv = ["--hier-preset", "lbp", "--hier-param-group-size", "2",
            "--hier-grad-group-size", str(node)]
    env = rank_location_env(node)
    medians = {"stock": [], "lbp": []}
    for _ in range(runs):
        for kind in ("stock", "lbp"):
            times = run_on_ranks(_time_steps, ranks, kind, spec, train, argv, rank_env=env,
                                 timeout=1800)[0]
            medians[kind].append(statistics.median(times))
    stock, lbp = statistics.median(medians["stock"]), statistics.median(medians["lbp"])
    return {
        "ranks": ranks, "runs": runs, "steps_timed_per_run": steps,
        "model": {"layers": layers, "hidden": hidden, "seq": seq, "vocab": 1024},
        "median_step_s": {"megatron-distopt": stock, "lbp": lbp},
        "run_medians_s": {"megatron-distopt": medians["stock"], "lbp": medians["lbp"]},
        "ratio_lbp_over_stock": lbp / stock,
        "machine": {"cpus": _cpus(), "python": platform.python_version(), "torch": _torch()},
    }


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _torch() -> str:
    import torch

    return torch.__version__


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_lbp.bench overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--runs", type=int, default=3, help="alternating runs of each scheme")
    p.add_argument("--steps", type=int, default=6, help=f"timed steps per run (after {WARMUP_STEPS} warm-up)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for flag in ("ranks", "runs", "steps", "hidden", "layers", "seq"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag}={getattr(args, flag)} must be >= 1")
    if args.ranks % 2:
        p.error(f"--ranks={args.ranks} must be even (lbp pairs ranks into packages of 2)")
    result = measure(args.ranks, args.runs, args.steps, args.hidden, args.layers, args.seq)
    if args.json:
        print(json.dumps(result))
    else:
        m = result["median_step_s"]
        print(f"overhead on {args.ranks} unshaped CPU ranks ({result['machine']['cpus']} cores), "
              f"{args.runs} alternating runs x {args.steps} steps, medians:")
        print(f"  megatron-distopt  {m['megatron-distopt']:.3f} s/step")
        print(f"  lbp (P=2, G=W)    {m['lbp']:.3f} s/step")
        print(f"  ratio lbp / stock {result['ratio_lbp_over_stock']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
