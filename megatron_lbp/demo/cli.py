"""The main job: a real GPT pretraining run with the hierarchy, checked against stock Megatron.

    python -m megatron_lbp.demo [--iters N] [--bf16 | --fp32] [--ranks 8] [--out runs/main]

Builds the shipped tokenizer and dataset if missing, trains the GPT through
megatron.training's ``pretrain()`` on 8 gloo ranks emulating 2 nodes x 2 packages x 2 GCDs
(lbp), trains the same model, data and seed with stock Megatron, counts one step's bytes
under zero3 and zeropp, and writes ``summary.json`` and ``loss_curve.png`` into a new
timestamped directory under ``--out``. fp32 unless the CPU has native bf16
(megatron_lbp.integration.cpu_bf16); ``--bf16`` / ``--fp32`` force either.
What it prints: docs/main-job.md.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

from megatron_lbp.demo import runs as demo_runs
from megatron_lbp.demo.runs import MODEL, RunResult, RunSpec

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ITERS = 100
PRESETS = ("zero3", "zeropp")


def plan(iters: int) -> list[RunSpec]:
    lbp = RunSpec("lbp", "lbp (hierarchy)", iters, ("--hier-partition", "--hier-preset", "lbp"),
                  comm_report=True, save=True)
    stock = RunSpec("stock", "stock Megatron distopt", iters, ("--use-distributed-optimizer",))
    return [lbp, stock]


def preset_extra(preset: str, bf16: bool) -> tuple[str, ...]:
    # With fp32 weights zeropp's hpZ copy is kept in bf16 (its gathers at 16 bits, as
    # under bf16 training); the summary's preset_extra_args and the plot's legend say so.
    return ("--hier-secondary-dtype", "bf16") if preset == "zeropp" and not bf16 else ()


def choose_dtype(bf16_flag: bool, fp32_flag: bool, native: tuple[bool, str]) -> tuple[bool, str]:
    """(bf16?, the one line that says which and why); ``native``: cpu_bf16.native_bf16()."""
    native, why = native
    if bf16_flag:
        if native:
            return True, f"[main] computing in bf16 (--bf16); {why}"
        return True, (f"[main] computing in bf16 because --bf16 was given, but {why}: expect "
                      f"several seconds per iteration instead of under one")
    if fp32_flag:
        return False, f"[main] computing in fp32 (--fp32); {why}"
    if native:
        return True, f"[main] computing in bf16: {why} (--fp32 to compute in fp32)"
    return False, f"[main] computing in fp32: {why}; --bf16 forces bf16 weights and gathers"


def last_report(run: RunResult) -> dict:
    lines = (run.dir / "comm.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def count_preset_bytes(args, bf16: bool, lbp: RunResult) -> tuple[dict[str, dict], float]:
    """Each preset's bytes per rank per step (demo_bytes), checked against the lbp run's own;
    and the CPU seconds its ranks used."""
    from megatron_lbp.demo import bytes as demo_bytes

    counted, cpu_s = demo_bytes.measure({p: preset_extra(p, bf16) for p in ("lbp", *PRESETS)},
                                        args.ranks, args.gpus_per_node, bf16)
    own = last_report(lbp)["traffic_bytes"]
    if counted["lbp"] != own:
        raise RuntimeError(f"the byte count's lbp step sent {counted['lbp']}, the lbp run reported "
                           f"{own}: they do not count the same model, so the presets' rows would "
                           f"not compare")
    return counted, cpu_s


def max_difference(a: dict[int, float], b: dict[int, float]) -> dict:
    common = sorted(set(a) & set(b))
    if not common:
        raise RuntimeError("no iteration has a loss in both the lbp and the stock run")
    worst = max(common, key=lambda i: abs(a[i] - b[i]))
    return {"value": abs(a[worst] - b[worst]), "iteration": worst,
            "relative": abs(a[worst] - b[worst]) / abs(b[worst]),
            "lbp": a[worst], "stock": b[worst], "iterations_compared": len(common)}


def seconds_per_step(run: RunResult) -> float:
    # Megatron logs the mean time per iteration over each interval; the first
    # interval holds the start-up (first gathers, allocator) and is skipped.
    steady = run.rows[1:] or run.rows
    return sum(r["ms"] for r in steady) / len(steady) / 1000.0


def summarize(job_dir: Path, runs: dict[str, RunResult], preset_bytes: dict, args, bf16: bool,
              dtype_line: str, timings: dict[str, float]) -> dict:
    """summary.json's content: lbp's losses and bytes, the comparison with stock and presets."""
    lbp, stock = runs["lbp"], runs["stock"]
    for run in (lbp, stock):
        if not run.losses or not run.rows:
            raise RuntimeError(f"no iteration losses from the {run.spec.name} run; "
                               f"see {run.dir / 'train.log'}")
    report = last_report(lbp)
    tokens_per_step = demo_runs.SAMPLES_PER_RANK * args.ranks * MODEL["seq-length"]
    its = sorted(lbp.losses)
    sec = seconds_per_step(lbp)
    summary = {
        "iterations": its[-1],
        "ranks": args.ranks,
        "ranks_per_node": args.gpus_per_node,
        "dtype": "bf16" if bf16 else "fp32",
        "dtype_reason": dtype_line,
        "loss_start": lbp.losses[its[0]],
        "loss_end": lbp.losses[its[-1]],
        "stock_loss_end": stock.losses[max(stock.losses)],
        "max_loss_difference_vs_stock": max_difference(lbp.losses, stock.losses),
        "loss_curve": [[i, lbp.losses[i]] for i in its],
        "stock_loss_curve": [[i, stock.losses[i]] for i in sorted(stock.losses)],
        "tokens_per_second": tokens_per_step / sec,
        "seconds_per_step": sec,
        "stock_seconds_per_step": seconds_per_step(stock),
        "bytes_sent_per_rank_per_step": report["traffic_bytes"],
        "bytes_by_phase": report["traffic_by_phase"],
        "bytes_held_per_rank": report["memory_bytes"],
        "bytes_sent_per_rank_per_step_by_scheme": {"lbp": report["traffic_bytes"],
                                                   **{p: preset_bytes[p] for p in PRESETS}},
        "preset_extra_args": {name: list(preset_extra(name, bf16)) for name in PRESETS},
        "timings_s": timings,
        "checkpoint": str(job_dir / "checkpoint"),
        "runs": {name: {"dir": str(r.dir), "iterations": r.spec.iters, "wall_s": r.wall_s,
                        "startup_s": r.startup_s} for name, r in runs.items()},
    }
    return summary


def draw(summary: dict, runs: dict[str, RunResult], path: Path) -> None:
    from megatron_lbp.demo import plot as demo_plot

    d = summary["max_loss_difference_vs_stock"]
    demo_plot.draw(
        path, {"lbp": runs["lbp"].losses, "stock": runs["stock"].losses},
        summary["bytes_sent_per_rank_per_step_by_scheme"],
        scheme_labels={name: name + (" (" + " ".join(extra) + ")" if extra else "")
                       for name, extra in summary["preset_extra_args"].items()},
        title=(f"megatron-lbp main job: GPT {MODEL['num-layers']} layers x hidden "
               f"{MODEL['hidden-size']}, {summary['ranks']} CPU ranks = "
               f"{summary['ranks'] // summary['ranks_per_node']} nodes x "
               f"{summary['ranks_per_node'] // 2} packages x 2 GCDs, {summary['dtype']}"),
        note=(f"largest |lbp - stock| loss difference over {d['iterations_compared']} iterations: "
              f"{d['value']:.2e} (iteration {d['iteration']}, {d['relative']:.1e} relative)\n"
              f"bytes: lbp from its run's last step (--hier-comm-report), zero3 and zeropp "
              f"from one step of the same model on the same ranks"))


def render(summary: dict, job_dir: Path) -> str:
    t, m = summary["bytes_sent_per_rank_per_step"], summary["bytes_held_per_rank"]
    d = summary["max_loss_difference_vs_stock"]
    kb = lambda x: f"{x / 1e3:,.1f} kB"  # noqa: E731
    by_scheme = summary["bytes_sent_per_rank_per_step_by_scheme"]
    times = summary["timings_s"]
    return "\n".join([
        f"summary ({job_dir}):",
        f"  loss {summary['loss_start']:.3f} -> {summary['loss_end']:.3f} over "
        f"{summary['iterations']} iterations ({summary['dtype']}); stock Megatron ends at "
        f"{summary['stock_loss_end']:.3f}",
        f"  largest loss difference lbp vs stock: {d['value']:.3e} at iteration "
        f"{d['iteration']} ({d['lbp']:.5f} vs {d['stock']:.5f}, {d['relative']:.1e} relative)",
        f"  {summary['tokens_per_second']:,.0f} tokens/s ({summary['seconds_per_step']:.3f} s/step "
        f"on {summary['ranks']} CPU ranks; stock {summary['stock_seconds_per_step']:.3f} s/step)",
        f"  bytes sent per rank per step: package {kb(t['package'])}, node {kb(t['node'])}, "
        f"network {kb(t['network'])}",
        "  network bytes per rank per step: " + ", ".join(
            f"{s} {kb(b['network'])}" for s, b in by_scheme.items()),
        f"  bytes held per rank: primary {kb(m['primary'])}, secondary {kb(m['secondary'])}, "
        f"grad {kb(m['grad'])}, optimizer {kb(m['optimizer'])}, "
        f"peak transient {kb(m['peak_transient'])}",
        "  wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()),
        "  CPU time: " + ", ".join(f"{k} {v:.0f} s" for k, v in summary["cpu_s"].items())
        + f" ({summary['cpus']} cores; 1-minute load average {summary['loadavg_start'][0]:.1f} at "
          f"the start, {summary['loadavg_end'][0]:.1f} at the end)",
        f"  checkpoint {summary['checkpoint']}",
        f"  loss curve {job_dir / 'loss_curve.png'}",
    ])


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        self.exit(2, f"python -m megatron_lbp.demo: error: {message}\n")


def _self_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the data build may fork)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime + demo_runs.children_cpu_s()


def parse(argv):
    p = _Parser(prog="python -m megatron_lbp.demo", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=DEFAULT_ITERS,
                   help=f"iterations of the lbp and the stock run (default {DEFAULT_ITERS})")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=4,
                   help="ranks per emulated node (default 4: 8 ranks = 2 nodes)")
    p.add_argument("--log-interval", type=int, default=10)
    dtype = p.add_mutually_exclusive_group()
    dtype.add_argument("--bf16", action="store_true",
                       help="bf16 weights and gathers even where the CPU emulates bf16 (slow)")
    dtype.add_argument("--fp32", action="store_true", help="fp32 even where bf16 is native")
    p.add_argument("--out", default=str(REPO / "runs" / "main"))
    p.add_argument("--data-dir", default=str(REPO / "data"))
    p.add_argument("--port", type=int, default=0,
                   help="first rendezvous port, one more per launch (default: torchrun "
                        "--standalone picks free ones)")
    args = p.parse_args(argv)
    for flag in ("iters", "ranks", "gpus_per_node", "log_interval"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    if args.gpus_per_node % 2:
        p.error(f"--gpus-per-node={args.gpus_per_node} must be even (packages of 2 GCDs)")
    if args.ranks % args.gpus_per_node or args.ranks == args.gpus_per_node:
        p.error(f"--ranks={args.ranks} must be a multiple of --gpus-per-node="
                f"{args.gpus_per_node} with at least 2 nodes (the network joins nodes)")
    if args.port < 0:
        p.error(f"--port={args.port} must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    from megatron_lbp.integration.cpu_bf16 import native_bf16

    bf16, dtype_line = choose_dtype(args.bf16, args.fp32, native_bf16())
    t_job = time.perf_counter()
    load_start = os.getloadavg()
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}      # CPU seconds of each part: what a quiet machine waits for

    from megatron_lbp.integration.data import build_demo_data

    t0, cpu0 = time.perf_counter(), _self_cpu_s()
    data_prefix = build_demo_data(args.data_dir)
    timings["data"] = time.perf_counter() - t0
    cpu["data"] = _self_cpu_s() - cpu0
    job_dir = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    job_dir.mkdir(parents=True, exist_ok=False)
    print(dtype_line, flush=True)
    runs_plan = plan(args.iters)
    progress = demo_runs.Progress(runs_plan)
    print(f"[main] {len(runs_plan)} launches of torchrun -m megatron_lbp.pretrain_gpt on "
          f"{args.ranks} ranks: " + "; ".join(f"{s.title}, {s.iters} iterations"
                                               for s in runs_plan)
          + f"; then one step each of {', '.join(PRESETS)} for their bytes", flush=True)
    runs: dict[str, RunResult] = {}
    for index, spec in enumerate(runs_plan):
        run_dir = job_dir / spec.name
        port = args.port + index if args.port else 0
        cmd = demo_runs.training_command(
            spec, ranks=args.ranks, gpus_per_node=args.gpus_per_node, data_prefix=data_prefix,
            run_dir=run_dir, bf16=bf16, log_interval=min(args.log_interval, spec.iters),
            port=port)
        print(f"[main {index + 1}/{len(runs_plan)}] {spec.title}: log {run_dir / 'train.log'}",
              flush=True)
        code, runs[spec.name] = demo_runs.launch(index, spec, cmd, run_dir, progress)
        timings[spec.name] = runs[spec.name].wall_s
        cpu[spec.name] = runs[spec.name].cpu_s
        if code:
            print(f"[main] the {spec.name} run failed with exit code {code}; full log: "
                  f"{run_dir / 'train.log'}", file=sys.stderr)
            return code
    t0 = time.perf_counter()
    print(f"[main] bytes per link class: one optimizer step of lbp, {', '.join(PRESETS)} on "
          f"{args.ranks} ranks", flush=True)
    preset_bytes, cpu["preset_bytes"] = count_preset_bytes(args, bf16, runs["lbp"])
    timings["preset_bytes"] = time.perf_counter() - t0
    t0, cpu0 = time.perf_counter(), _self_cpu_s()
    summary = summarize(job_dir, runs, preset_bytes, args, bf16, dtype_line, timings)
    draw(summary, runs, job_dir / "loss_curve.png")
    timings["summary_and_plot"] = time.perf_counter() - t0
    cpu["summary_and_plot"] = _self_cpu_s() - cpu0
    timings["total"] = time.perf_counter() - t_job
    cpu["total"] = sum(cpu.values())
    summary["timings_s"], summary["cpu_s"] = timings, cpu
    summary["cpus"] = len(os.sched_getaffinity(0))
    summary["loadavg_start"] = list(load_start)
    summary["loadavg_end"] = list(os.getloadavg())
    (job_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(render(summary, job_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
