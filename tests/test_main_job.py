"""The README's main job, end to end: tokenizer and data, lbp training on 8 CPU ranks, summary."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_demo(tmp_path, iters):
    out = subprocess.run(
        [sys.executable, "-m", "megatron_lbp.demo", "--iters", str(iters), "--log-interval", "10",
         "--out", str(tmp_path / "runs"), "--data-dir", str(tmp_path / "data"), "--port", "29531"],
        capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    return out.stdout, run_dir, json.loads((run_dir / "summary.json").read_text())


# Uniform guessing over the 4096-token vocabulary is ln(4096) = 8.32; the stated
# thresholds are what learning the corpus' frequent tokens reaches.
CI_ITERS, CI_LOSS = 40, 6.8
FULL_LOSS = 5.5


def check_run(stdout, run_dir, summary, threshold):
    assert summary["loss_start"] > 8.0, summary["loss_start"]
    assert summary["loss_end"] < threshold, (
        f"loss {summary['loss_start']:.3f} -> {summary['loss_end']:.3f}, expected below {threshold}")
    assert summary["bytes_sent_per_rank_per_step"]["network"] > 0
    assert summary["bytes_held_per_rank"]["primary"] > 0 and summary["tokens_per_second"] > 0
    assert (run_dir / "loss_curve.png").stat().st_size > 1000
    assert (run_dir / "checkpoint" / "latest_checkpointed_iteration.txt").exists()
    assert "summary (" in stdout and "bytes sent per rank per step" in stdout


def test_main_job_reduced(tmp_path):
    check_run(*run_demo(tmp_path, CI_ITERS), CI_LOSS)


@pytest.mark.slow
def test_main_job_full(tmp_path):
    check_run(*run_demo(tmp_path, 300), FULL_LOSS)
