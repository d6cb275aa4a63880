"""Blockwise symmetric int4, two codes per byte: the payload of ZeRO++'s qgZ gradient exchange.

Same block rule as :mod:`.blockwise` (one fp32 scale per ``block_size``
consecutive elements, the last block possibly partial), with 4-bit codes::

    scale = amax / 7                      (fp32; exactly 0 for an all-zero block,
                                           raised to 2**-126 when amax > 0 is tiny)
    q_i   = round_half_to_even(x_i / scale)   in [-7, 7] (-8 unused: symmetric grid)
    x'_i  = q_i * scale

Packing: element 2i goes to the low nibble of byte i, element 2i+1 to the high
nibble, each stored as ``q + 8`` (0..15); an odd count leaves the last high
nibble 8 (code 0). A buffer of ``int4_nbytes(numel, B)`` bytes holds the
scales first (4-byte aligned), then ``ceil(numel/2)`` packed bytes, like
``quant.packed_views`` does for int8.

Error bound per element: half a step, |x - x'| <= scale/2 (+ fp32 rounding),
i.e. amax/14 of its block. A block holding NaN/Inf gets an infinite scale and
dequantizes to NaN (the poison contract of :mod:`.blockwise`), never raises:
the engine calls this inside collectives, where raising on one rank would hang
the others.

DeepSpeed's qgZ (``all_to_all_quant_reduce``) uses the same symmetric int4
grid with its own group sizes; this module is written from that description,
not from its code.
"""
from __future__ import annotations

import torch

__all__ = ["QMAX4", "int4_nbytes", "int4_views", "quantize_int4_into", "dequantize_int4_from",
           "pack_int4", "unpack_int4"]

QMAX4 = 7
_TINY = 2.0 ** -126


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def int4_nbytes(numel: int, block_size: int) -> int:
    """Bytes of ``numel`` elements as blockwise int4: half a byte each plus a fp32 scale per block."""
    return 4 * _blocks(numel, block_size) + (numel + 1) // 2


def int4_views(buf: torch.Tensor, numel: int, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8, scales fp32) views of a uint8 buffer of int4_nbytes bytes."""
    nb = _blocks(numel, block_size)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != int4_nbytes(numel, block_size):
        raise ValueError(f"int4 buffer must be 1-D uint8 of {int4_nbytes(numel, block_size)} "
                         f"bytes for {numel} elements, got {buf.dtype} {tuple(buf.shape)}")
    scale = buf[:4 * nb].view(torch.float32)
    return buf[4 * nb:], scale


def pack_int4(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Codes in [-8, 7] (any integer dtype, 1-D) -> ceil(n/2) bytes, low nibble first."""
    n = q.numel()
    biased = (q.to(torch.int16) + 8).to(torch.uint8)
    if n % 2:
        biased = torch.cat([biased, biased.new_full((1,), 8)])
    pairs = biased.view(-1, 2)
    packed = pairs[:, 0] | (pairs[:, 1] << 4)
    if out is None:
        return packed
    out.copy_(packed)
    return out


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``numel`` int8 codes."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=1).reshape(-1)[:numel]


def _padded_rows(x: torch.Tensor, block_size: int) -> torch.Tensor:
    n = x.numel()
    rows = _blocks(n, block_size)
    if rows * block_size != n:
        x = torch.cat([x, x.new_zeros(rows * block_size - n)])
    return x.view(rows, block_size)


def quantize_int4_into(x: torch.Tensor, buf: torch.Tensor, block_size: int) -> None:
    """Quantize 1-D float ``x`` into the uint8 buffer ``buf`` (int4_nbytes bytes)."""
    n = x.numel()
    packed, scale = int4_views(buf, n, block_size)
    rows = _padded_rows(x.detach().float(), block_size)
    amax = rows.abs().amax(dim=1)
    s = torch.where(amax > 0, torch.clamp(amax / QMAX4, min=_TINY), torch.zeros_like(amax))
    finite = torch.isfinite(rows).all(dim=1)
    s = torch.where(finite, s, torch.full_like(s, float("inf")))
    safe = torch.where((s > 0) & torch.isfinite(s), s, torch.ones_like(s))
    q = torch.round(rows / safe[:, None])
    q = torch.where(((s > 0) & torch.isfinite(s))[:, None], q, torch.zeros_like(q))
    scale.copy_(s)
    pack_int4(q.reshape(-1)[:n].to(torch.int8), out=packed)


def dequantize_int4_from(buf: torch.Tensor, out: torch.Tensor, block_size: int) -> None:
    """Dequantize the int4 buffer ``buf`` into 1-D float ``out`` (its numel elements)."""
    n = out.numel()
    packed, scale = int4_views(buf, n, block_size)
    q = unpack_int4(packed, n).float()
    rows = _padded_rows(q, block_size)
    out.copy_((rows * scale[:, None]).reshape(-1)[:n])
