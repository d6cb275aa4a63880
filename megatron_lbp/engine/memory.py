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
