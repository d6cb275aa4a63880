"""Replay an engine schedule trace in program order with other durations (pure Python, no torch).

Keeps the order of a schedule trace (docs/schedule-trace.md) and nothing else:
every collective's link time and compute interval's time come from the caller
(``collective_s``, ``compute_s``). One host clock runs the program; compute is
serial; a collective holds its communicator for its link time; a wait holds the
clock until the collective is done (its exposed time, put down to ``queued``,
``at_once`` or ``ahead``). Host work outside recorded intervals is free.
The replay rules (``polled``, ``after``, ``needs``, ``carried``): docs/schedule-trace.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megatron_lbp.core.costs import PHASES

# engine/comm.py's ALL_PHASES, without importing torch: the replay is pure Python.
ALL_PHASES = PHASES + ("control",)

CAUSES = ("queued", "at_once", "ahead")


class ReplayError(ValueError):
    """The records cannot be replayed (one line saying why)."""


@dataclass
class ReplayedCollective:
    """One collective of the replay; times on the replay's host clock (seconds)."""

    record: int              # index of the step record that issued it (-1: before the replay)
    c: dict[str, Any]        # the trace's collective
    link_s: float
    issued: float | None     # when it was issued (None while held behind its trigger)
    start: float | None      # when its communicator was free
    end: float | None
    behind: str | None       # phase of the collective it queued (or was held) behind, if any
    ends_at_issue: int       # compute intervals ended before its issue
    wait: float | None = None
    exposed_s: float = 0.0
    cause: str | None = None
    waited_in: int | None = None  # index of the record whose program waited for it
    program_at: float = 0.0  # the clock where the trace issued it (issued, unless held)
    trigger: "ReplayedCollective | None" = None   # held until this one has landed
    landed: bool = False


def _phase_row() -> dict[str, Any]:
    return {"count": 0, "link_s": 0.0, "exposed_s": 0.0, **{f"{c}_s": 0.0 for c in CAUSES},
            "behind": {}}


@dataclass
class StepReplay:
    step: Any
    start: float
    end: float
    compute_s: float = 0.0
    # The ledger's phases in their order; a phase the trace names that is not
    # among them (a newer engine's) gets its own row after them.
    phases: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {ph: _phase_row() for ph in ALL_PHASES})

    @property
    def step_s(self) -> float:
        return self.end - self.start

    def as_json(self) -> dict[str, Any]:
        exposed = sum(p["exposed_s"] for p in self.phases.values())
        return {"step": self.step, "step_s": self.step_s, "compute_s": self.compute_s,
                "exposed_s": exposed, "link_s": sum(p["link_s"] for p in self.phases.values()),
                "phases": {ph: p for ph, p in self.phases.items() if p["count"]}}


def _need(obj: dict[str, Any], keys: Sequence[str], what: str) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ReplayError(f"{what} lacks {', '.join(missing)}: not a schedule trace record")


def _key(c: dict[str, Any]) -> tuple:
    return (c["phase"], c["unit"], c["family"], c["comm"], c["issued_seq"])


class _Program:
    """One rank's program replayed event by event (the rules of the module docstring)."""

    def __init__(self, records: Sequence[dict[str, Any]],
                 collective_s: Callable[[dict[str, Any], dict[str, Any]], float],
                 compute_s: Callable[[dict[str, Any], dict[str, Any]], float]) -> None:
        self.records, self.collective_s, self.compute_s = records, collective_s, compute_s
        self.clock = 0.0
        self.ends = 0                      # compute intervals ended so far
        self.index = 0                     # the record being replayed
        self.free: dict[str, float] = {}   # communicator -> when it is free
        self.last_on: dict[str, str] = {}  # communicator -> phase of the last one started
        self.by_id: dict[Any, ReplayedCollective] = {}
        self.by_key: dict[tuple, ReplayedCollective] = {}   # issued, not yet waited (no id)
        self.held: dict[str, list[ReplayedCollective]] = {}  # communicator -> held, in order
        self.polled: list[ReplayedCollective] = []  # taken by a poll in the trace, in flight here
        self.done: list[ReplayedCollective] = []

    # --- issuing ---------------------------------------------------------------------------
    def issue(self, index: int, c: dict[str, Any], record: dict[str, Any]) -> ReplayedCollective:
        link = float(self.collective_s(record, c))
        if link < 0:
            raise ReplayError(f"negative link time {link} for {c['phase']} unit {c['unit']}")
        rc = ReplayedCollective(index, c, link, None, None, None, None, self.ends,
                                program_at=self.clock)
        if c.get("id") is not None:
            self.by_id[c["id"]] = rc
        trigger = self.by_id.get(c.get("after")) if c.get("after") is not None else None
        if trigger is not None and not trigger.landed:
            rc.trigger = trigger
        if (rc.trigger is not None and rc.trigger.issued is None) or self.held.get(c["comm"]):
            self.held.setdefault(c["comm"], []).append(rc)
        else:
            self._start(rc)
        return rc

    def _start(self, rc: ReplayedCollective) -> None:
        comm, at = rc.c["comm"], self.clock
        rc.issued = at
        # Its stream runs it once its trigger has landed (the engine's streams wait for the
        # trigger's event; the host does not).
        ready = max(at, rc.trigger.end) if rc.trigger is not None else at
        rc.start = max(ready, self.free.get(comm, ready))
        rc.end = rc.start + rc.link_s
        if rc.start > ready:
            rc.behind = self.last_on.get(comm)
        elif ready > rc.program_at and rc.trigger is not None:
            rc.behind = rc.trigger.c["phase"]
        self.free[comm], self.last_on[comm] = rc.end, rc.c["phase"]

    def _release(self) -> None:
        """Issue, at the clock, the held collectives whose trigger has landed, in order."""
        for comm in list(self.held):
            queue = self.held[comm]
            while queue and (queue[0].trigger is None or queue[0].trigger.issued is not None):
                self._start(queue.pop(0))
            if not queue:
                del self.held[comm]

    # --- landing ---------------------------------------------------------------------------
    def _land(self, rc: ReplayedCollective) -> None:
        rc.landed, rc.waited_in = True, self.index
        if rc in self.polled:
            self.polled.remove(rc)
        self.done.append(rc)

    def poll(self) -> None:
        """A hook of the engine: land what a poll would find done, issue what that frees."""
        while True:
            ready = [rc for rc in self.polled if rc.issued is not None and rc.end <= self.clock]
            for rc in ready:
                rc.wait = self.clock
                rc.cause = "ahead"
                self._land(rc)
            before = sum(len(q) for q in self.held.values())
            self._release()
            if not ready and sum(len(q) for q in self.held.values()) == before:
                return

    def taken_by_poll(self, rc: ReplayedCollective) -> None:
        """The trace's engine took ``rc`` after a poll: here too only if it is done."""
        if rc.landed:
            return
        self.polled.append(rc)
        self.poll()

    def wait(self, rc: ReplayedCollective) -> None:
        """Hold the clock until ``rc`` has landed (a blocking wait, or a need)."""
        if rc.landed:
            return
        t0, ends = self.clock, self.ends
        while rc.issued is None:
            self._advance_towards(rc)
        self.clock = max(self.clock, rc.end)
        rc.wait = t0
        rc.exposed_s = self.clock - t0
        rc.cause = "at_once" if rc.ends_at_issue == ends and rc.record == self.index else "ahead"
        self._land(rc)
        self.poll()

    def _advance_towards(self, rc: ReplayedCollective) -> None:
        """``rc`` is held: move the clock to the landing of what holds it, and issue."""
        blocker = rc
        while blocker.issued is None:
            if blocker.trigger is not None and not blocker.trigger.landed:
                blocker = blocker.trigger
                continue
            head = self.held[blocker.c["comm"]][0]
            if head is blocker:     # its trigger has landed: it is issued at the release
                self._release()
                return
            blocker = head
        self.clock = max(self.clock, blocker.end)
        blocker.wait = blocker.end
        blocker.cause = "ahead"
        self._land(blocker)
        self._release()

    # --- the program -----------------------------------------------------------------------
    def run(self) -> list[StepReplay]:
        steps: list[StepReplay] = []
        for index, record in enumerate(self.records):
            self.index = index
            _need(record, ("collectives", "compute"), f"record {index}")
            step = StepReplay(record.get("step", index), self.clock, self.clock)
            issued: dict[int, ReplayedCollective] = {}
            for _, _, kind, obj in self._events(index, record):
                if kind == "issue":
                    rc = self.issue(index, obj, record)
                    if obj["wait_seq"] is None:
                        self.by_key[_key(obj)] = rc
                    else:
                        issued[id(obj)] = rc
                elif kind in ("wait", "carried"):
                    if kind == "wait":
                        rc = issued.pop(id(obj))
                    else:
                        rc = self.by_id.get(obj["id"]) if obj.get("id") is not None else None
                        rc = rc or self.by_key.pop(_key(obj), None)
                        if rc is None:   # issued before the first record given
                            at, self.clock = self.clock, step.start
                            rc = self.issue(-1, obj, self.records[0])
                            self.clock = at
                    if obj.get("polled"):
                        self.taken_by_poll(rc)
                    else:
                        self.wait(rc)
                elif kind == "need":
                    rc = self.by_id.get(obj["id"])
                    if rc is not None:
                        self.wait(rc)
                else:
                    dt = float(self.compute_s(record, obj))
                    if dt < 0:
                        raise ReplayError(f"negative compute time {dt} for {obj['pass']} "
                                          f"unit {obj.get('unit')}")
                    self.clock += dt
                    step.compute_s += dt
                    self.ends += 1
                    self.poll()
            step.end = self.clock
            steps.append(step)
        return steps

    @staticmethod
    def _events(index: int, record: dict[str, Any]) -> list[tuple[int, int, str, Any]]:
        events: list[tuple[int, int, str, Any]] = []
        for c in record["collectives"]:
            _need(c, ("phase", "unit", "family", "comm", "issued_seq", "wait_seq"),
                  f"a collective of record {index}")
            events.append((c["issued_seq"], 0, "issue", c))
            if c["wait_seq"] is not None:
                events.append((c["wait_seq"], 1, "wait", c))
        for c in record.get("carried", []):
            if c.get("wait_seq") is None:
                continue
            events.append((c["wait_seq"], 1, "carried", c))
        for n in record.get("needs", []):
            _need(n, ("id", "seq"), f"a need of record {index}")
            events.append((n["seq"], 1, "need", n))
        for interval in record["compute"]:
            _need(interval, ("pass", "start_seq", "end_seq"),
                  f"a compute interval of record {index}")
            if interval["end_seq"] is not None:
                events.append((interval["end_seq"], 2, "end", interval))
        events.sort(key=lambda e: (e[0], e[1]))
        return events


def replay(records: Sequence[dict[str, Any]],
           collective_s: Callable[[dict[str, Any], dict[str, Any]], float],
           compute_s: Callable[[dict[str, Any], dict[str, Any]], float],
           ) -> tuple[list[StepReplay], list[ReplayedCollective]]:
    """Replay consecutive step records of one rank; (per-step results, every collective
    landed).

    A step's time runs from the end of the previous step's program (0 for the
    first record) to the end of its own: its last compute or wait, or a
    synchronous collective's end.
    """
    if not records:
        raise ReplayError("no step records to replay")
    ranks = {r.get("rank") for r in records}
    if len(ranks) > 1:
        raise ReplayError(f"records of ranks {sorted(ranks)}: replay one rank's program")
    program = _Program(records, collective_s, compute_s)
    steps = program.run()
    for rc in program.done:
        _book(steps[rc.waited_in], rc)
    return steps, program.done


def _book(step: StepReplay, rc: ReplayedCollective) -> None:
    """Add one waited-for collective to its step's phase row, its exposure split by cause.

    Of the exposed interval [wait, end), the part before ``start`` was spent
    queued for the communicator (``queued``, behind ``rc.behind``); the rest
    is its own link time, ``at_once`` or ``ahead`` as decided at the wait.
    """
    row = step.phases.setdefault(rc.c["phase"], _phase_row())
    row["count"] += 1
    row["link_s"] += rc.link_s
    row["exposed_s"] += rc.exposed_s
    queued = max(0.0, min(rc.start, rc.end) - max(rc.wait, rc.program_at)) \
        if rc.exposed_s > 0 else 0.0
    if queued > 0:
        row["queued_s"] += queued
        row["behind"][rc.behind] = row["behind"].get(rc.behind, 0.0) + queued
    row[f"{rc.cause}_s"] += rc.exposed_s - queued


def explain(phases: dict[str, dict[str, Any]], top: int = 3) -> list[str]:
    """The phases with the most exposed time, each as one line saying what it waited behind."""
    rows = sorted(((ph, p) for ph, p in phases.items() if p["exposed_s"] > 0),
                  key=lambda x: -x[1]["exposed_s"])[:top]
    lines = []
    for ph, p in rows:
        parts = []
        if p["at_once_s"] > 0:
            parts.append(f"{p['at_once_s']:.3g} s waited for at once (synchronous, or issued "
                         f"with no compute before its wait)")
        for other, s in sorted(p["behind"].items(), key=lambda x: -x[1]):
            parts.append(f"{s:.3g} s queued behind {other} on its communicator")
        if p["ahead_s"] > 0:
            parts.append(f"{p['ahead_s']:.3g} s issued ahead but longer than the compute "
                         f"before its wait")
        lines.append(f"{ph}: {p['exposed_s']:.3g} s exposed of {p['link_s']:.3g} s link time "
                     f"over {p['count']} collectives: " + "; ".join(parts))
    return lines
