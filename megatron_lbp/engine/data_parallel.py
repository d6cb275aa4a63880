"""HierDataParallel: Megatron's data-parallel wrapper with weights sharded 1/P and gradients 1/G.

Drop-in for megatron-core's ``DistributedDataParallel`` (a ``_BaseDataParallel``).
It only wires things together: the model cut into gather units
(engine.grouping, engine.unit), hooks that call the schedule (engine.schedule),
and Megatron's DDP interface; ``no_sync()`` marks the step's last micro-batch.
Invariants: anything reading or writing weights outside the step first waits
for the updated-weights gathers (:meth:`HierDataParallel.settle`); every rank
runs the same modules in the same order (rank-dependent parameter use is not
supported). Data flow: docs/design.md §2.3.
"""
from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping

import torch

from megatron_lbp.core import costs
from megatron_lbp.core.config import (EngineOptions, check_quantized_grad_families,
                                      check_training_dtypes, default_grad_reduce_dtype,
                                      hierarchical_grad_reduce)
from megatron_lbp.engine.buckets import FlatBucket
from megatron_lbp.engine.comm import CONTROL, Collectives, CommLedger
from megatron_lbp.engine.grad_health import GradHealth
from megatron_lbp.engine.grouping import UnitSpec, group_into_units
from megatron_lbp.engine.streams import Streams
from megatron_lbp.engine.memory import TransientLedger, tensor_bytes
from megatron_lbp.engine.comm import Pending
from megatron_lbp.engine.schedule import UnitSchedule, in_autograd_backward
from megatron_lbp.engine.step_comm import StepComm
from megatron_lbp.engine.trace import ScheduleTrace, TraceObserver, output_path
from megatron_lbp.engine import checkpoint, mcore
from megatron_lbp.engine.unit import GatherUnit, UnitContext
from megatron_lbp.engine.process_groups import HierGroups
from megatron_lbp.core.topology import family_link_classes, hierarchy_groups

_GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class HierDataParallel(mcore.base_data_parallel()):
    def __init__(self, config: Any, module: torch.nn.Module, hier: HierGroups,
                 options: EngineOptions = EngineOptions(),
                 extra_weight_users: Mapping[torch.nn.Module, Iterable[torch.nn.Parameter]] | None = None,
                 units: Iterable[UnitSpec] | None = None,
                 ledger: CommLedger | None = None,
                 materialize: Callable[["HierDataParallel"], None] | None = None) -> None:
        """``materialize``: sharded initialization (engine/materialize.py). The
        parameters hold no values yet; units are laid out, ``materialize(self)``
        fills the primary slices through :meth:`write_weights`, and only then are
        the working buffers allocated."""
        super().__init__(config=config, module=module)
        self.hier = hier
        self.options = options
        cfg = hier.config
        self.comm = Collectives(
            groups=hier.groups, sizes={f: len(r) for f, r in hier.ranks.items()},
            links=hier.link_classes, ledger=ledger, comm_names=hier.comm_names)
        self.transient = TransientLedger()
        self.weight_keys = checkpoint.WeightKeys()   # what the checkpoint calls each parameter
        self._params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.grad_dtype = _GRAD_DTYPES[options.grad_reduce_dtype or default_grad_reduce_dtype(
            cfg.preset, _DTYPE_NAMES.get(self._params[0][1].dtype, "fp32")
            if self._params else "fp32")]
        self.ctx = self._unit_context(hier)

        unit_map = group_into_units(module, units or [], options.bucket_size,
                                    extra_weight_users)
        self.units: list[GatherUnit] = []
        for plan in unit_map.units:
            index = len(self.units)
            # Where a unit's memory comes into being: its primary slice is first
            # filled from the module's weights in here, or, with sharded
            # initialization, by ``materialize`` below.
            bucket = FlatBucket(
                index, plan.params, dp_index=hier.dp_index, world_size=cfg.world_size,
                param_group_size=cfg.param_group_size, grad_group_size=cfg.grad_group_size,
                optim_group_size=cfg.optim_group_size,
                secondary_group_size=cfg.secondary_group_size, grad_dtype=self.grad_dtype,
                transient=self.transient, secondary_dtype=cfg.secondary_dtype,
                quant_block_size=cfg.quant_block_size, copy_weights=materialize is None,
                grad_chunk_ordered=hier.grad_chunk_ordered)
            self.units.append(GatherUnit(index, plan.kind, plan.layer, bucket, self.ctx))
        self.buckets: list[FlatBucket] = [u.bucket for u in self.units]
        self.comm.streams = Streams(self.buckets[0].device if self.buckets else "cpu")
        # The one owner of the optimizer step's communication (its reductions and refreshes).
        self.step = StepComm(self.ctx)
        self.schedule = UnitSchedule(self.units, unit_map, self.comm, self.step,
                                     overlap=options.overlap,
                                     prefetch_units=options.prefetch_units,
                                     max_pending_reduces=options.max_pending_reduces,
                                     embedding_backward_gather=options.embedding_backward_gather)
        # The step refreshes the updated weights in the order the next forward uses them.
        self.step.forward_order = self.schedule.forward_order
        if materialize is not None:
            materialize(self)
            for b in self.buckets:
                b.attach()
        self._start_trace(options)
        self._hooks = []
        self._register_hooks()

    def _unit_context(self, hier: HierGroups) -> UnitContext:
        """Validate the int8 settings against the weights and the topology; pick qgZ's families.

        Every rank of the data-parallel group sees the same dtypes and the same
        group picture, so a refusal is raised on all of them, before any collective.
        """
        cfg = hier.config
        for dtype in sorted({p.dtype for _, p in self._params}, key=str):
            check_training_dtypes(cfg, _DTYPE_NAMES.get(dtype, str(dtype)))
        classes = family_link_classes(hierarchy_groups(hier.dp_ranks, cfg), hier.locations)
        families = costs.quantized_grad_families(cfg, classes)
        check_quantized_grad_families(cfg, families)
        me = hier.dp_ranks[hier.dp_index]
        return UnitContext(
            comm=self.comm, transient=self.transient, world_size=cfg.world_size,
            grad_dtype=self.grad_dtype, quantize_weight_gather=cfg.quantize_weight_gather,
            quant_block_size=cfg.quant_block_size, quantized_grad_families=families,
            group_index={f: ranks.index(me) for f, ranks in hier.ranks.items()},
            fused_wgrad=bool(getattr(self.config, "gradient_accumulation_fusion", False)),
            secondary_serves_step=cfg.secondary_scope == "step",
            grad_quant_bits=4 if cfg.grad_quant_scheme == "int4-hier" else 8,
            hierarchical_grad="grad" in families and hierarchical_grad_reduce(cfg))

    def _start_trace(self, options: EngineOptions) -> None:
        import torch.distributed as dist

        self.trace: ScheduleTrace | None = None
        path = output_path(options.trace, dist.get_rank()) if options.trace else None
        if path is None:
            return  # no trace object at all: nothing is recorded
        trace = ScheduleTrace(path, dist.get_rank())
        trace.prefetch_units = self.schedule.depth
        trace.units = [u.describe() for u in self.units]
        # It observes the collectives and hears the compute intervals from the schedule.
        self.comm.observe(TraceObserver(trace))
        self.schedule.trace = self.trace = trace

    @property
    def quantized_grad_families(self) -> tuple[str, ...]:
        return self.ctx.quantized_grad_families

    @property
    def overlap_samples(self) -> list[int]:
        """``comm.stats.in_flight`` at the start of each unit's compute since the last
        zero_grad_buffer (docs/design.md §6); :meth:`take_overlap_samples` reads and clears."""
        return self.schedule.overlap_samples

    def take_overlap_samples(self) -> list[int]:
        samples, self.schedule.overlap_samples = self.schedule.overlap_samples, []
        return samples

    # --- hooks ---------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        schedule = self.schedule
        self._hooks.append(self.module.register_forward_pre_hook(
            lambda module, args: schedule.begin_forward()))
        self._hooks.append(self.module.register_forward_hook(
            lambda module, args, output: schedule.end_forward()))
        for m in schedule.uses:
            self._hooks.append(m.register_forward_pre_hook(
                lambda module, args: schedule.pre_forward(module)))
            self._hooks.append(m.register_forward_hook(self._post_forward))
        for m in schedule.releases:
            if m not in schedule.uses:   # holds a unit it does not compute with (a split layer)
                self._hooks.append(m.register_forward_hook(
                    lambda module, args, output: schedule.post_forward(module)))
        for m in schedule.release_after_backward:
            self._hooks.append(m.register_forward_pre_hook(self._hook_inputs_backward))
        for _, p in self._params:
            self._hooks.append(p.register_post_accumulate_grad_hook(schedule.grad_ready))

    def _hook_inputs_backward(self, module, args):
        """The module's backward is done when every input's gradient is (schedule.post_backward)."""
        if not torch.is_grad_enabled() or in_autograd_backward():
            return
        inputs = [t for t in _tensors(args) if t.requires_grad]
        left = [len(inputs)]

        def arrived(grad, module=module) -> None:
            left[0] -= 1
            if left[0] == 0:
                self.schedule.post_backward(module)

        for t in inputs:
            t.register_hook(arrived)

    def _post_forward(self, module, args, output):
        self.schedule.post_forward(module)
        if torch.is_grad_enabled():
            # Fires when the gradients of the outputs are ready, i.e. just before the
            # module's backward (also for a forward recomputed inside the backward).
            hook = functools.partial(_pre_backward, self.schedule, module)
            for t in _tensors(output):
                # Not a parameter handed back (a linear module's skip_bias_add bias): a hook on
                # a leaf would stay for every later backward.
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(hook)

    def reduce_scatter_grad(self, out: torch.Tensor, inp: torch.Tensor, family: str,
                            phase: str, async_op: bool = False,
                            unit: int | None = None) -> Pending:
        """A gradient reduce-scatter in ``family`` (int8 all-to-all with qgZ where it crosses nodes)."""
        return self.ctx.reduce_scatter_grad(out, inp, family, phase, async_op=async_op,
                                            unit=unit)

    # --- Megatron's DDP interface --------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Megatron's schedules run every micro-batch but the last inside it.

        Gradients are reduce-scattered inside the G-group (one node) every
        micro-batch into the persistent 1/G shard regardless (that keeps the full
        gradient off the memory budget); what the context defers is the network
        part: leaving it marks the next backward as the step's last, whose units
        start their reduction to the optimizer slices as soon as their G-group
        reduce-scatter is done (megatron.training sets it as ``no_sync_func``:
        megatron_lbp.integration.megatron_adapter.wrap_model).
        """
        self.schedule.mark_last_micro_batch(False)
        try:
            yield
        finally:
            self.schedule.mark_last_micro_batch(True)

    def mark_last_micro_batch(self) -> None:
        """The next backward is the step's last micro-batch: for callers without ``no_sync``."""
        self.schedule.mark_last_micro_batch(True)

    def start_grad_sync(self, *unused) -> None:
        self.schedule.flush_backward()

    def finish_grad_sync(self, *unused, **kwargs) -> None:
        self.schedule.finish()

    def start_step_reduces(self) -> None:
        """Every unit's reduction to its optimizer slice issued (those not yet started)."""
        self.schedule.start_step_reduces()

    def zero_grad_buffer(self) -> None:
        self._check_no_new_parameters()
        self.schedule.reset_step()
        for b in self.buckets:
            b.grad_shard_fresh = True   # read as zero; the next reduce-scatter overwrites it
        self.schedule.overlap_samples = []

    def scale_gradients(self, scaling_factor: float) -> None:
        for u in self.units:
            self.step.scale(u, scaling_factor)
            u.scale_grad_shard(scaling_factor)

    # --- the optimizer's calls (engine/optimizer.py) --------------------------------------
    @property
    def grad_health(self) -> GradHealth:
        """Whether this step's gradients are finite, and whose were not."""
        return self.ctx.health

    def reduced_grad(self, unit: GatherUnit) -> torch.Tensor:
        """This rank's reduced 1/O gradient slice of ``unit`` (fp32), once it has landed."""
        return self.step.reduced_grad(unit)

    def release_reduced_grad(self, unit: GatherUnit) -> None:
        """Drop ``unit``'s reduced gradient slice (used, or discarded)."""
        self.step.release(unit)

    def send_updated_weights(self, write_own) -> None:
        """``write_own(unit)`` puts the updated 1/O slice into the unit's primary slice; each
        unit is then refreshed in the next forward's order (engine/step_comm.py)."""
        self.step.send_updated_weights(write_own, async_op=self.options.overlap)

    def start_param_sync(self, *unused, force_sync: bool = False, **kwargs) -> None:
        """Weights are gathered on demand; ``force_sync`` waits for the updated weights' gathers."""
        if force_sync:
            self.settle()

    def settle(self) -> None:
        """Wait until every unit's primary slice holds the updated weights (nothing in flight)."""
        self.step.settle()

    def broadcast_params(self) -> None:
        """Make every rank's weights those of data-parallel rank 0's P-group.

        Megatron broadcasts from DP rank 0; here no rank holds all weights, so
        slice p comes from its first holder, DP rank p: DP rank 0 gathers its
        P-group's slices and broadcasts the whole unit, one unit at a time.
        """
        src = self.hier.dp_ranks[0]
        for b in self.gathered_buckets():
            self.comm.broadcast(b.full, src, self.hier.dp_group, _widest_link(self.hier),
                                len(self.hier.dp_ranks))
            b.primary.copy_(b.full[b.primary_range.slice])

    def gathered_buckets(self, write_back: bool = False):
        """Each unit's whole weights in turn (its bucket), resident only while the caller holds it.

        The caller reads (or, with ``write_back``, edits) the bucket's parameters;
        it is freed before the next one is gathered, so a state dict or a
        broadcast never makes the whole model resident.
        """
        self.finish_grad_sync()
        self.settle()
        for u in self.units:
            self.step.await_refresh(u)
            u.unshard(CONTROL, async_op=False)
            try:
                yield u.bucket
            finally:
                if write_back:
                    u.bucket.primary.copy_(u.bucket.full[u.bucket.primary_range.slice])
                u.reshard()

    def write_weights(self, param: torch.nn.Parameter, values: torch.Tensor) -> bool:
        """Sharded initialization: keep this rank's slice of ``param``'s full values.

        False when ``param`` is in no unit (it needs no gradient): the caller keeps it whole.
        """
        hit = self.schedule.slot_of.get(id(param))
        if hit is None:
            return False
        unit, slot = hit
        unit.bucket.write_primary(slot, values)
        return True

    def _state_keys(self, prefix: str = "") -> tuple[dict, dict[int, list[str]]]:
        """The module's state dict with parameters as objects (no values read), and each
        unit parameter's keys (a tied weight has one per module that registers it)."""
        entries = self.module.state_dict(prefix=prefix, keep_vars=True)
        keys: dict[int, list[str]] = defaultdict(list)
        for k, v in entries.items():
            if isinstance(v, torch.nn.Parameter) and id(v) in self.schedule.slot_of:
                keys[id(v)].append(k)
        return entries, keys

    def state_dict(self, prefix: str = "", keep_vars: bool = False, destination=None):
        """Full tensors of every weight (copies), gathered one unit at a time."""
        entries, keys = self._state_keys(prefix)
        out = {k: (v.detach().clone() if torch.is_tensor(v) and not _bucketed(v, keys) else v)
               for k, v in entries.items()}
        for b in self.gathered_buckets():
            for slot in b.slots:
                for k in keys.get(id(slot.param), ()):
                    out[k] = slot.param.detach().clone()
        return out

    def load_state_dict(self, state_dict, strict: bool = True):
        """A plain state dict (full tensors), or what a distributed checkpoint load returned."""
        if any(".__lbp_piece" in k for k in state_dict):
            self.settle()  # nothing in flight may land on the loaded slices
            rest = checkpoint.load_model_pieces(self, state_dict)
            return self.module.load_state_dict(rest, strict=False)
        from torch.nn.modules.module import _IncompatibleKeys

        entries, keys = self._state_keys()
        missing = [k for k in entries if k not in state_dict]
        unexpected = [k for k in state_dict if k not in entries]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.module).__name__}: "
                               f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        rest = dict(state_dict)
        for b in self.gathered_buckets(write_back=True):
            for slot in b.slots:
                for k in keys.get(id(slot.param), ()):
                    if k in rest:
                        with torch.no_grad():
                            slot.param.copy_(rest.pop(k))
        # Buffers and extra state; Megatron's wrappers name keys as their inner module does.
        self.module.load_state_dict(rest, strict=False)
        return _IncompatibleKeys(missing, unexpected)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron-core's sharded state dict, each weight as the pieces this rank holds."""
        self.settle()  # the pieces are views of the primary slices, saved later
        return checkpoint.model_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    # --- accounting ----------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Measured bytes of this wrapper's persistent states (optimizer state is the optimizer's)."""
        return {
            "primary": tensor_bytes(b.primary for b in self.buckets),
            "secondary": tensor_bytes(b.secondary for b in self.buckets),
            "grad": tensor_bytes(b.grad_shard for b in self.buckets),
            "resident_full_weights": tensor_bytes(b.full for b in self.buckets),
            "peak_transient": self.transient.peak,
        }

    def bucket_numels(self) -> list[int]:
        """Elements of each unit (one flat bucket each), in unit order."""
        return [b.numel for b in self.buckets]

    def unit_table(self) -> list[dict[str, Any]]:
        """Each unit's index, kind, layer, numel and padded numel (the trace's unit table)."""
        return [u.describe() for u in self.units]

    def end_step(self, step: int) -> None:
        """The optimizer step is over: write its schedule trace record (with --hier-trace)."""
        if self.trace is not None:
            self.trace.end_step(step)

    def _check_no_new_parameters(self) -> None:
        now = {id(p) for p in self.module.parameters() if p.requires_grad}
        known = set(self.schedule.slot_of)
        if now != known:
            added = [n for n, p in self.module.named_parameters() if id(p) not in known]
            raise RuntimeError(
                "parameters changed after wrapping with HierDataParallel "
                f"(new or re-created: {added[:5]}); create every parameter before wrapping")


def _bucketed(v, keys: Mapping[int, list[str]]) -> bool:
    return isinstance(v, torch.nn.Parameter) and id(v) in keys


def _widest_link(hier: HierGroups) -> str:
    from megatron_lbp.core.topology import link_class

    return link_class(hier.dp_ranks, hier.locations)


def _pre_backward(schedule: UnitSchedule, module: torch.nn.Module, grad) -> None:
    schedule.pre_backward(module)


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)
