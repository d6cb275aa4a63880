"""The overhead benchmark runs both schemes and reports a ratio (never asserts a time)."""
import json
import subprocess
import sys


def test_overhead_bench_json_smoke():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_lbp.bench", "overhead", "--ranks", "4", "--runs", "1",
         "--steps", "1", "--hidden", "32", "--layers", "1", "--seq", "16", "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["median_step_s"]) == {"megatron-distopt", "lbp"}
    assert result["ratio_lbp_over_stock"] > 0 and result["ranks"] == 4


def test_bench_rejects_unknown_command_and_odd_ranks():
    bad = subprocess.run([sys.executable, "-m", "megatron_lbp.bench", "speed"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "command speed is not one of" in bad.stderr, bad.stderr
    odd = subprocess.run([sys.executable, "-m", "megatron_lbp.bench", "overhead", "--ranks", "3"],
                         capture_output=True, text=True, timeout=60)
    assert odd.returncode == 2 and "--ranks=3 must be even" in odd.stderr, odd.stderr
