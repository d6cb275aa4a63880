"""Flat buckets: the parameters of a gather unit laid end to end, and what one rank keeps of them.

A bucket owns ``primary`` (this rank's persistent 1/P weight slice), ``full``
(the whole bucket, held only while gathered), ``grad_shard`` (the persistent 1/G
gradient slice, accumulated across micro-batches), ``grad_full`` (one
backward's gradient) and, when S > 0, ``secondary`` (the 1/S copy the backward
regathers). Invariants: every parameter's ``.data`` and ``main_grad`` are views
into ``full`` and ``grad_full`` for the module's whole life (freeing resizes the
storage, so a stray use fails loudly); slices come from megatron_lbp.core.layout;
nothing here talks to other ranks. See docs/engine.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lbp.engine.memory import TransientLedger
from megatron_lbp.core.layout import BucketLayout, plan_bucket
from megatron_lbp.engine.quantized import quantize_into
from megatron_lbp.quant import DEFAULT_BLOCK_SIZE, quantized_nbytes


@dataclass
class ParamSlot:
    name: str
    param: torch.nn.Parameter
    start: int                 # offset of the parameter in the bucket
    numel: int
    shape: torch.Size
    index: int = 0             # position in the bucket's slots

    @property
    def stop(self) -> int:
        return self.start + self.numel


class FlatBucket:
    def __init__(self, index: int, named_params: list[tuple[str, torch.nn.Parameter]],
                 *, dp_index: int, world_size: int, param_group_size: int, grad_group_size: int,
                 optim_group_size: int, secondary_group_size: int, grad_dtype: torch.dtype,
                 transient: TransientLedger, secondary_dtype: str = "int8",
                 quant_block_size: int = DEFAULT_BLOCK_SIZE, copy_weights: bool = True,
                 grad_chunk_ordered: bool = False) -> None:
        devices = {p.device for _, p in named_params}
        if len(devices) != 1:
            raise ValueError(f"bucket {index} mixes devices {sorted(map(str, devices))}")
        # The bucket lives where the model lives (the GPU/GCD, or the CPU in tests).
        self.device = devices.pop()
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"bucket {index} mixes parameter dtypes {sorted(map(str, dtypes))}")
        self.index = index
        self.dtype = dtypes.pop()
        self.grad_dtype = grad_dtype
        self.dp_index = dp_index
        self._transient = transient
        self.slots: list[ParamSlot] = []
        offset = 0
        for name, p in named_params:
            self.slots.append(ParamSlot(name, p, offset, p.numel(), p.shape, len(self.slots)))
            offset += p.numel()
        self.layout: BucketLayout = plan_bucket(
            offset, world_size, param_group_size, grad_group_size, optim_group_size,
            secondary_group_size)
        r = dp_index
        self.primary_range = self.layout.primary_range(r)
        self.grad_range = self.layout.grad_range(r)
        self.optim_range = self.layout.optim_range(r)
        self.grad_in_primary = self.layout.grad_in_primary(r)
        self.optim_in_primary = self.layout.optim_in_primary(r)
        self.optim_in_grad = self.layout.optim_in_grad(r)

        # The G-group's reduce communicator hands out chunks in bucket order (layout.py).
        self.grad_chunk_ordered = grad_chunk_ordered
        self.quant_block_size = quant_block_size
        self.secondary_dtype = secondary_dtype
        self.secondary_range = self.layout.secondary_range(r)
        n = self.layout.padded_numel
        if copy_weights:
            staged = torch.zeros(n, dtype=self.dtype, device=self.device)
            for slot in self.slots:
                staged[slot.start:slot.stop].copy_(slot.param.detach().reshape(-1))
            # The primary slice is first filled here, from the module's own weights.
            self.primary = staged[self.primary_range.slice].clone()
            self.attach(staged)
        else:
            # Sharded initialization: the weights arrive slice by slice (write_primary),
            # then the owner calls attach().
            self.primary = torch.zeros(self.primary_range.size, dtype=self.dtype,
                                       device=self.device)

    def attach(self, full: torch.Tensor | None = None) -> None:
        """Allocate the working buffers and turn every parameter into a window onto the bucket.

        ``full`` (optional) is the whole bucket already staged; its memory is
        released here like that of any gathered bucket.
        """
        n = self.layout.padded_numel
        # Views are made while a storage is allocated (a view's bounds are checked
        # against it); each storage is freed before the next is allocated, so laying
        # out a bucket costs one full buffer at a time.
        self.full = full if full is not None else torch.empty(n, dtype=self.dtype,
                                                              device=self.device)
        for slot in self.slots:
            # From here on the parameter is a window onto the bucket.
            slot.param.data = self.full[slot.start:slot.stop].view(slot.shape)
        self._transient.alloc(self.full_nbytes)
        self.free_full()
        self.grad_full = torch.empty(n, dtype=self.grad_dtype, device=self.device)
        for slot in self.slots:
            slot.param.main_grad = self.grad_full[slot.start:slot.stop].view(slot.shape)
            # Megatron's protocol with a fused wgrad: the kernel sets it True and
            # hands autograd a dummy gradient (zeros when ``zero_out_wgrad``).
            slot.param.grad_added_to_main_grad = False
        self.grad_full.untyped_storage().resize_(0)
        self.secondary: torch.Tensor | None = None
        # primary._version when ``secondary`` was last written (-1: never). The
        # version counter moves with every in-place write to the primary slice
        # (optimizer step, checkpoint load, broadcast), so equality means "built
        # from the current weights".
        self.secondary_version = -1
        if self.secondary_range is not None:
            m = self.secondary_range.size
            self.secondary = (
                torch.zeros(quantized_nbytes(m, self.quant_block_size), dtype=torch.uint8,
                            device=self.device)
                if self.secondary_dtype == "int8"
                else torch.zeros(m, dtype=self.dtype if self.secondary_dtype == "param"
                                 else torch.bfloat16, device=self.device))
        self.grad_shard = torch.zeros(self.layout.grad_size, dtype=self.grad_dtype,
                                      device=self.device)
        self.grad_shard_fresh = False   # True after zero_grad_buffer: read as zero, overwrite
        self._grad_written = [False] * len(self.slots)   # windows of grad_full holding values

    def write_primary(self, slot: ParamSlot, values: torch.Tensor) -> None:
        """Copy this rank's part of one parameter's full ``values`` into the primary slice."""
        lo = max(slot.start, self.primary_range.start)
        hi = min(slot.stop, self.primary_range.stop)
        if lo < hi:
            flat = values.reshape(-1)
            self.primary[lo - self.primary_range.start:hi - self.primary_range.start].copy_(
                flat[lo - slot.start:hi - slot.start])

    # --- weights -------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def full_nbytes(self) -> int:
        return self.layout.padded_numel * self.full.element_size()

    def alloc_full(self) -> None:
        """Give ``full`` its memory back (contents undefined until gathered)."""
        if self.full.untyped_storage().nbytes() == 0:
            self.full.untyped_storage().resize_(self.full_nbytes)
            self._transient.alloc(self.full_nbytes)

    def free_full(self) -> None:
        if self.full.untyped_storage().nbytes():
            self.full.untyped_storage().resize_(0)
            self._transient.free(self.full_nbytes)

    def is_resident(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    # --- secondary copy ------------------------------------------------------------------
    @property
    def has_secondary(self) -> bool:
        return self.secondary is not None

    def build_secondary(self) -> None:
        """Write this rank's 1/S slice of the gathered ``full`` into ``secondary``."""
        own = self.full[self.secondary_range.slice]
        if self.secondary_dtype == "int8":
            quantize_into(own, self.secondary, self.quant_block_size)
        else:
            self.secondary.copy_(own)
        self.secondary_version = self.primary._version

    def secondary_is_current(self) -> bool:
        return self.secondary_version == self.primary._version

    def invalidate_secondary(self) -> None:
        """The weights are about to change on some rank (the optimizer step): no rank may read
        this copy until a forward rebuilds it, even where this rank's own slice stays as it was
        (a slice of padding only), or ranks would gather from different copies."""
        self.secondary_version = -1

    # --- gradients -----------------------------------------------------------------------
    @property
    def grad_full_nbytes(self) -> int:
        return self.layout.padded_numel * self.grad_full.element_size()

    def grad_full_resident(self) -> bool:
        return self.grad_full.untyped_storage().nbytes() > 0

    def ensure_grad_full(self, zero: bool = False) -> None:
        """Give ``grad_full`` (and so every ``main_grad`` view) memory, once per backward.

        Its contents are undefined: :meth:`write_grad` copies each parameter's
        first gradient. ``zero``: every window not yet written is zeroed and
        counted written, for a fused wgrad kernel that accumulates into
        ``main_grad``.
        """
        if not self.grad_full_resident():
            self.grad_full.untyped_storage().resize_(self.grad_full_nbytes)
            self._transient.alloc(self.grad_full_nbytes)
            self._grad_written = [False] * len(self.slots)
        if zero and not all(self._grad_written):
            if not any(self._grad_written):
                self.grad_full.zero_()
            else:
                for slot, written in zip(self.slots, self._grad_written):
                    if not written:
                        self.grad_full[slot.start:slot.stop].zero_()
            self._grad_written = [True] * len(self.slots)

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        """The parameter's window of ``grad_full``, holding zeros or what was accumulated so far
        (for a kernel that accumulates into it)."""
        self.ensure_grad_full()
        window = self.grad_full[slot.start:slot.stop]
        if not self._grad_written[slot.index]:
            window.zero_()
            self._grad_written[slot.index] = True
        return window

    def write_grad(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Add the parameter's gradient into its window (the first one of a backward is copied)."""
        self.ensure_grad_full()
        window = self.grad_full[slot.start:slot.stop]
        if self._grad_written[slot.index]:
            window.add_(grad.reshape(-1))
        else:
            window.copy_(grad.reshape(-1))
            self._grad_written[slot.index] = True

    def finish_grad_full(self) -> torch.Tensor:
        """``grad_full`` ready to reduce: zeros where no gradient was written (padding, unused
        parameters; all of it if nothing arrived: every rank still takes part)."""
        self.ensure_grad_full()
        g = self.grad_full
        g[self.layout.numel:].zero_()
        for slot, written in zip(self.slots, self._grad_written):
            if not written:
                g[slot.start:slot.stop].zero_()
        return g

    def release_grad_full(self) -> None:
        if self.grad_full_resident():
            self._transient.free(self.grad_full_nbytes)
            self.grad_full.untyped_storage().resize_(0)

    def grad_scatter_input(self) -> torch.Tensor:
        """The full gradient in the order the G-group reduce-scatter hands out chunks.

        With the G-group's communicator in chunk order (layout.grad_reduce_order),
        and whenever P == 1 or P == G, that is the bucket itself. Only where
        torch.distributed sorted the group: rank (q, p) owns chunk q of primary
        chunk p, but reduce_scatter_tensor gives chunk i to sorted group rank
        i = P*q + p, so the bucket is viewed as (P, G/P, N/G) and its first two
        axes swapped (a copy; see megatron_lbp.core.layout).
        """
        if self.grad_chunk_ordered or self.layout.grad_scatter_is_identity:
            return self.grad_full
        P = self.layout.param_group_size
        G = self.layout.grad_group_size
        return self.grad_full.view(P, G // P, -1).transpose(0, 1).reshape(-1)
