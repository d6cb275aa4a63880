"""Count the bytes any code sends through torch.distributed, with the engine's accounting.

Stock Megatron (DDP + distributed optimizer, Megatron-FSDP) does not go through
the engine's :class:`~megatron_lbp.engine.comm.Collectives`, so its traffic is
counted here instead, by wrapping torch.distributed's collectives for the
duration of a ``with count_collectives(locations) as ledger:`` block. Each call
is charged exactly as engine/comm.py charges its own, by the same rule
(``costs.ring_sent``: bytes **sent** by this rank, ring algorithms):

- all-gather whose full output is T bytes over n ranks: T·(n-1)/n
  (``all_gather_single``, ``all_gather_into_tensor``, ``_all_gather_base``, ``all_gather`` with a list
  of n outputs, ``all_gather_coalesced``);
- reduce-scatter whose full input is T bytes: T·(n-1)/n
  (``reduce_scatter_tensor``, ``_reduce_scatter_base``, ``reduce_scatter`` with
  a list of n inputs);
- all-reduce of T bytes: 2·T·(n-1)/n (``all_reduce``, ``all_reduce_coalesced``);
- all-to-all of a T-byte input: T·(n-1)/n (``all_to_all_single``);
- broadcast of T bytes: T·(n-1) by the root, 0 by the others;
- ``batch_isend_irecv`` (the engine's two-rank exchange, engine/pair_exchange.py): each
  send's whole tensor, a receive nothing;
- a group of one rank sends nothing.

Each call is charged to the slowest link class its group's members span
(``torch.distributed.get_process_group_ranks`` + ``topology.link_class`` over the
given locations, e.g. ``topology.emulated_locations``). Calls whose tensors hold
at most ``CONTROL_MAX_ELEMENTS`` elements in all (losses, gradient norms,
inf/nan flags) are booked as "control", like the engine's scalar collectives;
the rest is "bulk". Calls inside a ``_coalescing_manager`` block are counted one
by one, as issued. ``megatron.core.distributed.param_and_grad_buffer`` binds
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to module globals at
import time; those globals are wrapped too.

Object collectives (``all_gather_object``, ``broadcast_object_list``) and
point-to-point calls are not counted: Megatron uses them only at set-up and in
checkpointing, and a training step issues none.
"""
from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from fractions import Fraction
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_lbp.core.costs import LINK_CLASS_ORDER, number, ring_sent
from megatron_lbp.engine.dist_api import nbytes as _nbytes
from megatron_lbp.core.topology import link_class

CONTROL_MAX_ELEMENTS = 16
BULK, CONTROL = "bulk", "control"


def _numel(ts: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in ts)


class StockLedger:
    """Bytes sent by this rank, per (kind, link class), plus one record per call."""

    def __init__(self, locations) -> None:
        self.locations = locations
        self._bytes: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
        self.calls: list[dict[str, Any]] = []
        self._links: dict[Any, tuple[str, int]] = {}

    def _group(self, group) -> tuple[str, int]:
        key = id(group) if group is not None else None
        if key not in self._links:
            g = group if group is not None else dist.group.WORLD
            ranks = dist.get_process_group_ranks(g)
            self._links[key] = (link_class(ranks, self.locations), len(ranks))
        return self._links[key]

    def charge(self, op: str, group, tensors: Sequence[torch.Tensor], nbytes_of_n) -> None:
        link, n = self._group(group)
        sent = Fraction(0) if n <= 1 else Fraction(nbytes_of_n(n))
        kind = CONTROL if _numel(tensors) <= CONTROL_MAX_ELEMENTS else BULK
        self._bytes[(kind, link)] += sent
        self.calls.append({"op": op, "group_size": n, "link": link, "kind": kind,
                           "bytes": sent})

    def by_class(self, include_control: bool = False) -> dict[str, int | float]:
        kinds = (BULK, CONTROL) if include_control else (BULK,)
        out = {}
        for link in LINK_CLASS_ORDER:
            out[link] = number(sum((self._bytes.get((k, link), Fraction(0)) for k in kinds),
                                   Fraction(0)))
        return out

    def reset(self) -> None:
        self._bytes.clear()
        self.calls.clear()


def _wrappers(ledger: StockLedger, orig: Mapping[str, Any]) -> dict[str, Any]:
    """name -> wrapped function, each charging the ledger and then calling the original."""

    def gather_base(name):
        @functools.wraps(orig[name])
        def f(output_tensor, input_tensor, group=None, async_op=False, *a, **kw):
            ledger.charge(name, group, [output_tensor],
                          lambda n: ring_sent("all_gather", _nbytes(output_tensor), n))
            return orig[name](output_tensor, input_tensor, group, async_op, *a, **kw)
        return f

    def scatter_base(name):
        @functools.wraps(orig[name])
        def f(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, *a, **kw):
            ledger.charge(name, group, [input],
                          lambda n: ring_sent("reduce_scatter", _nbytes(input), n))
            return orig[name](output, input, op, group, async_op, *a, **kw)
        return f

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        ledger.charge("all_reduce", group, [tensor],
                      lambda n: ring_sent("all_reduce", _nbytes(tensor), n))
        return orig["all_reduce"](tensor, op, group, async_op)

    def all_reduce_coalesced(tensors, op=dist.ReduceOp.SUM, group=None, async_op=False):
        total = sum(_nbytes(t) for t in tensors)
        ledger.charge("all_reduce_coalesced", group, list(tensors),
                      lambda n: ring_sent("all_reduce", total, n))
        return orig["all_reduce_coalesced"](tensors, op, group, async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        total = sum(_nbytes(t) for t in tensor_list)
        ledger.charge("all_gather", group, list(tensor_list),
                      lambda n: ring_sent("all_gather", total, n))
        return orig["all_gather"](tensor_list, tensor, group, async_op)

    def all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None, async_op=False):
        outs = [t for lst in output_tensor_lists for t in lst]
        total = sum(_nbytes(t) for t in outs)
        ledger.charge("all_gather_coalesced", group, outs,
                      lambda n: ring_sent("all_gather", total, n))
        return orig["all_gather_coalesced"](output_tensor_lists, input_tensor_list, group, async_op)

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        total = sum(_nbytes(t) for t in input_list)
        ledger.charge("reduce_scatter", group, list(input_list),
                      lambda n: ring_sent("reduce_scatter", total, n))
        return orig["reduce_scatter"](output, input_list, op, group, async_op)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        ledger.charge("all_to_all_single", group, [input],
                      lambda n: ring_sent("all_to_all", _nbytes(input), n))
        return orig["all_to_all_single"](output, input, output_split_sizes, input_split_sizes,
                                         group, async_op)

    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        g = group if group is not None else dist.group.WORLD
        root = src if src is not None else dist.get_global_rank(g, group_src)
        me = dist.get_rank()
        ledger.charge("broadcast", group, [tensor],
                      lambda n: ring_sent("broadcast", _nbytes(tensor), n) if me == root else 0)
        return orig["broadcast"](tensor, src=src, group=group, async_op=async_op,
                                 group_src=group_src)

    def batch_isend_irecv(p2p_op_list):
        # A send puts its whole tensor on the link to its peer; a receive sends nothing.
        for p2p in p2p_op_list:
            if p2p.op is dist.isend:
                ledger.charge("batch_isend_irecv", p2p.group, [p2p.tensor],
                              lambda n, t=p2p.tensor: _nbytes(t))
        return orig["batch_isend_irecv"](p2p_op_list)

    return {
        **({"all_gather_single": gather_base("all_gather_single")}
           if "all_gather_single" in orig else {}),
        "all_gather_into_tensor": gather_base("all_gather_into_tensor"),
        "_all_gather_base": gather_base("_all_gather_base"),
        "reduce_scatter_tensor": scatter_base("reduce_scatter_tensor"),
        "_reduce_scatter_base": scatter_base("_reduce_scatter_base"),
        "all_reduce": all_reduce,
        "all_reduce_coalesced": all_reduce_coalesced,
        "all_gather": all_gather,
        "all_gather_coalesced": all_gather_coalesced,
        "reduce_scatter": reduce_scatter,
        "all_to_all_single": all_to_all_single,
        "broadcast": broadcast,
        "batch_isend_irecv": batch_isend_irecv,
    }


# all_gather_single: torch >= 2.13's name of all_gather_into_tensor (which calls it inside
# torch.distributed, not through these attributes: wrapping both counts a call once).
WRAPPED = tuple(name for name in (
    "all_gather_single", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_reduce", "all_reduce_coalesced", "all_gather",
    "all_gather_coalesced", "reduce_scatter", "all_to_all_single", "broadcast",
    "batch_isend_irecv")
    if hasattr(dist, name))

# Modules that captured a collective as a global at import time: module -> {global: dist name}.
_CAPTURED = {
    "megatron.core.distributed.param_and_grad_buffer": {
        "dist_all_gather_func": None, "dist_reduce_scatter_func": None},
}


@contextlib.contextmanager
def patched_collectives(make_wrappers) -> Iterator[None]:
    """torch.distributed's collectives (WRAPPED) replaced while the block runs.

    ``make_wrappers(orig)`` gets {name: original function} and returns {name:
    replacement}; the globals megatron-core captured at import time
    (``_CAPTURED``) are replaced by the same replacements. Every original is
    restored on exit, also after an exception.
    """
    import sys

    orig = {name: getattr(dist, name) for name in WRAPPED}
    wrapped = make_wrappers(orig)
    by_func = {id(orig[name]): wrapped[name] for name in WRAPPED}
    patched: list[tuple[Any, str, Any]] = []
    try:
        for name in WRAPPED:
            patched.append((dist, name, orig[name]))
            setattr(dist, name, wrapped[name])
        for modname, globals_ in _CAPTURED.items():
            mod = sys.modules.get(modname)
            if mod is None:
                continue
            for gname in globals_:
                current = getattr(mod, gname, None)
                if current is not None and id(current) in by_func:
                    patched.append((mod, gname, current))
                    setattr(mod, gname, by_func[id(current)])
        yield
    finally:
        for obj, name, value in reversed(patched):
            setattr(obj, name, value)


@contextlib.contextmanager
def count_collectives(locations) -> Iterator[StockLedger]:
    """Wrap torch.distributed's collectives while the block runs; yields the ledger.

    ``locations``: a sequence (index = global rank) or mapping of
    ``topology.RankLocation``, e.g. ``emulated_locations(W, gpus_per_node, 2)``.
    Restores every original on exit, also after an exception.
    """
    ledger = StockLedger(locations)
    with patched_collectives(functools.partial(_wrappers, ledger)):
        yield ledger


__all__ = ["CONTROL_MAX_ELEMENTS", "StockLedger", "count_collectives", "patched_collectives",
           "WRAPPED"]
