"""BENCHMARKS.md from fresh runs of the other benchmark commands: tables, plots, goals, provenance.

    python -m benchmarks report [--quick] [--out BENCHMARKS.md]
        [--plots-dir docs/benchmarks] [--skip network,...] [--reuse overhead,...] [--timeout S]
        [--only network_frontier,...]

Each section is produced by running the command's ``--json`` form in a fresh
subprocess (the exact argv is recorded): traffic at K=1 and K=4, project (with
its replayed schedule), overhead (plus the plan tool for the overhead run's
configuration, to say where its extra time goes) and network (the default model
and ``--model frontier-shaped``; the leading table, benchmarks/headline.py). Every result is saved in
``<plots-dir>/results.json`` together with the machine (CPU model, cores, load
average, kernel), the versions (python, torch, megatron-core, git commit and
dirty flag) and each command's wall time and exit status; the markdown is
rendered only from that file, so every figure in it can be traced.

A sub-command that fails, times out or does not exist is reported in its
section as "not run: <reason>" and makes this command exit 1, unless that
section was named in ``--skip``. ``--reuse`` takes named sections from the
existing results.json instead of running them again (their original
provenance is kept and printed); ``--only`` runs just the named runs (run keys, e.g.
``network_frontier``) and takes every other one from results.json the same way. ``--quick`` is the reduced CI form (8 traffic
ranks, 3 schemes, a one-step overhead on 4 ranks, one-step network runs of
lbp and zeropp on 2 nodes x 2 ranks, default and frontier-shaped); without
``--out`` it writes
into a new temporary directory, never over the committed BENCHMARKS.md.

Every emulated-network result rendered, fresh or reused, has its predictions
made again from its stored fit with this checkout's cost model
(benchmarks.recalibrate), recorded as ``calibration.fit.predicted_with``; a
result that lacks an input of the prediction keeps the run's own predictions,
marked ``not_rederived`` with the reason, and the report warns.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import recalibrate, report_goals, report_plots, report_render

SECTIONS = ("traffic", "project", "overhead", "network")
REPO = Path(__file__).resolve().parents[1]
BENCH = [sys.executable, "-m", "benchmarks"]
DEFAULT_TIMEOUT_S = 3600.0
STDERR_TAIL = 2000

# The plan run for the overhead run's lbp configuration (P=2, G=W, its micro-batches
# and bucket size, read from its JSON) explains lbp's extra collectives.
OVERHEAD_MICRO_BATCHES = 2   # runs from before the overhead JSON carried its own
OVERHEAD_DEFAULTS = {"ranks": 8, "hidden": 128, "layers": 4, "seq": 128}
QUICK_TRAFFIC = ["--ranks", "8", "--gpus-per-node", "4", "--schemes", "lbp,zeropp,zero3"]
QUICK_OVERHEAD = ["--ranks", "4", "--runs", "1", "--steps", "1", "--hidden", "32",
                  "--layers", "1", "--seq", "16"]
QUICK_NETWORK = ["--ranks-per-node", "2", "--schemes", "zeropp", "--steps", "1", "--warmup", "1",
                 "--layers", "1", "--hidden", "64"]
# The frontier-shaped run trains six schemes (ds-zero3 and ds-zeropp among them) in one
# multi-rank run: on the 2-core machine that outlasts the network bench's default 900 s
# per multi-rank run (E2's 2026-12-05 attempt failed at it under load), so that run gets
# 45 minutes; DEFAULT_TIMEOUT_S, per sub-command, still bounds the probe and the run.
# It also times 2 rounds after the 2 warm-up ones, not 4: one round of the six took ~11 min
# at load average ~100 (2026-12-05). Every scheme trains the same rounds in the same run.
FRONTIER_RUN_TIMEOUT_S = 2700
FRONTIER_STEPS = 2
# The leading table (benchmarks/headline.py) at its default size, which fits the 2-core
# machine; quick: one round of a one-layer model.
QUICK_HEADLINE = ["--steps", "1", "--warmup", "1", "--layers", "1", "--hidden", "32"]
QUICK_FRONTIER = ["--ranks-per-node", "2", "--schemes", "lbp,zeropp", "--steps", "1",
                  "--warmup", "1", "--layers", "2", "--hidden", "64"]


def section_commands(quick: bool) -> dict[str, dict[str, list[str]]]:
    """{section: {run key: argv}}; every argv prints one JSON object on its last stdout line."""
    traffic = QUICK_TRAFFIC if quick else []
    return {
        "traffic": {f"traffic_k{k}": BENCH + ["traffic", "--json", "--micro-batches", str(k)]
                    + traffic for k in (1, 4)},
        "project": {"project": BENCH + ["project", "--json"]},
        "overhead": {"overhead": BENCH + ["overhead", "--json"]
                     + (QUICK_OVERHEAD if quick else ["--profile"])},
        "network": {"headline": BENCH + ["headline", "--json"] + (QUICK_HEADLINE if quick else []),
                    "network": BENCH + ["network", "--json"] + (QUICK_NETWORK if quick else []),
                    "network_frontier": BENCH + ["network", "--json", "--model", "frontier-shaped"]
                    + (QUICK_FRONTIER if quick else ["--steps", str(FRONTIER_STEPS),
                                                       "--timeout", str(FRONTIER_RUN_TIMEOUT_S)])},
    }


def overhead_plan_argv(overhead: dict[str, Any]) -> list[str]:
    """The plan tool for the overhead run's own model, ranks and groups (fp32 like the run)."""
    m = overhead["model"]
    return [sys.executable, "-m", "megatron_lbp.plan", "--world-size", str(overhead["ranks"]),
            "--gpus-per-node", str(overhead["ranks"]), "--num-layers", str(m["layers"]),
            "--hidden-size", str(m["hidden"]), "--vocab-size", str(m["vocab"]),
            "--seq-length", str(m["seq"]),
            "--micro-batches", str(overhead.get("micro_batches", OVERHEAD_MICRO_BATCHES)),
            *(["--bucket-size", str(overhead["bucket_size"])] if "bucket_size" in overhead else []),
            "--params-dtype", "fp32", "--grad-dtype", "fp32", "--preset", "lbp",
            "--hier-param-group-size", "2", "--hier-grad-group-size", str(overhead["ranks"]),
            "--json"]


# --------------------------------------------------------------------------- provenance


def _utc() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    return out.stdout.strip() if out.returncode == 0 else ""


def git_state() -> dict[str, Any]:
    dirty = [ln[3:] for ln in _git("status", "--porcelain").splitlines() if ln.strip()]
    code = [p for p in dirty if p.startswith(("megatron_lbp/", "scripts/"))]
    return {"commit": _git("rev-parse", "HEAD") or "unknown", "dirty": bool(dirty),
            "dirty_code_paths": code}


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu_model": model, "cpus_online": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)), "loadavg_at_start": os.getloadavg(),
            "kernel": f"{platform.system()} {platform.release()}", "host_arch": platform.machine()}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "megatron-core", "matplotlib"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


# --------------------------------------------------------------------------- running


def run_command(argv: list[str], timeout: float) -> dict[str, Any]:
    """Run one --json command; {"status": "ok", "result": obj} or {"status": "failed", "reason"}."""
    record: dict[str, Any] = {"command": shlex.join(_display(argv)), "started_utc": _utc(),
                              "loadavg_at_start": os.getloadavg(), "git": git_state()}
    t0 = time.perf_counter()
    try:
        out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        record.update(status="failed", wall_s=time.perf_counter() - t0, returncode=None,
                      reason=f"timed out after {timeout:g} s")
        return record
    record.update(wall_s=time.perf_counter() - t0, returncode=out.returncode,
                  stderr_tail=out.stderr[-STDERR_TAIL:])
    if out.returncode != 0:
        record.update(status="failed", reason=f"exit {out.returncode}: {_last_line(out.stderr)}")
        return record
    try:
        record.update(status="ok", result=json.loads(out.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        record.update(status="failed",
                      reason=f"no JSON object on the last stdout line: {_last_line(out.stdout)!r}")
    return record


def _display(argv: list[str]) -> list[str]:
    """The argv as a user types it: 'python' for this interpreter."""
    return ["python" if a == sys.executable else a for a in argv]


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or ln.split(":")[0].endswith("Error")]
    return ((errors or lines or ["(no output)"])[-1])[:400]


def _load_previous(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"python -m benchmarks report: error: --reuse needs {path}: {e}")


def run_keys(quick: bool = False) -> list[str]:
    """Every run's key, in report order."""
    return [key for section, commands in section_commands(quick).items()
            for key in list(commands) + (["overhead_plan"] if section == "overhead" else [])]


def _reused(previous: dict[str, Any] | None, key: str) -> dict[str, Any]:
    old = (previous or {}).get("runs", {}).get(key)
    return dict(old, reused=True) if old else {
        "status": "failed", "reason": f"--reuse: no {key} in the previous results"}


def collect(quick: bool, skip: set[str], reuse: set[str], previous: dict[str, Any] | None,
            timeout: float, log=print, only: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every run record by key, in report order; skipped and reused ones marked as such.

    ``only``: run just these keys; every other run is reused from ``previous``."""
    runs: dict[str, dict[str, Any]] = {}
    for section, commands in section_commands(quick).items():
        keys = list(commands) + (["overhead_plan"] if section == "overhead" else [])
        if section in skip:
            for key in keys:
                runs[key] = {"status": "skipped", "reason": "skipped (--skip)"}
            continue
        if section in reuse:
            for key in keys:
                runs[key] = _reused(previous, key)
            continue
        for key, argv in commands.items():
            if only is not None and key not in only:
                runs[key] = _reused(previous, key)
                continue
            log(f"[report] {key}: {shlex.join(_display(argv))}")
            runs[key] = run_command(argv, timeout)
            log(f"[report] {key}: {runs[key]['status']} in {runs[key]['wall_s']:.0f} s"
                + (f" ({runs[key]['reason']})" if runs[key]["status"] != "ok" else ""))
        if section == "project" and runs["project"]["status"] == "ok":
            stale = (runs["project"]["result"].get("replay") or {}).get("stale")
            if stale:
                log(f"[report] WARNING: {stale}; then run this report again")
        if section == "overhead":
            if only is not None and not {"overhead", "overhead_plan"} & only:
                runs["overhead_plan"] = _reused(previous, "overhead_plan")
            elif runs["overhead"]["status"] == "ok":
                runs["overhead_plan"] = run_command(
                    overhead_plan_argv(runs["overhead"]["result"]), timeout)
            else:
                runs["overhead_plan"] = {"status": "failed", "reason": "overhead did not run"}
    return runs


def rederive_predictions(runs: dict[str, dict[str, Any]], git: dict[str, Any],
                         log=print) -> None:
    """Every network run's predictions made with this checkout's cost model, in place.

    A reused run's were made with the model of its own day; the measured figures
    and the fit stay the run's (benchmarks.recalibrate).
    """
    dirty = git.get("dirty_code_paths") or []
    model = f"the cost model at commit {git['commit']}" + (
        f" with uncommitted changes to {', '.join(dirty)}" if dirty else "")
    for key in ("network", "network_frontier"):   # the runs with a calibration
        run = runs.get(key)
        if not run or run.get("status") != "ok":
            continue
        try:
            run["result"] = recalibrate.recalibrate(
                run["result"], f"{model} (re-derived at report time from the run's fitted links "
                               f"and compute)")
            run.pop("not_rederived", None)
        except recalibrate.NotRederivable as e:
            # A run re-derived by an earlier report keeps that report's predictions.
            fit = ((run["result"].get("calibration") or {}).get("fit") or {})
            made = fit.get("predicted_with") or (
                f"the cost model at the run's commit {(run.get('git') or {}).get('commit')}")
            run["not_rederived"] = f"{e}; its predictions are still those of {made}"
            log(f"[report] WARNING: {key}: {run['not_rederived']}")


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced sizes (CI)")
    p.add_argument("--out", default=None, help="markdown file (default BENCHMARKS.md; "
                   "with --quick a new temporary directory)")
    p.add_argument("--plots-dir", default=None, help="PNGs and results.json (default "
                   "docs/benchmarks, or next to --out with --quick)")
    p.add_argument("--skip", default="", help=f"comma-separated sections of {','.join(SECTIONS)}")
    p.add_argument("--reuse", default="", help="sections taken from the existing results.json")
    p.add_argument("--only", default=None, help="comma-separated run keys to run (e.g. "
                   "network_frontier); every other run taken from the existing results.json")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds per sub-command")
    args = p.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    reuse = {s for s in args.reuse.split(",") if s}
    for flag, names in (("--skip", skip), ("--reuse", reuse)):
        if names - set(SECTIONS):
            p.error(f"{flag}: {','.join(sorted(names - set(SECTIONS)))} "
                    f"not in {','.join(SECTIONS)}")
    if skip & reuse:
        p.error(f"{','.join(sorted(skip & reuse))} both skipped and reused")
    if args.timeout <= 0:
        p.error(f"--timeout={args.timeout:g} must be > 0")
    only = None
    if args.only is not None:
        only = {k for k in args.only.split(",") if k}
        if skip or reuse:
            p.error("--only takes every other run from results.json: not with --skip or --reuse")
        if not only or only - set(run_keys(args.quick)):
            p.error(f"--only: {','.join(sorted(only - set(run_keys(args.quick)))) or '(none)'} "
                    f"not in {','.join(run_keys(args.quick))}")
    if args.out is None:
        base = Path(tempfile.mkdtemp(prefix="lbp-report-")) if args.quick else REPO
        out = base / "BENCHMARKS.md"
    else:
        out = Path(args.out).resolve()
    plots = Path(args.plots_dir).resolve() if args.plots_dir else (
        out.parent / "benchmarks" if args.quick else REPO / "docs" / "benchmarks")
    results_path = plots / "results.json"
    previous = _load_previous(results_path) if reuse or only else None

    started = _utc()
    report = {"command": shlex.join(["python", "-m", "benchmarks", "report",
                                     *(sys.argv[1:] if argv is None else argv)]),
              "quick": args.quick, "started_utc": started, "machine": machine(),
              "versions": versions(), "git": git_state()}
    report["runs"] = collect(args.quick, skip, reuse, previous, args.timeout, only=only)
    rederive_predictions(report["runs"], report["git"])
    report["finished_utc"] = _utc()
    plots.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The analysis is derived from the runs alone and stored with them, so the
    # markdown and its tests read one file.
    report.update(report_goals.analyse(report["runs"]))
    report["plots"] = report_plots.draw(report, plots)
    results_path.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    out.write_text(report_render.markdown(report, out, results_path))
    failed = [k for k, r in report["runs"].items() if r["status"] == "failed"]
    print(f"[report] wrote {out}, {results_path} and {len(report['plots'])} plot(s)"
          + (f"; not run: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
