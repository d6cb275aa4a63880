"""Every collective the engine issues, and the bytes each one puts on each link.

One small interface (:class:`Collectives`) wraps the five torch.distributed
calls the engine needs. Each call names the group *family* it runs in
("param", "grad", "inter", ...) and the *phase* of the step it belongs to;
the ledger then charges the bytes this rank sends to that family's link
class. The accounting is the same as the plan tool's (megatron_lbp.costs):

- all-gather producing T bytes over n ranks: T·(n-1)/n sent per rank;
- reduce-scatter consuming T bytes over n ranks: T·(n-1)/n;
- all-reduce of T bytes: 2·T·(n-1)/n (ring);
- all-to-all of a T-byte input over n ranks: T·(n-1)/n (the own chunk stays home);
- a group of one rank sends nothing (and no collective is issued).

Bulk phases are those the plan predicts; "control" holds the scalar
collectives (gradient norm, inf/nan flags, start-up broadcast) that it does not.

A collective that fails (a peer died, or the group's timeout ran out) is
diagnosed once by :mod:`megatron_lbp.engine.faults` and raised as a
``CollectiveFault`` naming the lost rank(s) and the phase; asynchronous work
keeps the phase it was issued in until ``wait()``. On NCCL, where ``wait()``
only orders streams, every collective is also handed to the fault module's
stall watch, which diagnoses one that does not complete in time.
"""
from __future__ import annotations

from collections import defaultdict
from fractions import Fraction
from typing import Any, Mapping

import torch
import torch.distributed as dist

from megatron_lbp.costs import LINK_CLASS_ORDER, PHASES
from megatron_lbp.engine import faults

CONTROL = "control"
ALL_PHASES = PHASES + (CONTROL,)


class CommLedger:
    """Bytes sent by this rank, per (phase, link class); exact (Fractions for all-reduce)."""

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, phase: str, link: str, nbytes: Fraction | int) -> None:
        if phase not in ALL_PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        self._bytes[(phase, link)] += Fraction(nbytes)
        self.calls[phase] += 1

    def by_phase(self) -> dict[str, dict[str, int | float]]:
        return {phase: {link: _number(self._bytes.get((phase, link), Fraction(0)))
                        for link in LINK_CLASS_ORDER} for phase in ALL_PHASES}

    def by_class(self, include_control: bool = False) -> dict[str, int | float]:
        phases = ALL_PHASES if include_control else PHASES
        return {link: _number(sum((self._bytes.get((p, link), Fraction(0)) for p in phases),
                                  Fraction(0)))
                for link in LINK_CLASS_ORDER}

    def reset(self) -> None:
        self._bytes.clear()
        self.calls.clear()


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Collectives:
    """The engine's only door to torch.distributed for bulk data."""

    def __init__(self, groups: Mapping[str, Any], sizes: Mapping[str, int],
                 links: Mapping[str, str], ledger: CommLedger | None = None) -> None:
        self.groups = dict(groups)
        self.sizes = dict(sizes)
        self.links = dict(links)
        self.ledger = ledger or CommLedger()
        self._activity = {f: faults.Activity("", f, _group_ranks(g))
                          for f, g in self.groups.items()}
        self._inject = faults.injection_for_this_rank()
        faults.ensure_monitor()

    def _issue(self, family: str, phase: str, collective, *args, group, async_op: bool, **kwargs):
        """Issue one collective; a failure (now or at ``wait()``) becomes a diagnosed fault."""
        base = self._activity.get(family)
        activity = faults.Activity(phase, family, base.ranks if base else _group_ranks(group))
        faults.TRACKER.enter(activity)
        if self._inject is not None:
            self._inject.before(phase)
        # NCCL's wait() does not block the host: the stall watch needs a handle on every
        # collective, so a synchronous one is issued asynchronously and waited for at once.
        watch = faults.stall_watch()
        try:
            work = collective(*args, group=group, async_op=async_op or watch is not None, **kwargs)
        except RuntimeError as err:
            raise faults.diagnose(activity, err) from err
        finally:
            faults.TRACKER.leave()
        if work is None:
            return None
        tracked = _TrackedWork(work, activity)
        if watch is not None:
            watch.add(tracked)
            if not async_op:
                tracked.wait()
                return None
        return tracked

    def poison_if_injected(self, grad: torch.Tensor, phase: str) -> None:
        """The fault-injection hook for gradients (LBP_FAULT_INJECT with action=nan)."""
        if self._inject is not None:
            self._inject.poison(grad, phase)

    def _charge(self, family: str, phase: str, nbytes: Fraction | int) -> None:
        self.ledger.record(phase, self.links[family], nbytes)

    def _exchange(self, collective, out: torch.Tensor, inp: torch.Tensor, family: str,
                  phase: str, total_bytes: int, async_op: bool):
        """One out-of-place collective whose rank sends (n-1)/n of ``total_bytes``."""
        n = self.sizes[family]
        if n == 1:
            out.copy_(inp)
            return None
        self._charge(family, phase, Fraction(total_bytes * (n - 1), n))
        return self._issue(family, phase, collective, out, inp, group=self.groups[family],
                           async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, family: str, phase: str,
                   async_op: bool = False):
        return self._exchange(dist.all_gather_into_tensor, out, inp, family, phase,
                              _nbytes(out), async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, family: str, phase: str,
                       async_op: bool = False):
        return self._exchange(dist.reduce_scatter_tensor, out, inp, family, phase,
                              _nbytes(inp), async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, family: str, phase: str,
                   async_op: bool = False):
        """Chunk i of ``inp`` (n equal chunks) goes to group rank i; chunk j of ``out`` came from j."""
        return self._exchange(dist.all_to_all_single, out, inp, family, phase, _nbytes(inp),
                              async_op)

    def all_reduce(self, t: torch.Tensor, family: str, phase: str,
                   op=dist.ReduceOp.SUM, async_op: bool = False):
        n = self.sizes[family]
        if n == 1:
            return None
        self._charge(family, phase, Fraction(2 * _nbytes(t) * (n - 1), n))
        return self._issue(family, phase, dist.all_reduce, t, op=op, group=self.groups[family],
                           async_op=async_op)

    def broadcast(self, t: torch.Tensor, src: int, group: Any, link: str, group_size: int,
                  phase: str = CONTROL) -> None:
        """Broadcast over an arbitrary group (start-up only); charged as the root's sends."""
        if group_size > 1:
            self.ledger.record(phase, link, _nbytes(t) * (group_size - 1) if dist.get_rank() == src else 0)
            self._issue("broadcast", phase, dist.broadcast, t, src=src, group=group,
                        async_op=False)


class _TrackedWork:
    """An issued collective that reports its own phase if waiting for it fails."""

    __slots__ = ("work", "activity")

    def __init__(self, work: Any, activity: faults.Activity) -> None:
        self.work, self.activity = work, activity

    def wait(self) -> None:
        faults.TRACKER.enter(self.activity)
        try:
            self.work.wait()
        except RuntimeError as err:
            raise faults.diagnose(self.activity, err) from err
        finally:
            faults.TRACKER.leave()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _group_ranks(group: Any) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(group)) if group is not None \
            else tuple(range(dist.get_world_size()))
    except (RuntimeError, ValueError, AttributeError):  # not a live group (no ranks to name)
        return ()
