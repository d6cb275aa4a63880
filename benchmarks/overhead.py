"""Engine overhead on one unshaped node: each engine preset beside the stock scheme that does its job.

On one node every link is the same loopback, so a step-time difference is
what the implementation costs, plus whatever the algorithm adds. Pairs (A / B):

- ``zero2 / megatron-distopt``: weights whole on every rank, gradients and
  optimizer state 1/W: the engine's implementation against Megatron's DDP +
  distributed optimizer;
- ``zero3 / megatron-fsdp``: everything 1/W, weights gathered before use and
  freed after: against megatron-core's bundled Megatron-FSDP (``optim_grads_params``);
- ``lbp / megatron-distopt``: the hierarchy (P=2, G=W) against stock Megatron,
  i.e. the algorithm's extra gathers and the implementation together.

All schemes train the same GPT (fp32) on the same data in the same rank
processes, set up side by side and stepped in turns: round r runs one step of
every scheme, the order rotated each round (and each run), so load from other
processes on the machine falls on all of them alike (ABAB...). Each step is
timed on every rank between two barriers (rank 0's figures). A pair's ratio is
A's median step over B's (medians over every round of every run); the median
over rounds of A / B in the same round is given beside it. Every scheme uses
the same bucket size (``--bucket-size``, default 70,000 elements), and the
bucket counts are reported. The same size does not give the same buckets:
Megatron's DDP closes a bucket once it has reached the size, so at 70,000 the
default model (4 layers of 198,272) has 8 DDP buckets (about 2 per layer; 13 at
40,000). The engine and Megatron-FSDP make each transformer layer one unit,
gathered and reduced as one bucket whatever the size (the size applies to the
parameters outside the layers; the engine's embedding and output layer are
units of their own: 6 in all). Every scheme overlaps communication
with compute as it does by default in training (Megatron's DDP needs
``overlap_grad_reduce`` for its buckets at all). With one micro-batch per step
(default) both sides of a pair issue the same collectives per bucket; with
more, the engine reduce-scatters each micro-batch's gradient into its 1/G
shard where Megatron accumulates the full gradient locally first.

    python -m benchmarks overhead [--ranks 8] [--runs 3] [--steps 6] [--json]
        [--bucket-size 70000] [--micro-batches 1] [--profile]

``--profile`` adds one run, not timed, with cProfile on rank 0 around each
scheme's steps, and reports for each pair the seconds per step by where they
are spent (collectives and waits, torch compute, engine / megatron-core /
torch Python), each side's top functions and the engine's functions by
cumulative time (benchmarks.overhead_profile).
"""
from __future__ import annotations
from megatron_lbp.projection import json_out

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

from benchmarks import cpu_share
from megatron_lbp.projection.schemes import DISTOPT, FSDP, schemes_from

WARMUP_STEPS = 2
DEFAULT_BUCKET_SIZE = 70_000
STOCK, FSDP = DISTOPT, FSDP
# (A, B, what the pair measures)
PAIRS = (
    ("zero2", STOCK, "implementation: same sharding as Megatron's distributed optimizer"),
    ("zero3", FSDP, "implementation: same sharding as Megatron-FSDP optim_grads_params"),
    ("lbp", STOCK, "algorithm + implementation: the hierarchy vs stock Megatron"),
)
SCHEMES = ("lbp", "zero2", "zero3", STOCK, FSDP)


def pair_key(a: str, b: str) -> str:
    return f"{a}/{b}"


def _engine_argv(scheme: str, node: int) -> list[str]:
    if scheme == "lbp":
        return ["--hier-preset", "lbp", "--hier-param-group-size", "2",
                "--hier-grad-group-size", str(node)]
    return ["--hier-preset", scheme]


def _trainer(scheme: str, spec, train, node: int):
    from benchmarks.traffic import setup_fsdp
    from megatron_lbp.testing.tiny_gpt import setup_hier, setup_stock

    if scheme == STOCK:
        return setup_stock(spec, train)
    if scheme == FSDP:
        return setup_fsdp(spec, train)
    return setup_hier(spec, train, _engine_argv(scheme, node))


def bucket_count(scheme: str, trainer) -> int:
    """How many buckets (units of one collective) the scheme split the model into."""
    if scheme == STOCK:
        return sum(len(g.buckets) for g in trainer.model.bucket_groups)
    if scheme == FSDP:
        return len(trainer.model.module.param_and_grad_buffer.parameter_groups)
    return len(trainer.model.bucket_numels())


def rank_bench(schemes, spec, train, node: int, profile: bool = False) -> dict[str, Any]:
    """On every rank: all schemes set up, then ``train.steps`` rounds of one step of each.

    With ``profile``, rank 0 runs cProfile around each scheme's kept steps and
    returns their summaries (overhead_profile.summarize).
    """
    import cProfile

    import torch.distributed as dist

    from benchmarks import overhead_profile

    trainers = {s: _trainer(s, spec, train, node) for s in schemes}
    profiling = profile and dist.get_rank() == 0
    profilers = {s: cProfile.Profile() for s in schemes} if profiling else {}
    results = dict.fromkeys(schemes)
    out: dict[str, Any] = {"step_s": {s: [] for s in schemes}, "order": []}
    for step in range(train.steps):
        keep = step >= WARMUP_STEPS
        shift = step % len(schemes)
        order = schemes[shift:] + schemes[:shift]
        if keep:
            out["order"].append(order)
        for s in order:
            dist.barrier()
            prof = profilers.get(s) if keep else None
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            results[s] = trainers[s].run([step], result=results[s])
            if prof:
                prof.disable()
            dist.barrier()
            if keep:
                out["step_s"][s].append(time.perf_counter() - t0)
    out["losses"] = {s: results[s].losses for s in schemes}
    out["buckets"] = {s: bucket_count(s, trainers[s]) for s in schemes}
    kept = train.steps - WARMUP_STEPS
    out["profiles"] = {s: overhead_profile.summarize(p, kept) for s, p in profilers.items()}
    return out


def measure(ranks: int = 8, runs: int = 3, steps: int = 6, hidden: int = 128, layers: int = 4,
            seq: int = 128, bucket_size: int = DEFAULT_BUCKET_SIZE, micro_batches: int = 1,
            schemes=SCHEMES, profile: bool = False, timeout: float = 1800) -> dict:
    from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec

    spec = TinyGPTSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                       vocab_size=1024, seq_length=seq)
    # overlap_grad_reduce: Megatron's DDP ignores the bucket size without it (one
    # bucket), and the engine (--hier-overlap, its default) and Megatron-FSDP
    # (forced for optim_grads_params) overlap too.
    train = TrainSpec(steps=steps + WARMUP_STEPS, micro_batch_size=2,
                      micro_batches=micro_batches, bucket_size=bucket_size,
                      overlap_grad_reduce=True)
    schemes = tuple(schemes)
    step_s: dict[str, list[float]] = {s: [] for s in schemes}
    run_medians: dict[str, list[float]] = {s: [] for s in schemes}
    paired: dict[str, list[float]] = {}
    load_start = os.getloadavg()
    cpu_start = cpu_share.snapshot()
    first = None
    for run in range(runs):
        rotated = schemes[run % len(schemes):] + schemes[:run % len(schemes)]
        rank0 = run_on_ranks(rank_bench, ranks, rotated, spec, train, ranks,
                             rank_env=rank_location_env(ranks), timeout=timeout)[0]
        first = first or rank0
        for s in schemes:
            step_s[s] += rank0["step_s"][s]
            run_medians[s].append(statistics.median(rank0["step_s"][s]))
        for a, b, _ in PAIRS:
            if a in schemes and b in schemes:
                paired.setdefault(pair_key(a, b), []).extend(
                    x / y for x, y in zip(rank0["step_s"][a], rank0["step_s"][b]))
    medians = {s: statistics.median(step_s[s]) for s in schemes}
    pairs = {}
    for a, b, what in PAIRS:
        key = pair_key(a, b)
        if key not in paired:
            continue
        la, lb = first["losses"][a], first["losses"][b]
        pairs[key] = {
            "a": a, "b": b, "measures": what,
            "ratio": medians[a] / medians[b],
            "median_paired_ratio": statistics.median(paired[key]),
            "paired_ratios": paired[key],
            "buckets": {a: first["buckets"][a], b: first["buckets"][b]},
            "max_loss_difference": max(abs(x - y) for x, y in zip(la, lb)),
        }
    load_end = os.getloadavg()
    out = {
        "ranks": ranks, "runs": runs, "steps_timed_per_run": steps,
        "warmup_steps": WARMUP_STEPS, "micro_batches": micro_batches,
        "bucket_size": bucket_size,
        "model": {"layers": layers, "hidden": hidden, "seq": seq, "vocab": 1024,
                  "dtype": "fp32"},
        "schemes": list(schemes),
        "buckets": first["buckets"],
        "median_step_s": medians,
        "run_medians_s": run_medians,
        "step_s": step_s,
        "losses": first["losses"],
        "pairs": pairs,
        "loadavg_start": list(load_start), "loadavg_end": list(load_end),
        "machine": {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                    "torch": _torch()},
    }
    if "lbp" in medians and STOCK in medians:
        out["ratio_lbp_over_stock"] = medians["lbp"] / medians[STOCK]
    cpu_share.record(out, cpu_start, out["machine"]["cpus"])
    if profile:
        # A run of its own: the profiler slows Python calls, so these steps are not timed.
        out["profiles"] = run_on_ranks(rank_bench, ranks, schemes, spec, train, ranks, True,
                                       rank_env=rank_location_env(ranks), timeout=timeout)[0][
            "profiles"]
    return out


def _torch() -> str:
    import torch

    return torch.__version__


def render(result: dict) -> str:
    m = result["median_step_s"]
    lines = [f"overhead on {result['ranks']} unshaped CPU ranks ({result['machine']['cpus']} cores), "
             f"{result['runs']} run(s) x {result['steps_timed_per_run']} rounds, every scheme "
             f"stepped in turn; bucket size {result['bucket_size']:,}, "
             f"{result['micro_batches']} micro-batch(es) per step; load average "
             f"{result['loadavg_start'][0]:.1f} at start, {result['loadavg_end'][0]:.1f} at the end"
             f"{cpu_share.clause(result.get('other_cpu'))}",
             *([f"WARNING: {result['load_warning']}"] if result.get("load_warning") else []),
             f"  {'scheme':<18}{'median s/step':>14}{'buckets':>9}"]
    for s in result["schemes"]:
        lines.append(f"  {s:<18}{m[s]:>14.4f}{result['buckets'][s]:>9}")
    lines.append(f"  {'pair (A/B)':<26}{'ratio':>7}{'paired':>8}  max |loss diff|  measures")
    for key, p in result["pairs"].items():
        lines.append(f"  {key:<26}{p['ratio']:>7.3f}{p['median_paired_ratio']:>8.3f}  "
                     f"{p['max_loss_difference']:>15.2e}  {p['measures']}")
    lines.append("  (ratio: A's median step / B's; paired: median over rounds of A / B in the "
                 "same round)")
    if result.get("profiles"):
        from benchmarks import overhead_profile

        lines += ["", overhead_profile.render(result["profiles"], result["pairs"])]
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        self.exit(2, f"python -m benchmarks overhead: error: {message}\n")


def main(argv=None) -> int:
    p = _Parser(prog="python -m benchmarks overhead", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--runs", type=int, default=3, help="multi-rank runs (scheme order rotated)")
    p.add_argument("--steps", type=int, default=6,
                   help=f"timed rounds per run (after {WARMUP_STEPS} warm-up)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE,
                   help="elements per bucket, the same for every scheme")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--schemes", default=",".join(SCHEMES),
                   help=f"comma-separated subset of {','.join(SCHEMES)}")
    p.add_argument("--profile", action="store_true",
                   help="one more run, cProfile on rank 0 around each scheme's steps (not timed): "
                        "where each pair's time goes")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for flag in ("ranks", "runs", "steps", "hidden", "layers", "seq", "bucket_size",
                 "micro_batches"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    if args.ranks % 2:
        p.error(f"--ranks={args.ranks} must be even (lbp pairs ranks into packages of 2)")
    schemes = schemes_from(p, args.schemes, SCHEMES)
    schemes = [s for s in SCHEMES if s in schemes]
    result = measure(args.ranks, args.runs, args.steps, args.hidden, args.layers, args.seq,
                     args.bucket_size, args.micro_batches, schemes, args.profile)
    json_out.emit(result) if args.json else print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
