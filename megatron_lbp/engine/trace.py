"""The schedule trace: what the engine did in one optimizer step, in the order it did it.

``--hier-trace PATH`` makes every writing rank keep one :class:`ScheduleTrace`;
without it no trace object exists. Per step: each collective (phase, unit,
family, communicator, bytes, ``issued``/``wait``/``done`` times, ``after``),
each unit's compute intervals per pass; ``*_seq`` is program order.
Invariant: a record's bytes summed per phase and link are its step's comm
report. A collective still in flight at the record is written again under
``carried`` in the step it completed in. Format: docs/schedule-trace.md.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from megatron_lbp.core.costs import number
from megatron_lbp.engine.comm import Call, CollectiveObserver

PASSES = ("forward", "recompute", "backward", "optimizer")


class TraceObserver(CollectiveObserver):
    """The trace's view of the collectives (registered once with them by the wrapper): a
    record per collective, its wait and its landing."""

    def __init__(self, trace: "ScheduleTrace") -> None:
        self.trace = trace

    def issuing(self, call: Call) -> None:
        call.record = self.trace.issued(call.phase, call.unit, call.family, call.comm,
                                        call.link, call.nbytes, call.async_op)

    def waiting(self, call: Call, polled: bool) -> None:
        if call.record is not None:   # (None: issued before the trace observed)
            self.trace.waiting(call.record, polled=polled)

    def completed(self, call: Call) -> None:
        rec = call.record
        if rec is None:
            return
        if rec.wait is None:   # synchronous: waited for where it was issued
            rec.wait, rec.wait_seq = rec.issued, rec.issued_seq
        self.trace.completed(rec)


def output_path(path: str, rank: int) -> str | None:
    """Where ``rank`` writes a per-step JSON-lines report named ``path``, or None.

    ``{rank}`` in ``path`` gives one file per rank; otherwise only rank 0 writes
    (the rule of --hier-comm-report and --hier-trace).
    """
    if "{rank}" in path:
        return path.format(rank=rank)
    return path if rank == 0 else None


def append_json_line(path: str, record: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class CollectiveRecord:
    """One collective as the trace sees it; times are absolute perf_counter values."""

    __slots__ = ("id", "owner", "phase", "unit", "micro_batch", "family", "comm", "link",
                 "nbytes", "async_op", "issued", "issued_seq", "wait", "wait_seq", "done",
                 "done_seq", "polled", "after", "needed")

    def __init__(self, phase, unit, micro_batch, family, comm, link, nbytes, async_op,
                 id_=0, owner=None):
        self.id, self.owner = id_, owner
        self.phase, self.unit, self.micro_batch = phase, unit, micro_batch
        self.family, self.comm, self.link = family, comm, link
        self.nbytes, self.async_op = nbytes, async_op
        self.issued = self.wait = self.done = None
        self.issued_seq = self.wait_seq = self.done_seq = None
        self.polled = False      # taken after a poll found it complete: never blocked on
        self.after: int | None = None    # id of the collective whose landing issued this one
        self.needed = False      # its data was required (a blocking wait, or a need)

    def as_json(self, origin: float) -> dict[str, Any]:
        def rel(t):
            return None if t is None else t - origin

        return {"phase": self.phase, "unit": self.unit, "micro_batch": self.micro_batch,
                "family": self.family, "comm": self.comm, "link": self.link,
                "bytes": self.nbytes, "async": self.async_op,
                "issued": rel(self.issued), "issued_seq": self.issued_seq,
                "wait": rel(self.wait), "wait_seq": self.wait_seq,
                "done": rel(self.done), "done_seq": self.done_seq,
                "id": self.id, "polled": self.polled, "after": self.after}


def record_of(pending: Any) -> CollectiveRecord | None:
    """The trace record of an issued collective's Pending (None: no trace, or ran synchronously).

    Read it before the Pending is waited for (its ``work`` is dropped then).
    """
    return getattr(getattr(pending, "work", None), "record", None)


def link_after(rec: CollectiveRecord | None, trigger: CollectiveRecord | None) -> None:
    """``rec`` was issued because ``trigger`` landed (the replay issues it no earlier)."""
    if rec is not None and trigger is not None:
        rec.after = trigger.id


def need(rec: CollectiveRecord | None) -> None:
    """The engine requires ``rec``'s data now (it blocks here if it is not done)."""
    if rec is not None and rec.owner is not None:
        rec.owner.needed(rec)


class ScheduleTrace:
    """Collects one step's records and writes them as one JSON line when the step ends."""

    def __init__(self, path: str, rank: int, clock=time.perf_counter) -> None:
        self.path = path
        self.rank = rank
        self._clock = clock
        self.micro_batch: int | None = None   # the micro-batch being run (None: outside one)
        self.prefetch_units = 0
        self.units: list[dict[str, Any]] = []  # the unit table, set by the engine
        self._carried: list[CollectiveRecord] = []
        self._next_id = 0                      # collective ids, unique over the whole trace
        self._open()

    def _open(self) -> None:
        self._seq = 0
        self._micro_batches = 0
        self._t_start: float | None = None
        self._opened = self._clock()
        self._collectives: list[CollectiveRecord] = []
        self._compute: list[dict[str, Any]] = []
        self._needs: list[dict[str, Any]] = []
        self.micro_batch = None

    def _point(self) -> tuple[float, int]:
        self._seq += 1
        return self._clock(), self._seq

    # --- what the engine reports -----------------------------------------------------------
    def start_micro_batch(self) -> None:
        """A training forward starts (the root module's pre-forward hook)."""
        if self._t_start is None:
            self._t_start = self._clock()
        self.micro_batch = self._micro_batches
        self._micro_batches += 1

    def issued(self, phase: str, unit: int | None, family: str, comm: str, link: str,
               nbytes, async_op: bool) -> CollectiveRecord:
        self._next_id += 1
        rec = CollectiveRecord(phase, unit, self.micro_batch, family, comm, link,
                               number(nbytes), async_op, self._next_id, self)
        rec.issued, rec.issued_seq = self._point()
        self._collectives.append(rec)
        return rec

    def waiting(self, rec: CollectiveRecord, polled: bool = False) -> None:
        """The engine waits for ``rec``: blocking, or (``polled``) taking it after a poll
        found it complete, in which case its need comes later (:meth:`needed`)."""
        if rec.wait is None:
            rec.wait, rec.wait_seq = self._point()
            rec.polled = polled
            rec.needed = not polled

    def needed(self, rec: CollectiveRecord) -> None:
        """The first point where the engine requires a polled collective's data (nothing for
        one not yet waited for: its wait, if blocking, is its need)."""
        if rec.needed or not rec.polled:
            return
        rec.needed = True
        t, seq = self._point()
        self._needs.append({"id": rec.id, "time": t, "seq": seq})

    def completed(self, rec: CollectiveRecord) -> None:
        rec.done, rec.done_seq = self._point()

    def compute_start(self, unit: int | None, pass_: str) -> dict[str, Any]:
        t, seq = self._point()
        interval = {"unit": unit, "micro_batch": self.micro_batch, "pass": pass_,
                    "start": t, "start_seq": seq, "end": None, "end_seq": None}
        self._compute.append(interval)
        return interval

    def compute_end(self, interval: dict[str, Any]) -> None:
        interval["end"], interval["end_seq"] = self._point()

    def discard(self) -> None:
        """Forget what was recorded since the last record (the comm report's ledger was reset)."""
        self._open()

    # --- the step's line -------------------------------------------------------------------
    def end_step(self, step: int) -> dict[str, Any]:
        """Write this step's record (one JSON line) and start the next; returns the record."""
        t_end = self._clock()
        origin = self._t_start if self._t_start is not None else self._opened
        record = {
            "rank": self.rank, "step": step, "t_start": 0.0, "t_end": t_end - origin,
            "clock": origin,
            "micro_batches": self._micro_batches, "prefetch_units": self.prefetch_units,
            "units": self.units,
            "collectives": [c.as_json(origin) for c in self._collectives],
            "compute": [_interval_json(i, origin) for i in self._compute],
            "carried": [c.as_json(origin) for c in self._carried if c.done is not None],
            "needs": [{**n, "time": n["time"] - origin} for n in self._needs],
        }
        self._carried = [c for c in self._carried + self._collectives if c.done is None]
        append_json_line(self.path, record)
        self._open()
        return record


def _interval_json(interval: dict[str, Any], origin: float) -> dict[str, Any]:
    out = dict(interval)
    out["start"] -= origin
    if out["end"] is not None:
        out["end"] -= origin
    return out


