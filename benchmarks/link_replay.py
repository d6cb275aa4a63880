"""A training step's collectives, recorded once and issued again alone: the step's link time.

``with recording() as calls:`` around one training step records every
torch.distributed collective the step issues (the functions
benchmarks.stock_accounting wraps, so the engine's, megatron-core
DDP's and Megatron-FSDP's alike): its function, its group and the shapes and
dtypes of its tensors. ``Replay(calls)()`` then issues the same collectives
again on the same groups, one after another and each waited for before the
next (one communicator's in their order, communicators one after another:
:func:`_communicator_key`), with no compute between them: the time that
takes (barrier to barrier, the slowest rank) is the link time of the step's
collectives timed alone. Buffers are allocated once per (shape, dtype,
argument position) and reused, so replaying allocates nothing.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from benchmarks.stock_accounting import patched_collectives


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class P2PSpec:
    """A point-to-point op of ``batch_isend_irecv`` (the engine's two-rank exchange), its
    tensor as a shape."""
    op: str          # "isend" or "irecv"
    tensor: TensorSpec
    peer: int | None
    group: Any
    tag: int


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict[str, Any]


def _spec(value: Any) -> Any:
    import torch.distributed as dist

    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), value.dtype)
    if isinstance(value, dist.P2POp):
        return P2PSpec(value.op.__name__, _spec(value.tensor), value.peer, value.group,
                       value.tag)
    if isinstance(value, (list, tuple)):
        return type(value)(_spec(v) for v in value)
    if isinstance(value, dict):
        return {k: _spec(v) for k, v in value.items()}
    return value


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
    """Record the collectives issued in the block (each is still issued as usual)."""
    calls: list[Call] = []

    def make_wrappers(orig):
        def wrap(name):
            @functools.wraps(orig[name])
            def f(*args, **kwargs):
                # Shapes only: a live buffer must never be written by the replay.
                calls.append(Call(name, _spec(args), _spec(kwargs)))
                return orig[name](*args, **kwargs)
            return f
        return {name: wrap(name) for name in orig}

    with patched_collectives(make_wrappers):
        yield calls


def _communicator_key(call: Call) -> str:
    """The name of the communicator ``call`` ran on, the same on every rank.

    Every rank issues one communicator's collectives in the same order, but not
    always interleaved with another communicator's in the same order: the
    engine issues a chain's next stage when it notices the last one done
    (megatron_lbp.engine.chains), and each rank notices at its own time. Issued
    again one after another, each waited for, such calls would deadlock. The
    replay therefore runs one communicator's calls (in their order) after
    another's, communicators in one order on every rank: the members of the
    first unfinished communicator are always all at it, so the replay never
    waits on a peer that waits elsewhere. The sum of the calls' times, each
    waited for alone, does not depend on their order.
    """
    import torch.distributed as dist

    group = call.kwargs.get("group")
    if group is None:
        group = next((a for a in call.args if isinstance(a, dist.ProcessGroup)), None)
    if group is None:   # batch_isend_irecv: its ops' group
        group = next((op.group for a in call.args if isinstance(a, list)
                      for op in a if isinstance(op, P2PSpec)), None)
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    return group.group_name


class Replay:
    """Issue recorded calls again, synchronously, on buffers of the recorded shapes."""

    def __init__(self, calls: list[Call]) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._calls = []
        for call in sorted(calls, key=_communicator_key):
            counter = iter(range(10 ** 6))
            args = self._materialize(call.args, counter)
            kwargs = {k: self._materialize(v, counter) for k, v in call.kwargs.items()}
            self._calls.append((call.name, args, kwargs))
        self.count = len(self._calls)

    def _materialize(self, value: Any, counter) -> Any:
        if isinstance(value, P2PSpec):
            import torch.distributed as dist

            return dist.P2POp(getattr(dist, value.op), self._materialize(value.tensor, counter),
                              value.peer, group=value.group, tag=value.tag)
        if isinstance(value, TensorSpec):
            key = (value.shape, value.dtype, next(counter))
            if key not in self._buffers:
                self._buffers[key] = torch.zeros(value.shape, dtype=value.dtype)
            return self._buffers[key]
        if isinstance(value, (list, tuple)):
            return type(value)(self._materialize(v, counter) for v in value)
        if isinstance(value, torch.Tensor):
            raise TypeError("a recorded call holds a tensor, not its shape")
        return value

    def __call__(self) -> None:
        import torch.distributed as dist

        for name, args, kwargs in self._calls:
            # Looked up per call: whatever wraps torch.distributed then sees the replay too.
            work = getattr(dist, name)(*args, **kwargs)
            for w in work if isinstance(work, list) else [work]:   # batch_isend_irecv: a list
                if w is not None:
                    w.wait()
