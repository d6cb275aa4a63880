"""The engine's optimizer state gathered into whole parameters, and what differs between two such states.

Each rank of HierDistributedOptimizer holds 1/O of every bucket's fp32 master
weights, exp_avg and exp_avg_sq (flat buffers over the bucket's optimizer
range). Put back together per parameter name, states taken under different
hierarchies and world sizes become comparable element by element: the test
of a checkpoint moving between them is then "the state after loading equals
the state that was saved", bit for bit, not only "the next loss looks right".

Runs inside ranks started by :mod:`megatron_lbp.testing.multirank` (any
process group holding every data-parallel rank).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Megatron's DistributedOptimizer names, as the checkpoint keys use them.
STATE_NAMES = ("fp32_param", "exp_avg", "exp_avg_sq")


@dataclass
class OptimizerState:
    """Whole-parameter optimizer state: ``tensors[state][param name]`` flat fp32, plus Adam's step."""

    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    step: float | None = None    # None: not known (read from a checkpoint's tensors only)


def _held_pieces(optimizer):
    """(param name, numel, offset in the param, {state: values}) of every piece this rank holds."""
    pieces = []
    for st in optimizer.states:
        b = st.bucket
        bufs = {"fp32_param": st.master, "exp_avg": st.exp_avg, "exp_avg_sq": st.exp_avg_sq}
        for slot in b.slots:
            lo, hi = max(slot.start, b.optim_range.start), min(slot.stop, b.optim_range.stop)
            if lo >= hi:
                continue
            rel = slice(lo - b.optim_range.start, hi - b.optim_range.start)
            pieces.append((slot.name, slot.numel, lo - slot.start,
                           {name: buf[rel].detach().float().clone() for name, buf in bufs.items()}))
    return pieces


def gather_optimizer_state(optimizer, group=None) -> OptimizerState:
    """Every rank's pieces of ``optimizer`` (a HierDistributedOptimizer) put together; on every rank.

    Replicas (O < W) hold the same pieces; they must agree exactly, or this raises.
    Raises if any element of any parameter is held by no rank.
    """
    world = dist.get_world_size(group)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, _held_pieces(optimizer), group=group)
    out = OptimizerState(tensors={name: {} for name in STATE_NAMES}, step=optimizer.step_count())
    covered: dict[str, torch.Tensor] = {}
    for rank, pieces in enumerate(everyone):
        for pname, numel, offset, values in pieces:
            if pname not in covered:
                covered[pname] = torch.zeros(numel, dtype=torch.bool)
                for name in STATE_NAMES:
                    out.tensors[name][pname] = torch.zeros(numel, dtype=torch.float32)
            span = slice(offset, offset + values[STATE_NAMES[0]].numel())
            seen = covered[pname][span]
            for name in STATE_NAMES:
                dest = out.tensors[name][pname][span]
                if seen.any() and not torch.equal(dest[seen], values[name][seen]):
                    raise AssertionError(f"replicas disagree: rank {rank}'s {name} of {pname} "
                                         f"[{span.start}:{span.stop}] differs from another rank's")
                dest.copy_(values[name])
            covered[pname][span] = True
    missing = {n: int((~c).sum()) for n, c in covered.items() if not c.all()}
    if missing:
        raise AssertionError(f"optimizer state held by no rank (elements per parameter): {missing}")
    return out


def checkpoint_optimizer_state(ckpt_dir: str) -> OptimizerState:
    """The optimizer state in a distributed (torch_dist) checkpoint directory, read in this process.

    Keys are the checkpoint's weight keys (megatron-core's, stacked layers as
    one tensor), so two checkpoints of one model compare whatever hierarchy and
    world size wrote them. No process group needed.
    """
    import os
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(ckpt_dir, path)
        loaded = torch.load(path, weights_only=False)
    out = OptimizerState(tensors={name: {} for name in STATE_NAMES})
    for key, value in loaded.items():
        for name in STATE_NAMES:
            prefix = f"optimizer.state.{name}."
            if key.startswith(prefix) and torch.is_tensor(value):
                out.tensors[name][key[len(prefix):]] = value.detach().float().reshape(-1)
    if not any(out.tensors.values()):
        raise ValueError(f"{ckpt_dir}: no optimizer state in this checkpoint")
    return out


def state_differences(got: OptimizerState, want: OptimizerState, rel: float = 0.0) -> list[str]:
    """One line per (state, parameter) that differs; empty when they agree.

    ``rel`` = 0: bit for bit. Otherwise (summation orders differ between world
    sizes, so values after training agree only to rounding) an element of a
    moment may differ by ``rel`` times the largest magnitude of that moment in
    that parameter, and a master weight by ``rel`` times max(largest |w|, 1), as
    the equivalence tests compare weights: Adam turns the rounding noise of a
    gradient that is zero in exact arithmetic (the attention key bias) into
    updates of any sign, so a small parameter's weights move apart by ~1e-7
    absolute while its moments stay alike.
    """
    lines = []
    if got.step is not None and want.step is not None and got.step != want.step:
        lines.append(f"Adam step count {got.step} != {want.step}")
    for name in STATE_NAMES:
        a, b = got.tensors.get(name, {}), want.tensors.get(name, {})
        if a.keys() != b.keys():
            lines.append(f"{name}: parameters {sorted(a.keys() ^ b.keys())} held by one side only")
        for pname in sorted(a.keys() & b.keys()):
            x, y = a[pname], b[pname]
            if x.shape != y.shape:
                lines.append(f"{name} of {pname}: {tuple(x.shape)} elements vs {tuple(y.shape)}")
                continue
            diff = (x - y).abs()
            scale = y.abs().max().item()
            allowed = rel * (max(scale, 1.0) if name == "fp32_param" else scale)
            bad = ~(diff <= allowed) if rel else x != y
            if bad.any():
                lines.append(f"{name} of {pname}: {int(bad.sum())} of {x.numel()} elements differ, "
                             f"max |diff| {diff.max().item():.3g} (max |value| {scale:.3g}"
                             f"{f', allowed {allowed:.3g}' if rel else ', exact required'})")
    return lines


__all__ = ["STATE_NAMES", "OptimizerState", "gather_optimizer_state", "checkpoint_optimizer_state",
           "state_differences"]
