"""One step of a schedule-trace record (engine/trace.py), summed: exposed time, count and bytes
per phase, compute per pass. The job's TensorBoard scalars and the trace reader
(projection/trace.py) both report it, so it lives beside the record it reads."""
from __future__ import annotations

from typing import Any

from megatron_lbp.engine.comm import ALL_PHASES
from megatron_lbp.engine.trace import PASSES


def exposed(c: dict[str, Any]) -> float:
    """Seconds the rank waited on collective ``c`` before it came back (0 if never waited)."""
    if c.get("done") is None:
        return 0.0
    start = max(c["issued"], c["wait"] if c.get("wait") is not None else c["issued"])
    return max(0.0, c["done"] - start)


def step_summary(record: dict[str, Any]) -> dict[str, Any]:
    """One rank's one step: exposed time, count and bytes per phase; compute per pass."""
    phases = {ph: {"exposed_s": 0.0, "count": 0, "bytes": 0} for ph in ALL_PHASES}
    for c in record["collectives"]:
        row = phases[c["phase"]]
        row["count"] += 1
        row["bytes"] += c["bytes"]
        row["exposed_s"] += exposed(c)
    for c in record.get("carried", []):
        phases[c["phase"]]["exposed_s"] += exposed(c)
    compute = dict.fromkeys(PASSES, 0.0)
    for i in record["compute"]:
        if i["end"] is not None:
            compute[i["pass"]] += i["end"] - i["start"]
    return {"step_s": record["t_end"] - record["t_start"], "compute_s": compute,
            "phases": phases, "exposed_s": sum(p["exposed_s"] for p in phases.values())}
