"""The runs of a study and what they cost: ``python -m megatron_lbp.study plan``.

A study is node counts x schemes (x seeds at its smallest node count), each run a fixed
number of iterations of the same model, data and settings, weak or strong scaling, one
after another in one allocation of the largest node count. The cost is an estimate,
stated as such: per run ``--startup-s`` (an assumption) plus the iterations at
``--step-seconds``, or at the projection's step time (stock Megatron's distributed
optimizer costed as zero2, the nearest scheme it models).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass

from megatron_lbp.projection.schemes import DISTOPT, DS_SCHEMES, MODELLED_AS

SCHEMES = ("lbp", "zeropp", "zero3", "distopt") + DS_SCHEMES
# The cost model has no scheme of these; each is costed as the nearest it has (the one
# registry, megatron_lbp/projection/schemes.py; the study calls stock's distributed
# optimizer "distopt", as HIER_PRESET does).
COST_AS = {"distopt": MODELLED_AS[DISTOPT], **{s: MODELLED_AS[s] for s in DS_SCHEMES}}
# hpZ partitions a secondary copy over one node: on one node it would be the whole job
# (megatron_lbp/deepspeed_baseline/schemes.py refuses it), so these schemes start at two nodes.
MIN_NODES = {"ds-hpz": 2, "ds-zeropp": 2}


class PlanError(ValueError):
    """Input the study cannot run; the message is one line."""


@dataclass(frozen=True)
class Run:
    name: str
    nodes: int
    scheme: str
    global_batch: int
    micro_batches: int
    seed: int
    step_s: float
    run_s: float


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlanError(f"{what}={text!r}: give comma-separated integers") from None
    if not values or any(v < 1 for v in values):
        raise PlanError(f"{what}={text!r}: give comma-separated integers >= 1")
    return sorted(set(values))


def projected_step_s(scheme: str, nodes: int, tasks_per_node: int, gcds_per_package: int,
                     model: dict, micro_batch_size: int, micro_batches: int, seq_length: int) -> float:
    from megatron_lbp.projection import project

    plan = project.plan_for(model, nodes * tasks_per_node, COST_AS.get(scheme, scheme), micro_batches,
                            gpus_per_node=tasks_per_node, gcds_per_package=gcds_per_package)
    compute = project.ComputeModel(seq_length=seq_length, micro_batch_size=micro_batch_size)
    return project.step_time(plan, model, project.LinkModel(), compute)["step_s"]


def make_runs(*, nodes: list[int], schemes: list[str], scaling: str, tasks_per_node: int,
              gcds_per_package: int, micro_batch_size: int, micro_batches: int | None,
              global_batch: int | None, iters: int, seeds: list[int], startup_s: float,
              step_seconds: float | None, model: dict, seq_length: int) -> list[Run]:
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise PlanError(f"--schemes {','.join(bad)}: unknown; choose from {', '.join(SCHEMES)}")
    if scaling == "weak":
        if not micro_batches:
            raise PlanError("--scaling weak needs --micro-batches (per GCD, fixed across node counts)")
    elif scaling == "strong":
        if not global_batch:
            raise PlanError("--scaling strong needs --global-batch (fixed across node counts)")
    else:
        raise PlanError(f"--scaling {scaling}: use weak or strong")
    if iters < 1:
        raise PlanError(f"--iters {iters}: at least 1")
    runs = []
    for n in nodes:
        gcds = n * tasks_per_node
        if scaling == "weak":
            k, gbs = micro_batches, micro_batches * micro_batch_size * gcds
        else:
            per = micro_batch_size * gcds
            if global_batch % per:
                raise PlanError(f"--global-batch {global_batch} is not a multiple of {per} "
                                f"(micro-batch size {micro_batch_size} x {gcds} GCDs on {n} node(s)): "
                                "strong scaling needs it divisible at every node count")
            k, gbs = global_batch // per, global_batch
        for scheme in schemes:
            if n < MIN_NODES.get(scheme, 1):
                continue
            step = step_seconds if step_seconds else projected_step_s(
                scheme, n, tasks_per_node, gcds_per_package, model, micro_batch_size, k, seq_length)
            for seed in (seeds if n == nodes[0] else seeds[:1]):
                name = f"n{n:03d}-{scheme}-s{seed}"
                runs.append(Run(name, n, scheme, gbs, k, seed, step, startup_s + iters * step))
    if not runs:
        raise PlanError(f"no runs: {', '.join(schemes)} on {','.join(map(str, nodes))} node(s) "
                        f"(hpZ schemes need >= 2 nodes)")
    return runs


def skipped(nodes: list[int], schemes: list[str]) -> list[str]:
    """The (scheme, node count) pairs the plan leaves out, and why, for the plan's printout."""
    return [f"{s} on {n} node(s): not run (hpZ's node-sized secondary partition would be the whole job)"
            for n in nodes for s in schemes if n < MIN_NODES.get(s, 1)]


def cost(runs: list[Run]) -> dict:
    alloc = max(r.nodes for r in runs)
    seconds = sum(r.run_s for r in runs)
    return {"allocation_nodes": alloc, "seconds": seconds, "node_hours": alloc * seconds / 3600,
            "busy_node_hours": sum(r.nodes * r.run_s for r in runs) / 3600,
            "walltime_minutes": math.ceil(seconds * 1.2 / 60) + 10}


def render(runs: list[Run], c: dict, scaling: str, iters: int, step_source: str) -> str:
    lines = [f"[study] {scaling} scaling, {iters} iterations per run, {len(runs)} runs in one allocation "
             f"of {c['allocation_nodes']} node(s), one fresh srun each, one after another",
             f"[study] {'run':<22} {'nodes':>5} {'scheme':<8} {'global batch':>12} {'micro-batches':>13} "
             f"{'seed':>5} {'step s':>8} {'run s':>8}"]
    for r in runs:
        lines.append(f"[study] {r.name:<22} {r.nodes:>5} {r.scheme:<9} {r.global_batch:>12} "
                     f"{r.micro_batches:>13} {r.seed:>5} {r.step_s:>8.2f} {r.run_s:>8.0f}")
    lines.append(f"[study] cost: {c['node_hours']:.2f} node-hours ({c['allocation_nodes']} nodes x "
                 f"{c['seconds'] / 3600:.2f} h; the runs themselves use {c['busy_node_hours']:.2f}); "
                 f"step times {step_source}; sbatch -t {c['walltime_minutes']} min (+20% and 10 min)")
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the study's runs, their order and cost in node-hours")
    p.add_argument("--nodes", required=True, help="node counts, e.g. 1,2,4,8,16,32,48")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--scaling", choices=("weak", "strong"), required=True)
    p.add_argument("--tasks-per-node", type=int, default=8)
    p.add_argument("--gcds-per-package", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=None, help="per GCD (weak scaling)")
    p.add_argument("--global-batch", type=int, default=None, help="strong scaling")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seeds", default="1234", help="seeds; all at the smallest node count, the first elsewhere")
    p.add_argument("--startup-s", type=float, default=300.0,
                   help="assumed seconds per run before its first iteration")
    p.add_argument("--step-seconds", type=float, default=None, help="replaces the cost model's step time")
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--runs-file", default=None, help="write the runs here, one tab-separated line each")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        runs = make_runs(
            nodes=_ints(args.nodes, "--nodes"), schemes=[s for s in args.schemes.split(",") if s],
            scaling=args.scaling, tasks_per_node=args.tasks_per_node,
            gcds_per_package=args.gcds_per_package, micro_batch_size=args.micro_batch_size,
            micro_batches=args.micro_batches, global_batch=args.global_batch, iters=args.iters,
            seeds=_ints(args.seeds, "--seeds") if args.seeds else [1234], startup_s=args.startup_s,
            step_seconds=args.step_seconds,
            model={"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                   "num_attention_heads": args.num_attention_heads, "vocab_size": args.vocab_size},
            seq_length=args.seq_length)
    except PlanError as err:
        print(f"{parser.prog} plan: error: {err}", file=sys.stderr)
        return 2
    c = cost(runs)
    source = (f"{args.step_seconds} s (given)" if args.step_seconds else
              "from bench project's cost model (MI250X compute, Frontier links; distopt costed as zero2, "
              "ds-zero3 as zero3, ds-hpz and ds-zeropp as zeropp)")
    print(render(runs, c, args.scaling, args.iters, source))
    for line in skipped(_ints(args.nodes, "--nodes"), [s for s in args.schemes.split(",") if s]):
        print(f"[study] {line}")
    if args.runs_file:
        with open(args.runs_file, "w") as f:
            for r in runs:
                f.write("\t".join(str(v) for v in (r.name, r.nodes, r.scheme, r.global_batch, r.seed)) + "\n")
            f.write(f"#walltime_minutes\t{c['walltime_minutes']}\n#allocation_nodes\t{c['allocation_nodes']}\n")
    return 0
