"""The main job: a real GPT pretraining run with the hierarchy, on CPU ranks, from nothing.

    python -m megatron_lbp.demo [--iters 300] [--ranks 8] [--out runs/main]

1. builds the shipped tokenizer and the indexed dataset from the shipped corpus
   if they are missing (``data/``);
2. runs ``torchrun -m megatron_lbp.pretrain_gpt`` on 8 gloo ranks emulating
   2 nodes x 2 packages x 2 GCDs (``--hier-gpus-per-node 4``), lbp preset, bf16,
   printing Megatron's iteration log as it goes and keeping it in ``train.log``;
3. saves a distributed checkpoint at the end;
4. writes ``summary.json`` and ``loss_curve.png`` and prints the summary: loss at
   the start and the end, tokens/s, bytes each rank sent per step on each link
   class, and bytes each rank held per state.

Every run gets its own directory under ``--out`` (a timestamp), so the command
can be rerun as often as wanted.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODEL = {"num-layers": 2, "hidden-size": 128, "num-attention-heads": 4, "seq-length": 128,
         "max-position-embeddings": 128}
ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
    r".*?lm loss: ([\dE+\-.]+) \|")


def training_command(args, run_dir: Path, data_prefix: str) -> list[str]:
    seq = MODEL["seq-length"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
           "--master-port", str(args.port), "-m", "megatron_lbp.pretrain_gpt"]
    for k, v in MODEL.items():
        cmd += [f"--{k}", str(v)]
    cmd += [
        "--micro-batch-size", "2", "--global-batch-size", str(4 * args.ranks),
        "--train-iters", str(args.iters), "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, args.iters // 20)),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16", "--seed", "1234",
        "--position-embedding-type", "rope",
        "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(REPO / "tokenizer" / "lbp_bpe.model"),
        "--data-path", data_prefix, "--split", "98,2,0",
        "--log-interval", str(args.log_interval), "--log-throughput",
        "--eval-iters", "0", "--eval-interval", str(10 * args.iters),
        "--save", str(run_dir / "checkpoint"), "--save-interval", str(args.iters),
        "--ckpt-format", "torch_dist",
        "--hier-partition", "--hier-preset", "lbp",
        "--hier-gpus-per-node", str(args.gpus_per_node),
        "--hier-comm-report", str(run_dir / "comm.jsonl"),
    ]
    assert seq > 0
    return cmd


def parse_log(text: str) -> list[dict]:
    rows = []
    for m in ITERATION_LINE.finditer(text):
        rows.append({"iteration": int(m.group(1)), "ms": float(m.group(3)),
                     "loss": float(m.group(4))})
    return rows


def summarize(run_dir: Path, rows: list[dict], ranks: int, tokens_per_step: int) -> dict:
    if not rows:
        raise RuntimeError(f"no iteration lines in {run_dir / 'train.log'}")
    reports = [json.loads(line) for line in (run_dir / "comm.jsonl").read_text().splitlines()]
    last = reports[-1]
    # Megatron logs the mean time per iteration over each interval; skip the first
    # interval (start-up, first gathers) for the throughput.
    steady = rows[1:] or rows
    sec_per_step = sum(r["ms"] for r in steady) / len(steady) / 1000.0
    summary = {
        "iterations": rows[-1]["iteration"],
        "loss_start": rows[0]["loss"],
        "loss_end": rows[-1]["loss"],
        "loss_curve": [(r["iteration"], r["loss"]) for r in rows],
        "tokens_per_second": tokens_per_step / sec_per_step,
        "seconds_per_step": sec_per_step,
        "ranks": ranks,
        "bytes_sent_per_rank_per_step": last["traffic_bytes"],
        "bytes_by_phase": last["traffic_by_phase"],
        "bytes_held_per_rank": last["memory_bytes"],
        "checkpoint": str(run_dir / "checkpoint"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_loss(rows, run_dir / "loss_curve.png")
    return summary


def plot_loss(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["iteration"] for r in rows], [r["loss"] for r in rows], marker="o", markersize=3)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("megatron-lbp main job: tiny GPT, lbp on 8 CPU ranks")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def render(summary: dict, run_dir: Path) -> str:
    t, m = summary["bytes_sent_per_rank_per_step"], summary["bytes_held_per_rank"]
    kb = lambda x: f"{x / 1e3:,.1f} kB"  # noqa: E731
    return "\n".join([
        f"summary ({run_dir}):",
        f"  loss {summary['loss_start']:.3f} -> {summary['loss_end']:.3f} "
        f"over {summary['iterations']} iterations",
        f"  {summary['tokens_per_second']:,.0f} tokens/s ({summary['seconds_per_step']:.3f} s/step "
        f"on {summary['ranks']} CPU ranks)",
        f"  bytes sent per rank per step: package {kb(t['package'])}, node {kb(t['node'])}, "
        f"network {kb(t['network'])}",
        f"  bytes held per rank: primary {kb(m['primary'])}, secondary {kb(m['secondary'])}, "
        f"grad {kb(m['grad'])}, optimizer {kb(m['optimizer'])}, "
        f"peak transient {kb(m['peak_transient'])}",
        f"  checkpoint {summary['checkpoint']}",
        f"  loss curve {run_dir / 'loss_curve.png'}",
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_lbp.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=4,
                   help="ranks per emulated node (default 4: 8 ranks = 2 nodes)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--out", default=str(REPO / "runs" / "main"))
    p.add_argument("--data-dir", default=str(REPO / "data"))
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args(argv)
    for flag in ("iters", "ranks", "gpus_per_node", "log_interval"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    if args.ranks % args.gpus_per_node:
        p.error(f"--gpus-per-node={args.gpus_per_node} must divide --ranks={args.ranks}")

    from megatron_lbp.data import build_demo_data

    data_prefix = build_demo_data(args.data_dir)
    run_dir = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=False)
    cmd = training_command(args, run_dir, data_prefix)
    print("[megatron-lbp] " + " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with open(run_dir / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=REPO)
        for line in proc.stdout:
            log.write(line)
            if "iteration" in line or "error" in line.lower() or "megatron-lbp" in line:
                print(line, end="", flush=True)
        code = proc.wait()
    if code:
        print(f"[megatron-lbp] training failed with exit code {code}; full log: {run_dir / 'train.log'}",
              file=sys.stderr)
        return code
    rows = parse_log((run_dir / "train.log").read_text())
    summary = summarize(run_dir, rows, args.ranks, 4 * args.ranks * MODEL["seq-length"])
    print(render(summary, run_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
