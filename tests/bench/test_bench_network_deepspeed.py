"""DeepSpeed's rows in the emulated-network benchmark (issue 28 item 4): ds-zero3 and ds-zeropp
train the same GPT on the same batches in the same ranks and rounds as lbp, their step
collectives are recorded (DeepSpeed calls the all-gather and reduce-scatter it bound at
start-up: DeepSpeedTrainer.collectives_visible) and replayed alone, and their step times come
out as ratios to lbp's. Needs root and iproute2; run it under flock /tmp/lbp-netns.lock."""
import importlib.util
import json

import pytest

from tests.bench.test_bench_network import FRONTIER_REDUCED, _ours, launch, needs_root  # noqa: F401

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is a test dependency: scripts/install.sh --test")


@pytest.mark.slow  # the frontier-shaped form reduced, three schemes: ~2-4 min on the loaded machine
@needs_root
@needs_deepspeed
def test_deepspeed_rows_in_the_same_run_as_lbp(launch):
    proc = launch(FRONTIER_REDUCED + ["--schemes", "lbp,ds-zero3,ds-zeropp", "--json"])
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-4000:]
    assert _ours(proc.pid) == [], f"namespaces left behind: {_ours(proc.pid)}"
    out = json.loads(stdout.strip().splitlines()[-1])
    rows = out["schemes"]
    assert set(rows) == {"lbp", "ds-zero3", "ds-zeropp"}, set(rows)
    lbp = rows["lbp"]
    for scheme in ("ds-zero3", "ds-zeropp"):
        row = rows[scheme]
        assert row["ratio_to_lbp"] == pytest.approx(row["median_s"] / lbp["median_s"])
        # ZeRO-3 gathers every weight tensor of the 2-layer GPT for forward and again for
        # backward (full recomputation: a third time) and reduce-scatters its gradients: the
        # recorder sees them only through collectives_visible
        assert row["replayed_collectives"] >= 20 and row["link_s"] > 0, (scheme, row)
        # same model, same batches: the first step's loss is the same forward in bf16
        assert row["losses"][0] == pytest.approx(lbp["losses"][0], rel=2e-3), (scheme, row["losses"])
        assert len(row["losses"]) == len(lbp["losses"])
    assert out["calibration"]["fit"]["modelled_as"]["ds-zeropp"] == "zeropp"
