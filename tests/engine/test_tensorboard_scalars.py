"""megatron_lbp/integration/tensorboard_scalars.py's figures from a real engine trace record (the e2e run in
tests/e2e/test_pretrain_e2e.py reads the event files of a real pretrain back)."""
from __future__ import annotations

import gzip
from types import SimpleNamespace

from megatron_lbp.integration import tensorboard_scalars
from megatron_lbp.projection.project_replay import default_traces
from megatron_lbp.engine.trace_summary import step_summary


def test_exposed_communication_is_the_last_traced_steps(tmp_path):
    import json

    with gzip.open(default_traces()["lbp"][32], "rt") as f:
        records = [json.loads(line) for line in f if line.strip()]
    path = tmp_path / "trace-0.jsonl"     # the engine's file: one record per line, last = newest
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    optimizer = SimpleNamespace(models=[SimpleNamespace(comm=SimpleNamespace(
        trace=SimpleNamespace(path=str(path))))])
    args = SimpleNamespace(global_batch_size=16, seq_length=32)
    report = {"traffic_bytes": {"package": 10, "node": 20, "network": 30},
              "memory_bytes": {"primary": 1, "total": 2}}
    out = tensorboard_scalars.scalars(5, args, report, optimizer)
    assert out["exposed communication seconds"] == step_summary(records[-1])["exposed_s"] > 0
    assert out["bytes sent per step/node"] == 20 and out["held bytes/total"] == 2
    later = tensorboard_scalars.scalars(7, args, report, optimizer)   # 2 iterations later
    assert later["tokens per second"] > 0
