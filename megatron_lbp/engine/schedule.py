"""When each gather unit is gathered, freed and reduced: the engine's schedule, in one place.

Hooks (megatron_lbp.engine.data_parallel) call the methods here; the units
(megatron_lbp.engine.unit) do the collectives. A unit is gathered at its first
need in a pass, with the next ``prefetch_units`` units prefetched in that pass's
order; freed after its last user; its gradient reduce-scatter is issued when its
last gradient arrives, at most ``max_pending_reduces`` in flight.
Invariant: every collective is issued at a hook, a micro-batch boundary or the
optimizer step, never because the host saw one finish, so the sequence of
collectives is a function of the program and the same on every rank.
Passes, look-ahead and the optimizer-step overlap: docs/engine.md, docs/schedule-trace.md.
"""
from __future__ import annotations

import enum
from typing import Any

import torch

from megatron_lbp.core.vocabulary import (DEFAULT_EMBEDDING_BACKWARD_GATHER,
                                           EMBEDDING_BACKWARD_GATHERS, MAX_PENDING_REDUCES)
from megatron_lbp.engine.buckets import ParamSlot
from megatron_lbp.engine.comm import Collectives
from megatron_lbp.engine.grouping import UnitMap
from megatron_lbp.engine.step_comm import StepComm
from megatron_lbp.engine.trace import record_of
from megatron_lbp.engine.unit import GatherUnit, ReduceInFlight, WeightState, unfused_gradient

FORWARD, BACKWARD = "forward", "backward"


class Pass(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"      # including activation recomputation


def in_autograd_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread now."""
    return torch._C._current_graph_task_id() != -1


class UnitSchedule:
    def __init__(self, units: list[GatherUnit], unit_map: UnitMap, comm: Collectives,
                 step: StepComm, *, overlap: bool, prefetch_units: int,
                 max_pending_reduces: int = MAX_PENDING_REDUCES,
                 embedding_backward_gather: str = DEFAULT_EMBEDDING_BACKWARD_GATHER) -> None:
        if max_pending_reduces < 1:
            raise ValueError(f"max_pending_reduces={max_pending_reduces}: must be >= 1")
        if embedding_backward_gather not in EMBEDDING_BACKWARD_GATHERS:
            raise ValueError(f"embedding_backward_gather={embedding_backward_gather!r}: must be "
                             f"one of {EMBEDDING_BACKWARD_GATHERS}")
        self.units = units
        self.comm = comm
        self.step = step    # the optimizer step's communication (engine/step_comm.py)
        self.overlap = overlap
        self.depth = prefetch_units if overlap else 0
        # Without overlap every reduction completes at once (the bound is moot).
        self.max_pending_reduces = max_pending_reduces if overlap else 0
        self.uses = {m: [units[i] for i in idx] for m, idx in unit_map.uses.items()}
        self.home = {m: units[i] for m, i in unit_map.home.items()}
        # Per module, the units whose forward use its post-forward ends (see the docstring).
        held = {i for idx in unit_map.held.values() for i in idx}
        self.releases = {m: [units[i] for i in idx if i not in held]
                         for m, idx in unit_map.uses.items()}
        for m, idx in unit_map.held.items():
            self.releases.setdefault(m, []).extend(units[i] for i in idx)
        # Per unit, the post-forwards that must run before it is freed.
        self._users = [len(plan.holders) or len(plan.users) for plan in unit_map.units]
        self._home_modules = [0] * len(units)
        for u in self.home.values():
            self._home_modules[u.index] += 1
        # Units whose own modules' backward needs no gathered weights (embedding lookups), and
        # per module computing with one of them from another unit, those it frees after its
        # backward.
        self.no_backward_gather = {u.index for u in units if u.kind == "embedding"} \
            if embedding_backward_gather == "skip" else set()
        self.release_after_backward = {
            m: rel for m, us in self.uses.items()
            if (rel := [u for u in us if u.index in self.no_backward_gather
                        and self.home.get(m) is not u])}
        self.slot_of: dict[int, tuple[GatherUnit, ParamSlot]] = {
            id(s.param): (u, s) for u in units for s in u.bucket.slots}
        n = len(units)
        self._order = {FORWARD: list(range(n)), BACKWARD: list(reversed(range(n)))}
        self._position = {k: {u: i for i, u in enumerate(v)} for k, v in self._order.items()}
        self.overlap_samples: list[int] = []
        self._pass = Pass.IDLE
        self._recording: list[int] = []
        self._used: set[int] = set()
        self._reduced: set[int] = set()
        self._users_left: list[int] = list(self._users)
        self._open_compute: dict[int, list[Any]] = {}    # unit -> [interval, home modules left]
        self._open_backward: dict[int, Any] = {}         # unit -> its backward interval
        self._pending_reduces: list[ReduceInFlight] = []
        self._backward_ran = False
        self.trace = None   # the schedule trace (--hier-trace): the wrapper sets it
        self.last_micro_batch = False       # the next backward is the step's last
        self._backward_is_last = False      # the running backward is
        self.step_reduce_started = False    # its network reductions are issued

    # --- forward -------------------------------------------------------------------------
    def mark_last_micro_batch(self, last: bool = True) -> None:
        """The next backward is the step's last micro-batch (False: it is not)."""
        self.last_micro_batch = last

    def forward_order(self) -> list[GatherUnit]:
        """The units in the order the next forward will need them."""
        return [self.units[i] for i in self._order[FORWARD]]

    def begin_forward(self) -> None:
        """The root module's pre-forward: complete the last backward, open a forward pass."""
        self.flush_backward()
        self._pass = Pass.FORWARD
        self._used, self._reduced, self._recording = set(), set(), []
        self._users_left = list(self._users)
        self._open_compute, self._open_backward = {}, {}
        for u in self.units:
            u.reset_pass()
        trace = self.trace
        if trace is not None:
            if torch.is_grad_enabled():
                trace.start_micro_batch()
            else:
                trace.micro_batch = None  # an evaluation forward: no micro-batch of the step

    def end_forward(self) -> None:
        """The root module's post-forward: free what users that did not run left gathered."""
        if self._pass is not Pass.FORWARD:
            return
        for u in self.units:
            if u.state is not WeightState.SHARDED:
                u.reshard()
        self._keep_order(FORWARD)

    def pre_forward(self, module: torch.nn.Module) -> None:
        if in_autograd_backward():   # activation recomputation inside the backward pass
            self._enter_backward()
            self._need(module, self.uses.get(module, []), "backward_gather", BACKWARD)
            self._start_compute(module, "recompute")
            return
        self._need(module, self.uses.get(module, []), "forward_gather", FORWARD)
        self._start_compute(module, "forward")

    def post_forward(self, module: torch.nn.Module) -> None:
        recompute = self._pass is Pass.BACKWARD
        self._end_compute(module)
        if recompute:
            return  # the weights stay gathered for the backward that follows
        for u in self.releases.get(module, []):
            self._users_left[u.index] -= 1
            if self._users_left[u.index] == 0:
                u.reshard()

    # --- backward ------------------------------------------------------------------------
    def pre_backward(self, module: torch.nn.Module) -> None:
        """Gradients of ``module``'s outputs are ready: its backward is next."""
        self._enter_backward()
        home = self.home.get(module)
        units = [u for u in self.uses.get(module, []) if u.index not in self._reduced
                 and not (u.index in self.no_backward_gather and u is home)]
        self._need(module, units, "backward_gather", BACKWARD)
        if home is not None and home.index not in self._open_backward \
                and home.index not in self._reduced:
            self._open_backward[home.index] = self._open_interval(home, "backward")

    def post_backward(self, module: torch.nn.Module) -> None:
        """The gradients of ``module``'s inputs are ready, so its backward has run: free the
        units it computed with that their own backward does not need (the tied embedding
        after the output layer's; a linear layer's weight gradient reads the input, not
        the weight)."""
        for u in self.release_after_backward.get(module, ()):
            if u.index not in self._reduced and u.state is not WeightState.SHARDED:
                u.reshard()

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """One parameter's gradient of this backward is complete, by either route (unit.py)."""
        unit, slot = self.slot_of[id(param)]
        self._backward_ran = True
        last = unit.accumulate(slot, unfused_gradient(param))
        param.grad = None
        if last:
            self._reduce(unit)

    def _enter_backward(self) -> None:
        if self._pass is not Pass.BACKWARD:
            if self.step_reduce_started:
                raise RuntimeError(
                    "a backward pass after the step's last micro-batch (its gradients are "
                    "already being reduced to the optimizer slices): run every micro-batch but "
                    "the last inside model.no_sync(), as Megatron's schedules do, or call "
                    "model.mark_last_micro_batch() only before the last backward")
            self._pass = Pass.BACKWARD
            self._used, self._recording = set(), []
            self._open_compute = {}
            self._backward_ran = True
            self._backward_is_last = self.last_micro_batch

    def _reduce(self, unit: GatherUnit) -> None:
        self._reduced.add(unit.index)
        interval = self._open_backward.pop(unit.index, None)
        if interval is not None:
            self.trace.compute_end(interval)
        # Without overlap the step's reductions wait for the optimizer step.
        reduce = unit.start_reduce(async_op=self.overlap,
                                   last=self._backward_is_last and self.overlap)
        self._pending_reduces.append(reduce)
        if reduce.last:
            self._start_network_reduction(reduce)
        while len(self._pending_reduces) > self.max_pending_reduces:
            self._complete_oldest_reduce()

    def _start_network_reduction(self, reduce: ReduceInFlight) -> None:
        """The step's last reduce-scatter of a unit makes its 1/G shard final: the network
        reduction is issued now, in the same hook, on its stream after the reduce-scatter's
        event (a stream dependency, as on a GPU), and runs under the rest of the backward."""
        self.step.shard_final(reduce.unit, async_op=True, after=record_of(reduce.pending),
                              waits=(reduce.pending.event,))

    def _complete_oldest_reduce(self) -> None:
        """At a program point (the bound, the flush), never because it happened to be done;
        it issues nothing (what follows it was issued with it, after its event)."""
        reduce = self._pending_reduces.pop(0)
        reduce.unit.finish_reduce(reduce)

    def flush_backward(self) -> None:
        """Reduce what the last backward left (unused parameters) and wait for every reduce."""
        if self._backward_ran:
            for u in self.units:
                if u.index not in self._reduced:
                    self._reduce(u)
            self._backward_ran = False
            self._keep_order(BACKWARD)
        while self._pending_reduces:
            self._complete_oldest_reduce()
        if self._backward_is_last:
            self._backward_is_last = self.last_micro_batch = False
            self.step_reduce_started = True

    def start_step_reduces(self) -> None:
        """finish the backward, then issue the network reduction of every unit not yet reduced."""
        self.flush_backward()
        for u in self.units:
            self.step.start_reduction(u, async_op=self.overlap)
        self.step_reduce_started = True

    def reset_step(self) -> None:
        """zero_grad_buffer: a new step; reductions of the last one still running are dropped."""
        self.flush_backward()
        for u in self.units:
            self.step.release(u)
        self.step_reduce_started = self.last_micro_batch = self._backward_is_last = False

    def finish(self) -> None:
        """finish_grad_sync: everything of the micro-batches done, every unit sharded."""
        self.flush_backward()
        self._pass = Pass.IDLE
        for u in self.units:
            if u.state is not WeightState.SHARDED:
                u.reshard()
        trace = self.trace
        if trace is not None:
            trace.micro_batch = None

    # --- gathers and prefetch ------------------------------------------------------------
    def _need(self, module: torch.nn.Module, units: list[GatherUnit], phase: str,
              kind: str) -> None:
        """Gather ``units`` for ``module``, issue the look-ahead, then wait for ``units``."""
        first = []
        for u in units:
            if u.index not in self._used:
                self._used.add(u.index)
                self._recording.append(u.index)
                first.append(u)
            if u.state is WeightState.SHARDED:
                self._unshard(u, phase, self.overlap)
        home = self.home.get(module)
        if self.depth and home is not None:
            self._prefetch_after(home, phase, kind)
        for u in units:
            u.wait_for_unshard()
            if phase == "backward_gather":
                u.prepare_backward()
        if phase == "forward_gather":
            # The weights this forward computes with, kept as this rank's 1/S
            # slice for the backward: rebuilt by every forward, never stale.
            for u in first:
                u.build_secondary()

    def _prefetch_after(self, home: GatherUnit, phase: str, kind: str) -> None:
        """Keep the ``depth`` units that follow ``home`` in this pass's order gathered or in flight."""
        position = self._position[kind].get(home.index)
        if position is None:
            return
        ahead = 0
        for index in self._order[kind][position + 1:]:
            if ahead >= self.depth:
                return
            if index in self._used or index in self._reduced:
                continue
            if kind == BACKWARD and index in self.no_backward_gather:
                continue  # gathered only by a module that computes with it (post_backward)
            unit = self.units[index]
            if (phase == "backward_gather" and unit.bucket.has_secondary
                    and not unit.bucket.secondary_is_current()):
                continue  # not run forward this micro-batch: its own need will say so
            if unit.state is WeightState.SHARDED:
                self._unshard(unit, phase, True)
            ahead += 1

    def _unshard(self, unit: GatherUnit, phase: str, async_op: bool) -> None:
        """Gather ``unit``, after its updated weights have landed (their first use)."""
        self.step.await_refresh(unit)
        unit.unshard(phase, async_op=async_op)

    def _keep_order(self, kind: str) -> None:
        """The pass just ended sets the order the next pass of its kind prefetches in."""
        if not self._recording:
            return
        seen = set(self._recording)
        order = self._recording + [u for u in self._order[kind] if u not in seen]
        self._order[kind] = order
        self._position[kind] = {u: i for i, u in enumerate(order)}
        self._recording = []

    # --- compute intervals ---------------------------------------------------------------
    def _open_interval(self, unit: GatherUnit, pass_: str):
        self.overlap_samples.append(self.comm.stats.in_flight)
        trace = self.trace
        return trace.compute_start(unit.index, pass_) if trace is not None else None

    def _start_compute(self, module: torch.nn.Module, pass_: str) -> None:
        home = self.home.get(module)
        if home is not None and home.index not in self._open_compute:
            self._open_compute[home.index] = [self._open_interval(home, pass_),
                                              self._home_modules[home.index]]

    def _end_compute(self, module: torch.nn.Module) -> None:
        home = self.home.get(module)
        entry = self._open_compute.get(home.index) if home is not None else None
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._open_compute[home.index]
            if entry[0] is not None:
                self.trace.compute_end(entry[0])
