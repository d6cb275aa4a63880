"""Blockwise symmetric int8 quantization for the secondary weight copy and qwZ.

Two implementations with one contract (see :mod:`.blockwise` for it, and for
how DEFAULT_BLOCK_SIZE was measured):

- :mod:`.blockwise` -- vectorised torch, any device, the reference;
- :mod:`.triton_kernels` -- one Triton program per block, bit-identical to
  the reference on finite input; used on CUDA/ROCm GPUs.

:func:`quantize_auto` / :func:`dequantize_auto` pick Triton for GPU tensors
when it is available and torch otherwise (always torch for CPU tensors, even
under TRITON_INTERPRET=1: the interpreter is for tests, not speed).
"""
from __future__ import annotations

import torch

from megatron_lbp.quant.blockwise import (
    DEFAULT_BLOCK_SIZE,
    KERNEL_ALIGN,
    QMAX,
    QuantError,
    check_block_size,
    dequantize,
    find_nonfinite,
    num_blocks,
    packed_views,
    poisoned_blocks,
    quantize,
    quantized_nbytes,
)
from megatron_lbp.quant.triton_kernels import (
    dequantize_triton,
    quantize_triton,
    triton_available,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "KERNEL_ALIGN",
    "QMAX",
    "QuantError",
    "check_block_size",
    "num_blocks",
    "quantized_nbytes",
    "packed_views",
    "quantize",
    "dequantize",
    "find_nonfinite",
    "poisoned_blocks",
    "quantize_triton",
    "dequantize_triton",
    "triton_available",
    "use_triton",
    "quantize_auto",
    "dequantize_auto",
]


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule: Triton for non-CPU tensors it can run on, torch otherwise."""
    return t.device.type != "cpu" and triton_available(t.device)


def quantize_auto(x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, *,
                  out_q: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
                  check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` on the fastest implementation for ``x``'s device."""
    impl = quantize_triton if use_triton(x) else quantize
    return impl(x, block_size, out_q=out_q, out_scale=out_scale, check_finite=check_finite)


def dequantize_auto(q: torch.Tensor, scale: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE,
                    *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """:func:`dequantize` on the fastest implementation for ``q``'s device."""
    impl = dequantize_triton if use_triton(q) else dequantize
    return impl(q, scale, block_size, dtype=dtype, out=out)
