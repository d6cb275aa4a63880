"""Collectives whose payload is blockwise int8 + fp32 scales (megatron_lbp.quant).

Three uses, one protocol each; none of them knows about hooks or buckets:

- :func:`gather_packed_slices`: every rank of an n-rank group contributes one
  packed slice (``quant.packed_views`` layout: scales, then codes) of ``numel``
  elements; the n slices are all-gathered and dequantized, in group order, into
  the destination (the secondary copy's backward gather);
- :func:`all_gather_quantized` (qwZ): quantize this rank's shard, then as above
  (the P-group weight gather);
- :func:`reduce_scatter_quantized` (qgZ): cut the input into n chunks, quantize
  each peer's chunk, exchange them with one all-to-all, then dequantize the n-1
  received chunks and add them to this rank's own chunk in fp32. The own chunk
  never leaves the rank, so it is used unquantized; only the bytes that cross a
  link are int8.

Each function issues exactly one collective through
:class:`~megatron_lbp.engine.comm.Collectives` (so the ledger charges the int8
bytes actually sent: ``(n-1) * quantized_nbytes(chunk)``) and returns a
:class:`Pending`. ``Pending.wait()`` waits for the collective and then lands the
result (dequantize / sum), so the same code serves synchronous calls and the
prefetch that overlaps with compute. Temporary buffers are registered with the
caller's transient ledger for as long as they live.

Non-finite input does not raise here (that would be a host sync on GPUs and,
worse, an error on one rank while its peers wait in the collective): a block
holding NaN/Inf travels as a poisoned block and dequantizes to NaN, so the loss
or the optimizer's inf check sees it.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from megatron_lbp.engine.comm import Collectives, Pending
from megatron_lbp.engine.dist_api import nbytes as _nbytes
from megatron_lbp.engine.memory import TransientLedger
from megatron_lbp.quant import dequantize_auto, packed_views, quantize_auto, quantized_nbytes

__all__ = ["Pending", "quantize_into", "dequantize_from", "gather_packed_slices",
           "all_gather_quantized", "reduce_scatter_quantized"]


def quantize_into(x: torch.Tensor, packed: torch.Tensor, block_size: int) -> None:
    """Quantize 1-D ``x`` into the packed uint8 buffer ``packed`` (quantized_nbytes bytes)."""
    q, scale = packed_views(packed, x.numel(), block_size)
    quantize_auto(x, block_size, out_q=q, out_scale=scale, check_finite=False)


def dequantize_from(packed: torch.Tensor, out: torch.Tensor, block_size: int) -> None:
    """Dequantize a packed buffer into ``out`` (1-D, any float dtype)."""
    q, scale = packed_views(packed, out.numel(), block_size)
    dequantize_auto(q, scale, block_size, out=out)


def gather_packed_slices(comm: Collectives, out: torch.Tensor, packed: torch.Tensor,
                         block_size: int, family: str, phase: str,
                         transient: TransientLedger, async_op: bool = False,
                         release: Callable[[], None] | None = None,
                         unit: int | None = None, stream=None) -> Pending:
    """All-gather each rank's packed slice of ``out.numel() / n`` elements and dequantize into ``out``.

    ``release`` runs after landing (e.g. to free the caller's send buffer); ``stream``: the
    gather runs there (the dequantization where it is waited for).
    """
    n = comm.sizes[family]
    numel = out.numel() // n
    nb = quantized_nbytes(numel, block_size)
    assert packed.numel() == nb and numel * n == out.numel(), (packed.numel(), nb, out.numel(), n)
    if n == 1:
        recv = packed
    else:
        recv = torch.empty(n * nb, dtype=torch.uint8, device=packed.device)
        transient.alloc(_nbytes(recv))
    work = comm.all_gather(recv, packed, family, phase, async_op=async_op,
                           unit=unit, stream=stream) if n > 1 else None

    def finish() -> None:
        for i in range(n):
            dequantize_from(recv[i * nb:(i + 1) * nb], out[i * numel:(i + 1) * numel], block_size)
        if n > 1:
            transient.free(_nbytes(recv))
        if release is not None:
            release()

    pending = Pending(work, finish)
    if not async_op:
        pending.wait()
    return pending


def all_gather_quantized(comm: Collectives, out: torch.Tensor, shard: torch.Tensor,
                         block_size: int, family: str, phase: str,
                         transient: TransientLedger, async_op: bool = False,
                         unit: int | None = None, stream=None) -> Pending:
    """qwZ: ``out`` = the group's shards, sent as int8 + scales and dequantized on arrival.

    Every rank, this one included, ends up with the dequantized values of every
    shard, so all ranks compute with identical weights.
    """
    nb = quantized_nbytes(shard.numel(), block_size)
    send = torch.empty(nb, dtype=torch.uint8, device=shard.device)
    transient.alloc(nb)
    quantize_into(shard, send, block_size)
    return gather_packed_slices(comm, out, send, block_size, family, phase, transient,
                                async_op=async_op, release=lambda: transient.free(nb),
                                unit=unit, stream=stream)


def reduce_scatter_quantized(comm: Collectives, out: torch.Tensor, inp: torch.Tensor,
                             my_index: int, block_size: int, family: str, phase: str,
                             transient: TransientLedger, async_op: bool = False,
                             unit: int | None = None, stream=None, waits=()) -> Pending:
    """qgZ: ``out`` = sum over the group of every rank's chunk ``my_index`` of ``inp``.

    Chunk i of ``inp`` (``out.numel()`` elements) goes to group rank i as int8 +
    scales through one all-to-all; the receiver dequantizes and sums in fp32, its
    own chunk added unquantized, in group order, then casts to ``out``'s dtype.
    """
    n = comm.sizes[family]
    c = out.numel()
    assert inp.numel() == n * c, (inp.numel(), n, c)
    if n == 1:
        out.copy_(inp)
        return Pending()
    nb = quantized_nbytes(c, block_size)
    send = torch.empty(n * nb, dtype=torch.uint8, device=inp.device)
    recv = torch.empty_like(send)
    transient.alloc(2 * _nbytes(send))

    def quantize() -> None:
        for i in range(n):
            if i != my_index:  # the own chunk's slot is sent to itself only and never read
                quantize_into(inp[i * c:(i + 1) * c], send[i * nb:(i + 1) * nb], block_size)

    def land(acc: torch.Tensor, part: torch.Tensor) -> None:
        acc.zero_()
        for i in range(n):
            if i == my_index:
                acc.add_(inp[my_index * c:(my_index + 1) * c])
            else:
                dequantize_from(recv[i * nb:(i + 1) * nb], part, block_size)
                acc.add_(part)
        out.copy_(acc)

    if stream is not None:
        # Every step on the stream, in order, after ``waits``: the input may be written
        # there; the sum's buffers exist (and are counted) from now until the host's wait.
        acc = torch.empty(c, dtype=torch.float32, device=inp.device)
        part = torch.empty(c, dtype=torch.float32, device=inp.device)
        transient.alloc(2 * _nbytes(acc))
        stream.submit(quantize, waits, holds=(inp, send), what=f"{phase} quantize")
        work = comm.all_to_all(recv, send, family, phase, unit=unit, stream=stream)
        landed = stream.submit(lambda: land(acc, part), holds=(inp, recv, out, acc, part),
                               what=f"{phase} sum")
        return Pending(work, lambda: transient.free(2 * _nbytes(acc) + 2 * _nbytes(send)),
                       event=landed)
    quantize()
    work = comm.all_to_all(recv, send, family, phase, async_op=async_op, unit=unit)

    def finish() -> None:
        acc = torch.empty(c, dtype=torch.float32, device=inp.device)
        part = torch.empty(c, dtype=torch.float32, device=inp.device)
        transient.alloc(2 * _nbytes(acc))
        land(acc, part)
        transient.free(2 * _nbytes(acc) + 2 * _nbytes(send))

    pending = Pending(work, finish)
    if not async_op:
        pending.wait()
    return pending
