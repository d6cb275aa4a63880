"""Replay an engine schedule trace in program order with other durations (pure Python, no torch).

The schedule trace (``--hier-trace``, docs/schedule-trace.md) says in which
order one rank issued its collectives, computed its units and waited. This
module keeps that order and nothing else of the recorded run: every
collective's link time and every compute interval's time come from the
caller (``collective_s(record, c)``, ``compute_s(record, interval)``), e.g.
Frontier's link and compute figures at the real model shape
(megatron_lbp.bench.project_replay). The rules, applied to the events of the
given step records in program order (``*_seq`` within a step, steps in the
order given):

- one host clock runs the rank's program; compute is serial on it: a compute
  interval adds its duration when it ends (``end_seq``);
- a collective starts when it is issued and its communicator (``comm``) is
  free, then holds that communicator for its link time (collectives on
  different communicators run at once, at full speed each);
- a wait (``wait_seq``; for a synchronous collective the issue itself) holds
  the host clock until the collective is done; what it holds is the
  collective's *exposed* time;
- a collective issued in one step and waited for in a later one (the trace
  writes it with ``wait`` null, then under ``carried`` in the step it
  completed in) keeps its place in the issuing step; one carried into the
  first record given, whose issue is not in the replay, counts as issued at
  that record's start.

Nothing else takes time: host work outside the recorded intervals (loss,
data, Python) is free. Each exposed second is put down to one of three
causes, so that a report can say what a wait was behind:

- ``queued``: the part of the exposed interval the collective spent waiting
  for its communicator, behind the collective named in ``behind`` (the phase
  of the one queued last on it when this one was issued);
- ``at_once``: the rest, when no compute ended between its issue and its wait
  (a synchronous call, or a prefetch that had nothing to hide behind);
- ``ahead``: the rest, when compute ran between issue and wait but was
  shorter than the link time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megatron_lbp.costs import PHASES

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
    issued: float
    start: float             # when its communicator was free
    end: float
    behind: str | None       # phase of the collective it queued behind, if any
    ends_at_issue: int       # compute intervals ended before its issue
    wait: float | None = None
    exposed_s: float = 0.0
    cause: str | None = None
    waited_in: int | None = None  # index of the record whose program waited for it


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


def replay(records: Sequence[dict[str, Any]],
           collective_s: Callable[[dict[str, Any], dict[str, Any]], float],
           compute_s: Callable[[dict[str, Any], dict[str, Any]], float],
           ) -> tuple[list[StepReplay], list[ReplayedCollective]]:
    """Replay consecutive step records of one rank; (per-step results, every collective).

    A step's time runs from the end of the previous step's program (0 for the
    first record) to the end of its own: its last compute or wait, or a
    synchronous collective's end.
    """
    if not records:
        raise ReplayError("no step records to replay")
    ranks = {r.get("rank") for r in records}
    if len(ranks) > 1:
        raise ReplayError(f"records of ranks {sorted(ranks)}: replay one rank's program")
    clock = 0.0
    free: dict[str, float] = {}      # communicator -> when it is free
    last_on: dict[str, str] = {}     # communicator -> phase of the last collective on it
    pending: dict[tuple, ReplayedCollective] = {}
    steps: list[StepReplay] = []
    done: list[ReplayedCollective] = []
    ends = 0

    def issue(index: int, c: dict[str, Any], at: float) -> ReplayedCollective:
        link = float(collective_s(records[index] if index >= 0 else records[0], c))
        if link < 0:
            raise ReplayError(f"negative link time {link} for {c['phase']} unit {c['unit']}")
        comm = c["comm"]
        start = max(at, free.get(comm, at))
        behind = last_on.get(comm) if start > at else None
        rc = ReplayedCollective(index, c, link, at, start, start + link, behind, ends)
        free[comm], last_on[comm] = rc.end, c["phase"]
        return rc

    def wait(rc: ReplayedCollective, index: int) -> None:
        nonlocal clock
        rc.wait, rc.waited_in = clock, index
        rc.exposed_s = max(0.0, rc.end - clock)
        rc.cause = "at_once" if rc.ends_at_issue == ends and rc.record == index else "ahead"
        clock = max(clock, rc.end)
        done.append(rc)

    for index, record in enumerate(records):
        _need(record, ("collectives", "compute"), f"record {index}")
        step = StepReplay(record.get("step", index), clock, clock)
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
        for interval in record["compute"]:
            _need(interval, ("pass", "start_seq", "end_seq"),
                  f"a compute interval of record {index}")
            if interval["end_seq"] is not None:
                events.append((interval["end_seq"], 2, "end", interval))
        events.sort(key=lambda e: (e[0], e[1]))
        issued: dict[int, ReplayedCollective] = {}
        for _, _, kind, obj in events:
            if kind == "issue":
                rc = issue(index, obj, clock)
                if obj["wait_seq"] is None:
                    pending[_key(obj)] = rc
                else:
                    issued[id(obj)] = rc
            elif kind == "wait":
                wait(issued.pop(id(obj)), index)
            elif kind == "carried":
                rc = pending.pop(_key(obj), None)
                if rc is None:   # issued before the first record given
                    rc = issue(-1, obj, step.start)
                wait(rc, index)
            else:
                dt = float(compute_s(record, obj))
                if dt < 0:
                    raise ReplayError(f"negative compute time {dt} for {obj['pass']} "
                                      f"unit {obj.get('unit')}")
                clock += dt
                step.compute_s += dt
                ends += 1
        step.end = clock
        steps.append(step)
    for rc in done:
        _book(steps[rc.waited_in], rc)
    return steps, done


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
    queued = max(0.0, rc.start - max(rc.wait, rc.issued)) if rc.exposed_s > 0 else 0.0
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
