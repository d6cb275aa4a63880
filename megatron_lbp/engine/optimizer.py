"""HierDistributedOptimizer: Adam state for 1/O of every bucket, and the step's two network hops.

One step: the 1/G gradient shard reduce-scattered to the 1/O slice (and
all-reduced over R replicas), the gradient norm and inf/nan verdict in one
all-reduce, clipping, AdamW on the fp32 master slice, then the updated weights
gathered back 1/O -> 1/G -> 1/P per unit in the next forward's order.
Invariants: the optimizer slice nests inside the gradient and primary slices
(with fp32 weights the master *is* the primary slice's part); every step's comm
report counts the same bytes. See docs/engine.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_lbp.engine.buckets import FlatBucket
from megatron_lbp.engine import faults
from megatron_lbp.engine.comm import CONTROL
from megatron_lbp.engine import mcore
from megatron_lbp.engine.data_parallel import HierDataParallel
from megatron_lbp.engine.grad_health import GradHealth
from megatron_lbp.engine.memory import tensor_bytes
from megatron_lbp.engine.trace import append_json_line, output_path
from megatron_lbp.engine.unit import GatherUnit


@dataclass
class _BucketState:
    bucket: FlatBucket
    model: HierDataParallel
    unit: GatherUnit
    master: torch.Tensor          # fp32 [N/O] (a view of primary for fp32 weights)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor | None = None   # fp32 [N/O], alive during the step only


class HierDistributedOptimizer(mcore.megatron_optimizer()):
    def __init__(self, config: Any, model_chunks: Sequence[HierDataParallel],
                 param_groups: list[dict], grad_scaler: Any = None,
                 comm_report: str | None = None) -> None:
        if config.optimizer != "adam":
            raise ValueError(f"--optimizer {config.optimizer} is not supported with "
                             "--hier-partition (only adam)")
        self.models = list(model_chunks)
        self.comm = self.models[0].comm
        self.grad_scaler = grad_scaler
        self.comm_report = comm_report
        self.steps_done = 0
        self.last_step_report: dict[str, Any] = {}
        self.states: list[_BucketState] = []
        self.check_for_nan_in_grad = False   # (a property: the wrappers learn it too)
        self.nonfinite_ranks: list[int] = []
        shard_of_param: dict[int, list[torch.nn.Parameter]] = {}
        for model in self.models:
            for b in model.buckets:
                st = self._make_state(model, b)
                self.states.append(st)
                for slot in b.slots:
                    piece = _intersect(slot.start, slot.stop, b.optim_range.start, b.optim_range.stop)
                    if piece is None:
                        shard_of_param[id(slot.param)] = []
                        continue
                    lo, hi = piece[0] - b.optim_range.start, piece[1] - b.optim_range.start
                    shard = torch.nn.Parameter(st.master[lo:hi], requires_grad=False)
                    shard._lbp_bucket_state = st
                    shard._lbp_range = (lo, hi)
                    shard._lbp_name = slot.name
                    # Megatron's norm and zero count skip a weight another one shares (PP > 1).
                    shard._lbp_shared = bool(getattr(slot.param, "shared", False))
                    shard_of_param[id(slot.param)] = [shard]
        groups = []
        for group in param_groups:
            shards = [s for p in group["params"] for s in shard_of_param.get(id(p), [])]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": shards})
        inner = torch.optim.AdamW(
            groups, lr=config.lr, weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
        for group in inner.param_groups:
            for shard in group["params"]:
                st, (lo, hi) = shard._lbp_bucket_state, shard._lbp_range
                # Views into the flat state buffers: the optimizer state is exactly
                # 1/O of every padded bucket, contiguous for checkpoints.
                inner.state[shard] = {
                    # torch's AdamW keeps a CPU step count unless capturable/fused.
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": st.exp_avg[lo:hi],
                    "exp_avg_sq": st.exp_avg_sq[lo:hi],
                }
        super().__init__(inner, config, init_state_fn=lambda *a, **k: None)
        self._device = self.states[0].bucket.device if self.states else torch.device("cpu")
        self._scale_one = torch.tensor([1.0], device=self._device)
        self.is_stub_optimizer = False

    def _make_state(self, model: HierDataParallel, b: FlatBucket) -> _BucketState:
        n = b.layout.optim_size
        own = b.primary[b.optim_in_primary.slice]
        master = own if b.dtype == torch.float32 else own.float().clone()
        return _BucketState(b, model, model.units[b.index], master,
                            torch.zeros(n, device=b.device), torch.zeros(n, device=b.device))

    @property
    def check_for_nan_in_grad(self) -> bool:
        """Megatron's --check-for-nan-in-loss-and-grad (set by the training hooks): stop on an
        inf/nan gradient, naming the rank(s) it came from; otherwise a loss scaler skips
        the step. Where the reduce-scatter scales the gradients itself (PREMUL_SUM), the
        wrappers count each rank's own inf/nan only when this is on
        (engine/grad_health.py: GradHealth.counts_own)."""
        return self._check_for_nan_in_grad

    @check_for_nan_in_grad.setter
    def check_for_nan_in_grad(self, value: bool) -> None:
        self._check_for_nan_in_grad = bool(value)
        for model in self.models:
            model.grad_health.name_ranks = bool(value)

    # --- step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self):
        self._reduce_to_optimizer_slices()
        trace = self.models[0].trace
        # The host side of the step (inf check, norm, clipping, Adam) in the schedule trace.
        interval = trace.compute_start(None, "optimizer") if trace is not None else None
        found_inf, grad_norm = self._norm_and_inf_check()
        if found_inf and self.grad_scaler is not None:
            self._drop_grads()
            if interval is not None:
                trace.compute_end(interval)
            self._finish_step()
            return False, None, None
        if self.config.clip_grad > 0.0 and math.isfinite(grad_norm):
            coeff = self.config.clip_grad / (grad_norm + 1.0e-6)
            if coeff < 1.0:
                for st in self.states:
                    st.grad.mul_(coeff)
        for group in self.optimizer.param_groups:
            for shard in group["params"]:
                lo, hi = shard._lbp_range
                shard.grad = shard._lbp_bucket_state.grad[lo:hi]
        num_zeros = (self._count_zeros() if getattr(self.config, "log_num_zeros_in_grad", False)
                     else None)
        self.optimizer.step()
        self._drop_grads()
        if interval is not None:
            trace.compute_end(interval)
        self._gather_updated_weights()
        self._finish_step()
        return True, grad_norm, num_zeros

    def _own_pieces(self):
        """This rank's fp32 master slice of each weight Megatron counts (not a shared copy)."""
        for group in self.optimizer.param_groups:
            for shard in group["params"]:
                if not shard._lbp_shared:
                    yield shard

    def _sum_over_optimizer_group(self, value: torch.Tensor) -> float:
        # The O-group holds every element exactly once (each replica group the same sum).
        self.comm.all_reduce(value, "optim", CONTROL)
        return value.item()

    def _count_zeros(self) -> int:
        """--log-num-zeros-in-grad: zero elements of the clipped gradients, over all ranks (as
        Megatron's count_zeros_fp32 counts its main gradients after clipping)."""
        zeros = torch.zeros((), dtype=torch.float64, device=self._device)
        for shard in self._own_pieces():
            zeros += shard.grad.numel() - torch.count_nonzero(shard.grad)
        return int(self._sum_over_optimizer_group(zeros))

    @torch.no_grad()
    def params_norm(self) -> float:
        """--log-params-norm: the L2 norm of the fp32 master weights, from this rank's slices
        (Megatron's calc_params_l2_norm reads the same values from whole weights, which a
        rank does not hold between steps)."""
        sq = torch.zeros((), dtype=torch.float64, device=self._device)
        for shard in self._own_pieces():
            sq += shard.double().pow(2).sum()
        return math.sqrt(self._sum_over_optimizer_group(sq))

    def _reduce_to_optimizer_slices(self) -> None:
        for model in self.models:
            model.finish_grad_sync()
            model.start_step_reduces()
        for st in self.states:
            st.grad = st.model.reduced_grad(st.unit)

    def _norm_and_inf_check(self) -> tuple[bool, float]:
        """The global gradient norm and whether any gradient is inf/nan, agreed on every rank.

        One fp64 all-reduce over the O-group (whose ranks hold every element
        exactly once) of this rank's sum of squares and its own count of
        non-finite gradients (counted by the data-parallel wrapper before any
        reduction, where it counts: GradHealth.counts_own), then the
        count over the replicas. A non-finite element makes the sum of squares
        non-finite (squares of finite fp32 values cannot overflow fp64), and any
        rank's inf/nan makes the reduced element non-finite (inf and nan survive
        the sums and the 1/W, int8 blocks holding one dequantize to nan), so that
        one pass alone detects every case exactly; the counts only say whose. Only
        when something is non-finite does :meth:`_blame` find whose.
        """
        hier = self.models[0].hier
        local = torch.zeros((), dtype=torch.float64, device=self._device)
        for m in self.models:
            local += m.grad_health.take_count(self._device)
        sq = torch.zeros((), dtype=torch.float64, device=self._device)
        for st in self.states:
            if self.grad_scaler is not None:
                st.grad.mul_(self.grad_scaler.inv_scale)
            sq += st.grad.double().pow(2).sum()
        both = torch.stack([sq, local])
        self.comm.all_reduce(both, "optim", CONTROL)
        self.comm.all_reduce(both[1:], "replica", CONTROL)
        total_sq, nonfinite = both.tolist()
        found_inf = GradHealth.verdict(total_sq, nonfinite)
        self.nonfinite_ranks = []
        if not found_inf:
            if self.grad_scaler is not None:
                self.grad_scaler.update(False)
            return False, math.sqrt(total_sq)
        self._blame(hier, local > 0, not math.isfinite(sq.item()))
        return True, math.sqrt(total_sq) if total_sq >= 0 else total_sq

    def _blame(self, hier, mine: torch.Tensor, my_slice_nonfinite: bool) -> None:
        """Some gradient is inf/nan: name the ranks whose own gradient was, and react.

        One byte per data-parallel rank (its own gradient was non-finite before
        any reduction) plus one for a non-finite reduced slice (a sum that
        overflowed), MAX-reduced over the O-group and then the replicas:
        together they span every rank, so every rank names the same ranks.
        Where the ranks did not count their own (the collective scaled the
        gradients and no --check-for-nan-in-loss-and-grad) there is no one to
        name, and no collective: every rank knows that alike.
        """
        counted = all(m.grad_health.counts_own for m in self.models)
        self.nonfinite_ranks = []
        if counted:
            flags = torch.zeros(len(hier.dp_ranks) + 1, dtype=torch.uint8, device=self._device)
            flags[hier.dp_index] = mine.to(torch.uint8)
            flags[-1] = int(my_slice_nonfinite)
            self.comm.all_reduce(flags, "optim", CONTROL, op=dist.ReduceOp.MAX)
            self.comm.all_reduce(flags, "replica", CONTROL, op=dist.ReduceOp.MAX)
            flags = flags.tolist()
            self.nonfinite_ranks = [hier.dp_ranks[i] for i, f in enumerate(flags[:-1]) if f]
        iteration = faults.TRACKER.iteration
        origin = (f"rank(s) {self.nonfinite_ranks}" if self.nonfinite_ranks
                  else "no single rank (the reduced sum overflowed)")
        if self.check_for_nan_in_grad:
            raise NonFiniteGradientError(
                f"[megatron-lbp] iteration {iteration}: inf/nan gradient produced by {origin} "
                "before the data-parallel reduction; stopping (--check-for-nan-in-loss-and-grad)",
                self.nonfinite_ranks, iteration)
        if self.grad_scaler is not None:
            before = float(self.grad_scaler.scale.item())
            self.grad_scaler.update(True)
            what = (f"step skipped, loss scale {before:g} -> "
                    f"{float(self.grad_scaler.scale.item()):g}")
        else:
            what = "no loss scaler and no --check-for-nan-in-loss-and-grad: step taken anyway"
        if dist.get_rank() == hier.dp_ranks[0]:
            found = (f"inf/nan gradient from {origin}" if counted else
                     "the reduced gradients are inf/nan (naming the rank(s) they came from "
                     "needs --check-for-nan-in-loss-and-grad)")
            print(f"[megatron-lbp] iteration {iteration}: {found}; {what}", flush=True)

    def _drop_grads(self) -> None:
        for group in self.optimizer.param_groups:
            for shard in group["params"]:
                shard.grad = None
        for st in self.states:
            st.grad = None
            st.model.release_reduced_grad(st.unit)

    def _gather_updated_weights(self) -> None:
        """Each unit's updated 1/O slice handed to the model, whose step communication
        refreshes the primary slices in next-forward order (engine/step_comm.py)."""
        of_unit = {(id(st.model), st.unit.index): st for st in self.states}
        for model in self.models:
            def write_own(unit, model=model):
                st = of_unit[(id(model), unit.index)]
                own = st.bucket.primary[st.bucket.optim_in_primary.slice]
                if st.master.data_ptr() != own.data_ptr():
                    own.copy_(st.master)

            model.send_updated_weights(write_own)

    def _finish_step(self) -> None:
        self.steps_done += 1
        faults.TRACKER.iteration += 1
        self.last_step_report = {"step": self.steps_done, **self.traffic_report(),
                                 "memory_bytes": self.memory_bytes(),
                                 "nonfinite_ranks": list(self.nonfinite_ranks)}
        if self.comm_report:
            self._write_comm_report(self.last_step_report)
        for model in self.models:
            model.end_step(self.steps_done)
            model.comm.ledger.reset()
            model.transient.reset_peak()

    # --- accounting ----------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Measured bytes per state on this rank, the optimizer's and its models' together."""
        out = {"primary": 0, "secondary": 0, "grad": 0, "peak_transient": 0}
        for model in self.models:
            m = model.memory_bytes()
            for k in out:
                out[k] += m[k]
        separate_master = [st.master for st in self.states if st.bucket.dtype != torch.float32]
        out["optimizer"] = tensor_bytes(
            separate_master + [st.exp_avg for st in self.states] + [st.exp_avg_sq for st in self.states])
        out["total"] = out["primary"] + out["secondary"] + out["grad"] + out["optimizer"]
        return out

    def traffic_report(self) -> dict[str, Any]:
        ledger = self.comm.ledger
        return {"traffic_bytes": ledger.by_class(), "traffic_by_phase": ledger.by_phase()}

    def _write_comm_report(self, report: dict[str, Any]) -> None:
        path = output_path(self.comm_report, dist.get_rank())
        if path is not None:
            append_json_line(path, {"rank": dist.get_rank(), **report})

    # --- Megatron's optimizer interface --------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for model in self.models:
            model.zero_grad_buffer()

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def prepare_grads(self) -> bool:
        raise NotImplementedError("HierDistributedOptimizer runs the whole step in step()")

    def step_with_ready_grads(self) -> bool:
        raise NotImplementedError("HierDistributedOptimizer runs the whole step in step()")

    def reload_model_params(self, state_dict=None) -> None:
        """Refresh the fp32 master slices from the (changed) primary weights."""
        for model in self.models:
            model.settle()
        for st in self.states:
            own = st.bucket.primary[st.bucket.optim_in_primary.slice]
            if st.master.data_ptr() != own.data_ptr():
                st.master.copy_(own)

    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        steps = [self.optimizer.state[s]["step"].item()
                 for g in self.optimizer.param_groups for s in g["params"]]
        return {
            "param_groups": groups,
            "step": steps[0] if steps else 0.0,
            "buckets": [{"master": st.master.clone(), "exp_avg": st.exp_avg.clone(),
                         "exp_avg_sq": st.exp_avg_sq.clone()} for st in self.states],
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model in self.models:
            model.settle()   # nothing in flight may land on the loaded slices
        if "param_state" in state_dict:  # from a distributed (torch_dist) checkpoint
            self._load_sharded(state_dict)
            return
        if len(state_dict["buckets"]) != len(self.states):
            raise ValueError(f"optimizer state has {len(state_dict['buckets'])} buckets, "
                             f"this model {len(self.states)}")
        for st, saved in zip(self.states, state_dict["buckets"]):
            for name in ("master", "exp_avg", "exp_avg_sq"):
                mine, theirs = getattr(st, name), saved[name]
                if mine.shape != theirs.shape:
                    raise ValueError(f"optimizer {name} of bucket {st.bucket.index}: saved "
                                     f"{tuple(theirs.shape)}, expected {tuple(mine.shape)}")
                mine.copy_(theirs)
            own = st.bucket.primary[st.bucket.optim_in_primary.slice]
            if st.master.data_ptr() != own.data_ptr():
                own.copy_(st.master)
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for shard in group["params"]:
                self.optimizer.state[shard]["step"].fill_(state_dict["step"])
        if self.grad_scaler is not None and state_dict.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        self._gather_updated_weights()
        # Not part of the next step's report (both hops are charged here, when the
        # chains start), nor of its trace record, except that with overlap the second
        # hop's collectives are issued, and recorded, under the next forward.
        self.comm.ledger.reset()
        if self.models[0].trace is not None:
            self.models[0].trace.discard()

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False,
                           metadata=None, **kwargs):
        from megatron_lbp.engine import checkpoint

        return checkpoint.optimizer_sharded_state_dict(self, model_sharded_state_dict, is_loading)

    def step_count(self) -> float:
        for group in self.optimizer.param_groups:
            for shard in group["params"]:
                return self.optimizer.state[shard]["step"].item()
        return float(self.steps_done)

    def _load_sharded(self, state_dict: dict[str, Any]) -> None:
        from megatron_lbp.engine import checkpoint

        checkpoint.load_optimizer_pieces(self, state_dict)
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for shard in group["params"]:
                self.optimizer.state[shard]["step"].fill_(state_dict["step"])


class NonFiniteGradientError(RuntimeError):
    """An inf/nan gradient with --check-for-nan-in-loss-and-grad; raised on every rank alike."""

    def __init__(self, message: str, ranks: list[int], iteration: int) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.iteration = iteration


def _intersect(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int] | None:
    lo, hi = max(a0, b0), min(a1, b1)
    return (lo, hi) if lo < hi else None
