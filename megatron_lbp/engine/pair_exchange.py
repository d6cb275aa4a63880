"""A two-rank group's collectives on gloo as one exchange, each rank's receive posted first.

Gloo carries both directions of a rank pair on one TCP connection, and its all-gather,
all-to-all and all-reduce post their send before their receive. The receive's ready notice
then waits behind the whole outgoing message, the peer sends only once that message has
arrived, and the two directions take turns, each at half the link's rate on average
(tests/bench/test_survey_network.py times both on a shaped link). NCCL and RCCL run both
directions at once, and so does this exchange; it sends the bytes gloo's ring sends
(half of the whole for two ranks). Groups of three or more keep gloo's own collectives:
there each connection of a ring carries data one way only.

Results are gloo's bit for bit: a sum of two operands does not depend on their order, nor does
the max or min of two finite values.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

# The reductions an exchange can finish locally; any other op keeps gloo's all-reduce.
_LOCAL_REDUCE: dict[Any, Callable[[torch.Tensor, torch.Tensor], None]] = {
    dist.ReduceOp.SUM: lambda mine, theirs: mine.add_(theirs),
    dist.ReduceOp.MAX: lambda mine, theirs: torch.maximum(mine, theirs, out=mine),
    dist.ReduceOp.MIN: lambda mine, theirs: torch.minimum(mine, theirs, out=mine),
}


def takes(backend: str, group_size: int) -> bool:
    """Whether a ``group_size``-rank group on ``backend`` runs its collectives as an exchange."""
    return backend == "gloo" and group_size == 2


def reduces_locally(op) -> bool:
    """Whether an all-reduce with ``op`` can run as an exchange."""
    return op in _LOCAL_REDUCE


def _me_and_peer(group: Any) -> tuple[int, int]:
    """(this rank's index in the group, the other member's global rank)."""
    ranks = dist.get_process_group_ranks(group) if group is not None \
        else list(range(dist.get_world_size()))
    if len(ranks) != 2:
        raise ValueError(f"an exchange needs a group of 2 ranks, not {len(ranks)}: {ranks}")
    me = ranks.index(dist.get_rank())
    return me, ranks[1 - me]


def _halves(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous() or t.numel() % 2:
        raise ValueError(f"an exchange splits a contiguous tensor of an even size into two "
                         f"halves, not shape {tuple(t.shape)} (contiguous: {t.is_contiguous()})")
    return t.view(2, -1)


def _exchange(received: torch.Tensor, sent: torch.Tensor, group: Any, peer: int,
              finish: Callable[[], None] | None, async_op: bool):
    """``sent`` to the peer, ``received`` from it, the receive posted first."""
    # Looked up per call: whatever wraps torch.distributed (the benchmarks' byte counters
    # and link replay) sees the exchange.
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, peer, group=group),
                                    dist.P2POp(dist.isend, sent, peer, group=group)])
    work = _ExchangeWork(works, finish)
    if async_op:
        return work
    work.wait()
    return None


def all_gather(out: torch.Tensor, inp: torch.Tensor, *, group: Any, async_op: bool):
    """``out`` = both ranks' ``inp`` in group-rank order (``inp`` may be this rank's half)."""
    me, peer = _me_and_peer(group)
    halves = _halves(out)
    if inp.data_ptr() != halves[me].data_ptr():
        halves[me].copy_(inp.view(-1))
    return _exchange(halves[1 - me], halves[me], group, peer, None, async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, *, group: Any, async_op: bool):
    """Half i of ``inp`` goes to group rank i; half j of ``out`` came from group rank j."""
    me, peer = _me_and_peer(group)
    o, i = _halves(out), _halves(inp)
    o[me].copy_(i[me])
    return _exchange(o[1 - me], i[1 - me], group, peer, None, async_op)


def all_reduce(t: torch.Tensor, *, op=dist.ReduceOp.SUM, group: Any, async_op: bool):
    """``t`` = ``op`` of both ranks' ``t`` (SUM, MAX or MIN: :func:`reduces_locally`)."""
    if not reduces_locally(op):
        raise ValueError(f"an exchange reduces with SUM, MAX or MIN, not {op}")
    _, peer = _me_and_peer(group)
    theirs = torch.empty_like(t)
    reduce = _LOCAL_REDUCE[op]
    return _exchange(theirs, t, group, peer, lambda: reduce(t, theirs), async_op)


class _ExchangeWork:
    """An exchange in flight: ``wait()`` waits for both directions, then finishes it (the
    local reduction) once."""

    __slots__ = ("_works", "_finish")

    def __init__(self, works: list, finish: Callable[[], None] | None) -> None:
        self._works, self._finish = works, finish

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)
