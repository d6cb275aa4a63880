"""Blockwise symmetric int8 quantization: the torch reference implementation.

One fp32 scale and B int8 codes per block of B elements; codes in [-127, 127],
ties to even, error at most half a step plus fp32 rounding. A block holding a
non-finite value is poisoned (scale +Inf, dequantizes to NaN) and ``quantize``
raises :class:`QuantError` unless ``check_finite=False``. Outputs may be views
into a larger buffer (:func:`packed_views`: scales first, 4-byte aligned). On
CPU the work runs in 2**20-element chunks, one torch op per step, no Python
loop over blocks. The format, the contract and the choice of the default block
size: docs/int8.md, "The format".
"""
from __future__ import annotations

import math
import numbers
from typing import Iterator

import torch

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "KERNEL_ALIGN",
    "QMAX",
    "INPUT_DTYPES",
    "OUTPUT_DTYPES",
    "QuantError",
    "check_block_size",
    "num_blocks",
    "quantized_nbytes",
    "packed_views",
    "quantize",
    "dequantize",
    "find_nonfinite",
    "poisoned_blocks",
]

# Block sizes must be multiples of 64: an AMD CDNA wavefront is 64 lanes (an
# NVIDIA warp 32), so a block fills whole wavefronts, and every block starts
# on a 64-element boundary (128 B of bf16, 256 B of fp32, 64 B of int8), so a
# Triton program's loads are aligned and vectorisable. The layout's default
# bucket alignment (128) is a multiple of it.
KERNEL_ALIGN = 64
DEFAULT_BLOCK_SIZE = 256
QMAX = 127
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUTPUT_DTYPES = INPUT_DTYPES

# Smallest normal fp32: the scale floor that keeps |x / scale| <= 127 (see docstring).
_MIN_SCALE = 2.0 ** -126
# 4 MiB fp32 temporary: measured fastest (see the docstring); smaller chunks pay
# per-op overhead, one big temporary pays page faults and cache misses.
_CPU_CHUNK_ELEMS = 1 << 20


class QuantError(ValueError):
    """A bad argument or non-finite input; the message is one line."""


# ----------------------------------------------------------------- sizes


def check_block_size(block_size: int) -> int:
    """Return ``block_size`` as an int if it is a positive multiple of KERNEL_ALIGN."""
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise QuantError(f"block_size must be an int, got {block_size!r} "
                         f"({type(block_size).__name__})")
    block_size = int(block_size)
    if block_size <= 0 or block_size % KERNEL_ALIGN:
        raise QuantError(f"block_size must be a positive multiple of KERNEL_ALIGN="
                         f"{KERNEL_ALIGN}, got {block_size}")
    return block_size


def _check_numel(numel: int) -> int:
    if isinstance(numel, bool) or not isinstance(numel, numbers.Integral) or numel < 0:
        raise QuantError(f"numel must be a non-negative int, got {numel!r}")
    return int(numel)


def num_blocks(numel: int, block_size: int) -> int:
    """Number of scales for ``numel`` elements: ceil(numel / block_size)."""
    numel = _check_numel(numel)
    block_size = check_block_size(block_size)
    return -(-numel // block_size)


def quantized_nbytes(numel: int, block_size: int) -> int:
    """Exact storage/wire bytes: one int8 per element plus one fp32 scale per block."""
    return _check_numel(numel) + 4 * num_blocks(numel, block_size)


def packed_views(buf: torch.Tensor, numel: int, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a uint8/int8 buffer of quantized_nbytes(numel, block_size) into (q, scale).

    Layout: ``[scale (4*num_blocks bytes, fp32) | q (numel bytes, int8)]``; scales
    come first so they are 4-byte aligned whatever ``numel`` is. ``buf`` may be a
    slice of a bigger buffer (e.g. one rank's chunk of an S-group all-gather); its
    storage offset must then be a multiple of 4.
    """
    nb = num_blocks(numel, block_size)
    need = quantized_nbytes(numel, block_size)
    if not isinstance(buf, torch.Tensor) or buf.dtype not in (torch.uint8, torch.int8):
        raise QuantError(f"buf must be a uint8 or int8 tensor, got "
                         f"{getattr(buf, 'dtype', type(buf).__name__)}")
    if buf.dim() != 1 or not buf.is_contiguous() or buf.numel() != need:
        raise QuantError(f"buf must be 1-D contiguous with quantized_nbytes={need} "
                         f"elements, got shape {tuple(buf.shape)}")
    if buf.storage_offset() % 4:
        raise QuantError(f"buf storage offset must be a multiple of 4 for the fp32 "
                         f"scales, got {buf.storage_offset()}")
    scale = buf[: 4 * nb].view(torch.int8).view(torch.float32)
    q = buf[4 * nb:].view(torch.int8)
    return q, scale


# ----------------------------------------------------------------- validation


def _check_input(x: torch.Tensor, name: str, dtypes: tuple) -> None:
    if not isinstance(x, torch.Tensor):
        raise QuantError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise QuantError(f"{name} dtype must be one of {allowed}, got "
                         f"{str(x.dtype).replace('torch.', '')}")
    if x.dim() != 1 or not x.is_contiguous():
        raise QuantError(f"{name} must be 1-D and contiguous, got shape {tuple(x.shape)} "
                         f"(contiguous={x.is_contiguous()})")


def _output(out: torch.Tensor | None, name: str, numel: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """Validate a caller's preallocated output, or allocate one."""
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    _check_input(out, name, (dtype,))
    if out.numel() != numel:
        raise QuantError(f"{name} must have {numel} elements, got {out.numel()}")
    if out.device != device:
        raise QuantError(f"{name} must be on {device}, got {out.device}")
    return out


def prepare_quantize(x, block_size, out_q, out_scale):
    """Shared argument checks of every quantize implementation -> (B, q, scale)."""
    block_size = check_block_size(block_size)
    _check_input(x, "x", INPUT_DTYPES)
    nb = num_blocks(x.numel(), block_size)
    q = _output(out_q, "out_q", x.numel(), torch.int8, x.device)
    scale = _output(out_scale, "out_scale", nb, torch.float32, x.device)
    return block_size, q, scale


def prepare_dequantize(q, scale, block_size, dtype, out):
    """Shared argument checks of every dequantize implementation -> (B, out)."""
    block_size = check_block_size(block_size)
    _check_input(q, "q", (torch.int8,))
    _check_input(scale, "scale", (torch.float32,))
    nb = num_blocks(q.numel(), block_size)
    if scale.numel() != nb:
        raise QuantError(f"scale must have num_blocks({q.numel()}, {block_size})={nb} "
                         f"elements, got {scale.numel()}")
    if scale.device != q.device:
        raise QuantError(f"scale must be on {q.device} like q, got {scale.device}")
    if dtype is None:
        dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
    if dtype not in OUTPUT_DTYPES:
        raise QuantError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return block_size, _output(out, "out", q.numel(), dtype, q.device)


# ----------------------------------------------------------------- non-finite values


def find_nonfinite(x: torch.Tensor) -> tuple[int, int] | None:
    """(count, first index) of NaN/Inf elements of ``x``, or None when all are finite.

    A full pass over ``x`` plus a host sync: meant for diagnostics and error
    messages, not for the hot path (quantize's own check reads only the scales).
    """
    bad = ~torch.isfinite(x.reshape(-1))
    count = int(bad.sum())
    if count == 0:
        return None
    # argmax returns the first maximal index
    return count, int(torch.argmax(bad.to(torch.uint8)))


def poisoned_blocks(scale: torch.Tensor) -> torch.Tensor:
    """Bool mask of blocks that held a non-finite value (their scale is +Inf)."""
    return ~torch.isfinite(scale)


def finish_nonfinite(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     block_size: int, check_finite: bool) -> None:
    """Apply the non-finite contract after the codes are written (see module docstring)."""
    bad = poisoned_blocks(scale)
    if not bool(bad.any()):
        return
    # Codes of a poisoned block come from NaN / Inf quotients: make them 0.
    q.masked_fill_(bad.repeat_interleave(block_size)[: q.numel()], 0)
    if check_finite:
        raise_nonfinite(x)


def raise_nonfinite(x: torch.Tensor) -> None:
    found = find_nonfinite(x)
    count, first = found if found else (0, -1)
    value = x[first].item() if first >= 0 else float("nan")
    raise QuantError(f"x has {count} non-finite value(s) (first at index {first}: "
                     f"{value}); quantize needs finite input (pass check_finite=False "
                     f"to get poisoned blocks instead)")


# ----------------------------------------------------------------- row chunks


def _row_spans(numel: int, block_size: int, chunk_rows: int) -> Iterator[tuple[int, int, int]]:
    """(first block, rows, row width) spans: chunks of full blocks, then the partial tail."""
    full = numel // block_size
    for r0 in range(0, full, chunk_rows):
        yield r0, min(chunk_rows, full - r0), block_size
    tail = numel - full * block_size
    if tail:
        yield full, 1, tail


def _chunk_rows(device: torch.device, numel: int, block_size: int) -> int:
    if device.type == "cpu":
        return max(1, _CPU_CHUNK_ELEMS // block_size)
    return max(1, numel // block_size)  # one launch per op: GPUs want big kernels


def _rows(t: torch.Tensor, first_block: int, rows: int, width: int, block_size: int):
    start = first_block * block_size
    return t[start: start + rows * width].view(rows, width)


# ----------------------------------------------------------------- quantize


def _scale_and_divisor(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scale (see docstring) and the divisor that is safe for all-zero blocks."""
    amax = torch.where(torch.isnan(amax), math.inf, amax)  # poisoned: scale = +Inf
    scale = torch.div(amax, float(QMAX)).clamp_min_(_MIN_SCALE)
    zero = amax == 0
    return torch.where(zero, 0.0, scale), torch.where(zero, 1.0, scale)


def _quantize_rows(x2d: torch.Tensor, q2d: torch.Tensor, scale: torch.Tensor,
                   tmp: torch.Tensor) -> None:
    y = tmp[: x2d.numel()].view(x2d.shape)
    src = x2d
    if x2d.dtype != torch.float32:
        y.copy_(x2d)  # exact widening; the rest works in fp32 like the kernel
        src = y
    # amax and amin are two fast reductions; abs().amax() would allocate a copy.
    amax = torch.maximum(src.amax(dim=1), src.amin(dim=1).neg_())
    s, divisor = _scale_and_divisor(amax)
    scale.copy_(s)
    torch.div(src, divisor.unsqueeze(1), out=y)
    torch.round(y, out=y)  # ties to even
    q2d.copy_(y)           # exact: y is an integer in [-127, 127]


def quantize(x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, *,
             out_q: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
             check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize 1-D ``x`` to (q int8 [numel], scale fp32 [num_blocks]).

    ``out_q`` / ``out_scale`` receive the result when given (and are returned).
    Non-finite input raises QuantError, or with ``check_finite=False`` yields
    poisoned blocks (scale +Inf, q 0); see the module docstring.
    """
    block_size, q, scale = prepare_quantize(x, block_size, out_q, out_scale)
    numel = x.numel()
    if numel == 0:
        return q, scale
    chunk_rows = _chunk_rows(x.device, numel, block_size)
    tmp = torch.empty(min(numel, chunk_rows * block_size), dtype=torch.float32, device=x.device)
    for first, rows, width in _row_spans(numel, block_size, chunk_rows):
        _quantize_rows(_rows(x, first, rows, width, block_size),
                       _rows(q, first, rows, width, block_size),
                       scale[first: first + rows], tmp)
    finish_nonfinite(x, q, scale, block_size, check_finite)
    return q, scale


# ----------------------------------------------------------------- dequantize


def _dequantize_rows(q2d: torch.Tensor, scale: torch.Tensor, out2d: torch.Tensor,
                     tmp: torch.Tensor) -> None:
    # fp32 product first, one rounding to the output dtype last: the kernel does the same.
    y = out2d if out2d.dtype == torch.float32 else tmp[: q2d.numel()].view(q2d.shape)
    y.copy_(q2d)
    y.mul_(scale.unsqueeze(1))
    if y is not out2d:
        out2d.copy_(y)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE,
               *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x' = q * scale[block] as ``dtype`` (default: ``out.dtype`` if given, else fp32)."""
    block_size, out = prepare_dequantize(q, scale, block_size, dtype, out)
    numel = q.numel()
    if numel == 0:
        return out
    chunk_rows = _chunk_rows(q.device, numel, block_size)
    tmp = None
    if out.dtype != torch.float32:
        tmp = torch.empty(min(numel, chunk_rows * block_size), dtype=torch.float32,
                          device=q.device)
    for first, rows, width in _row_spans(numel, block_size, chunk_rows):
        _dequantize_rows(_rows(q, first, rows, width, block_size),
                         scale[first: first + rows],
                         _rows(out, first, rows, width, block_size), tmp)
    return out
