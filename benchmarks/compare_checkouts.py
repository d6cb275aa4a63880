"""lbp's step time and exposed communication at another commit and at this checkout, side by side.

Each run of ``python -m benchmarks network --json ...`` (the arguments after
``--``; default the lbp scheme alone) is made once at ``--ref`` (a copy of that
commit's tree from ``git archive``, imported ahead of this checkout's editable
install through PYTHONPATH) and once here, alternating, the starting side
swapped every round, so load from other processes falls on both alike. Per
side: the median over the runs of each run's median step and exposed
communication (step - compute alone), their spread (lowest and highest), the
exposed seconds per phase from the schedule trace, and the 1-minute load
average at the start of each run.

    python -m benchmarks compare-checkouts --ref 4f50808 --rounds 4 \
        [-- --schemes lbp --steps 4 --warmup 1]

Needs root and iproute2, as ``network`` does. Nothing is kept but the report
(``--out DIR`` keeps each run's JSON and traces).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from megatron_lbp.projection import json_out

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_NETWORK_ARGS = ["--schemes", "lbp", "--steps", "4", "--warmup", "1"]


def export(ref: str, into: str) -> str:
    """The tree of ``ref`` written under ``into``; its resolved commit."""
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--verify", f"{ref}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    archive = subprocess.Popen(["git", "-C", HERE, "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", into], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed")
    return commit


def run_once(tree: str, network_args: list[str], trace_dir: str | None,
             timeout: float) -> dict[str, Any]:
    """One ``network`` run of the checkout at ``tree``: lbp's figures and the load."""
    env = dict(os.environ, PYTHONPATH=tree)
    argv = [sys.executable, "-m", "benchmarks", "network", "--json", *network_args]
    if trace_dir:
        argv += ["--trace-dir", trace_dir]
    load = os.getloadavg()[0]
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"network in {tree} exited {done.returncode}:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    lbp = out["schemes"]["lbp"]
    phases = {p: v["exposed_s"] for p, v in (lbp.get("trace") or {}).get("phases", {}).items()}
    return {"step_s": lbp["median_s"], "exposed_s": lbp["exposed_s"],
            "compute_s": lbp["compute_s"], "phases": phases, "load_1min": load,
            "raw": out}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key):
        xs = [r[key] for r in runs]
        return {"median": statistics.median(xs), "low": min(xs), "high": max(xs), "runs": xs}

    phases = sorted({p for r in runs for p in r["phases"]})
    return {"step_s": med("step_s"), "exposed_s": med("exposed_s"), "compute_s": med("compute_s"),
            "phases_exposed_s": {p: statistics.median(r["phases"].get(p, 0.0) for r in runs)
                                 for p in phases},
            "load_1min": [r["load_1min"] for r in runs]}


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks compare-checkouts",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", required=True, help="the commit to compare this checkout against")
    p.add_argument("--rounds", type=int, default=4, help="runs of each side, alternated")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--out", default=None, help="keep each run's JSON and traces here")
    p.add_argument("--json", action="store_true")
    args, rest = p.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if any(a in ("--json", "--trace-dir") for a in rest):
        p.error("--json and --trace-dir are set by compare-checkouts itself")
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds} must be >= 1")
    args.network_args = rest or list(DEFAULT_NETWORK_ARGS)
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    work = tempfile.mkdtemp(prefix="lbp-compare-")
    try:
        before_tree = os.path.join(work, "ref")
        os.makedirs(before_tree)
        commit = export(args.ref, before_tree)
        trees = {"ref": before_tree, "here": HERE}
        runs: dict[str, list] = {"ref": [], "here": []}
        for r in range(args.rounds):
            order = ("ref", "here") if r % 2 == 0 else ("here", "ref")
            for side in order:
                trace_dir = os.path.join(args.out, f"{side}-{r + 1}") if args.out else None
                got = run_once(trees[side], args.network_args, trace_dir, args.timeout)
                if args.out:
                    with open(os.path.join(args.out, f"{side}-{r + 1}.json"), "w") as f:
                        json.dump(got["raw"], f, indent=1)
                del got["raw"]
                runs[side].append(got)
                print(f"[compare] round {r + 1}/{args.rounds} {side}: step {got['step_s']:.3f} s, "
                      f"exposed {got['exposed_s']:.3f} s, load {got['load_1min']:.1f}",
                      file=sys.stderr)
        report = {"ref": commit, "network_args": args.network_args, "rounds": args.rounds,
                  "cpus": os.cpu_count(), **{side: summary(v) for side, v in runs.items()}}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        json_out.emit(report)
        return 0
    print(f"lbp at {commit[:10]} (ref) and at this checkout (here), {args.rounds} runs each, "
          f"alternated; network {' '.join(args.network_args)}")
    for key in ("step_s", "exposed_s", "compute_s"):
        for side in ("ref", "here"):
            s = report[side][key]
            print(f"  {key:<10} {side:<5} median {s['median']:.3f}  spread {s['low']:.3f}-"
                  f"{s['high']:.3f}  runs {' '.join(f'{x:.3f}' for x in s['runs'])}")
    for side in ("ref", "here"):
        ph = report[side]["phases_exposed_s"]
        print(f"  trace exposed per phase, {side}: "
              + ", ".join(f"{p} {v:.3f}" for p, v in ph.items()))
        print(f"  1-min load at each run's start, {side}: "
              + " ".join(f"{x:.1f}" for x in report[side]["load_1min"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
