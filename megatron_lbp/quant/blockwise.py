"""Blockwise symmetric int8 quantization: the torch reference implementation.

A 1-D tensor of ``numel`` elements is cut into ``num_blocks = ceil(numel / B)``
consecutive blocks of ``B = block_size`` elements (the last one may be partial).
Each block gets one fp32 scale and ``B`` int8 codes::

    amax  = max |x_i| over the block                (computed in fp32; exact)
    scale = amax / 127                              (fp32, IEEE round-to-nearest)
            raised to 2**-126 (the smallest normal fp32) when amax > 0 is tiny,
            and exactly 0 for an all-zero block
    q_i   = round_half_to_even(x_i / scale)         (IEEE fp32 division; 0 if scale == 0)
    x'_i  = q_i * scale                             (dequantize: one fp32 product,
                                                     then one rounding to the output dtype)

Rounding is ties-to-even (``torch.round``, IEEE ``roundeven``), so 0.5 -> 0,
1.5 -> 2, -2.5 -> -2. The codes never leave [-127, 127] (-128 is unused, which
keeps the grid symmetric): with a normal scale, |x/scale| <= 127 * (1 + 2**-23)
< 127.5, and the 2**-126 floor keeps the scale normal, so no clamp is needed.
The floor only matters for blocks whose amax < 127 * 2**-126 ~ 1.5e-36.

Error bound, per element: |x - x'| <= scale * (1/2 + 2**-18) + ulp(x')/2, i.e.
half a quantization step plus fp32 rounding: the quotient x/scale is rounded
once before the integer rounding (half an fp32 ulp of a number below 128, at
most 2**-18 of a step), and the product q*scale once (in the output dtype).

Non-finite input (the contract)
-------------------------------
A block holding any NaN or +-Inf is *poisoned*: its scale is +Inf and its codes
are 0, so every element of that block dequantizes to NaN (0 * Inf) -- the
damage stays visible instead of turning into plausible numbers. By default
(``check_finite=True``) :func:`quantize` then raises :class:`QuantError` naming
the count and the first index of the non-finite values. The check reads only
the ``num_blocks`` scales (1/B of the data), but on a GPU it is a host sync;
an engine that wants no sync passes ``check_finite=False`` and relies on the
poison (or calls :func:`find_nonfinite` / ``torch.isinf(scale).any()`` at its
own sync point). Weights are expected finite, so the default raises.

Shapes and preallocated outputs
-------------------------------
Inputs are 1-D contiguous fp32/bf16/fp16 tensors on any device. ``out_q``
(int8, ``numel``), ``out_scale`` (fp32, ``num_blocks``) and ``out`` for
dequantize may be views into bigger buffers (e.g. a rank's 1/S slice of a
persistent secondary buffer); they must be 1-D and contiguous.
:func:`packed_views` splits one uint8 buffer of :func:`quantized_nbytes` bytes
into ``(q, scale)`` views, scales first so they stay 4-byte aligned.

Blocks are independent, so quantizing S slices separately and concatenating the
results equals quantizing the whole bucket at once exactly when every slice
length is a multiple of the block size; otherwise dequantize slice by slice.

Speed
-----
No Python loop over blocks: full blocks are viewed as a [rows, B] matrix (the
partial tail is one extra 1-row matrix) and every step is one torch op over
it. On CPU the work runs in chunks of ``_CPU_CHUNK_ELEMS`` = 2**20 elements
(a 4 MiB fp32 temporary, reused): fp32 quantize of 16M elements measured
7.4 GB/s that way, 2.6 GB/s with 2**16-element chunks (per-op overhead) and
1.0 GB/s in one pass (a fresh 64 MiB temporary page-faults and misses cache).
Other devices take a single chunk.

Choosing DEFAULT_BLOCK_SIZE (measurement)
-----------------------------------------
Reproduce with::

    python -m megatron_lbp.quant.bench --threads 1 --repeats 15

(16M elements; add ``--json`` for the raw figures.) On the project's 2-core
AMD EPYC VM, torch 2.13 CPU, one thread (two threads are faster on an idle
machine but wildly noisy on a shared one), median of 15, in the same run
memcpy (``dst.copy_(src)``) = 11.8 GB/s for fp32 and 11.3 GB/s for bf16.
GB/s of the full-precision side (numel * itemsize), ratio to that memcpy in
parentheses; two more runs under heavy load from other jobs agreed within ~15 %:

=====  ============  ============  ============  ===========  =========  ==========  ========
B      quantize      dequantize    quantize      dequantize   rel err    rel err     scale
       fp32          -> fp32       bf16          -> bf16      fp32 out   bf16 out    overhead
=====  ============  ============  ============  ===========  =========  ==========  ========
64     5.29 (0.45)   12.69 (1.08)  2.35 (0.21)   7.90 (0.70)  0.631 %    0.617 %     6.25 %
128    6.02 (0.51)   12.94 (1.10)  2.72 (0.24)   7.80 (0.69)  0.693 %    0.683 %     3.13 %
256    6.08 (0.52)   13.47 (1.15)  3.36 (0.30)   7.83 (0.70)  0.749 %    0.743 %     1.56 %
512    6.03 (0.51)   14.10 (1.20)  3.51 (0.31)   7.94 (0.71)  0.803 %    0.797 %     0.78 %
1024   6.15 (0.52)   13.59 (1.16)  3.61 (0.32)   7.92 (0.70)  0.852 %    0.845 %     0.39 %
2048   6.09 (0.52)   14.04 (1.19)  3.60 (0.32)   8.04 (0.71)  0.897 %    0.887 %     0.20 %
=====  ============  ============  ============  ===========  =========  ==========  ========

rel err = mean|x - x'| / mean|x| for a weight-like x = bf16(N(0, 1) * 0.02)
(4M elements, seed 0); the worst element was 0.5000 of its step for every B.
Dequantize beats memcpy for fp32 because it reads 1 byte per element, not 4.
Scale overhead = 4/B bytes per element on top of the 1-byte code; the wire
and memory cost of the secondary copy is (1 + 4/B)/2 of bf16.

Why 256: from B = 256 up throughput is flat (within 7 % of B = 2048), while
below it per-block work costs 10-30 % (bf16 quantize 0.21x memcpy at B = 64
against 0.30x at 256). Error grows ~7-8 % per doubling of B (0.63 % at 64,
0.75 % at 256, 0.90 % at 2048), and the scale overhead halves each time: at
256 it is already under 2 %, so going larger saves less than 0.8 % of the
bytes for 7-20 % more error. 256 is also what the plan tool's cost model
(``costs.DEFAULT_QUANT_BLOCK``) assumes, and one block is a small Triton
program (2 warps or wavefronts, 2-4 elements per lane). GPU throughput is not
measured yet: the bench times the Triton kernels when it finds a GPU.
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
