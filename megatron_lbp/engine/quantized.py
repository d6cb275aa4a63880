"""Collectives whose payload is blockwise int8 (or int4) + fp32 scales (megatron_lbp.quant).

:func:`gather_packed_slices`, :func:`all_gather_quantized` (qwZ),
:func:`reduce_scatter_quantized` (qgZ) and :func:`reduce_scatter_hierarchical`
(ZeRO++'s two-hop qgZ); none knows about hooks or buckets. Each returns a
:class:`Pending` whose ``wait()`` lands the result.
Invariants: only bytes that cross a link are quantized (a rank's own chunk stays
exact); the ledger charges the quantized bytes actually sent; non-finite input
does not raise here but travels as a poisoned block that dequantizes to NaN.
See docs/int8.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_lbp.engine.comm import Collectives, Pending
from megatron_lbp.engine.dist_api import nbytes as _nbytes
from megatron_lbp.engine.memory import TransientLedger
from megatron_lbp.engine.trace import link_after
from megatron_lbp.quant import dequantize_auto, packed_views, quantize_auto, quantized_nbytes
from megatron_lbp.quant.int4 import dequantize_int4_from, int4_nbytes, quantize_int4_into

__all__ = ["Pending", "Codec", "INT8", "INT4", "quantize_into", "dequantize_from",
           "gather_packed_slices", "all_gather_quantized", "reduce_scatter_quantized",
           "reduce_scatter_hierarchical"]


def quantize_into(x: torch.Tensor, packed: torch.Tensor, block_size: int) -> None:
    """Quantize 1-D ``x`` into the packed uint8 buffer ``packed`` (quantized_nbytes bytes)."""
    q, scale = packed_views(packed, x.numel(), block_size)
    quantize_auto(x, block_size, out_q=q, out_scale=scale, check_finite=False)


def dequantize_from(packed: torch.Tensor, out: torch.Tensor, block_size: int) -> None:
    """Dequantize a packed buffer into ``out`` (1-D, any float dtype)."""
    q, scale = packed_views(packed, out.numel(), block_size)
    dequantize_auto(q, scale, block_size, out=out)


@dataclass(frozen=True)
class Codec:
    """A blockwise payload format: bytes of a slice, and how to write and read one."""

    bits: int

    def nbytes(self, numel: int, block_size: int) -> int:
        return quantized_nbytes(numel, block_size) if self.bits == 8 else \
            int4_nbytes(numel, block_size)

    def encode(self, x: torch.Tensor, buf: torch.Tensor, block_size: int) -> None:
        (quantize_into if self.bits == 8 else quantize_int4_into)(x, buf, block_size)

    def decode(self, buf: torch.Tensor, out: torch.Tensor, block_size: int) -> None:
        (dequantize_from if self.bits == 8 else dequantize_int4_from)(buf, out, block_size)


INT8 = Codec(8)
INT4 = Codec(4)


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
                             unit: int | None = None, stream=None, waits=(),
                             codec: Codec = INT8) -> Pending:
    """qgZ: ``out`` = sum over the group of every rank's chunk ``my_index`` of ``inp``.

    Chunk i of ``inp`` (``out.numel()`` elements) goes to group rank i as ``codec``
    codes + scales through one all-to-all; the receiver dequantizes and sums in fp32,
    its own chunk added unquantized, in group order, then casts to ``out``'s dtype.
    """
    n = comm.sizes[family]
    c = out.numel()
    assert inp.numel() == n * c, (inp.numel(), n, c)
    if n == 1:
        out.copy_(inp)
        return Pending()
    nb = codec.nbytes(c, block_size)
    send = torch.empty(n * nb, dtype=torch.uint8, device=inp.device)
    recv = torch.empty_like(send)
    transient.alloc(2 * _nbytes(send))

    def quantize() -> None:
        for i in range(n):
            if i != my_index:  # the own chunk's slot is sent to itself only and never read
                codec.encode(inp[i * c:(i + 1) * c], send[i * nb:(i + 1) * nb], block_size)

    def land(acc: torch.Tensor, part: torch.Tensor) -> None:
        acc.zero_()
        for i in range(n):
            if i == my_index:
                acc.add_(inp[my_index * c:(my_index + 1) * c])
            else:
                codec.decode(recv[i * nb:(i + 1) * nb], part, block_size)
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


def hierarchical_transient_bytes(c: int, S: int, X: int, block_size: int,
                                 codec: Codec = INT4) -> tuple[int, int]:
    """(bytes held from issue to landing, bytes added while landing) by
    :func:`reduce_scatter_hierarchical` for chunks of ``c`` elements, S-groups of S and X of
    them (the plan counts the same: core/costs.py)."""
    nb = codec.nbytes(c, block_size)
    return 2 * S * X * nb, 4 * X * c + 2 * 4 * c + 2 * X * nb


def reduce_scatter_hierarchical(comm: Collectives, out: torch.Tensor, inp: torch.Tensor,
                                s_index: int, x_index: int, block_size: int, phase: str,
                                transient: TransientLedger, async_op: bool = False,
                                unit: int | None = None, codec: Codec = INT4,
                                streams=None, waits=()) -> Pending:
    """ZeRO++'s qgZ over a gradient group of G = S*X ranks: ``out`` = the sum over the group
    of every rank's chunk j = S*x_index + s_index of ``inp`` (chunks in sorted group order).

    Hop 1, "secondary" (the S-group, inside a node): to member t go the X chunks
    {S*b + t}, quantized; each rank sums what it received for its own position with
    its own chunks (unquantized) in fp32. Hop 2, "grad_cross" (the X ranks at this
    S-group position): partial sum b, quantized, goes to member b; the receiver adds
    them to its own partial sum.

    ``streams``: (hop 1's stream, hop 2's stream), the reduce streams of the two
    communicators. Both hops are issued now: hop 1 and its partial sum on the first
    (after ``waits``), hop 2 and the final sum on the second after the partial sum's
    event; the buffers are held by those tasks and freed once the result is waited
    for. Without streams, hop 1 is issued now and hop 2 runs where the result is
    waited for (``Pending.wait()``), on the host.
    """
    S, X = comm.sizes["secondary"], comm.sizes["grad_cross"]
    c = out.numel()
    assert inp.numel() == S * X * c, (inp.numel(), S, X, c)
    nb = codec.nbytes(c, block_size)
    held, landing = hierarchical_transient_bytes(c, S, X, block_size, codec)
    send = torch.empty(S * X * nb, dtype=torch.uint8, device=inp.device)
    recv = torch.empty_like(send)
    transient.alloc(held)

    def chunk(j: int) -> torch.Tensor:
        return inp[j * c:(j + 1) * c]

    def quantize() -> None:
        for t in range(S):
            if t == s_index:
                continue   # the own position's chunks stay home
            for b in range(X):
                codec.encode(chunk(S * b + t), send[(t * X + b) * nb:(t * X + b + 1) * nb],
                             block_size)

    def landing_buffers():
        transient.alloc(landing)
        return (torch.empty(X * c, dtype=torch.float32, device=inp.device),   # partial
                torch.empty(c, dtype=torch.float32, device=inp.device),       # part
                torch.empty(c, dtype=torch.float32, device=inp.device),       # total
                torch.empty(X * nb, dtype=torch.uint8, device=inp.device))    # send2

    def partial_sum(partial: torch.Tensor, part: torch.Tensor, send2: torch.Tensor) -> None:
        partial.zero_()
        for t in range(S):     # in S-group order, every rank sums alike
            for b in range(X):
                dst = partial[b * c:(b + 1) * c]
                if t == s_index:
                    dst.add_(chunk(S * b + t))
                else:
                    codec.decode(recv[(t * X + b) * nb:(t * X + b + 1) * nb], part, block_size)
                    dst.add_(part)
        for b in range(X):
            if b != x_index:
                codec.encode(partial[b * c:(b + 1) * c], send2[b * nb:(b + 1) * nb], block_size)

    def land(partial, part, total, recv2) -> None:
        total.zero_()
        for b in range(X):
            if b == x_index:
                total.add_(partial[b * c:(b + 1) * c])
            else:
                codec.decode(recv2[b * nb:(b + 1) * nb], part, block_size)
                total.add_(part)
        out.copy_(total)

    if streams is not None:
        first, second = streams
        partial, part, total, send2 = landing_buffers()
        recv2 = torch.empty_like(send2)
        first.submit(quantize, waits, holds=(inp, send), what=f"{phase} quantize (hop 1)")
        first_work = comm.all_to_all(recv, send, "secondary", phase, unit=unit, stream=first)
        summed = first.submit(lambda: partial_sum(partial, part, send2),
                              holds=(inp, recv, partial, part, send2),
                              what=f"{phase} partial sum (hop 1)")
        work = comm.all_to_all(recv2, send2, "grad_cross", phase, unit=unit, stream=second,
                               waits=(summed,))
        link_after(getattr(work, "record", None), getattr(first_work, "record", None))
        landed = second.submit(lambda: land(partial, part, total, recv2),
                               holds=(partial, part, total, recv2, out),
                               what=f"{phase} sum (hop 2)")
        return Pending(work, lambda: transient.free(held + landing), event=landed)

    assert not waits, "without streams there is no producer to wait for"
    quantize()
    work = comm.all_to_all(recv, send, "secondary", phase, async_op=async_op, unit=unit)

    def finish() -> None:
        partial, part, total, send2 = landing_buffers()
        recv2 = torch.empty_like(send2)
        partial_sum(partial, part, send2)
        second = comm.all_to_all(recv2, send2, "grad_cross", phase, unit=unit)
        if second is not None:
            second.wait()
        land(partial, part, total, recv2)
        transient.free(held + landing)

    pending = Pending(work, finish)
    if not async_op:
        pending.wait()
    return pending
