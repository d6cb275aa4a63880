"""Gradient health: whether a step's gradients are finite, and whose were not.

One object per wrapper (``UnitContext.health``), shared by its units and read by
the optimizer. Each rank counts its *own* inf/nan while its gradients are
reduced (before the reduction mixes ranks); the optimizer takes the count into
its one all-reduce with the sum of squares, and :meth:`GradHealth.verdict`
decides. Only when something is non-finite does ``_blame`` find whose.
"""
from __future__ import annotations

import math
from typing import Callable

import torch


class GradHealth:
    def __init__(self, collective_scales: Callable[[], bool]) -> None:
        """``collective_scales()``: whether the gradient reduce-scatter scales its input itself."""
        self._collective_scales = collective_scales
        # This rank's own non-finite unit gradients since the last optimizer step.
        self.local = torch.zeros((), dtype=torch.int32)
        # --check-for-nan-in-loss-and-grad (set by the optimizer): name the rank(s).
        self.name_ranks = False

    @property
    def counts_own(self) -> bool:
        """Whether :attr:`local` is counted: always where the scaling pass counts for free;
        where the collective scales (PREMUL_SUM) only when the ranks are to be named,
        since that count is a read pass of its own."""
        return not self._collective_scales() or self.name_ranks

    def scale_and_count(self, grad: torch.Tensor, factor: float) -> None:
        """``grad *= factor`` and this rank's inf/nan counted, in one pass (the kernel that
        unscales for torch's GradScaler; bit-identical to ``mul_``)."""
        found = torch.zeros((), dtype=torch.float32, device=grad.device)
        inv = torch.full((), factor, dtype=torch.float32, device=grad.device)
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found, inv)
        self.local = self.local.to(grad.device) + found.to(torch.int32)

    def count(self, grad: torch.Tensor) -> None:
        """This rank's inf/nan counted from a read of ``grad`` (inf/nan survive the sum; no
        host sync on GPU)."""
        finite = torch.isfinite(grad.sum())
        self.local = self.local.to(grad.device) + ~finite

    def take_count(self, device: torch.device) -> torch.Tensor:
        """This step's own count (on ``device``), reset for the next step."""
        out = self.local.to(device)
        self.local = torch.zeros_like(self.local)
        return out

    @staticmethod
    def verdict(total_sq: float, nonfinite: float) -> bool:
        """The reduced gradients' sum of squares is non-finite, or a rank counted an inf/nan
        of its own (the first alone is exact: engine/optimizer.py ``_norm_and_inf_check``)."""
        return nonfinite > 0 or not math.isfinite(total_sq)
