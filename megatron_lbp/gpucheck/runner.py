"""``python -m megatron_lbp.gpu_check [--out DIR] [--parts A,B,C,D,E] [--require-gpu]``

What one GPU can prove about the engine, part by part, each in its own process under
its own time limit; writes result.json and summary.md and prints the summary.

Parts: A the int8 Triton kernels against torch; B torch.distributed at world size 1;
C the engine against stock megatron-core at world size 1; D the plan's memory at 384
ranks over torch's fake process group; E four gloo ranks with CUDA tensors on one GPU.
Without a GPU only D runs. An unusable GPU or another megatron-core is refused in one
line before any part (gpucheck/stack.py). Exit status: 0 every part that ran passed,
1 a part failed, timed out or crashed, 2 refused. Details: docs/gpu.md.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from megatron_lbp.gpucheck import stack

PROG = "python -m megatron_lbp.gpu_check"
SCHEMA = 1
CPU_LAYERS = 1        # part D on CPU: the fewest layers (one 20B layer is ~5.5 GiB of RSS)
CPU_TOKENS = 2        # part D on CPU: bf16 matmuls are emulated; bytes do not depend on tokens
CPU_STEPS = 1         # part D on CPU: one step (~5 min of bf16 matmuls per step here); GPU: 2
STATUSES = ("pass", "fail", "error", "timeout", "needs-gpu", "cannot-run")


@dataclass(frozen=True)
class Part:
    key: str
    title: str
    gpu_limit_s: int           # on one H100; the sum stays under 8 minutes
    cpu_limit_s: int | None    # None: needs a GPU
    needs: tuple[str, ...] = ("cuda",)


PARTS = (
    Part("A", "int8 Triton kernels vs the torch reference, throughput vs a device copy", 45,
         None, ("cuda", "triton")),
    Part("B", "NCCL at world size 1: async collectives behind GEMMs, handles, streams, events",
         30, None, ("cuda", "nccl")),
    Part("C", "engine vs stock megatron-core at world size 1, 2 layers of the 20B shape, bf16",
         110, None, ("cuda", "nccl")),
    Part("D", "plan's memory at 384 ranks over the fake process group, lbp P=2 G=8 O=384",
         80, 3600, ()),
    Part("E", "4 gloo ranks with CUDA tensors on the one GPU: tiny GPT vs the reference", 55,
         None, ("cuda",)),
)
D_VARIANTS = ("int8-secondary", "no-secondary")   # part D's two runs, each with the limit


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    p.add_argument("--out", default=None,
                   help="output directory (default runs/gpu_check/<UTC time>)")
    p.add_argument("--parts", default="A,B,C,D,E", help="comma-separated parts (default all)")
    p.add_argument("--require-gpu", action="store_true",
                   help="refuse to start without a usable CUDA device (the device run)")
    p.add_argument("--d-layers", type=int, default=None,
                   help=f"part D's layers of the 20B shape (default 44 on a GPU, {CPU_LAYERS} on CPU)")
    p.add_argument("--d-tokens", type=int, default=None,
                   help=f"part D's tokens per micro-batch (default 2048 on a GPU, {CPU_TOKENS} on CPU)")
    args = p.parse_args(argv)
    parts = [x.strip().upper() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in parts if x not in {q.key for q in PARTS}]
    if unknown or not parts:
        p.exit(2, f"{PROG}: error: --parts={args.parts}: parts are A, B, C, D, E\n")
    for flag in ("d_layers", "d_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.exit(2, f"{PROG}: error: --{flag.replace('_', '-')}={value}: must be >= 1\n")
    args.parts = parts
    return args


def missing(part: Part, info: dict[str, Any]) -> str | None:
    """Why ``part`` cannot run on this machine (one line), or None."""
    have = {"cuda": info["cuda_available"], "triton": bool(info["triton"]),
            "nccl": bool(info["nccl"])}
    lacking = [n for n in part.needs if not have[n]]
    if not lacking:
        return None
    if "cuda" in lacking:
        return f"needs a GPU: torch {info['torch']} sees no CUDA device here ({info['device']})"
    return f"needs {' and '.join(lacking)} with the GPU: not in this torch install"


def run_child(key: str, extra: list[str], limit_s: int, out_dir: Path, log_name: str
              ) -> dict[str, Any]:
    """One part in its own process group under ``limit_s``; its record (status, checks...)."""
    fd, result_path = tempfile.mkstemp(prefix=f"gpu-check-{key}-", suffix=".json")
    os.close(fd)
    log = out_dir / log_name
    cmd = [sys.executable, "-m", "megatron_lbp.gpucheck.child", key, result_path, *extra]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)   # the part and any ranks it started
            proc.wait()
    wall = round(time.perf_counter() - t0, 1)
    try:
        with open(result_path) as f:
            body = json.load(f)
    except (OSError, ValueError):
        body = None
    os.unlink(result_path)
    record: dict[str, Any] = {"limit_s": limit_s, "wall_s": wall, "log": log.name,
                              "checks": [], "figures": {}}
    if timed_out:
        return {**record, "status": "timeout",
                "reason": f"killed at its {limit_s} s limit (last lines: {log.name})"}
    if body is None:
        return {**record, "status": "error",
                "reason": f"exited with status {proc.returncode} without a result ({log.name})"}
    if "error" in body:
        return {**record, "status": "error", "reason": body["error"],
                "figures": {"traceback_tail": body.get("traceback_tail")}}
    checks = body.get("checks", [])
    status = "pass" if checks and all(c["ok"] for c in checks) else "fail"
    if body.get("reason"):
        status = "cannot-run"
    return {**record, "status": status, "reason": body.get("reason"), "checks": checks,
            "figures": body.get("figures", {})}


def run_part(part: Part, info: dict[str, Any], args, out_dir: Path) -> dict[str, Any]:
    head = {"part": part.key, "title": part.title}
    why = missing(part, info)
    if why is not None:
        return {**head, "status": "needs-gpu" if "GPU" in why else "cannot-run", "reason": why,
                "limit_s": 0, "wall_s": 0.0, "checks": [], "figures": {}}
    gpu = info["cuda_available"]
    limit = part.gpu_limit_s if gpu else part.cpu_limit_s
    if part.key != "D":
        return {**head, **run_child(part.key, [], limit, out_dir, f"part-{part.key}.log")}
    layers = args.d_layers or (44 if gpu else CPU_LAYERS)
    tokens = args.d_tokens or (2048 if gpu else CPU_TOKENS)
    steps = 2 if gpu else CPU_STEPS
    runs = {v: run_child("D", ["--variant", v, "--layers", str(layers), "--tokens", str(tokens),
                               "--steps", str(steps), "--device", "cuda" if gpu else "cpu"],
                         limit, out_dir, f"part-D-{v}.log") for v in D_VARIANTS}
    order = {s: i for i, s in enumerate(("error", "timeout", "fail", "cannot-run", "pass"))}
    worst = min(runs.values(), key=lambda r: order[r["status"]])
    return {**head, "status": worst["status"],
            "reason": "; ".join(f"{v}: {r['reason']}" for v, r in runs.items() if r["reason"])
                      or None,
            "limit_s": limit * len(runs), "wall_s": round(sum(r["wall_s"] for r in runs.values()), 1),
            "checks": [c for r in runs.values() for c in r["checks"]],
            "figures": {"layers": layers, "tokens": tokens, "steps": steps,
                        "variants": {v: r["figures"] for v, r in runs.items()},
                        "logs": [r["log"] for r in runs.values()]}}


def summary_markdown(result: dict[str, Any]) -> str:
    lines = [f"# gpu_check on {result['device']}", "",
             f"`{result['command']}`, started {result['started_utc']}, "
             f"{result['wall_s']} s in all.", "",
             "| part | status | time (limit) | what |", "|---|---|---|---|"]
    for p in result["parts"]:
        lines.append(f"| {p['part']} | {p['status']} | {p['wall_s']} s ({p['limit_s']} s) | "
                     f"{p['title']} |")
    for p in result["parts"]:
        lines += ["", f"## {p['part']}: {p['status']}"]
        if p["reason"]:
            lines.append(p["reason"])
        for c in p["checks"]:
            lines.append(f"- {'ok' if c['ok'] else 'FAILED'}: {c['name']}: {c['detail']}")
        if p["part"] == "D" and p["figures"].get("variants"):
            lines += _memory_table(p["figures"])
    return "\n".join(lines) + "\n"


def _memory_table(fig: dict[str, Any]) -> list[str]:
    rows = ["", f"Bytes per rank at 384 ranks, {fig['layers']} layer(s) of the 20B shape, "
                "measured / plan (GiB):", "",
            "| variant | primary | secondary | grad | optimizer | total | peak transient |",
            "|---|---|---|---|---|---|---|"]
    for variant, f in fig["variants"].items():
        b = f.get("bytes")
        if not b:
            continue
        cells = [f"{b[s]['measured'] / 2**30:.3f} / {b[s]['plan'] / 2**30:.3f}"
                 for s in ("primary", "secondary", "grad", "optimizer", "total", "peak_transient")]
        rows.append(f"| {variant} | " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = stack.describe()
    refused = stack.refusal(info, args.require_gpu)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    started = datetime.now(timezone.utc)
    out_dir = Path(args.out or Path("runs/gpu_check") / started.strftime("%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    parts = []
    for part in PARTS:
        if part.key not in args.parts:
            continue
        record = run_part(part, info, args, out_dir)
        print(f"[gpu_check] {part.key} {record['status']} ({record['wall_s']} s)"
              + (f": {record['reason']}" if record["reason"] else ""), flush=True)
        parts.append(record)
    result = {"schema": SCHEMA, "command": " ".join([PROG, *(argv if argv is not None else sys.argv[1:])]),
              "started_utc": started.isoformat(timespec="seconds"), "device": info["device"],
              "stack": info, "wall_s": round(time.perf_counter() - t0, 1), "parts": parts,
              "ok": all(p["status"] in ("pass", "needs-gpu", "cannot-run") for p in parts)}
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = summary_markdown(result)
    (out_dir / "summary.md").write_text(text)
    print(text)
    print(f"[gpu_check] wrote {out_dir / 'result.json'} and {out_dir / 'summary.md'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
