"""HierDataParallel: Megatron's data-parallel wrapper with weights sharded 1/P and gradients 1/G.

Drop-in for megatron-core's ``DistributedDataParallel`` where megatron.training
and :class:`~megatron_lbp.engine.optimizer.HierDistributedOptimizer` use it
(it subclasses megatron-core's ``_BaseDataParallel``, the template class for
data-parallel implementations).

Life of one bucket in a micro-batch (see DESIGN.md §2):

forward   first owner module's pre-hook: all-gather the primary slices in the
          P-group into ``full`` (or wait for the prefetch issued one bucket
          earlier; int8 + scales on the wire with qwZ), keep this rank's 1/S
          slice of it as the secondary copy when S > 0, then prefetch the
          next bucket in forward order;
          last owner's post-hook: free ``full``.
backward  a hook on each owner's outputs fires when their gradient is ready,
          i.e. just before the module's backward: gather again -- from the
          secondary copies in the S-group when S > 0, else from the primary
          in the P-group -- (and prefetch the next bucket in backward order);
          activation recomputation's forward pre-hooks gather the same way;
          each parameter's post-accumulate-grad hook adds its gradient into
          the bucket's ``grad_full`` and drops ``param.grad``; when the last
          one arrives the weights are freed and ``grad_full`` (scaled by 1/W)
          is reduce-scattered in the G-group, asynchronously when overlap is
          on (an int8 all-to-all summed in fp32 when qgZ covers that group),
          and added to the persistent 1/G ``grad_shard``.

An "owner" of a bucket is a module whose own parameters live in it, plus any
module that uses a bucket's weight without owning it (tied output layer),
which the Megatron adapter names. Every rank issues the same collectives in
the same order because every rank runs the same modules in the same order.
Data-dependent parameter use that differs between ranks is not supported.
"""
from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from typing import Any, Iterable, Mapping

import torch

from megatron_lbp import costs
from megatron_lbp.config import (EngineOptions, check_quantized_grad_families,
                                 check_training_dtypes)
from megatron_lbp.engine.buckets import FlatBucket, GatherState, split_into_buckets
from megatron_lbp.engine.comm import CONTROL, Collectives, CommLedger
from megatron_lbp.engine.memory import TransientLedger, tensor_bytes
from megatron_lbp.engine.quantized import (Pending, all_gather_quantized, gather_packed_slices,
                                           reduce_scatter_quantized)
from megatron_lbp.process_groups import HierGroups

_GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Reduce-scatters kept in flight before the oldest is waited for: bounds the
# number of full gradient buckets alive at once during backward.
MAX_PENDING_REDUCES = 2


def _megatron_base():
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    return _BaseDataParallel


class HierDataParallel(_megatron_base()):
    def __init__(self, config: Any, module: torch.nn.Module, hier: HierGroups,
                 options: EngineOptions = EngineOptions(),
                 extra_weight_users: Mapping[torch.nn.Module, Iterable[torch.nn.Parameter]] | None = None,
                 units: Iterable[torch.nn.Module] | None = None,
                 ledger: CommLedger | None = None) -> None:
        super().__init__(config=config, module=module)
        self.hier = hier
        self.options = options
        cfg = hier.config
        self.comm = Collectives(
            groups=hier.groups, sizes={f: len(r) for f, r in hier.ranks.items()},
            links=hier.link_classes, ledger=ledger)
        self.transient = TransientLedger()
        # Count of this rank's own non-finite bucket gradients since the last optimizer
        # step, taken before the reduction mixes ranks (read and reset by the optimizer).
        self.local_nonfinite = torch.zeros((), dtype=torch.int32)
        self.grad_dtype = _GRAD_DTYPES[options.grad_reduce_dtype]
        self._params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._setup_quantization(hier)
        self.buckets: list[FlatBucket] = []
        for group in _same_dtype_runs(self._params):
            for named in split_into_buckets(group, options.bucket_size):
                self.buckets.append(FlatBucket(
                    len(self.buckets), named, dp_index=hier.dp_index, world_size=cfg.world_size,
                    param_group_size=cfg.param_group_size, grad_group_size=cfg.grad_group_size,
                    optim_group_size=cfg.optim_group_size,
                    secondary_group_size=cfg.secondary_group_size, grad_dtype=self.grad_dtype,
                    transient=self.transient, secondary_dtype=cfg.secondary_dtype,
                    quant_block_size=cfg.quant_block_size))
        self._slot_of = {id(s.param): (b, s) for b in self.buckets for s in b.slots}

        self._owned: dict[torch.nn.Module, list[FlatBucket]] = defaultdict(list)
        for m, params in _owners(module, units or [], extra_weight_users or {}).items():
            for p in params:
                b = self._slot_of[id(p)][0]
                if b not in self._owned[m]:
                    self._owned[m].append(b)
        self._owner_count = defaultdict(int)
        for buckets in self._owned.values():
            for b in buckets:
                self._owner_count[b.index] += 1

        # Bucket order of the first forward and first backward; prefetching follows them after.
        self._used: set[int] = set()      # buckets ensured in the current pass
        self._cursor = -1                 # furthest position reached in the pass's order
        self._fwd_order: list[int] = []
        self._bwd_order: list[int] = []
        self._fwd_recorded = False
        self._bwd_recorded = False
        self._in_backward = False
        self._backward_ran = False
        self._fwd_left: dict[int, int] = {}
        self._grads_left: dict[int, int] = {}
        self._reduced: set[int] = set()
        self._pending_reduces: list[tuple[FlatBucket, Any, torch.Tensor, torch.Tensor]] = []
        self._hooks = []
        self._register_hooks()

    def _setup_quantization(self, hier: HierGroups) -> None:
        """Validate the int8 settings against the weights and the topology; pick qgZ's families.

        Every rank of the data-parallel group sees the same dtypes and the same
        group picture, so a refusal is raised on all of them, before any collective.
        """
        cfg = hier.config
        names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        for dtype in sorted({p.dtype for _, p in self._params}, key=str):
            check_training_dtypes(cfg, names.get(dtype, str(dtype)))
        from megatron_lbp.topology import family_link_classes, hierarchy_groups

        classes = family_link_classes(hierarchy_groups(hier.dp_ranks, cfg), hier.locations)
        self.quantized_grad_families = costs.quantized_grad_families(cfg, classes)
        check_quantized_grad_families(cfg, self.quantized_grad_families)
        self.quantize_weight_gather = cfg.quantize_weight_gather
        self.quant_block_size = cfg.quant_block_size
        me = hier.dp_ranks[hier.dp_index]
        self._group_index = {f: ranks.index(me) for f, ranks in hier.ranks.items()}

    # --- hooks ---------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        self._hooks.append(self.module.register_forward_pre_hook(self._root_pre_forward))
        self._hooks.append(self.module.register_forward_hook(self._root_post_forward))
        for m in self._owned:
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(m.register_forward_hook(self._post_forward))
        for _, p in self._params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _root_pre_forward(self, module, args):
        self._flush_backward()
        self._in_backward = False
        self._backward_ran = False
        self._fwd_left = {b.index: self._owner_count[b.index] for b in self.buckets}
        self._grads_left = {b.index: len(b.slots) for b in self.buckets}
        self._reduced = set()
        self._used: set[int] = set()
        self._cursor = -1

    def _root_post_forward(self, module, args, output):
        # Owners that did not run this time (conditional code) leave their bucket gathered.
        for b in self.buckets:
            if b.state is not GatherState.SHARDED and not self._in_backward:
                self._wait(b)
                b.free_full()
        self._fwd_recorded = self._fwd_recorded or bool(self._fwd_order)

    def _pre_forward(self, module, args):
        if self._in_backward:  # activation recomputation inside backward
            for b in self._owned[module]:
                self._ensure_gathered(b, "backward_gather", None, False)
            return
        for b in self._owned[module]:
            self._ensure_gathered(b, "forward_gather", self._fwd_order, self._fwd_recorded)

    def _post_forward(self, module, args, output):
        if self._in_backward:
            return  # activation recomputation: weights stay for the backward that follows
        for b in self._owned[module]:
            self._fwd_left[b.index] -= 1
            if self._fwd_left[b.index] == 0:
                self._wait(b)
                b.free_full()
        if torch.is_grad_enabled():
            hook = functools.partial(self._pre_backward, module)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(hook)

    def _pre_backward(self, module, grad):
        if not self._in_backward:  # first hook of this backward: a new pass
            self._used, self._cursor = set(), -1
        self._in_backward = True
        self._backward_ran = True
        for b in self._owned[module]:
            if b.index not in self._reduced:
                self._ensure_gathered(b, "backward_gather", self._bwd_order, self._bwd_recorded)
        return None

    def _grad_ready(self, param: torch.nn.Parameter) -> None:
        b, slot = self._slot_of[id(param)]
        self._backward_ran = True
        with torch.no_grad():
            b.grad_view(slot).add_(param.grad.reshape(-1))
        param.grad = None
        self._grads_left[b.index] -= 1
        if self._grads_left[b.index] == 0:
            self._reduce(b)

    # --- gathers -------------------------------------------------------------------------
    def _ensure_gathered(self, b: FlatBucket, phase: str, order: list[int] | None,
                         recorded: bool) -> None:
        if order is not None and not recorded and b.index not in order:
            order.append(b.index)
        self._used.add(b.index)
        if b.state is GatherState.SHARDED:
            self._gather(b, phase, async_op=False)
        else:
            self._wait(b)
        if phase == "forward_gather" and b.has_secondary:
            # The weights this forward computes with, kept as this rank's 1/S
            # slice for the backward: rebuilt by every forward, never stale.
            b.build_secondary()
        if self.options.overlap and recorded:
            self._prefetch_after(b, order, phase)

    def _gather(self, b: FlatBucket, phase: str, async_op: bool) -> None:
        """Start filling ``full``: from the secondary copy in backward when there is one,
        else from the primary slices in the P-group (int8 on the wire with qwZ)."""
        b.alloc_full()
        if phase == "backward_gather" and b.has_secondary:
            pending = self._gather_secondary(b, async_op)
        elif self.quantize_weight_gather and phase != CONTROL:
            pending = all_gather_quantized(self.comm, b.full, b.primary, self.quant_block_size,
                                           "param", phase, self.transient, async_op=async_op)
        else:
            pending = Pending(self.comm.all_gather(b.full, b.primary, "param", phase,
                                                   async_op=async_op))
        b.pending = pending
        b.state = GatherState.GATHERING if async_op and pending.in_flight else GatherState.GATHERED

    def _gather_secondary(self, b: FlatBucket, async_op: bool) -> Pending:
        if not b.secondary_is_current():
            raise RuntimeError(
                f"bucket {b.index}: the backward pass needs the secondary weight copy, but it "
                "was not built from the current weights (no forward since they changed); "
                "run the forward pass before its backward")
        if b.secondary_dtype == "int8":
            return gather_packed_slices(self.comm, b.full, b.secondary, self.quant_block_size,
                                        "secondary", "backward_gather", self.transient,
                                        async_op=async_op)
        if b.full.dtype == b.secondary.dtype:
            return Pending(self.comm.all_gather(b.full, b.secondary, "secondary",
                                                "backward_gather", async_op=async_op))
        # bf16 copy of wider weights: gather in bf16, widen on arrival.
        tmp = torch.empty(b.layout.padded_numel, dtype=b.secondary.dtype, device=b.device)
        nbytes = tmp.numel() * tmp.element_size()
        self.transient.alloc(nbytes)
        work = self.comm.all_gather(tmp, b.secondary, "secondary", "backward_gather",
                                    async_op=async_op)

        def finish() -> None:
            b.full.copy_(tmp)
            self.transient.free(nbytes)

        pending = Pending(work, finish)
        if not async_op:
            pending.wait()
        return pending

    def _wait(self, b: FlatBucket) -> None:
        if b.state is GatherState.GATHERING:
            b.pending.wait()
            b.pending = None
            b.state = GatherState.GATHERED

    def _prefetch_after(self, b: FlatBucket, order: list[int], phase: str) -> None:
        """Start gathering the bucket that follows ``b`` in this pass's recorded order.

        Only when ``b`` moves the pass forward: a module revisiting an earlier
        bucket (the tied output layer uses the first bucket last) must not
        drag in buckets that were already used and freed.
        """
        position = order.index(b.index) if b.index in order else -1
        if position <= self._cursor:
            return
        self._cursor = position
        if position + 1 >= len(order):
            return
        index = order[position + 1]
        nxt = self.buckets[index]
        if index in self._used or index in self._reduced or nxt.state is not GatherState.SHARDED:
            return
        self._gather(nxt, phase, async_op=True)

    # --- gradient reduction --------------------------------------------------------------
    def _reduce(self, b: FlatBucket) -> None:
        """Free the weights and reduce-scatter the bucket's gradient in the G-group."""
        self._reduced.add(b.index)
        self._wait(b)
        b.free_full()
        if b.grad_full is None:  # nothing arrived: still take part in the collective
            b.grad_view(b.slots[0])
        b.grad_full.mul_(1.0 / self.hier.config.world_size)
        self.comm.poison_if_injected(b.grad_full, "grad_reduce")
        finite = torch.isfinite(b.grad_full.sum())  # inf/nan survive the sum; no sync on GPU
        self.local_nonfinite = self.local_nonfinite.to(b.device) + ~finite
        send = b.grad_scatter_input()
        send_extra = 0 if send is b.grad_full else send.numel() * send.element_size()
        out = torch.empty(b.layout.grad_size, dtype=self.grad_dtype, device=b.device)
        self.transient.alloc(send_extra + out.numel() * out.element_size())
        work = self.reduce_scatter_grad(out, send, "grad", "grad_reduce",
                                        async_op=self.options.overlap)
        self._pending_reduces.append((b, work, out, send))
        limit = MAX_PENDING_REDUCES if self.options.overlap else 0
        while len(self._pending_reduces) > limit:
            self._complete_oldest_reduce()

    def reduce_scatter_grad(self, out: torch.Tensor, inp: torch.Tensor, family: str,
                            phase: str, async_op: bool = False) -> Pending:
        """A gradient reduce-scatter in ``family``: int8 all-to-all with qgZ when that
        family crosses nodes, else the plain reduce-scatter. Call ``.wait()`` on the result."""
        if family in self.quantized_grad_families:
            return reduce_scatter_quantized(self.comm, out, inp, self._group_index[family],
                                            self.quant_block_size, family, phase,
                                            self.transient, async_op=async_op)
        return Pending(self.comm.reduce_scatter(out, inp, family, phase, async_op=async_op))

    def _complete_oldest_reduce(self) -> None:
        b, work, out, send = self._pending_reduces.pop(0)
        work.wait()
        b.grad_shard.add_(out)
        send_extra = 0 if send is b.grad_full else send.numel() * send.element_size()
        self.transient.free(send_extra + out.numel() * out.element_size())
        b.release_grad_full()

    def _flush_backward(self) -> None:
        """Reduce what the last backward left (unused parameters) and wait for every reduce."""
        if self._backward_ran:
            for b in self.buckets:
                if b.index not in self._reduced:
                    self._reduce(b)
            self._backward_ran = False
            self._bwd_recorded = self._bwd_recorded or bool(self._bwd_order)
        while self._pending_reduces:
            self._complete_oldest_reduce()

    # --- Megatron's DDP interface --------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accepted for Megatron's schedules; nothing to defer.

        Gradients are reduce-scattered inside the G-group (one node) every
        micro-batch into the persistent 1/G shard, which is what keeps the full
        gradient off the memory budget; the network part of the reduction
        happens once per optimizer step regardless.
        """
        yield

    def start_grad_sync(self, *unused) -> None:
        self._flush_backward()

    def finish_grad_sync(self, *unused, **kwargs) -> None:
        self._flush_backward()
        self._in_backward = False
        for b in self.buckets:
            if b.state is not GatherState.SHARDED:
                self._wait(b)
                b.free_full()

    def zero_grad_buffer(self) -> None:
        self._check_no_new_parameters()
        for b in self.buckets:
            b.grad_shard.zero_()

    def scale_gradients(self, scaling_factor: float) -> None:
        for b in self.buckets:
            b.grad_shard.mul_(scaling_factor)

    def start_param_sync(self, *unused, **kwargs) -> None:
        """Weights are gathered on demand from the primary slices: nothing to start."""

    def broadcast_params(self) -> None:
        """Make every rank's weights those of data-parallel rank 0's P-group.

        Megatron broadcasts from DP rank 0; here no rank holds all weights, so
        slice p comes from its first holder, DP rank p: DP rank 0 gathers its
        P-group's slices and broadcasts the whole bucket.
        """
        src = self.hier.dp_ranks[0]
        with self.gathered_weights(write_back=False):
            for b in self.buckets:
                self.comm.broadcast(b.full, src, self.hier.dp_group, _widest_link(self.hier),
                                    len(self.hier.dp_ranks))
                b.primary.copy_(b.full[b.primary_range.slice])

    @contextlib.contextmanager
    def gathered_weights(self, write_back: bool = False):
        """All weights resident (e.g. to save or load a plain state dict); optionally keep edits."""
        self.finish_grad_sync()
        for b in self.buckets:
            self._gather(b, CONTROL, async_op=False)
        try:
            yield self
        finally:
            for b in self.buckets:
                if write_back:
                    b.primary.copy_(b.full[b.primary_range.slice])
                b.free_full()

    def state_dict(self, prefix: str = "", keep_vars: bool = False, destination=None):
        with self.gathered_weights():
            sd = self.module.state_dict(prefix=prefix, keep_vars=False)
            return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in sd.items()}

    def load_state_dict(self, state_dict, strict: bool = True):
        """A plain state dict (full tensors), or what a distributed checkpoint load returned."""
        from megatron_lbp.engine import checkpoint

        if any(".__lbp_piece" in k for k in state_dict):
            rest = checkpoint.load_model_pieces(self, state_dict)
            return self.module.load_state_dict(rest, strict=False)
        with self.gathered_weights(write_back=True):
            return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron-core's sharded state dict, each weight as the pieces this rank holds."""
        from megatron_lbp.engine import checkpoint

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
        return [b.numel for b in self.buckets]

    def _check_no_new_parameters(self) -> None:
        now = {id(p) for p in self.module.parameters() if p.requires_grad}
        known = set(self._slot_of)
        if now != known:
            added = [n for n, p in self.module.named_parameters() if id(p) not in known]
            raise RuntimeError(
                "parameters changed after wrapping with HierDataParallel "
                f"(new or re-created: {added[:5]}); create every parameter before wrapping")


def _owners(root: torch.nn.Module, units: Iterable[torch.nn.Module],
            extra_weight_users: Mapping[torch.nn.Module, Iterable[torch.nn.Parameter]]
            ) -> dict[torch.nn.Module, list[torch.nn.Parameter]]:
    """Which module's forward must have which parameters gathered.

    A parameter belongs to the innermost of ``units`` whose subtree holds it,
    else to the module that registers it. Units exist because a module may
    hand its own weight to its parent: Megatron's linear layers return their
    bias (skip_bias_add) for the transformer layer to add later, so hooking
    the linear layer alone would free the bias before that use.
    """
    unit_set = set(units)
    owner_of: dict[int, torch.nn.Module] = {}

    def walk(m: torch.nn.Module, unit: torch.nn.Module | None) -> None:
        if m in unit_set:
            unit = m
        for p in m.parameters(recurse=False):
            owner_of.setdefault(id(p), unit if unit is not None else m)
        for child in m.children():
            walk(child, unit)

    walk(root, None)
    owners: dict[torch.nn.Module, list[torch.nn.Parameter]] = defaultdict(list)
    for p in root.parameters():
        if p.requires_grad:
            owners[owner_of[id(p)]].append(p)
    for m, params in extra_weight_users.items():
        owners[m].extend(params)
    return owners


def _widest_link(hier: HierGroups) -> str:
    from megatron_lbp.topology import link_class

    return link_class(hier.dp_ranks, hier.locations)


def _same_dtype_runs(named_params):
    """Consecutive runs of parameters with one dtype (a flat bucket holds one dtype)."""
    runs, current = [], []
    for name, p in named_params:
        if current and current[-1][1].dtype != p.dtype:
            runs.append(current)
            current = []
        current.append((name, p))
    if current:
        runs.append(current)
    return runs


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)
