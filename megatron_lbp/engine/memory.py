"""Bytes this rank holds, by state, measured from the tensors themselves.

Persistent states are summed from their storages when asked (so a test checks
what really is allocated, not what the code meant to allocate). Transient
buffers (gathered weight buckets, full gradient buckets, step buffers) are
registered when allocated and released when freed, and the peak of their sum
is kept.
"""
from __future__ import annotations

from typing import Iterable

import torch

STATES = ("primary", "secondary", "grad", "optimizer")


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Allocated bytes of distinct storages behind ``tensors`` (views of one storage count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr(), storage.nbytes()
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


class TransientLedger:
    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def free(self, nbytes: int) -> None:
        self.current -= nbytes
        if self.current < 0:
            raise AssertionError(f"transient buffer accounting went negative ({self.current})")

    def reset_peak(self) -> None:
        self.peak = self.current


class AllocationPeak:
    """Peak bytes the allocator handed out on ``device`` while the block ran, above what was
    allocated when it began (``peak_bytes``; ``end_bytes``: still allocated at the end).

    Read from the allocator, not estimated: on a GPU/GCD its statistics
    (``max_memory_allocated``); on CPU the allocation events torch.profiler
    records for every allocation, free and storage resize, summed in order.
    The profiler reports a free only for a block it saw allocated, so a tensor
    from before the block that is replaced inside it counts as new memory:
    on CPU the figure is an upper bound.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.end_bytes = 0

    def __enter__(self) -> "AllocationPeak":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self._base
            return
        self._profile.__exit__(*exc)
        events = [e for e in self._profile.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        current = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            current += e.nbytes()
            peak = max(peak, current)
        self.peak_bytes, self.end_bytes = peak, current
