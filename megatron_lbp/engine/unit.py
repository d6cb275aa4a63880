"""A gather unit: what one all-gather brings in and one reduce-scatter sends back.

One :class:`~megatron_lbp.engine.buckets.FlatBucket` holding the weights of a part
of the model computed as a whole (a layer, the embedding, the output layer). The
unit owns its collectives and state (weights SHARDED -> GATHERING -> GATHERED ->
SHARDED; gradients into ``grad_full`` then reduce-scattered into the 1/G shard);
*when* they run is the schedule's business (megatron_lbp.engine.schedule).
Invariants: buffers are freed only after the host waited for their event
(``check_free``); a gather waits for the unit's refresh first
(``StepComm.await_refresh``). See docs/engine.md.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_lbp.engine.buckets import FlatBucket, ParamSlot
from megatron_lbp.engine.comm import CONTROL, Collectives, Pending
from megatron_lbp.engine.grad_health import GradHealth
from megatron_lbp.engine.memory import TransientLedger
from megatron_lbp.engine.quantized import (INT4, INT8, all_gather_quantized,
                                           gather_packed_slices, reduce_scatter_hierarchical,
                                           reduce_scatter_quantized)
from megatron_lbp.engine.streams import check_free


class WeightState(enum.Enum):
    SHARDED = "sharded"        # only the primary slice (and the secondary copy) exist
    GATHERING = "gathering"    # an asynchronous all-gather into ``full`` is in flight
    GATHERED = "gathered"      # ``full`` holds the whole unit


@dataclass
class UnitContext:
    """What every unit of one wrapper shares: the collectives, the ledgers, the settings."""

    comm: Collectives
    transient: TransientLedger
    world_size: int
    grad_dtype: torch.dtype
    quantize_weight_gather: bool
    quant_block_size: int
    quantized_grad_families: tuple[str, ...]
    group_index: dict[str, int]
    # Megatron's --gradient-accumulation-fusion: weight gradients arrive in main_grad.
    fused_wgrad: bool = False
    # The secondary copy serves every gather of the step after the first forward's
    # (config.SECONDARY_SCOPES "step"), not only the backward.
    secondary_serves_step: bool = False
    # qgZ's payload (config.GRAD_QUANT_SCHEMES) and whether the "grad" family's reduce runs in
    # two hops, the S-group then "grad_cross" (config.hierarchical_grad_reduce).
    grad_quant_bits: int = 8
    hierarchical_grad: bool = False
    # Whether the step's gradients are finite, and whose were not (engine/grad_health.py).
    health: GradHealth = field(init=False)

    def __post_init__(self) -> None:
        self.health = GradHealth(lambda: self.folds_prescale("grad"))

    def reduce_scatter_grad(self, out: torch.Tensor, inp: torch.Tensor, family: str,
                            phase: str, async_op: bool = False, unit: int | None = None,
                            prescale: float | None = None, stream=None,
                            waits=()) -> Pending:
        """A gradient reduce-scatter in ``family``: int8 all-to-all with qgZ when that
        family crosses nodes, else the plain reduce-scatter (``prescale``: see
        :meth:`folds_prescale`; ``stream``/``waits``: on that stream after those events;
        the two-hop qgZ runs on the secondary and grad_cross reduce streams instead).
        Call ``.wait()`` on the result."""
        if family in self.quantized_grad_families:
            assert prescale is None, "qgZ quantizes the scaled gradient"
            codec = INT4 if self.grad_quant_bits == 4 else INT8
            if family == "grad" and self.hierarchical_grad:
                # Both hops issued here, each on its communicator's reduce stream, hop 2
                # after hop 1's partial sum (an event): no host wait between them.
                hops = None if stream is None else (self.comm.stream("secondary", "reduce"),
                                                    self.comm.stream("grad_cross", "reduce"))
                return reduce_scatter_hierarchical(
                    self.comm, out, inp, self.group_index["secondary"],
                    self.group_index["grad_cross"], self.quant_block_size, phase,
                    self.transient, async_op=async_op, unit=unit, codec=codec,
                    streams=hops, waits=waits)
            return reduce_scatter_quantized(self.comm, out, inp, self.group_index[family],
                                            self.quant_block_size, family, phase,
                                            self.transient, async_op=async_op, unit=unit,
                                            stream=stream, waits=waits, codec=codec)
        return Pending(self.comm.reduce_scatter(out, inp, family, phase, async_op=async_op,
                                                unit=unit, prescale=prescale, stream=stream,
                                                waits=waits))

    def folds_prescale(self, family: str) -> bool:
        """Whether ``family``'s gradient reduce-scatter scales its input itself (not qgZ, and
        a backend with PREMUL_SUM: megatron_lbp.engine.comm.prescale_in_collective)."""
        return family not in self.quantized_grad_families and self.comm.folds_prescale(family)


@dataclass
class ReduceInFlight:
    """A unit's gradient reduce-scatter between issue and completion, with its buffers."""

    unit: "GatherUnit"
    pending: Pending
    out: torch.Tensor       # the 1/G shard itself on the step's first micro-batch
    send: torch.Tensor
    nbytes: int             # transient bytes held by ``out`` and a separate ``send``
    last: bool = False      # of the step's last micro-batch: the step's reduction follows
    accumulated: bool = False   # ``out`` is added into the 1/G shard on the stream


class GatherUnit:
    def __init__(self, index: int, kind: str, layer: int | None, bucket: FlatBucket,
                 ctx: UnitContext) -> None:
        self.index = index
        self.kind = kind
        self.layer = layer
        self.bucket = bucket
        self.ctx = ctx
        self.state = WeightState.SHARDED
        self._pending: Pending | None = None
        self.grads_left = len(bucket.slots)

    def describe(self) -> dict[str, Any]:
        """The unit's row in the schedule trace's unit table."""
        row: dict[str, Any] = {"unit": self.index, "kind": self.kind}
        if self.layer is not None:
            row["layer"] = self.layer
        row.update(numel=self.bucket.numel, padded_numel=self.bucket.layout.padded_numel)
        return row

    @property
    def numel(self) -> int:
        return self.bucket.numel

    # --- weights -------------------------------------------------------------------------
    def reads_secondary(self, phase: str) -> bool:
        """Whether a gather in ``phase`` reads the secondary copy: every backward gather when
        there is one; with the step scope also a forward gather once the step's first forward
        has built it from the current weights."""
        b = self.bucket
        if not b.has_secondary or phase == CONTROL:
            return False
        if phase == "backward_gather":
            return True
        return self.ctx.secondary_serves_step and b.secondary_is_current()

    def unshard(self, phase: str, async_op: bool) -> None:
        """Start filling ``full``: from the secondary copy in the S-group where
        :meth:`reads_secondary`, else from the primary slices in the P-group (int8 on the
        wire with qwZ)."""
        b, ctx = self.bucket, self.ctx
        check_free(b.primary, f"unit {self.index}'s primary slice")
        b.alloc_full()
        if self.reads_secondary(phase):
            pending = self._gather_secondary(phase, async_op)
        elif ctx.quantize_weight_gather and phase != CONTROL:
            pending = all_gather_quantized(ctx.comm, b.full, b.primary, ctx.quant_block_size,
                                           "param", phase, ctx.transient, async_op=async_op,
                                           unit=self.index,
                                           stream=self._stream("param", async_op))
        else:
            pending = Pending(ctx.comm.all_gather(b.full, b.primary, "param", phase,
                                                  async_op=async_op, unit=self.index,
                                                  stream=self._stream("param", async_op)))
        if async_op and pending.in_flight:
            self._pending, self.state = pending, WeightState.GATHERING
        else:
            pending.wait()
            self.state = WeightState.GATHERED

    def _stream(self, family: str, async_op: bool, channel: str = "gather"):
        """Where an asynchronous collective of this unit runs: its communicator's stream
        (megatron_lbp.engine.streams); a synchronous one runs on the host (None)."""
        return self.ctx.comm.stream(family, channel) if async_op else None

    def _gather_secondary(self, phase: str, async_op: bool) -> Pending:
        b, ctx = self.bucket, self.ctx
        stream = self._stream("secondary", async_op)
        if not b.secondary_is_current():
            raise RuntimeError(
                f"unit {self.index} ({self.kind}): the backward pass needs the secondary "
                "weight copy, but it was not built from the current weights (no forward "
                "since they changed); run the forward pass before its backward")
        if b.secondary_dtype == "int8":
            return gather_packed_slices(ctx.comm, b.full, b.secondary, ctx.quant_block_size,
                                        "secondary", phase, ctx.transient,
                                        async_op=async_op, unit=self.index, stream=stream)
        if ctx.quantize_weight_gather:
            # qwZ covers the secondary gather too (DeepSpeed quantizes every weight
            # all-gather, hpZ's intra-node one included, when zero_quantized_weights is on).
            return all_gather_quantized(ctx.comm, b.full, b.secondary, ctx.quant_block_size,
                                        "secondary", phase, ctx.transient, async_op=async_op,
                                        unit=self.index, stream=stream)
        if b.full.dtype == b.secondary.dtype:
            return Pending(ctx.comm.all_gather(b.full, b.secondary, "secondary", phase,
                                               async_op=async_op, unit=self.index,
                                               stream=stream))
        # bf16 copy of wider weights: gather in bf16, widen on arrival.
        tmp = torch.empty(b.layout.padded_numel, dtype=b.secondary.dtype, device=b.device)
        nbytes = tmp.numel() * tmp.element_size()
        ctx.transient.alloc(nbytes)
        work = ctx.comm.all_gather(tmp, b.secondary, "secondary", phase,
                                   async_op=async_op, unit=self.index, stream=stream)

        def finish() -> None:
            b.full.copy_(tmp)
            ctx.transient.free(nbytes)

        return Pending(work, finish)

    def wait_for_unshard(self) -> None:
        if self.state is WeightState.GATHERING:
            pending, self._pending = self._pending, None
            pending.wait()
            self.state = WeightState.GATHERED

    def reshard(self) -> None:
        """Free ``full`` (waiting first for a gather still in flight into it)."""
        self.wait_for_unshard()
        check_free(self.bucket.full, f"unit {self.index}'s gathered weights")
        self.bucket.free_full()
        self.state = WeightState.SHARDED

    def build_secondary(self) -> None:
        """Keep this rank's 1/S slice of the weights this forward computes with (S > 0); with
        the step scope only where the step's weights are not in it yet (its first forward)."""
        b = self.bucket
        if b.has_secondary and not (self.ctx.secondary_serves_step and b.secondary_is_current()):
            b.build_secondary()

    # --- gradients -----------------------------------------------------------------------
    def grad_buffer(self, slot: ParamSlot) -> torch.Tensor:
        """The parameter's window of the unit's full gradient (zeros or what it holds so far;
        the buffer lives from its first use until the reduce-scatter is done)."""
        return self.bucket.grad_view(slot)

    def prepare_backward(self) -> None:
        """Before the unit's backward: a fused wgrad kernel accumulates into the ``main_grad``
        views, which must hold zeros."""
        if self.ctx.fused_wgrad:
            self.bucket.ensure_grad_full(zero=True)

    def accumulate(self, slot: ParamSlot, grad: torch.Tensor | None) -> bool:
        """Write one parameter's gradient (None: it is already in ``main_grad``); True when it
        was the unit's last one."""
        if grad is not None:
            with torch.no_grad():
                self.bucket.write_grad(slot, grad)
        self.grads_left -= 1
        return self.grads_left == 0

    def start_reduce(self, async_op: bool, last: bool = False) -> ReduceInFlight:
        """Free the weights and reduce-scatter the unit's gradient in the G-group, averaged.

        The first micro-batch after zero_grad_buffer writes the 1/G shard
        directly; later ones reduce into a buffer that is added to it: on the
        reduce stream after the collective when asynchronous (the result's event
        is then the shard's: the step's reduction may wait for it), else by
        :meth:`finish_reduce`.
        """
        b, ctx = self.bucket, self.ctx
        self.reshard()
        grad = b.finish_grad_full()  # zeros if nothing arrived: still take part
        ctx.comm.poison_if_injected(grad, "grad_reduce")
        send = b.grad_scatter_input()
        send_extra = 0 if send is grad else send.numel() * send.element_size()
        if b.grad_shard_fresh:
            out, b.grad_shard_fresh = b.grad_shard, False
            nbytes = send_extra
        else:
            out = torch.empty(b.layout.grad_size, dtype=ctx.grad_dtype, device=b.device)
            nbytes = send_extra + out.numel() * out.element_size()
        ctx.transient.alloc(nbytes)
        scale = 1.0 / ctx.world_size
        fold = ctx.folds_prescale("grad")
        if not fold:
            ctx.health.scale_and_count(send, scale)
        stream = self._stream("grad", async_op, "reduce")
        pending = ctx.reduce_scatter_grad(out, send, "grad", "grad_reduce", async_op=async_op,
                                          unit=self.index, prescale=scale if fold else None,
                                          stream=stream)
        accumulated = False
        if stream is not None and out is not b.grad_shard and pending.event is not None:
            shard = b.grad_shard
            pending.event = stream.submit(lambda: shard.add_(out), (pending.event,),
                                          holds=(out, shard), what="grad_reduce accumulate")
            accumulated = True
        if fold and ctx.health.name_ranks:
            # A read of this rank's own gradient besides the collective's, only to name it:
            # the optimizer's pass over the reduced slices already detects any rank's
            # inf/nan exactly. Stock Megatron pays the same read only with
            # check_for_nan_in_grad (megatron-core 0.19.2,
            # distributed/param_and_grad_buffer.py: start_grad_sync calls check_grads, a
            # norm per bucket, only when ddp_config.check_for_nan_in_grad).
            ctx.health.count(grad)
        return ReduceInFlight(self, pending, out, send, nbytes, last, accumulated)

    def finish_reduce(self, reduce: ReduceInFlight) -> None:
        reduce.pending.wait()   # its event: only then are its buffers read or freed
        b = self.bucket
        check_free(reduce.send, f"unit {self.index}'s gradient sent to the reduce-scatter")
        if reduce.out is not b.grad_shard:   # (the shard itself lives on: the step reads it)
            check_free(reduce.out, f"unit {self.index}'s reduce-scatter output")
            if not reduce.accumulated:
                b.grad_shard.add_(reduce.out)
        self.ctx.transient.free(reduce.nbytes)
        b.release_grad_full()

    def reset_pass(self) -> None:
        self.grads_left = len(self.bucket.slots)

    def scale_grad_shard(self, factor: float) -> None:
        """Megatron's scale_gradients on the 1/G shard (the step's reduction of it is
        engine/step_comm.py's)."""
        if not self.bucket.grad_shard_fresh:
            self.bucket.grad_shard.mul_(factor)


def unfused_gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient of ``param`` still to add to its unit, or None (consumes Megatron's flag).

    With gradient-accumulation fusion Megatron's linear layers (and Transformer
    Engine's) accumulate the weight gradient into ``param.main_grad``, set
    ``grad_added_to_main_grad`` and hand autograd a dummy gradient, which is
    dropped, unless the weight is also used unfused (``zero_out_wgrad``: the tied
    embedding, whose lookup gradient rides on a zero dummy).
    """
    fused = getattr(param, "grad_added_to_main_grad", False)
    param.grad_added_to_main_grad = False
    if fused and not getattr(param, "zero_out_wgrad", False):
        return None
    return param.grad
