"""``python -m megatron_lbp.projection``: the Frontier projection's command line, the cost model
(projection/project.py) and the committed traces' replay (projection/project_replay.py) side by side."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any, Sequence

from megatron_lbp.core.config import DEFAULT_BUCKET_SIZE
from megatron_lbp.core.costs import LINK_CLASS_ORDER
from megatron_lbp.projection import json_out
from megatron_lbp.projection import project as pj
from megatron_lbp.projection import project_replay as pr
from megatron_lbp.projection.project import (DEFAULT_SCHEMES, GB, GCDS, MODELS, SCHEMES, US,
                                             ComputeModel, LinkModel, project, render)


def main(argv=None) -> int:
    c, links = ComputeModel(), LinkModel()
    p = argparse.ArgumentParser(prog="python -m megatron_lbp.projection", description=pj.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--gcds", default=",".join(map(str, GCDS)))
    p.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                   help=f"comma-separated subset of {','.join(SCHEMES)}")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=c.micro_batch_size)
    p.add_argument("--seq-length", type=int, default=c.seq_length)
    p.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE,
                   help=f"elements (default {DEFAULT_BUCKET_SIZE:,}, Megatron's)")
    p.add_argument("--mfu", type=float, default=c.mfu)
    p.add_argument("--peak-tflops", type=float, default=c.peak_flops / 1e12)
    p.add_argument("--recompute", action="store_true", help="full activation recomputation")
    p.add_argument("--no-overlap", action="store_true")
    for cls in LINK_CLASS_ORDER:
        p.add_argument(f"--bw-{cls}", type=float, default=links.bandwidth[cls] / GB,
                       help="GB/s per GCD")
        p.add_argument(f"--lat-{cls}", type=float, default=links.latency[cls] / US,
                       help="microseconds per collective step")
    r = p.add_argument_group("the replayed schedule (megatron_lbp/projection/project_replay.py)")
    r.add_argument("--trace", action="append", default=[], metavar="SCHEME=PATH",
                   help="replay SCHEME from this schedule trace (--hier-trace output, .gz "
                        "allowed) instead of the committed one; repeatable")
    r.add_argument("--trace-rank", type=int, default=0, help="whose program to replay")
    r.add_argument("--no-replay", action="store_true", help="only the idealised model")
    r.add_argument("--record-traces", metavar="DIR", default=None,
                   help="record the traces the replay uses into DIR (index.json + one "
                        ".jsonl.gz per layer count and scheme) and stop")
    r.add_argument("--record-layers", default=None,
                   help="layer counts to record (default: those of --models)")
    r.add_argument("--record-ranks", type=int, default=16,
                   help="gloo ranks, 8 per node (default 16: two nodes)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    models = [m for m in args.models.split(",") if m]
    schemes = [s for s in args.schemes.split(",") if s]
    if not models or any(m not in MODELS for m in models):
        p.error(f"--models must be a subset of {','.join(MODELS)}")
    if not schemes or any(s not in SCHEMES for s in schemes):
        p.error(f"--schemes must be a subset of {','.join(SCHEMES)}")
    try:
        gcds = sorted({int(g) for g in args.gcds.split(",") if g})
    except ValueError:
        p.error(f"--gcds={args.gcds!r}: comma-separated integers")
    if not gcds or any(g < 1 for g in gcds):
        p.error("--gcds must list positive GCD counts")
    for flag in ("micro_batches", "micro_batch_size", "seq_length", "bucket_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not 0 < args.mfu <= 1 or args.peak_tflops <= 0:
        p.error("--mfu must be in (0, 1] and --peak-tflops > 0")
    try:
        links = LinkModel.from_measured(
            {c: getattr(args, f"bw_{c}") * GB for c in LINK_CLASS_ORDER},
            {c: getattr(args, f"lat_{c}") * US for c in LINK_CLASS_ORDER})
    except ValueError as e:
        p.error(str(e))
    compute = replace(c, mfu=args.mfu, peak_flops=args.peak_tflops * 1e12,
                      micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                      recompute=args.recompute)
    if args.record_traces is not None:
        return _record(p, args, models, schemes, given)
    try:
        traces = {} if args.no_replay else _traces(args.trace, schemes, models, pr)
    except pr.ReplayError as e:
        print(f"python -m megatron_lbp.projection: error: {e}", file=sys.stderr)
        return 2
    out = project(models, gcds, schemes, args.micro_batches, args.bucket_size, links, compute,
                  not args.no_overlap)
    if not args.no_replay:
        try:
            out["replay"] = pr.replay_projection(models, gcds, schemes, traces, links, compute,
                                                 rank=args.trace_rank)
        except pr.ReplayError as e:
            print(f"python -m megatron_lbp.projection: error: {e}", file=sys.stderr)
            return 2
    if args.json:
        json_out.emit(out)
    else:
        print(render(out) + ("\n" + "\n".join(pr.render(out["replay"], out["paper"], out))
                             if "replay" in out else ""))
    return 0


def _traces(given: Sequence[str], schemes: Sequence[str], models: Sequence[str],
            pr) -> dict[str, dict[int, Any]]:
    """scheme -> layer count -> trace path: the committed ones, replaced by each --trace
    (which must have the units of every model asked for)."""
    import os

    traces = pr.default_traces()
    for item in given:
        scheme, sep, path = item.partition("=")
        if not sep or scheme not in SCHEMES or not path:
            raise pr.ReplayError(f"--trace {item!r}: give SCHEME=PATH, SCHEME one of "
                                 f"{','.join(SCHEMES)}")
        if "{rank}" not in path and not os.path.exists(path):
            raise pr.ReplayError(f"--trace {item!r}: {path} does not exist")
        if scheme not in schemes:
            raise pr.ReplayError(f"--trace {item!r}: {scheme} is not in --schemes")
        records = pr.load(path)
        for name in models:
            pr.check_units(records, MODELS[name], f"--trace {item} for {name}")
        traces[scheme] = {pr.layer_count(records): path}
    return traces


def _record(p, args, models, schemes, given: Sequence[str]) -> int:
    import shlex

    try:
        layers = sorted({int(x) for x in args.record_layers.split(",") if x}, reverse=True) \
            if args.record_layers else [MODELS[m]["num_layers"] for m in models]
    except ValueError:
        p.error(f"--record-layers={args.record_layers!r}: comma-separated layer counts")
    if not layers or min(layers) < 1:
        p.error("--record-layers must list positive layer counts")
    if args.record_ranks < 16 or args.record_ranks % 8:
        p.error(f"--record-ranks={args.record_ranks} must be a multiple of 8 (nodes of 8 "
                f"GCDs), at least 16 (two nodes: every group family spans ranks)")
    command = shlex.join(["python", "-m", "megatron_lbp.projection", *given])
    try:
        index = pr.record_traces(args.record_traces, layers=layers, schemes=schemes,
                                 ranks=args.record_ranks, command=command,
                                 log=lambda line: print(line, file=sys.stderr, flush=True))
    except pr.ReplayError as e:
        p.error(str(e))
    if args.json:
        json_out.emit(index)
    else:
        print("\n".join(f"{e['file']}: {e['scheme']}, {e['layers']} layers" for e in index["traces"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
