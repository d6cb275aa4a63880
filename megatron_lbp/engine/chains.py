"""Collectives that must run one after another, per unit, without holding up the host.

A :class:`Chain` holds one unit's optimizer-step hops (reduction 1/G -> 1/O
[-> replica all-reduce], or refresh 1/O -> 1/G -> 1/P); a :class:`ChainQueue`
holds the chains of one kind in start order. :meth:`ChainQueue.start` issues
every stage at once, each on its communicator's stream and waiting for the
stage before's event; :meth:`ChainQueue.complete` waits where the data is needed.
Invariants: every rank starts a queue's chains in one order, so every
communicator's collectives are issued in one order; each stage is charged in
the step that started its chain.
"""
from __future__ import annotations

from typing import Callable, Sequence

from megatron_lbp.engine.comm import Pending
from megatron_lbp.engine.trace import link_after, record_of

# Issues one collective: ``stage(waits, async_op)``, on its stream after the events ``waits``,
# or without ``async_op`` synchronously on the host (--no-hier-overlap).
Stage = Callable[[tuple, bool], Pending]


class Chain:
    """One unit's stages; ``on_done`` runs once the last one has been waited for."""

    def __init__(self, unit: int, stages: Sequence[Stage],
                 on_done: Callable[[], None] | None = None, after=None,
                 waits: tuple = ()) -> None:
        self.unit = unit
        self.after = after    # the trace record of what the first stage follows, if any
        self.waits = waits    # the events the first stage waits for (its producer's)
        self._stages = list(stages)
        self._on_done = on_done
        self._pending: list[Pending] = []
        self.done = False

    def issue(self, async_op: bool = True) -> None:
        """Every stage, each on its stream after the one before (the host does not wait);
        without ``async_op`` each one synchronously, in order."""
        before: Pending | None = None
        for stage in self._stages:
            waits = self.waits if before is None else \
                (before.event,) if before.event is not None else ()
            pending = stage(waits, async_op)
            link_after(record_of(pending), record_of(before) if before is not None else self.after)
            self._pending.append(pending)
            before = pending

    def wait(self) -> None:
        """Until the last stage's data has landed (the stages' own waits free their buffers)."""
        for pending in self._pending:
            pending.wait()
        self._pending = []
        if not self.done:
            self.done = True
            if self._on_done is not None:
                self._on_done()


class ChainQueue:
    """Chains of one kind in start order."""

    def __init__(self) -> None:
        self._chains: list[Chain] = []

    def __bool__(self) -> bool:
        return bool(self._chains)

    def __len__(self) -> int:
        return len(self._chains)

    def start(self, chain: Chain, async_op: bool = True) -> Chain:
        """Issue the chain's stages (and, without ``async_op``, wait for them)."""
        self._chains.append(chain)
        chain.issue(async_op)
        if not async_op:
            self.complete(chain)
        return chain

    def complete(self, chain: Chain | None = None) -> None:
        """Wait until ``chain`` and every chain before it are done (None: all of them)."""
        if chain is not None and chain.done:
            return
        upto = self._chains.index(chain) + 1 if chain is not None else len(self._chains)
        for c in self._chains[:upto]:
            c.wait()
        del self._chains[:upto]
