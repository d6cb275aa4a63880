"""Triton kernels for blockwise int8 quantization (CUDA and ROCm GPUs).

Same contract as :mod:`megatron_lbp.quant.blockwise` (the reference), one program per
block, bit-identical to it on finite input and runnable in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, how the tests run them): division is ``tl.math.div_rn`` (a plain
``/`` is approximate on NVIDIA), ties-to-even is built from ``floor`` (``rint`` is
backend-specific), and bf16 output is rounded by bit arithmetic (the interpreter's cast
truncates). The compiled code does not flush subnormals (the tests compile for sm_90 and
gfx90a and check). Importing needs neither a GPU nor Triton: without Triton
:func:`triton_available` is False and the entry points raise QuantError.
"""
from __future__ import annotations

import os

import torch

from megatron_lbp.quant.blockwise import (
    QMAX,
    QuantError,
    finish_nonfinite,
    prepare_dequantize,
    prepare_quantize,
)

try:  # a CPU-only install may lack Triton or ship a broken one
    import triton
    import triton.language as tl
except Exception as exc:  # noqa: BLE001 - any import failure means "no Triton"
    triton = None
    tl = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    _IMPORT_ERROR = None

__all__ = ["triton_available", "interpreter_active", "quantize_triton", "dequantize_triton"]

def interpreter_active() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(device: torch.device | str | None = None) -> bool:
    """Can the kernels run on tensors of ``device`` (default: the current CUDA/ROCm device)?

    True for a CUDA or ROCm device (torch calls both "cuda") when Triton imports,
    and for CPU tensors only under the interpreter.
    """
    if triton is None:
        return False
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type == "cpu":
        return interpreter_active()
    return device.type == "cuda" and torch.cuda.is_available()


def _num_warps(block_pow2: int) -> int:
    # ~128 elements per warp (4 fp32 = one 16-byte load per NVIDIA lane): a guess for a
    # memory-bound kernel, not yet tuned on a GPU (the bench times it when one is present).
    return max(1, min(8, block_pow2 // 128))


if triton is not None:
    # jit code may read globals only as constexpr
    _MIN_SCALE = tl.constexpr(2.0 ** -126)  # the reference's scale floor
    _INF = tl.constexpr(float("inf"))

    @triton.jit
    def _round_half_even(y):
        a = tl.abs(y)
        f = tl.floor(a)
        d = a - f  # exact for 0 <= a < 2**23
        half = f * 0.5
        odd = half != tl.floor(half)
        r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
        return tl.where(y < 0, -r, r)

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, scale_ptr, numel,
                         BLOCK_SIZE: tl.constexpr, BLOCK_POW2: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)  # int64: buckets may exceed 2**31 elements
        lane = tl.arange(0, BLOCK_POW2)
        offs = pid * BLOCK_SIZE + lane
        mask = (lane < BLOCK_SIZE) & (offs < numel)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # NaN -> +Inf so a poisoned block gets scale +Inf whatever max does with NaN.
        ax = tl.where(x == x, tl.abs(x), _INF)
        amax = tl.max(ax, axis=0)
        scale = tl.maximum(tl.math.div_rn(amax, 127.0), _MIN_SCALE)
        scale = tl.where(amax == 0.0, 0.0, scale)
        divisor = tl.where(amax == 0.0, 1.0, scale)
        y = tl.math.div_rn(x, tl.zeros_like(x) + divisor)
        r = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0)  # a no-op; defensive
        r = tl.where(amax < _INF, r, 0.0)  # poisoned block: codes 0
        tl.store(q_ptr + offs, r.to(tl.int8), mask=mask)
        tl.store(scale_ptr + pid, scale)

    @triton.jit
    def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, numel,
                           BLOCK_SIZE: tl.constexpr, BLOCK_POW2: tl.constexpr,
                           OUT_BF16: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, BLOCK_POW2)
        offs = pid * BLOCK_SIZE + lane
        mask = (lane < BLOCK_SIZE) & (offs < numel)
        q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
        y = q * tl.load(scale_ptr + pid)
        if OUT_BF16:
            # round-to-nearest-even to bf16 by hand (torch's c10 algorithm, NaN -> 0x7FC0)
            bits = y.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            hi = tl.where(y == y, bits >> 16, 0x7FC0).to(tl.uint16)
            tl.store(out_ptr + offs, hi.to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _require(device: torch.device) -> None:
    if triton is None:
        raise QuantError(f"Triton is not importable ({_IMPORT_ERROR}); "
                         f"use the torch implementation")
    if not triton_available(device):
        raise QuantError(f"Triton kernels cannot run on device {device} "
                         f"(need a CUDA/ROCm GPU, or TRITON_INTERPRET=1 for CPU)")


def _launch_shape(block_size: int) -> tuple[int, int]:
    pow2 = triton.next_power_of_2(block_size)
    return pow2, _num_warps(pow2)


def quantize_triton(x: torch.Tensor, block_size: int, out_q: torch.Tensor | None = None,
                    out_scale: torch.Tensor | None = None, *, check_finite: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`blockwise.quantize` (same arguments, same results)."""
    block_size, q, scale = prepare_quantize(x, block_size, out_q, out_scale)
    _require(x.device)
    if scale.numel():
        pow2, warps = _launch_shape(block_size)
        _quantize_kernel[(scale.numel(),)](x, q, scale, x.numel(), BLOCK_SIZE=block_size,
                                           BLOCK_POW2=pow2, num_warps=warps)
    if check_finite:  # the kernel already zeroed poisoned codes; this only raises
        finish_nonfinite(x, q, scale, block_size, check_finite)
    return q, scale


def dequantize_triton(q: torch.Tensor, scale: torch.Tensor, block_size: int,
                      dtype: torch.dtype | None = None, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Triton twin of :func:`blockwise.dequantize` (same arguments, same results)."""
    block_size, out = prepare_dequantize(q, scale, block_size, dtype, out)
    _require(q.device)
    if scale.numel():
        pow2, warps = _launch_shape(block_size)
        _dequantize_kernel[(scale.numel(),)](q, scale, out, q.numel(), BLOCK_SIZE=block_size,
                                             BLOCK_POW2=pow2,
                                             OUT_BF16=out.dtype == torch.bfloat16,
                                             num_warps=warps)
    return out


assert QMAX == 127  # the kernel hard-codes 127.0
