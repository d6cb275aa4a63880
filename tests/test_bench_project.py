"""The Frontier projection is a pure function: sane, monotone, reproducible, printable as JSON."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_lbp.bench import project as pj

SMALL = dict(models=("10B",), gcds=(8, 16, 48), schemes=pj.DEFAULT_SCHEMES)


@pytest.fixture(scope="module")
def base():
    return pj.project(**SMALL)


def _steps(out):
    return {(m, s, g): row["step_s"] for m, per in out["results"].items()
            for s, rows in per.items() for g, row in rows.items()}


@pytest.mark.parametrize("cls", ["package", "node", "network"])
def test_more_bandwidth_or_less_latency_is_never_slower(base, cls):
    links = pj.LinkModel()
    faster = pj.LinkModel.from_measured({**links.bandwidth, cls: 2 * links.bandwidth[cls]},
                                        links.latency)
    quicker = pj.LinkModel.from_measured(links.bandwidth, {**links.latency, cls: 0.0})
    before = _steps(base)
    for better in (faster, quicker):
        after = _steps(pj.project(**SMALL, links=better))
        for key, t in before.items():
            assert after[key] <= t + 1e-12, (cls, key, t, after[key])


def test_faster_compute_is_never_slower_and_bounds_hold(base):
    quick = _steps(pj.project(**SMALL, compute=replace(pj.ComputeModel(), mfu=0.7)))
    for key, t in _steps(base).items():
        assert quick[key] <= t, key
    c = pj.ComputeModel()
    for per in base["results"].values():
        for rows in per.values():
            for row in rows.values():
                assert 0 < row["tflops_per_gcd"] <= c.mfu * c.peak_flops / 1e12
                assert row["step_s"] >= row["compute_s"] > 0
            assert rows["8"]["scaling_efficiency"] == 1.0


def test_infinite_links_give_the_assumed_mfu():
    ideal = pj.LinkModel.from_measured({c: 1e30 for c in ("package", "node", "network")},
                                       {c: 0.0 for c in ("package", "node", "network")})
    out = pj.project(("20B",), (384,), ("lbp", "zero3"), links=ideal)
    c = pj.ComputeModel()
    for rows in out["results"]["20B"].values():
        # Only Adam on the 1/O shard is left beside compute.
        assert rows["384"]["tflops_per_gcd"] == pytest.approx(c.mfu * c.peak_flops / 1e12, rel=1e-3)


def test_lbp_network_bytes_do_not_depend_on_micro_batches():
    model = pj.MODELS["20B"]
    net = {k: pj.plan_for(model, 96, "lbp", k)["traffic_bytes"]["network"] for k in (1, 4)}
    assert net[1] == net[4] > 0, net
    z3 = {k: pj.plan_for(model, 96, "zero3", k)["traffic_bytes"]["network"] for k in (1, 4)}
    assert z3[4] == 4 * z3[1], z3


def test_reproducible(base):
    assert json.dumps(pj.project(**SMALL)) == json.dumps(base)


def test_from_measured_is_the_calibration_hook():
    plan = pj.plan_for(pj.MODELS["10B"], 16, "lbp", 1)
    slow = pj.LinkModel.from_measured({"network": 1e9})       # others keep the defaults
    assert slow.bandwidth["node"] == pj.LinkModel().bandwidth["node"]
    assert pj.step_time(plan, pj.MODELS["10B"], slow)["step_s"] > \
        pj.step_time(plan, pj.MODELS["10B"])["step_s"]
    with pytest.raises(ValueError, match="bandwidth"):
        pj.LinkModel.from_measured({"node": 0})


def test_cli_json_shape_and_printed_assumptions():
    args = [sys.executable, "-m", "megatron_lbp.bench", "project", "--models", "20B",
            "--gcds", "8,384"]
    out = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    obj = json.loads(out.stdout)
    assert set(obj) == {"assumptions", "results", "ratios", "paper"}
    assert set(obj["results"]["20B"]) == set(pj.DEFAULT_SCHEMES)
    for rows in obj["results"]["20B"].values():
        assert set(rows) == {"8", "384"}
        keys = {"tflops_per_gcd", "scaling_efficiency", "step_s", "traffic_bytes"}
        assert keys <= set(rows["384"])
    assert obj["paper"]["lbp_over_zeropp_tflops_20B_384"] == 1.71
    assert "20B lbp/zeropp TFLOPS at 384" in obj["ratios"]
    text = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr[-2000:]
    for needle in ("assumptions:", "bandwidth_GB_per_s_per_gcd", "mfu", "latency", "paper 1.71"):
        assert needle in text.stdout, needle
    bad = subprocess.run(args[:4] + ["--schemes", "zero9"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--schemes" in bad.stderr
