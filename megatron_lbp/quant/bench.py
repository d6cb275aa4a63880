"""Throughput of blockwise int8 quantize/dequantize against a plain memory copy.

    python -m megatron_lbp.quant.bench [--numel N] [--repeats R]
        [--block-sizes 64,128,256,512,1024,2048] [--dtypes fp32,bf16] [--threads T] [--json]

Per input dtype and block size: GB/s of the full-precision side for quantize and
dequantize (torch; on a GPU also Triton, checked bit-exact against torch), beside
``dst.copy_(src)`` of the same bytes (``vs_memcpy``), medians over interleaved repeats;
and the error on a weight-like bf16 tensor (mean relative, L2, worst in steps) with the
scale overhead 4/B. How the default block size was chosen: docs/int8.md, "The format".
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch

from megatron_lbp.quant.blockwise import (
    check_block_size,
    dequantize,
    num_blocks,
    quantize,
    QuantError,
)
from megatron_lbp.quant.triton_kernels import dequantize_triton, quantize_triton, triton_available

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_BLOCKS = (64, 128, 256, 512, 1024, 2048)
ERROR_NUMEL_MAX = 1 << 22  # enough elements for stable error statistics


# ----------------------------------------------------------------- arguments


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    for v in values:
        try:
            check_block_size(v)
        except QuantError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return values


def _dtype_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"dtypes must be among {','.join(DTYPES)}, got {text!r}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_lbp.quant.bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=1 << 24, help="elements per tensor (default 2**24)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats; medians (default 7)")
    p.add_argument("--block-sizes", type=_int_list, default=list(DEFAULT_BLOCKS),
                   help="comma-separated block sizes (default 64,...,2048)")
    p.add_argument("--dtypes", type=_dtype_list, default=["fp32", "bf16"],
                   help="input dtypes (default fp32,bf16)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's; 1 is the reproducible "
                        "choice on a shared machine, where spinning threads wait on each other)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args(argv)
    if args.numel < 1 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        p.error("--numel, --repeats and --threads must be >= 1")
    return args


# ----------------------------------------------------------------- timing


def _machine(device: torch.device) -> dict:
    info = {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def cpu_model() -> str:
    """The CPU's model name (for the records the benchmarks and the GPU check write)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def time_once(fn: Callable[[], object]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    return time_once


def _cases(args, device, impls):
    """name -> (fn, bytes) for every timed op; one warm-up call each."""
    cases = {}
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        x = (torch.randn(args.numel, device=device) * 0.02).to(dtype)
        nbytes = x.numel() * x.element_size()
        dst = torch.empty_like(x)
        cases[("memcpy", dname, 0)] = (lambda d=dst, s=x: d.copy_(s), nbytes)
        for block in args.block_sizes:
            q = torch.empty(args.numel, dtype=torch.int8, device=device)
            s = torch.empty(num_blocks(args.numel, block), dtype=torch.float32, device=device)
            out = torch.empty_like(x)
            for impl, (quant, dequant) in impls.items():
                cases[(f"{impl}:quantize", dname, block)] = (
                    lambda f=quant, x=x, b=block, q=q, s=s: f(x, b, out_q=q, out_scale=s), nbytes)
                cases[(f"{impl}:dequantize", dname, block)] = (
                    lambda f=dequant, b=block, q=q, s=s, o=out: f(q, s, b, out=o), nbytes)
    for fn, _ in cases.values():
        fn()
    return cases


def measure(args, device: torch.device, impls) -> dict:
    cases = _cases(args, device, impls)
    time_once = _timer(device)
    times = {key: [] for key in cases}
    for _ in range(args.repeats):
        for key, (fn, _) in cases.items():
            times[key].append(time_once(fn))
    return {key: cases[key][1] / statistics.median(ts) / 1e9 for key, ts in times.items()}


def _exactness(args, device: torch.device) -> dict:
    """Triton vs torch on the same GPU tensors: bit-equal q, scale and outputs?"""
    result = {}
    for dname in args.dtypes:
        x = (torch.randn(args.numel, device=device) * 0.02).to(DTYPES[dname])
        for block in args.block_sizes:
            q1, s1 = quantize(x, block)
            q2, s2 = quantize_triton(x, block)
            d1 = dequantize(q1, s1, block, dtype=x.dtype)
            d2 = dequantize_triton(q1, s1, block, dtype=x.dtype)
            result[f"{dname}:{block}"] = bool(torch.equal(q1, q2) and torch.equal(s1, s2)
                                              and torch.equal(d1, d2))
    return result


# ----------------------------------------------------------------- error


def error_stats(numel: int, block_sizes: list[int], device: torch.device) -> list[dict]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(min(numel, ERROR_NUMEL_MAX), generator=gen) * 0.02).to(torch.bfloat16)
    x = x.to(device)
    xf = x.float()
    mean_abs = xf.abs().mean()
    rows = []
    for block in block_sizes:
        q, s = quantize(x, block)
        d32 = dequantize(q, s, block, dtype=torch.float32)
        d16 = dequantize(q, s, block, dtype=torch.bfloat16).float()
        step = s.repeat_interleave(block)[: x.numel()]
        err = (xf - d32).abs()
        rows.append({
            "block_size": block,
            "mean_rel_err": float(err.mean() / mean_abs),
            "mean_rel_err_bf16_out": float((xf - d16).abs().mean() / mean_abs),
            "rel_l2_err": float(torch.linalg.vector_norm(xf - d32) / torch.linalg.vector_norm(xf)),
            "max_err_steps": float((err / step.clamp_min(1e-30)).max()),
            "scale_overhead": 4.0 / block,
        })
    return rows


# ----------------------------------------------------------------- report


def run(args) -> dict:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    impls = {"torch": (quantize, dequantize)}
    if device.type == "cuda" and triton_available(device):
        impls["triton"] = (quantize_triton, dequantize_triton)
    gbps = measure(args, device, impls)
    memcpy = {d: gbps[("memcpy", d, 0)] for d in args.dtypes}
    results = []
    for impl in impls:
        for dname in args.dtypes:
            for block in args.block_sizes:
                qg = gbps[(f"{impl}:quantize", dname, block)]
                dg = gbps[(f"{impl}:dequantize", dname, block)]
                results.append({
                    "impl": impl, "dtype": dname, "block_size": block,
                    "quantize_gbps": qg, "dequantize_gbps": dg,
                    "quantize_vs_memcpy": qg / memcpy[dname],
                    "dequantize_vs_memcpy": dg / memcpy[dname],
                })
    report = {
        "machine": _machine(device),
        "numel": args.numel,
        "repeats": args.repeats,
        "unit": "GB/s of numel*itemsize(input dtype), median over repeats",
        "memcpy_gbps": memcpy,
        "results": results,
        "error": error_stats(args.numel, args.block_sizes, device),
    }
    if "triton" in impls:
        report["triton_bit_exact"] = _exactness(args, device)
    return report


def print_report(report: dict) -> None:
    m = report["machine"]
    print(f"machine: {m['cpu']} ({m['cpu_count']} CPUs, {m['torch_threads']} torch threads), "
          f"torch {m['torch']}, device {m['device']}" + (f" ({m['gpu']})" if "gpu" in m else ""))
    print(f"numel {report['numel']}, median of {report['repeats']}; {report['unit']}")
    print("memcpy: " + ", ".join(f"{d} {g:.2f} GB/s" for d, g in report["memcpy_gbps"].items()))
    print(f"{'impl':<7} {'dtype':<5} {'block':>6} {'quant GB/s':>11} {'x memcpy':>9} "
          f"{'dequant GB/s':>13} {'x memcpy':>9}")
    for r in report["results"]:
        print(f"{r['impl']:<7} {r['dtype']:<5} {r['block_size']:>6} {r['quantize_gbps']:>11.2f} "
              f"{r['quantize_vs_memcpy']:>9.2f} {r['dequantize_gbps']:>13.2f} "
              f"{r['dequantize_vs_memcpy']:>9.2f}")
    print("error on bf16 N(0,1)*0.02 (mean|x-x'|/mean|x|):")
    print(f"{'block':>6} {'fp32 out':>10} {'bf16 out':>10} {'rel L2':>10} {'max steps':>10} "
          f"{'scale ovh':>10}")
    for e in report["error"]:
        print(f"{e['block_size']:>6} {e['mean_rel_err']:>10.5f} "
              f"{e['mean_rel_err_bf16_out']:>10.5f} "
              f"{e['rel_l2_err']:>10.5f} {e['max_err_steps']:>10.4f} {e['scale_overhead']:>10.2%}")
    if "triton_bit_exact" in report:
        print("triton bit-exact vs torch:", report["triton_bit_exact"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report = run(args)
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
