"""Distributed checkpoints (Megatron's ``torch_dist`` format) straight from the shards.

Each rank describes the pieces it holds as ShardedTensors of the *global*
parameter (megatron-core's GPT keys and shapes; a flat range of a 2-D weight is
at most three rectangles); weights come from the 1/P primary slice, optimizer
state (``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>``) from the 1/O slice.
Invariants: nothing is gathered to save; only replica index 0 writes; a
checkpoint written under one hierarchy and world size loads under any other.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_lbp.engine import mcore

OPTIMIZER_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")


def flat_range_pieces(shape: tuple[int, ...], start: int, stop: int):
    """Rectangles covering elements [start, stop) of a row-major tensor of ``shape``.

    Yields (local_shape, global_offset, flat_start, flat_stop) with flat
    positions relative to ``start``.
    """
    if len(shape) == 1:
        if stop > start:
            yield (stop - start,), (start,), 0, stop - start
        return
    if len(shape) != 2:
        raise ValueError(f"checkpointing a {len(shape)}-D parameter piece is not supported "
                         f"(shape {tuple(shape)})")
    cols = shape[1]
    pos = start
    while pos < stop:
        row, col = divmod(pos, cols)
        if col or stop - pos < cols:          # a partial row
            n = min(cols - col, stop - pos)
            yield (1, n), (row, col), pos - start, pos - start + n
            pos += n
        else:                                 # as many whole rows as fit
            rows = (stop - pos) // cols
            yield (rows, cols), (row, 0), pos - start, pos - start + rows * cols
            pos += rows * cols


def _sharded_pieces(like, key: str, flat: torch.Tensor, start: int, stop: int, replica: int):
    """ShardedTensors for elements [start, stop) of the tensor that Megatron's ``like`` describes.

    ``like`` carries the global coordinates: Megatron stacks a block's layers
    along prepended axes (``prepend_axis_num``, the layer index as offset);
    the pieces spell those axes out as leading dimensions of size one, the
    form megatron-core hands to DCP for uneven shards.
    """
    ShardedTensor = mcore.sharded_tensor()

    lead = like.prepend_axis_num
    shape = tuple(like.local_shape)
    out = []
    for local_shape, offset, a, b in flat_range_pieces(shape, start, stop):
        out.append(ShardedTensor(
            key=key, data=flat[a:b].view((1,) * lead + tuple(local_shape)), dtype=flat.dtype,
            local_shape=(1,) * lead + tuple(local_shape), global_shape=tuple(like.global_shape),
            global_offset=tuple(like.global_offset[:lead]) + tuple(offset),
            axis_fragmentations=None, replica_id=(0, 0, replica)))
    return out


def _entry(key: str, like) -> str:
    """Dict entry of a parameter's pieces: stacked layers share a key, so add the layer offset."""
    lead = like.prepend_axis_num
    return key if not lead else f"{key}@{','.join(map(str, like.global_offset[:lead]))}"


def model_sharded_state_dict(ddp, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
    """megatron-core's sharded state dict of the wrapped model, parameters replaced by held pieces."""
    base = ddp.module.sharded_state_dict(prefix, sharded_offsets, metadata)
    slot_of = {id(slot.param): (b, slot) for b in ddp.buckets for slot in b.slots}
    keys = {}

    def convert(tree):
        ShardedTensor, ShardedTensorFactory = mcore.sharded_tensor(), mcore.sharded_tensor_factory()

        out = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out[name] = convert(value)
                continue
            if isinstance(value, ShardedTensorFactory) and id(value.data) in slot_of:
                value = _whole_tensor_of_factory(value)
            if isinstance(value, ShardedTensor) and id(value.data) in slot_of:
                lead = value.prepend_axis_num
                if tuple(value.global_shape[lead:]) != tuple(value.local_shape):
                    raise ValueError(f"{value.key}: tensor-parallel shards are not supported with "
                                     "--hier-partition checkpoints")
                b, slot = slot_of[id(value.data)]
                keys[id(slot.param)] = value
                lo = max(slot.start, b.primary_range.start)
                hi = min(slot.stop, b.primary_range.stop)
                if lo >= hi:
                    continue
                flat = b.primary[lo - b.primary_range.start:hi - b.primary_range.start]
                replica = ddp.hier.dp_index // ddp.hier.config.param_group_size
                for i, piece in enumerate(_sharded_pieces(value, value.key, flat,
                                                          lo - slot.start, hi - slot.start, replica)):
                    out[f"{name}.__lbp_piece{i}"] = piece
                continue
            out[name] = value
        return out

    converted = convert(base)
    ddp.weight_keys.named(keys)
    return converted


class WeightKeys:
    """Megatron's ShardedTensor of each parameter of one model (its key and global
    coordinates), by ``id(param)``, as the model's last sharded state dict named it.

    The optimizer's pieces are saved and loaded under these keys. Megatron asks for the
    model's sharded state dict first (with its prefix and metadata); :meth:`of` builds
    one with the defaults when it has not.
    """

    def __init__(self) -> None:
        self._by_param: dict[int, Any] = {}

    def named(self, keys: dict[int, Any]) -> None:
        self._by_param = keys

    def of(self, ddp) -> dict[int, Any]:
        if not self._by_param:
            model_sharded_state_dict(ddp)
        return self._by_param


def _whole_tensor_of_factory(factory):
    """The ShardedTensor of the whole parameter behind a factory that splits it in global coordinates.

    megatron-core saves SwiGLU's fused ``linear_fc1`` through a factory that
    cuts the [gate; up] weight in two along its first axis. Without tensor
    parallelism the halves lie next to each other, so together they are the
    parameter itself at the same global place, and the engine's pieces of
    the parameter can be addressed like any other weight's (the factory
    itself would slice a parameter that the engine keeps only in its buckets).
    """
    ShardedTensor = mcore.sharded_tensor()

    param = factory.data
    parts = factory.build_fn(factory.key, torch.empty(param.shape, dtype=param.dtype, device="meta"),
                             factory.replica_id, None)
    parts = parts if isinstance(parts, (list, tuple)) else [parts]
    lead = parts[0].prepend_axis_num
    rows = [p.global_offset[lead] for p in parts]
    whole = (len({p.key for p in parts}) == 1 and parts[0].key == factory.key
             and rows == sorted(rows) and rows[0] == 0
             and sum(p.local_shape[0] for p in parts) == param.shape[0]
             and tuple(parts[0].global_shape[lead:]) == tuple(param.shape))
    if not whole:
        raise ValueError(f"{factory.key}: its checkpoint factory splits the parameter across ranks "
                         "(tensor parallelism?), which --hier-partition checkpoints do not support")
    first = parts[0]
    return ShardedTensor(
        key=first.key, data=param, dtype=param.dtype, local_shape=tuple(param.shape),
        global_shape=tuple(first.global_shape), global_offset=tuple(first.global_offset[:lead])
        + (0,) * param.dim(), axis_fragmentations=None, replica_id=first.replica_id,
        prepend_axis_num=lead)


def load_model_pieces(ddp, state_dict: dict) -> dict:
    """Copy loaded pieces into the primary slices; return what is left for module.load_state_dict."""
    slot_by_name = {}
    for b in ddp.buckets:
        for slot in b.slots:
            slot_by_name[slot.name] = (b, slot)
    rest = {}
    pieces: dict[str, list] = {}
    for name, value in state_dict.items():
        if ".__lbp_piece" in name:
            pieces.setdefault(name.split(".__lbp_piece")[0], []).append((name, value))
        else:
            rest[name] = value
    for name, items in pieces.items():
        b, slot = _find_slot(slot_by_name, name)
        lo = max(slot.start, b.primary_range.start)
        hi = min(slot.stop, b.primary_range.stop)
        flat = b.primary[lo - b.primary_range.start:hi - b.primary_range.start]
        got = torch.cat([v.reshape(-1) for _, v in sorted(items, key=lambda kv: _index(kv[0]))])
        if got.numel() != flat.numel():
            raise ValueError(f"checkpoint piece of {name} has {got.numel()} elements, "
                             f"this rank holds {flat.numel()}")
        if got.data_ptr() != flat.data_ptr():
            flat.copy_(got)
    return rest


def _find_slot(slot_by_name, name):
    # Sharded-state-dict names drop the wrapper prefixes that named_parameters keeps.
    for full, found in slot_by_name.items():
        if full == name or full.endswith("." + name):
            return found
    raise KeyError(f"checkpoint holds {name}, which is not a parameter of this model")


def _index(piece_name: str) -> int:
    return int(piece_name.rsplit("__lbp_piece", 1)[1])


def optimizer_sharded_state_dict(opt, model_sharded_state_dict: dict, is_loading: bool) -> dict:
    """Optimizer pieces keyed by the model's weight keys; hyper-parameters as common state."""
    keys = _weight_keys(opt)
    state: dict[str, Any] = {"param_groups": [
        {k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]}
    state["step"] = opt.step_count()
    pieces = {}
    for st in opt.states:
        b = st.bucket
        replica = st.model.hier.dp_index // st.model.hier.config.optim_group_size
        for slot in b.slots:
            lo = max(slot.start, b.optim_range.start)
            hi = min(slot.stop, b.optim_range.stop)
            if lo >= hi:
                continue
            like = keys[id(slot.param)]
            rel = slice(lo - b.optim_range.start, hi - b.optim_range.start)
            for state_name in OPTIMIZER_STATES:
                buf = {"fp32_param": st.master, "exp_avg": st.exp_avg,
                       "exp_avg_sq": st.exp_avg_sq}[state_name]
                flat = buf[rel]                      # fp32 views: loading writes in place
                full_key = f"optimizer.state.{state_name}.{like.key}"
                for i, piece in enumerate(_sharded_pieces(like, full_key, flat,
                                                          lo - slot.start, hi - slot.start, replica)):
                    pieces[f"{_entry(full_key, like)}.__lbp_piece{i}"] = piece
    state["param_state"] = pieces
    return state


def _weight_keys(opt) -> dict:
    """Megatron's ShardedTensor (key, global coordinates) of every model parameter (Megatron asks for the model's state dict first)."""
    keys = {}
    for model in opt.models:
        keys.update(model.weight_keys.of(model))
    return keys


def load_optimizer_pieces(opt, state_dict: dict) -> None:
    """Copy loaded optimizer pieces into the flat master / exp_avg / exp_avg_sq buffers."""
    keys = _weight_keys(opt)
    loaded: dict[str, list] = {}
    for name, value in state_dict["param_state"].items():
        loaded.setdefault(name.split(".__lbp_piece")[0], []).append((name, value))
    for st in opt.states:
        b = st.bucket
        for slot in b.slots:
            lo = max(slot.start, b.optim_range.start)
            hi = min(slot.stop, b.optim_range.stop)
            if lo >= hi:
                continue
            rel = slice(lo - b.optim_range.start, hi - b.optim_range.start)
            for state_name in OPTIMIZER_STATES:
                like = keys[id(slot.param)]
                full_key = _entry(f"optimizer.state.{state_name}.{like.key}", like)
                if full_key not in loaded:
                    raise KeyError(f"the checkpoint has no {full_key}")
                got = torch.cat([v.reshape(-1) for _, v in
                                 sorted(loaded[full_key], key=lambda kv: _index(kv[0]))])
                buf = {"fp32_param": st.master, "exp_avg": st.exp_avg,
                       "exp_avg_sq": st.exp_avg_sq}[state_name][rel]
                if got.numel() != buf.numel():
                    raise ValueError(f"{full_key}: checkpoint piece has {got.numel()} elements, "
                                     f"this rank holds {buf.numel()}")
                if got.data_ptr() != buf.data_ptr():
                    buf.copy_(got)


def atomic_write_text(path: str, text: str, also_sync: tuple[str, ...] = (), before_replace=None) -> None:
    """Write ``path`` so that a reader (or a restart after a kill) sees the old or the new text, never a torn one.

    The text goes to a temporary file in the same directory, is fsynced,
    ``also_sync`` files (what the new text points at) are fsynced too, and
    ``os.replace`` swaps it in; the directory is fsynced last so the rename
    survives a node crash. ``before_replace`` runs just before the swap (the
    test-only stall point).
    """
    import os

    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    for other in also_sync:
        _fsync_path(other)
    if before_replace is not None:
        before_replace()
    os.replace(tmp, path)
    _fsync_path(directory)


def _fsync_path(path: str) -> None:
    import os

    if not os.path.exists(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
