"""NCCL's PREMUL_SUM emulated exactly on gloo, so CPU ranks run the branch a GPU takes (tests only).

Where the backend has PREMUL_SUM (NCCL, and RCCL, which names itself "nccl"),
the engine folds the 1/W gradient scaling into the G-group reduce-scatter
(UnitContext.folds_prescale) instead of scaling in a pass of its own. The only
backend-specific piece of that branch is megatron_lbp.engine.comm.PREMUL_SUM:
whether a backend has the op, and the collective. NCCL defines PREMUL_SUM as
each rank's input multiplied by the factor (in the input's dtype) and then
summed; :class:`GlooPremulSum` does exactly that, on a temporary copy of the
input, with gloo's SUM reduce-scatter, so the numbers are the ones scaling
first gives, bit for bit. Everything else of the branch (the fold decision,
what is counted, the optimizer's check) runs for real.

Nothing in the engine turns this on (no flag, no environment variable): a rank
enters :func:`premul_sum_on_gloo` around a training. :func:`counting_passes`
counts, in this rank, the engine's read passes over its own gradient
(``CALLS["count_pass"]``: GradHealth.count; ``CALLS["scale_pass"]``:
GradHealth.scale_and_count) and the emulated collectives (``CALLS["premul_sum"]``).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist

CALLS: Counter = Counter()


class _HoldsInput:
    """Gloo's work for one reduce-scatter, keeping its scaled input alive until waited for."""

    def __init__(self, work, scaled: torch.Tensor) -> None:
        self.work, self._scaled = work, scaled

    def wait(self):
        done = self.work.wait()
        self._scaled = None
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()


class GlooPremulSum:
    """PREMUL_SUM on gloo: ``out`` = sum over the group of ``factor * input`` (one fp rounding
    of the product in the input's dtype, as NCCL's, then gloo's SUM)."""

    def available(self, backend: str) -> bool:
        return backend in ("nccl", "gloo")

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, factor: float, *,
                       group, async_op: bool):
        CALLS["premul_sum"] += 1
        scaled = inp * torch.tensor(factor, dtype=inp.dtype, device=inp.device)
        work = dist.reduce_scatter_tensor(out, scaled, group=group, async_op=async_op)
        return None if work is None else _HoldsInput(work, scaled)


@contextlib.contextmanager
def premul_sum_on_gloo():
    """The engine's PREMUL_SUM seam replaced by the exact gloo emulation, while inside."""
    from megatron_lbp.engine import comm

    with mock.patch.object(comm, "PREMUL_SUM", GlooPremulSum()):
        yield


@contextlib.contextmanager
def counting_passes():
    """Count the engine's own-gradient read passes in :data:`CALLS` (reset on entry)."""
    from megatron_lbp.engine.grad_health import GradHealth

    CALLS.clear()
    count, scale = GradHealth.count, GradHealth.scale_and_count

    def counted(self, grad):
        CALLS["count_pass"] += 1
        return count(self, grad)

    def scaled(self, grad, factor):
        CALLS["scale_pass"] += 1
        return scale(self, grad, factor)

    with mock.patch.object(GradHealth, "count", counted), \
            mock.patch.object(GradHealth, "scale_and_count", scaled):
        yield
