"""Deliberately broken engines, for the tests of the tests (ranks import these by name).

Each function returns a context manager that, inside a rank, patches the engine
for as long as one training runs (tiny_gpt.train_several's ``faults``). They
exist only here: no engine flag or environment variable turns them on. A check
that still passes on one of these engines would be a check that cannot fail.
"""
from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock


@contextlib.contextmanager
def gradient_scale(factor: float):
    """Every reduced gradient multiplied by ``factor`` before the optimizer sees it.

    factor 2 on 8 ranks with grad groups of 4 is the error of dividing by G
    where the engine must divide by W; clipping at 1.0 then hides most of it
    from the loss (measured with this seam: the loss moves by ~1e-4 relative).
    """
    from megatron_lbp.engine.optimizer import HierDistributedOptimizer

    reduce = HierDistributedOptimizer._reduce_to_optimizer_slices

    def scaled(self):
        reduce(self)
        for st in self.states:
            st.grad.mul_(factor)

    with mock.patch.object(HierDistributedOptimizer, "_reduce_to_optimizer_slices", scaled):
        yield


@contextlib.contextmanager
def overlap_off():
    """--hier-overlap accepted, but the engine's schedule runs every collective synchronously."""
    from megatron_lbp.engine import schedule

    init = schedule.UnitSchedule.__init__

    def synchronous(self, *args, **kwargs):
        kwargs["overlap"] = False
        init(self, *args, **kwargs)

    with mock.patch.object(schedule.UnitSchedule, "__init__", synchronous):
        yield


@contextlib.contextmanager
def quantization_off():
    """The int8 flags accepted, but the engine keeps a bf16 secondary copy and gathers unquantized."""
    from megatron_lbp.engine import process_groups

    build = process_groups.build_hier_groups

    def unquantized(*args, **kwargs):
        hier = build(*args, **kwargs)
        hier.config = dataclasses.replace(hier.config, secondary_dtype="bf16",
                                          quantize_weight_gather=False,
                                          quantize_grad_reduce=False)
        return hier

    with mock.patch.object(process_groups, "build_hier_groups", unquantized):
        yield


@contextlib.contextmanager
def reduced_check_ignores_nonfinite():
    """The optimizer's verdict trusts only the ranks' own counts, not its pass over the reduced
    gradients: right wherever every rank counts, blind where the collective scales the
    gradients (PREMUL_SUM) and nobody counts (no --check-for-nan-in-loss-and-grad)."""
    from megatron_lbp.engine.grad_health import GradHealth

    with mock.patch.object(GradHealth, "verdict",
                           staticmethod(lambda total_sq, nonfinite: nonfinite > 0)):
        yield


@contextlib.contextmanager
def premul_sum_rounding_in_fp64():
    """The fold branch with a PREMUL_SUM that multiplies in fp64 and rounds once: NCCL's op
    multiplies in the input's dtype, so with 1/W no power of two the numbers differ."""
    from megatron_lbp.engine import comm
    from tests.helpers.premul_sum_gloo import GlooPremulSum

    class Fp64Product(GlooPremulSum):
        def reduce_scatter(self, out, inp, factor, *, group, async_op):
            return super().reduce_scatter(out, (inp.double() * factor).to(inp.dtype), 1.0,
                                          group=group, async_op=async_op)

    with mock.patch.object(comm, "PREMUL_SUM", Fp64Product()):
        yield


@contextlib.contextmanager
def stale_weights_on_rank(rank: int):
    """On ``rank`` only, the step's weight gathers are lost: when a unit's refresh has landed
    (waited for at the unit's next use), its primary slice is put back as it was when the refresh started (its own 1/O slice, which
    the optimizer had just written, included: only what the gathers brought is lost). Its
    P-group then computes with partly old weights, while the logged losses, all-reduced
    over the data-parallel ranks, are still the same number on every rank. Purely local:
    every collective is issued as before."""
    import torch.distributed as dist

    from megatron_lbp.engine.step_comm import StepComm

    start, wait = StepComm.start_refresh, StepComm.await_refresh

    def start_and_remember(self, unit, async_op):
        if dist.get_rank() == rank:
            unit._lbp_before_refresh = unit.bucket.primary.clone()
        start(self, unit, async_op)

    def land_and_forget(self, unit):
        pending = self._of(unit).refresh is not None   # its refresh lands in this wait
        wait(self, unit)
        before = getattr(unit, "_lbp_before_refresh", None)
        if pending and before is not None:
            unit.bucket.primary.copy_(before)
            unit._lbp_before_refresh = None

    with mock.patch.object(StepComm, "start_refresh", start_and_remember), \
            mock.patch.object(StepComm, "await_refresh", land_and_forget):
        yield


@contextlib.contextmanager
def embedding_skip_ignored():
    """--hier-embedding-backward-gather skip accepted, but the schedule gathers the embedding
    for its backward and keeps a tied one until its last gradient, as by default."""
    from megatron_lbp.engine.schedule import UnitSchedule

    init = UnitSchedule.__init__

    def ignoring(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.no_backward_gather, self.release_after_backward = set(), {}

    with mock.patch.object(UnitSchedule, "__init__", ignoring):
        yield


@contextlib.contextmanager
def issue_on_poll():
    """A unit's network reduction is issued not with its reduce-scatter but at the first
    hook that finds that reduce-scatter done (``is_complete()``), wherever each rank's
    timing lets it see it (the rest at the end of the backward): the engine that decides
    what to issue by polling."""
    from megatron_lbp.engine import schedule

    start = schedule.UnitSchedule._start_network_reduction
    flush = schedule.UnitSchedule.flush_backward

    def later(self):
        return self.__dict__.setdefault("_issue_when_seen", [])

    def deferred(self, reduce):
        later(self).append(reduce)

    def issue_seen(self, every=False):
        waiting = later(self)
        while waiting and (every or waiting[0].pending.is_complete()):
            start(self, waiting.pop(0))

    def polled(hook):
        def run(self, *args, **kwargs):
            issue_seen(self)
            return hook(self, *args, **kwargs)
        return run

    def flushed(self):
        flush(self)
        issue_seen(self, every=True)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(schedule.UnitSchedule, "_start_network_reduction",
                                              deferred))
        stack.enter_context(mock.patch.object(schedule.UnitSchedule, "flush_backward", flushed))
        for name in ("pre_forward", "post_forward", "pre_backward"):
            stack.enter_context(mock.patch.object(
                schedule.UnitSchedule, name, polled(getattr(schedule.UnitSchedule, name))))
        yield


@contextlib.contextmanager
def chains_not_awaited():
    """The optimizer step's chains taken as done without waiting for their streams: the
    reduced gradient is read (and its buffer reused) while its collectives still run."""
    from megatron_lbp.engine import chains

    def taken(self):
        self._pending = []
        self.done = True

    with mock.patch.object(chains.Chain, "wait", taken):
        yield
