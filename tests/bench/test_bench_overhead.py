"""bench overhead: every pair's figures follow from the step times it reports (never a wall-time assert).

One small run (2 ranks, a 2-layer GPT with buckets small enough for several
per layer in Megatron's DDP) with ``--profile``: the pairs' ratios are recomputed from the raw
step times, the pairs are shown to train the same model on the same data (same
losses), to have the buckets or units they should, and the profile's
categories to add up.
"""
import json
import statistics
import subprocess
import sys

import pytest

from benchmarks import overhead, overhead_profile

LAYERS = 2


@pytest.fixture(scope="module")
def result():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "overhead", "--ranks", "2", "--runs", "1",
         "--steps", "1", "--hidden", "32", "--layers", str(LAYERS), "--seq", "16",
         "--bucket-size", "1500", "--profile", "--json"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow   # the module's reduced overhead run: 15 s of the CI's 20 minutes
def test_pairs_follow_from_the_step_times(result):
    assert set(result["pairs"]) == {"zero2/megatron-distopt", "zero3/megatron-fsdp",
                                    "lbp/megatron-distopt"}
    steps = result["step_s"]
    for scheme in overhead.SCHEMES:
        assert len(steps[scheme]) == result["runs"] * result["steps_timed_per_run"], scheme
        assert result["median_step_s"][scheme] == pytest.approx(statistics.median(steps[scheme]))
    for key, p in result["pairs"].items():
        a, b = key.split("/")
        assert (p["a"], p["b"]) == (a, b)
        assert p["ratio"] == pytest.approx(statistics.median(steps[a]) / statistics.median(steps[b]))
        same_round = [x / y for x, y in zip(steps[a], steps[b])]
        assert p["median_paired_ratio"] == pytest.approx(statistics.median(same_round))
        assert p["ratio"] > 0 and p["buckets"] == {a: result["buckets"][a], b: result["buckets"][b]}
    assert result["ratio_lbp_over_stock"] == result["pairs"]["lbp/megatron-distopt"]["ratio"]
    assert len(result["loadavg_start"]) == 3 and len(result["loadavg_end"]) == 3


@pytest.mark.slow   # the module's reduced overhead run: 15 s of the CI's 20 minutes
def test_pairs_train_the_same_model_with_several_buckets(result):
    losses = result["losses"]
    ref = losses[overhead.STOCK]
    assert len(ref) == result["warmup_steps"] + result["steps_timed_per_run"]
    for scheme, got in losses.items():
        # fp32, same data and seed: the schemes differ only in the order of sums.
        assert got == pytest.approx(ref, abs=1e-4), (scheme, got, ref)
    for key, p in result["pairs"].items():
        assert p["max_loss_difference"] < 1e-4, (key, p["max_loss_difference"])
    b = result["buckets"]
    # The bucket size gives Megatron's DDP several buckets per layer; the engine and
    # Megatron-FSDP make each layer one unit (the engine: plus embedding and output).
    assert b[overhead.STOCK] >= 2 * LAYERS, b
    for scheme in ("lbp", "zero2", "zero3"):
        assert b[scheme] == LAYERS + 2, (scheme, b)
    assert b[overhead.FSDP] >= LAYERS, b


@pytest.mark.slow   # the module's reduced overhead run: 15 s of the CI's 20 minutes
def test_profile_adds_up(result):
    profiles = result["profiles"]
    assert set(profiles) == set(overhead.SCHEMES)
    for scheme, prof in profiles.items():
        br = prof["breakdown_s_per_step"]
        assert br["total"] == pytest.approx(sum(br[c] for c in overhead_profile.CATEGORIES))
        assert br["collectives and waits"] > 0 and br["torch compute"] > 0, (scheme, br)
        if scheme in ("lbp", "zero2", "zero3"):
            assert br["engine Python"] > 0 and prof["engine_cumulative"], (scheme, br)
        else:
            # Stock schemes run no engine code in their steps (the loop and shims are apart).
            assert br["engine Python"] == 0 and not prof["engine_cumulative"], (scheme, br)
        assert prof["top_self"][0]["s_per_step"] >= prof["top_self"][-1]["s_per_step"]
    text = overhead_profile.render(profiles, result["pairs"])
    for key in result["pairs"]:
        assert f"== {key}" in text


@pytest.mark.parametrize("key, want", [
    (("~", 0, "<built-in method torch._C._distributed_c10d.wait>"), "collectives and waits"),
    (("~", 0, "<method 'run_backward' of 'torch._C._EngineBase' objects>"), "torch compute"),
    (("/x/megatron_lbp/engine/comm.py", 10, "wait"), "engine Python"),
    (("/x/megatron_lbp/compat.py", 10, "to"), "shims + loop Python"),
    (("/x/site-packages/megatron/core/optimizer/optimizer.py", 1, "step"), "megatron-core Python"),
    (("/x/site-packages/torch/nn/modules/module.py", 1, "_call_impl"), "torch Python"),
    (("/usr/lib/python3.11/contextlib.py", 1, "__enter__"), "other Python"),
])
def test_profile_categories(key, want):
    assert overhead_profile.category(key) == want


def test_bench_rejects_unknown_command_and_odd_ranks():
    bad = subprocess.run([sys.executable, "-m", "benchmarks", "speed"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "command speed is not one of" in bad.stderr, bad.stderr
    odd = subprocess.run([sys.executable, "-m", "benchmarks", "overhead", "--ranks", "3"],
                         capture_output=True, text=True, timeout=60)
    assert odd.returncode == 2 and "--ranks=3 must be even" in odd.stderr, odd.stderr
    scheme = subprocess.run([sys.executable, "-m", "benchmarks", "overhead", "--schemes",
                             "zero9"], capture_output=True, text=True, timeout=60)
    assert scheme.returncode == 2 and "zero9 not in" in scheme.stderr, scheme.stderr
