"""A schedule trace's program structure: what a re-recording on another day must reproduce.

The committed traces (``traces/``) are replayed as the engine's schedule, so a
test has to show that they still are today's engine's. Their times never
repeat, and part of their order is the machine's, not the program's: a chain's
next stage is issued when a poll finds the previous one done, and a poll finds
what the host's timing lets it find. What the program decides, and what this
module keeps, per step record:

- the order of the program's points: each compute interval's start (pass,
  unit, micro-batch), each collective the program issues itself (``after``
  null: the gathers and reduce-scatters at its hooks, the scalar control
  collectives, a chain's first stage), and each point where the program needs
  a collective's data (a blocking wait, or the recorded need of one a poll
  had taken) for collectives that end a chain; needs with nothing else of the
  program between them are one point, sorted (the optimizer step takes its
  chains' ends in the order they landed);
- every collective with its phase, unit, micro-batch, group family,
  communicator, link class, bytes, whether it is asynchronous, and the
  collective whose landing issues it (``after``), as a sorted list.

Units are named by kind and index (``layer 3``), collectives by those fields,
never by their trace ``id`` (a counter over the whole run). Two recordings of
one engine, configuration and trace format give equal structures; a changed
order of the engine's hooks, a collective more, fewer or of other bytes, or a
changed overlap (a gather issued a compute interval later) does not.
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
