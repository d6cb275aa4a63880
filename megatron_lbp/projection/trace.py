"""Exposed communication per phase, from the engine's schedule trace (``--hier-trace``).

    python -m megatron_lbp.projection trace PATH [PATH ...] [--steps all|N|A-B] [--json]
    python -m megatron_lbp.projection trace --record DIR [--ranks 8] [--gpus-per-node 4]
        [--layers 4] [--hidden 128] [--steps 4] [--micro-batches 2] [--no-recompute]
        [--prefetch-units 1] [--json]

PATH is a trace file (``.gz`` allowed) or a pattern with ``{rank}``. Per rank and
phase: exposed time, collective count and bytes, compute per pass, step time;
means over steps (the first left out unless --steps all). ``--record DIR``
first traces the tests' tiny GPT on gloo ranks. Format: docs/schedule-trace.md.
"""
from __future__ import annotations
from megatron_lbp.projection import json_out

import argparse
import glob
import gzip
import json
import statistics
import sys
from typing import Any, Iterable, Sequence

from megatron_lbp.engine.comm import ALL_PHASES
from megatron_lbp.engine.trace_summary import exposed, step_summary  # noqa: F401 (read here too)
# The reader is torch-free (the launcher's dry run replays the committed traces); named
# here too for the tools that read traces through this module.
from megatron_lbp.projection.trace_records import TRACE_FORMAT_VERSION, TraceError, read_records

PROG = "python -m megatron_lbp.projection trace"
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise TraceError(message)


def _mean(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of step summaries (same keys, nested)."""
    first = rows[0]
    if isinstance(first, dict):
        return {k: _mean([r[k] for r in rows]) for k in first}
    return sum(rows) / len(rows)


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    first = rows[0]
    if isinstance(first, dict):
        return {k: _median([r[k] for r in rows]) for k in first}
    return statistics.median(rows)


def summarize(records: Iterable[dict[str, Any]], steps: set[int] | str | None = None
              ) -> dict[str, Any]:
    """Per rank (mean over ``steps``: a set, "all", or None for all but the first when
    there are more) and the median over ranks."""
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    for r in records:
        by_rank.setdefault(r["rank"], {})[r["step"]] = r
    if not by_rank:
        raise TraceError("the trace holds no step records")
    all_steps = sorted(set().union(*(set(s) for s in by_rank.values())))
    if steps == "all":
        chosen = all_steps
    elif steps is not None:
        chosen = sorted(steps)
    else:
        chosen = all_steps[1:] if len(all_steps) > 1 else all_steps
    ranks = {}
    for rank, records_of in sorted(by_rank.items()):
        rows = [step_summary(records_of[s]) for s in chosen if s in records_of]
        if not rows:
            raise TraceError(f"rank {rank} has none of the steps {chosen} "
                             f"(it has {sorted(records_of)})")
        ranks[rank] = _mean(rows)
    return {"steps": chosen, "ranks": ranks, "median": _median(list(ranks.values()))}


def parse_steps(text: str) -> set[int] | str:
    if text == "all":
        return "all"
    try:
        if "-" in text:
            a, b = (int(x) for x in text.split("-", 1))
            if a > b:
                raise ValueError
            return set(range(a, b + 1))
        return {int(text)}
    except ValueError:
        raise TraceError(f"--steps={text}: give all, N or A-B (step numbers from 1)") from None


def render(summary: dict[str, Any], units: list[dict[str, Any]] | None, depth) -> str:
    med = summary["median"]
    ranks = summary["ranks"]
    steps = summary["steps"]
    kinds = {}
    for u in units or []:
        kinds[u["kind"]] = kinds.get(u["kind"], 0) + 1
    unit_text = ", ".join(f"{n} {k}{_plural(k, n)}" for k, n in kinds.items())
    lines = [f"schedule trace: {len(ranks)} rank(s), step(s) {_steps_text(steps)}; "
             f"{len(units or [])} unit(s) ({unit_text}), prefetch {depth} unit(s) ahead",
             "per optimizer step, median over ranks:",
             f"  {'phase':<16}{'exposed ms':>12}{'count':>8}{'bytes':>16}"]
    for ph in ALL_PHASES:
        row = med["phases"][ph]
        if not row["count"] and not row["exposed_s"]:
            continue
        lines.append(f"  {ph:<16}{1e3 * row['exposed_s']:12.3f}{row['count']:8.0f}"
                     f"{row['bytes']:16,.0f}")
    lines.append(f"  {'total':<16}{1e3 * med['exposed_s']:12.3f}")
    lines.append(f"  step {1e3 * med['step_s']:.3f} ms; compute: "
                 + ", ".join(f"{p} {1e3 * s:.3f} ms" for p, s in med["compute_s"].items() if s))
    shown = [ph for ph in ALL_PHASES if med["phases"][ph]["count"]]
    lines += ["exposed ms per rank:", "  rank" + "".join(f"{ph:>17}" for ph in shown)
              + f"{'total':>10}"]
    for rank, r in ranks.items():
        lines.append(f"  {rank:>4}" + "".join(f"{1e3 * r['phases'][ph]['exposed_s']:17.3f}"
                                               for ph in shown)
                     + f"{1e3 * r['exposed_s']:10.3f}")
    return "\n".join(lines)


def _plural(kind: str, n: int) -> str:
    return "s" if n > 1 and kind in ("layer", "other") else ""


def _steps_text(steps: list[int]) -> str:
    if len(steps) > 1 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}"
    return ",".join(map(str, steps))


# --- recording a small run ---------------------------------------------------------------
RECORDED_RUNS = ("overlap-on", "overlap-off", "untraced")


def _record_on_rank(spec, train, runs: dict[str, list[str]]) -> dict[str, list[float]]:
    """Every run's trainer on this rank, stepped in turns (the order rotated each step, so
    load from other processes hits all alike); each step's wall time between barriers."""
    import time

    import torch.distributed as dist

    from megatron_lbp.testing.tiny_gpt import setup_hier

    trainers = {name: setup_hier(spec, train, argv) for name, argv in runs.items()}
    names = list(trainers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(train.steps):
        for name in names[step % len(names):] + names[:step % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            trainers[name].run([step])
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return times


def record(out_dir: str, *, ranks: int = 8, gpus_per_node: int = 4, layers: int = 4,
           hidden: int = 128, steps: int = 4, micro_batches: int = 2, recompute: bool = True,
           prefetch_units: int = 1) -> dict[str, Any]:
    import os

    from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec

    spec = TinyGPTSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                       vocab_size=1024, seq_length=128, recompute=recompute)
    train = TrainSpec(steps=steps, micro_batch_size=2, micro_batches=micro_batches)
    base = ["--hier-preset", "lbp", "--hier-param-group-size", "2",
            "--hier-grad-group-size", str(gpus_per_node),
            "--hier-prefetch-units", str(prefetch_units)]
    paths = {name: os.path.join(out_dir, name, "trace-{rank}.jsonl") for name in RECORDED_RUNS[:2]}
    for name in paths:
        os.makedirs(os.path.dirname(paths[name]), exist_ok=True)
        for f in glob.glob(os.path.join(out_dir, name, "trace-*.jsonl")):
            os.remove(f)  # the trace appends: start from nothing
    runs = {"overlap-on": base + ["--hier-trace", paths["overlap-on"]],
            "overlap-off": base + ["--no-hier-overlap", "--hier-trace", paths["overlap-off"]],
            "untraced": base}
    times = run_on_ranks(_record_on_rank, ranks, spec, train, runs,
                         rank_env=rank_location_env(gpus_per_node), timeout=1800)[0]
    out = {name: summarize(read_records([path])) for name, path in paths.items()}
    out["step_s"] = {"traced": statistics.median(times["overlap-on"][1:] or times["overlap-on"]),
                     "untraced": statistics.median(times["untraced"][1:] or times["untraced"])}
    out["units"] = read_records([paths["overlap-on"]])[0]["units"]
    out["prefetch_units"] = prefetch_units
    return out


def render_recorded(out: dict[str, Any]) -> str:
    on, off = out["overlap-on"]["median"], out["overlap-off"]["median"]
    lines = [render(out["overlap-on"], out["units"], out["prefetch_units"]).splitlines()[0],
             "exposed communication per optimizer step, median over ranks (ms):",
             f"  {'phase':<16}{'overlap on':>12}{'overlap off':>13}{'count':>7}{'bytes':>14}"]
    for ph in ALL_PHASES:
        if not off["phases"][ph]["count"]:
            continue
        lines.append(f"  {ph:<16}{1e3 * on['phases'][ph]['exposed_s']:12.3f}"
                     f"{1e3 * off['phases'][ph]['exposed_s']:13.3f}"
                     f"{off['phases'][ph]['count']:7.0f}{off['phases'][ph]['bytes']:14,.0f}")
    lines.append(f"  {'total':<16}{1e3 * on['exposed_s']:12.3f}{1e3 * off['exposed_s']:13.3f}")
    lines.append(f"  {'step':<16}{1e3 * on['step_s']:12.3f}{1e3 * off['step_s']:13.3f}")
    t = out["step_s"]
    lines.append(f"median step with overlap, barrier to barrier: traced {1e3 * t['traced']:.3f} "
                 f"ms, untraced {1e3 * t['untraced']:.3f} ms (ratio "
                 f"{t['traced'] / t['untraced']:.3f})")
    return "\n".join(lines)


def _json_summary(summary: dict[str, Any]) -> dict[str, Any]:
    return {"steps": summary["steps"],
            "ranks": {str(k): v for k, v in summary["ranks"].items()},
            "median": summary["median"]}


def main(argv: Sequence[str] | None = None) -> int:
    p = _Parser(prog=PROG, description=__doc__, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", metavar="PATH")
    p.add_argument("--steps", default=None,
                   help="all, N or A-B (default: all but the first when there are more); "
                        "with --record: optimizer steps to run (default 4)")
    p.add_argument("--json", action="store_true")
    r = p.add_argument_group("recording a small run first (--record DIR)")
    r.add_argument("--record", metavar="DIR", default=None)
    r.add_argument("--ranks", type=int, default=8)
    r.add_argument("--gpus-per-node", type=int, default=4)
    r.add_argument("--layers", type=int, default=4)
    r.add_argument("--hidden", type=int, default=128)
    r.add_argument("--micro-batches", type=int, default=2)
    r.add_argument("--prefetch-units", type=int, default=1)
    r.add_argument("--no-recompute", action="store_true")
    try:
        args = p.parse_args(argv)
        if args.record is not None:
            return _main_record(args)
        if not args.paths:
            raise TraceError("give a trace PATH (or --record DIR to make one)")
        records = read_records(args.paths)
        steps = parse_steps(args.steps) if args.steps is not None else None
        summary = summarize(records, steps)
    except TraceError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if args.json:
        json_out.emit(_json_summary(summary))
    else:
        first = records[0]
        print(render(summary, first.get("units"), first.get("prefetch_units")))
    return 0


def _main_record(args) -> int:
    if args.paths:
        raise TraceError("--record DIR makes its own trace: give no PATH with it")
    steps = 4 if args.steps is None else int(args.steps) if args.steps.isdigit() else 0
    for flag, value, low in (("--steps", steps, 2), ("--ranks", args.ranks, 2),
                             ("--layers", args.layers, 1), ("--hidden", args.hidden, 4),
                             ("--micro-batches", args.micro_batches, 1),
                             ("--prefetch-units", args.prefetch_units, 0),
                             ("--gpus-per-node", args.gpus_per_node, 2)):
        if value < low:
            raise TraceError(f"{flag}={value if flag != '--steps' else args.steps}: "
                             f"must be a whole number >= {low}")
    if args.gpus_per_node % 2 or args.ranks % args.gpus_per_node or args.hidden % 4:
        raise TraceError(f"--ranks={args.ranks} must be a multiple of --gpus-per-node="
                         f"{args.gpus_per_node} (even), --hidden={args.hidden} of 4 (heads)")
    out = record(args.record, ranks=args.ranks, gpus_per_node=args.gpus_per_node,
                 layers=args.layers, hidden=args.hidden, steps=steps,
                 micro_batches=args.micro_batches, recompute=not args.no_recompute,
                 prefetch_units=args.prefetch_units)
    if args.json:
        json_out.emit({"overlap-on": _json_summary(out["overlap-on"]),
                       "overlap-off": _json_summary(out["overlap-off"]),
                       "step_s": out["step_s"]})
    else:
        print(render_recorded(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
