"""A schedule trace's program structure: what a re-recording on another day must reproduce.

Keeps, per step record, what the program decides and not what timing does: the
order of compute starts, program-issued collectives and needs, and every collective
(phase, unit, micro-batch, family, communicator, link, bytes, async, ``after``) as
a sorted list, units named by kind and index, never by trace ``id``.
Invariant: two recordings of one engine, configuration and trace format give equal
structures; a changed hook order, collective set or overlap does not.
See docs/schedule-trace.md.
"""
from __future__ import annotations

from typing import Any, Sequence

COLLECTIVE_KEYS = ("phase", "micro_batch", "family", "comm", "link", "bytes", "async")


def _unit(units: Sequence[dict[str, Any]], index: int | None) -> str:
    if index is None:
        return "-"
    kind = units[index]["kind"]
    return f"{kind} {units[index]['layer']}" if kind == "layer" else kind


def _name(c: dict[str, Any], units) -> tuple:
    return (_unit(units, c["unit"]),) + tuple(c[k] for k in COLLECTIVE_KEYS)


def step_structure(record: dict[str, Any]) -> dict[str, Any]:
    """One step record's program order and collectives (module docstring)."""
    units = record["units"]
    issued = record["collectives"]
    everything = {c["id"]: c for c in [*record.get("carried", []), *issued]}
    followed = {c["after"] for c in everything.values() if c["after"] is not None}
    needs = {n["id"]: n["seq"] for n in record.get("needs", [])}
    points: list[tuple[int, tuple]] = []
    for i in record["compute"]:
        points.append((i["start_seq"], ("compute", i["pass"], _unit(units, i["unit"]),
                                        i["micro_batch"])))
    for c in issued:
        if c["after"] is None:
            points.append((c["issued_seq"], ("issue",) + _name(c, units)))
    for c in everything.values():
        if c["id"] in followed:
            continue
        seq = needs.get(c["id"])
        if seq is None and not c["polled"] and c.get("wait_seq") is not None and c["async"]:
            seq = c["wait_seq"]
        if seq is not None:
            points.append((seq, ("need",) + _name(c, units)))
    names = {cid: _name(c, units) for cid, c in everything.items()}
    # repr orders them: micro_batch and unit may be None beside integers
    chained = sorted(((_name(c, units), names.get(c["after"], ("earlier step",))
                       if c["after"] is not None else None) for c in issued), key=repr)
    return {"step": record["step"], "units": [_unit(units, u["unit"]) for u in units],
            "program": _needs_as_sets([p for _, p in sorted(points, key=lambda p: p[0])]),
            "collectives": [[list(n), list(a) if a else None] for n, a in chained]}


def _needs_as_sets(program: list[tuple]) -> list[tuple]:
    """Needs with nothing of the program between them, sorted: where the engine takes several
    at one point (the optimizer step's chains) it takes them in the order they landed."""
    out: list[tuple] = []
    run: list[tuple] = []
    for point in program + [("end",)]:
        if point[0] == "need":
            run.append(point)
            continue
        out += sorted(run, key=repr)
        run = []
        out.append(point)
    return out[:-1]


def structure(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every step record's structure, in step order."""
    return [step_structure(r) for r in sorted(records, key=lambda r: r["step"])]


def _as_lists(value):
    if isinstance(value, (list, tuple)):
        return [_as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    return value


def difference(got: Sequence[dict[str, Any]], want: Sequence[dict[str, Any]]) -> str:
    """'' when equal, else where the first difference is, with its neighbours from both."""
    got, want = _as_lists(list(got)), _as_lists(list(want))
    if len(got) != len(want):
        return f"{len(got)} step records, the reference has {len(want)}"
    for g, w in zip(got, want):
        for key in ("units", "program", "collectives"):
            a, b = g[key], w[key]
            if a == b:
                continue
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            lo = max(0, at - 2)
            return (f"step {g['step']}, {key}: {len(a)} entries, the reference {len(b)}; first "
                    f"difference at {at}: got {a[lo:at + 3]}, reference {b[lo:at + 3]}")
    return ""
