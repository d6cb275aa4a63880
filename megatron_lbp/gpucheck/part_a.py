"""Part A: the int8 Triton kernels against the torch reference, and their throughput.

Each case quantizes one tensor with both implementations on one device and compares codes
and scales bit for bit, then dequantizes with both and compares the outputs (poisoned
blocks: both NaN). Cases: each dtype and block size, tails inside a block, NaN and Inf,
and one tensor over 2**31 elements (int64 offsets). Throughput is GB/s against a device
copy of the same bytes (quant/bench.py's timer). Runs on a GPU, or on CPU tensors under
Triton's interpreter (TRITON_INTERPRET=1), which is how the tests run it.
"""
from __future__ import annotations

from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BLOCKS = (64, 128, 256, 1024, 2048)
# Lengths: whole blocks, one element, a tail inside the last block, a prime.
LENGTHS = (1 << 20, 1, (1 << 20) + 37, 1_000_003)
HUGE = (1 << 31) + 4099          # over 2**31 elements, not a multiple of any block size
THROUGHPUT_NUMEL = 1 << 28


def _input(numel: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(numel, generator=g) * 0.02).to(dtype).to(device)


def compare(x: torch.Tensor, block: int) -> dict[str, Any]:
    """Quantize ``x`` with both implementations and dequantize with both; what differs."""
    from megatron_lbp.quant import blockwise, triton_kernels

    q_ref, s_ref = blockwise.quantize(x, block, check_finite=False)
    q_tri, s_tri = triton_kernels.quantize_triton(x, block, check_finite=False)
    d_ref = blockwise.dequantize(q_ref, s_ref, block, dtype=x.dtype)
    d_tri = triton_kernels.dequantize_triton(q_ref, s_ref, block, dtype=x.dtype)
    out = {"numel": x.numel(), "dtype": str(x.dtype).removeprefix("torch."), "block": block,
           "codes_differ": int((q_ref != q_tri).sum()),
           "scales_differ": int((s_ref != s_tri).sum()),
           # NaN == NaN for this purpose: a poisoned block dequantizes to NaN on both sides.
           "outputs_differ": int(((d_ref != d_tri) & ~(d_ref.isnan() & d_tri.isnan())).sum())}
    out["ok"] = out["codes_differ"] == out["scales_differ"] == out["outputs_differ"] == 0
    return out


def agreement_cases(device: torch.device, lengths=LENGTHS, blocks=BLOCKS,
                    huge: int | None = HUGE) -> list[dict[str, Any]]:
    """Every dtype x block x length, the NaN/Inf cases, and the one over 2**31 elements."""
    rows = []
    seed = 0
    for dname, dtype in DTYPES.items():
        for block in blocks:
            for numel in lengths:
                seed += 1
                rows.append(compare(_input(numel, dtype, device, seed), block))
        x = _input(max(lengths), dtype, device, seed + 1)
        x[3] = float("nan")                 # poisons block 0
        x[5 * blocks[-1] + 1] = float("inf")
        x[-1] = float("-inf")               # poisons the tail block
        row = compare(x, blocks[-1])
        row["case"] = "nan-inf"
        rows.append(row)
    if huge is not None:
        x = torch.empty(huge, dtype=torch.bfloat16, device=device)
        x.normal_(0, 0.02)
        x[-1] = 3.0                         # a tail block whose scale only int64 offsets reach
        row = compare(x, 256)
        row["case"] = "over 2**31 elements"
        rows.append(row)
        del x
    return rows


def throughput(device: torch.device, numel: int = THROUGHPUT_NUMEL, repeats: int = 10
               ) -> list[dict[str, Any]]:
    """GB/s of quantize and dequantize (both implementations) and of a device copy."""
    import argparse

    from megatron_lbp.quant import bench, blockwise, triton_kernels

    args = argparse.Namespace(numel=numel, repeats=repeats, dtypes=["bf16", "fp32"],
                              block_sizes=[256, 2048])
    impls = {"torch": (blockwise.quantize, blockwise.dequantize),
             "triton": (triton_kernels.quantize_triton, triton_kernels.dequantize_triton)}
    gbps = bench.measure(args, device, impls)
    rows = []
    for dname in args.dtypes:
        copy = gbps[("memcpy", dname, 0)]
        for block in args.block_sizes:
            for impl in impls:
                q, d = gbps[(f"{impl}:quantize", dname, block)], gbps[(f"{impl}:dequantize", dname, block)]
                rows.append({"impl": impl, "dtype": dname, "block": block, "copy_gbps": round(copy, 1),
                             "quantize_gbps": round(q, 1), "dequantize_gbps": round(d, 1),
                             "quantize_vs_copy": round(q / copy, 3),
                             "dequantize_vs_copy": round(d / copy, 3)})
    return rows


def run(opts) -> dict[str, Any]:
    device = torch.device("cuda")
    rows = agreement_cases(device)
    torch.cuda.empty_cache()
    bad = [r for r in rows if not r["ok"]]
    checks = [{"name": "Triton == torch reference (codes, scales, outputs)", "ok": not bad,
               "detail": f"{len(rows) - len(bad)}/{len(rows)} cases bit-identical"
                         + (f"; first differing: {bad[0]}" if bad else "")}]
    rates = throughput(device)
    return {"checks": checks, "figures": {"cases": rows, "throughput": rates}}
