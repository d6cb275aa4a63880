"""Collectives that must run one after another, per unit, without holding up the host.

The optimizer step moves each unit's data through two hops: the gradient from
its 1/G shard to the 1/O optimizer slice (``inter`` reduce-scatter, then the
``replica`` all-reduce when R > 1), and the updated weights back up (``inter``
all-gather 1/O -> 1/G, then ``grad_to_param`` all-gather 1/G -> 1/P). Each hop
reads what the one before it wrote, so the second can only be issued once the
first is done. A :class:`Chain` holds one unit's hops (its *stages*); a
:class:`ChainQueue` holds the chains of one kind in the order they were
started.

Stage k of a chain is issued only after stage k of every chain before it in
the queue: every rank then issues each communicator's collectives in the same
order, whenever it happens to notice that a stage is done (the one rule
torch.distributed has). :meth:`ChainQueue.poll` advances every chain as far as
it can without blocking (a stage whose collective has completed is waited for,
which returns at once, and the next is issued); the schedule calls it at each
of its hooks. :meth:`ChainQueue.complete` blocks until a chain and every chain
before it are done: where the data is needed (a unit's first use in the next
forward, the optimizer step, a checkpoint).

With gloo ``wait()`` blocks the host, so issuing stage 2 right after stage 1
would hold the host for stage 1; polling lets compute run meanwhile. With
NCCL/RCCL ``wait()`` only orders streams, but waiting for stage 1 before
issuing stage 2 would put the compute stream behind the network collective;
polling ``is_completed()`` keeps the compute stream free until the data is
used. The same code serves both.

A chain is never abandoned half way: a peer may already have issued a later
stage (it noticed the earlier one done first), and would wait for this rank
to issue it too.

The comm report (megatron_lbp.engine.comm.CommLedger) charges every stage of a
chain to the step that started it: :meth:`ChainQueue.start` charges the later
stages' bytes at once (``stage(False, issue=False)``) and issues them later
with ``charge=False``. The updated weights' second hop, issued under the next
step's forward, so counts in the step that wrote the weights, and every step's
report, the first and the last included, holds the same bytes. The schedule
trace still records each collective when it really is issued.
"""
from __future__ import annotations

from typing import Callable, Sequence

from megatron_lbp.engine.comm import Pending
from megatron_lbp.engine.trace import link_after, need, record_of

# Issues one collective: ``stage(async_op)``. A later stage of a chain is a plain
# all-gather or all-reduce and also takes their keywords ``charge`` and ``issue``
# (megatron_lbp.engine.comm.Collectives).
Stage = Callable[..., Pending]


class Chain:
    """One unit's stages; ``on_done`` runs once the last one has landed."""

    def __init__(self, unit: int, stages: Sequence[Stage],
                 on_done: Callable[[], None] | None = None) -> None:
        self.unit = unit
        self._stages = list(stages)
        self._on_done = on_done
        self.issued = 0               # stages issued so far
        self.async_op = True
        self._pending: Pending | None = None
        self.done = False
        self.records: list = []     # the schedule trace's record of each stage issued
        self._landed = None         # ... of the stage that landed last

    def _land(self, block: bool) -> bool:
        """Take the stage in flight if it is done (or, with ``block``, once it is)."""
        if self._pending is None:
            return True
        if not block and not self._pending.is_complete():
            return False
        pending, self._pending = self._pending, None
        self._landed = record_of(pending)
        pending.wait()
        return True

    def _charge_later_stages(self) -> None:
        for stage in self._stages[1:]:
            stage(False, issue=False)

    def _issue_next(self) -> None:
        stage = self._stages[self.issued]
        # The first stage charges as it issues (at the start); the later ones were charged then.
        self._pending = stage(self.async_op) if self.issued == 0 else \
            stage(self.async_op, charge=False)
        record = record_of(self._pending)
        if self.issued:
            link_after(record, self._landed)
        if record is not None:
            self.records.append(record)
        self.issued += 1

    def note_need(self) -> None:
        """The engine requires this chain's data now (for the schedule trace)."""
        for record in self.records:
            need(record)

    def _finish_if_last(self) -> None:
        if self._pending is None and self.issued == len(self._stages) and not self.done:
            self.done = True
            if self._on_done is not None:
                self._on_done()


class ChainQueue:
    """Chains of one kind in start order; see the module docstring for the ordering rule.

    Every chain of a queue has the same stages (the units share one group layout).
    """

    def __init__(self) -> None:
        self._chains: list[Chain] = []

    def __bool__(self) -> bool:
        return bool(self._chains)

    def __len__(self) -> int:
        return len(self._chains)

    def start(self, chain: Chain, async_op: bool = True) -> Chain:
        """Issue the chain's first stage (all of them, one after another, without ``async_op``).

        Nothing else is issued here: the later stages are issued by the next
        :meth:`poll` or :meth:`complete`; their bytes are charged now (the
        module docstring).
        """
        self._chains.append(chain)
        chain.async_op = async_op
        chain._charge_later_stages()
        if not async_op:
            self.complete(chain)
        elif chain._stages:
            chain._issue_next()
        else:
            chain._finish_if_last()
            self._drop_done()
        return chain

    def poll(self) -> None:
        """Advance every chain as far as it goes without blocking, in queue order."""
        before: Chain | None = None
        for chain in self._chains:
            while not chain.done and chain._land(block=False):
                if chain.issued == len(chain._stages):
                    chain._finish_if_last()
                    break
                if before is not None and not before.done and before.issued <= chain.issued:
                    break   # the chain before has not issued this stage yet
                chain._issue_next()
            before = chain
        self._drop_done()

    def complete(self, chain: Chain | None = None) -> None:
        """Block until ``chain`` and every chain before it are done (None: all of them)."""
        if chain is not None and chain.done:
            chain.note_need()
            return
        upto = self._chains.index(chain) + 1 if chain is not None else len(self._chains)
        for c in self._chains[:upto]:
            c.note_need()
        for c in self._chains[:upto]:
            while not c.done:
                c._land(block=True)
                if c.issued == len(c._stages):
                    c._finish_if_last()
                else:
                    c._issue_next()
        self._drop_done()

    def _drop_done(self) -> None:
        while self._chains and self._chains[0].done:
            self._chains.pop(0)
