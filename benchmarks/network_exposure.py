"""Per scheme on the emulated network: compute alone, link time alone, exposed time and why.

Definitions (the network bench's ``schemes.<name>`` fields):

- ``median_s``: the median step, barrier to barrier;
- ``compute_s``: the compute alone, i.e. the same GPT as a plain
  megatron-core module (no engine, no data-parallel wrapper, no collective)
  running the step's micro-batches on one rank's rows (forward, the
  recomputation when the model recomputes, backward) and then Adam on a 1/W
  shard, every rank at once; the slowest rank, median over rounds (one
  figure, the same for every scheme);
- ``link_s``: the scheme's own collectives of one step timed alone: every
  collective the step issued (recorded once, benchmarks.link_replay),
  issued again in order on the same groups, each waited for before the next,
  nothing else running; barrier to barrier, median over rounds;
- ``exposed_s`` = median_s - compute_s, the communication the step did not
  hide, and ``exposed_share`` = exposed_s / link_s (0: all hidden, 1: none).

The exposed time holds more than waiting on the network: on this 2-core
machine the engine's own host work around its collectives (copies,
gradient accumulation) and the compute slowed by communication sharing its
cores count too. The schedule trace of each engine scheme (``--hier-trace``)
says how much of the step the rank really stood waiting for a collective,
per phase, and why: ``at_once`` (waited for with no compute since its issue:
synchronous, or nothing to hide behind) or ``ahead`` (issued ahead of compute
that was shorter).
"""
from __future__ import annotations

import bisect
from typing import Any, Iterable, Mapping, Sequence

from megatron_lbp.core.costs import PHASES

PHASES_ALL = PHASES + ("control",)


def compute_alone_text(recompute: bool) -> str:
    return ("the same GPT as a plain megatron-core module (no engine, no wrapper, no "
            "collective): the micro-batches' forward, " + ("recomputation, " if recompute
                                                            else "") +
            "backward and Adam on a 1/W shard, every rank at once; slowest rank, median")


def figures(median_s: float, compute_s: float, link_s: float) -> dict[str, float]:
    exposed = median_s - compute_s
    return {"compute_s": compute_s, "link_s": link_s, "exposed_s": exposed,
            "exposed_share": exposed / link_s if link_s > 0 else float("nan")}


def recorded_causes(record: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Exposed seconds per phase of one trace record, split into at_once and ahead."""
    from megatron_lbp.engine.trace_summary import exposed

    ends = sorted(i["end_seq"] for i in record["compute"] if i.get("end_seq") is not None)
    out = {ph: {"exposed_s": 0.0, "at_once_s": 0.0, "ahead_s": 0.0} for ph in PHASES_ALL}
    for c, carried in [(c, False) for c in record["collectives"]] + \
            [(c, True) for c in record.get("carried", [])]:
        e = exposed(c)
        if c.get("done") is None or (not carried and e == 0.0):
            continue
        wait_seq = c["wait_seq"] if c.get("wait_seq") is not None else c["issued_seq"]
        between = carried or bisect.bisect_right(ends, c["issued_seq"]) < \
            bisect.bisect_left(ends, wait_seq)
        row = out.setdefault(c["phase"], {"exposed_s": 0.0, "at_once_s": 0.0, "ahead_s": 0.0})
        row["exposed_s"] += e
        row["ahead_s" if between else "at_once_s"] += e
    return out


def trace_summary(paths: Sequence[str], steps: Iterable[int]) -> dict[str, Any]:
    """``bench trace``'s summary of the kept steps of every path (one per run), averaged over
    runs, with each phase's exposed time split into at_once and ahead in the proportion
    of the split over all ranks and steps."""
    from megatron_lbp.projection.trace import _mean, read_records, summarize

    chosen = set(steps)
    per_run = []
    for path in paths:
        records = [r for r in read_records([path]) if r["step"] in chosen]
        summary = summarize(records, "all")["median"]
        causes = [recorded_causes(r) for r in records]
        for ph, row in summary["phases"].items():
            # The median rank's exposed time, split in the proportion all ranks' splits add to.
            total = sum(c.get(ph, {}).get("exposed_s", 0.0) for c in causes)
            once = (sum(c.get(ph, {}).get("at_once_s", 0.0) for c in causes) / total
                    if total > 0 else 0.0)
            row["at_once_s"] = row["exposed_s"] * once
            row["ahead_s"] = row["exposed_s"] - row["at_once_s"]
        per_run.append(summary)
    return _mean(per_run)


def explain(scheme: str, row: Mapping[str, Any], top: int = 3) -> str:
    """One line: the exposed time, what the trace saw the rank wait on, and what is left."""
    text = (f"{scheme}: exposed {row['exposed_s']:.3f} s per step "
            f"({row['exposed_share']:.0%} of its {row['link_s']:.3f} s link time)")
    tr = row.get("trace")
    if not tr:
        return text + "; no schedule trace (not an engine scheme)"
    phases = sorted(((ph, p) for ph, p in tr["phases"].items() if p["exposed_s"] > 0),
                    key=lambda x: -x[1]["exposed_s"])
    waits = tr["exposed_s"]
    parts = [f"{ph} {p['exposed_s']:.3f} s (" + ", ".join(
        text for value, text in ((p["at_once_s"], f"{p['at_once_s']:.3f} waited for at once"),
                                 (p["ahead_s"], f"{p['ahead_s']:.3f} issued ahead of shorter "
                                                f"compute")) if value > 0) + ")"
             for ph, p in phases[:top]]
    rest = row["exposed_s"] - waits
    text += (f"; the trace has the rank waiting on collectives {waits:.3f} s: "
             + (", ".join(parts) or "none"))
    if rest >= 0:
        return text + (f"; the other {rest:.3f} s are the engine's host work around its "
                       f"collectives and compute slowed by communication on the same cores "
                       f"(traced step {tr['step_s']:.3f} s)")
    return text + (f"; that is {-rest:.3f} s more than step - compute alone: the compute "
                   f"inside the traced steps (step {tr['step_s']:.3f} s) ran faster than the "
                   f"compute alone measured beside them, as load on the machine varies")


def render_table(schemes: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = [f"  {'scheme':<18}{'median s':>10}{'/ lbp':>7}{'compute s':>11}{'link s':>9}"
             f"{'exposed s':>11}{'of link':>9}{'trace waits s':>15}"]
    for s, r in schemes.items():
        waits = r.get("trace", {}).get("exposed_s")
        lines.append(f"  {s:<18}{r['median_s']:>10.3f}{r['ratio_to_lbp']:>7.2f}"
                     f"{r['compute_s']:>11.3f}{r['link_s']:>9.3f}{r['exposed_s']:>11.3f}"
                     f"{r['exposed_share']:>9.0%}"
                     + (f"{waits:>15.3f}" if waits is not None else f"{'-':>15}"))
    return lines
