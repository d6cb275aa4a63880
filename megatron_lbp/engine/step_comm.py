"""The optimizer step's communication: one owner for its chains, their queues and their order.

Each unit's **reduction** (1/G gradient shard -> 1/O slice, then the replica
all-reduce when R > 1) and **refresh** (updated weights 1/O -> 1/G -> 1/P).
The schedule says when a shard is final (:meth:`StepComm.shard_final`), the
optimizer takes the reduced gradients and sends the updated weights back, and a
unit's next gather waits for its refresh (:meth:`StepComm.await_refresh`).
Invariant: every rank starts each kind's chains at the same program points in
the same order, so every rank issues the same collectives in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from megatron_lbp.engine.chains import Chain, ChainQueue
from megatron_lbp.engine.comm import Pending
from megatron_lbp.engine.streams import check_free

if TYPE_CHECKING:
    from megatron_lbp.engine.unit import GatherUnit, UnitContext


@dataclass
class _UnitStep:
    """One unit's part of the step: its chains and the reduced gradient slice."""

    reduction: Chain | None = None        # the 1/G -> 1/O reduction, until its gradient is taken
    grad: torch.Tensor | None = None      # the 1/O slice it reduces into (fp32 once taken)
    grad_nbytes: int = 0                  # transient bytes ``grad`` holds
    refresh: Chain | None = None          # the updated weights' gathers, until waited for


class StepComm:
    def __init__(self, ctx: "UnitContext") -> None:
        self.ctx = ctx
        self.reductions = ChainQueue()
        self.refreshes = ChainQueue()
        self._units: dict[int, _UnitStep] = {}
        # The next forward's unit order (the schedule's, set by the wrapper once it has one).
        self.forward_order: Callable[[], Iterable["GatherUnit"]] = lambda: ()

    def _of(self, unit: "GatherUnit") -> _UnitStep:
        return self._units.setdefault(id(unit), _UnitStep())

    # --- the reduction ---------------------------------------------------------------------
    def shard_final(self, unit: "GatherUnit", async_op: bool, after=None, waits=()) -> None:
        """The schedule: ``unit``'s 1/G shard is final once the events ``waits`` are; its
        reduction is issued now, its first stage on its stream after them.

        ``after``: the trace record of the reduce-scatter that makes it final (the
        reduction's first stage is traced as following it).
        """
        self.start_reduction(unit, async_op, after, waits)

    def start_reduction(self, unit: "GatherUnit", async_op: bool, after=None,
                        waits=()) -> None:
        """The 1/G shard -> this rank's 1/O slice (once per step; :meth:`reduced_grad` waits).

        ``after``: the trace record its first stage is traced as following; ``waits``: the
        events its first stage waits for on its stream."""
        b, ctx, mine = unit.bucket, self.ctx, self._of(unit)
        comm = ctx.comm
        if mine.reduction is not None or mine.grad is not None:
            return
        if b.grad_shard_fresh:     # no micro-batch reduced into it since zero_grad_buffer
            b.grad_shard.zero_()
            b.grad_shard_fresh = False
        stages = []
        if ctx.comm.sizes.get("inter", 1) > 1:
            out = torch.empty(b.layout.optim_size, dtype=ctx.grad_dtype, device=b.device)
            mine.grad_nbytes = out.numel() * out.element_size()
            ctx.transient.alloc(mine.grad_nbytes)
            # int8 all-to-all summed in fp32 when qgZ covers this (cross-node) hop
            stages.append(lambda waits, a: ctx.reduce_scatter_grad(
                out, b.grad_shard, "inter", "step_reduce", unit=unit.index,
                stream=comm.stream("inter", "reduce") if a else None, waits=waits))
        else:   # O == G: the optimizer slice is the gradient shard
            out = b.grad_shard
            mine.grad_nbytes = 0
        if ctx.comm.sizes.get("replica", 1) > 1:
            stages.append(lambda waits, a: Pending(comm.all_reduce(
                out, "replica", "step_reduce", unit=unit.index,
                stream=comm.stream("replica", "reduce") if a else None, waits=waits)))
        mine.grad = out
        mine.reduction = Chain(unit.index, stages, after=after,
                               waits=tuple(w for w in waits if w is not None))
        self.reductions.start(mine.reduction, async_op=async_op)

    def reduced_grad(self, unit: "GatherUnit") -> torch.Tensor:
        """The optimizer: this rank's reduced 1/O gradient slice (fp32), once its reduction is done."""
        mine = self._of(unit)
        if mine.reduction is not None:
            self.reductions.complete(mine.reduction)
            mine.reduction = None
        grad = mine.grad
        check_free(grad, f"unit {unit.index}'s reduced gradient")
        if grad.dtype != torch.float32:   # reduced in bf16: Adam and the norm want fp32
            wide = grad.float()
            self.ctx.transient.alloc(wide.numel() * 4)
            self.ctx.transient.free(mine.grad_nbytes)
            mine.grad, mine.grad_nbytes = wide, wide.numel() * 4
            grad = wide
        return grad

    def scale(self, unit: "GatherUnit", factor: float) -> None:
        """Megatron's scale_gradients on a reduction already started (it is linear: scaling
        its result is scaling its input); the 1/G shard itself is the unit's."""
        if self._of(unit).grad is not None:
            grad = self.reduced_grad(unit)
            if grad is not unit.bucket.grad_shard:
                grad.mul_(factor)

    def release(self, unit: "GatherUnit") -> None:
        """Drop the step's gradient slice (after the optimizer used it, or to discard it)."""
        mine = self._of(unit)
        if mine.reduction is not None:
            self.reductions.complete(mine.reduction)
            mine.reduction = None
        check_free(mine.grad, f"unit {unit.index}'s reduced gradient")
        mine.grad = None
        self.ctx.transient.free(mine.grad_nbytes)
        mine.grad_nbytes = 0

    # --- the refresh -----------------------------------------------------------------------
    def send_updated_weights(self, write_own: Callable[["GatherUnit"], None], async_op: bool) -> None:
        """The optimizer: ``write_own(unit)`` puts the updated 1/O slice into the unit's primary
        slice; each unit is then refreshed, in the next forward's order (asynchronously with
        overlap: a unit's next gather waits for its own)."""
        for unit in self.forward_order():
            self.await_refresh(unit)   # (a load right after a step: the step's gathers first)
            check_free(unit.bucket.primary, f"unit {unit.index}'s primary slice")
            # On every rank, whether or not its slice changed (one all padding does not): the
            # next forward's gathers must read the same copy everywhere (DeepSpeed's
            # invalidate_secondary_tensor after the step).
            unit.bucket.invalidate_secondary()
            write_own(unit)
            self.start_refresh(unit, async_op)

    def start_refresh(self, unit: "GatherUnit", async_op: bool) -> None:
        """After the optimizer wrote this rank's 1/O slice: gather the primary slice back up.

        1/O -> 1/G over ``inter`` (network), then 1/G -> 1/P over
        ``grad_to_param`` (node), each in place (this rank's chunk already sits
        where the gather puts it), both issued now on their streams, the second
        after the first (megatron_lbp.engine.chains). Asynchronous: the unit's
        next gather waits.
        """
        b, comm, mine = unit.bucket, self.ctx.comm, self._of(unit)
        grad_part = b.primary[b.grad_in_primary.slice]
        stages = []
        if comm.sizes.get("inter", 1) > 1:
            own = b.primary[b.optim_in_primary.slice]
            stages.append(lambda waits, a: Pending(comm.all_gather(
                grad_part, own, "inter", "step_gather", unit=unit.index,
                stream=comm.stream("inter", "gather") if a else None, waits=waits)))
        if comm.sizes.get("grad_to_param", 1) > 1:
            stages.append(lambda waits, a: Pending(comm.all_gather(
                b.primary, grad_part, "grad_to_param", "step_gather", unit=unit.index,
                stream=comm.stream("grad_to_param", "gather") if a else None, waits=waits)))
        self.await_refresh(unit)
        mine.refresh = Chain(unit.index, stages)
        self.refreshes.start(mine.refresh, async_op=async_op)

    def await_refresh(self, unit: "GatherUnit") -> None:
        """Until the unit's primary slice holds the updated weights (and every refresh before):
        the current stream waits (on gloo, the host)."""
        mine = self._of(unit)
        if mine.refresh is not None:
            self.refreshes.complete(mine.refresh)
            mine.refresh = None

    def settle(self) -> None:
        """Wait until every unit's primary slice holds the updated weights (nothing in flight)."""
        self.refreshes.complete()
