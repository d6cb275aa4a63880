"""torch.distributed calls whose name moved between the torch versions the project runs on,
and the byte size of what a collective sends."""
from __future__ import annotations

from typing import Any, Callable


def nbytes(t: Any) -> int:
    """Bytes of tensor ``t``'s elements: what a collective's byte charge starts from."""
    return t.numel() * t.element_size()


def all_gather_single() -> Callable:
    """torch.distributed's all-gather into one output tensor.

    torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` and
    deprecates the old name with a FutureWarning per call site and rank; older
    torch has only the old name. Looked up on each call, never bound once, so
    whatever wraps torch.distributed (the benchmarks' byte counters and link
    replay) sees the engine's gathers too.
    """
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
