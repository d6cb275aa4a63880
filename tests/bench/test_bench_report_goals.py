"""The issue 13 goals of the report (report_goals): met or missed against the issue's targets,
and a missed goal's reason built from the trace of the run it judges.

The replay goals are judged on a real replayed projection (the committed traces); the
Frontier-shaped emulation's on a run record of the shape ``bench network --json`` prints
(the command itself is tested in test_bench_network.py), with its figures moved across
the targets to see both outcomes.
"""
import copy

import pytest

from megatron_lbp.projection import project as pj
from megatron_lbp.projection import project_replay as pr
from benchmarks import report_goals as rg

EFF_KEY, RATIO_KEY = "20B lbp scaling efficiency 8->384", "20B lbp/zeropp TFLOPS at 384"


@pytest.fixture(scope="module")
def project_run():
    out = {"paper": pj.PAPER,
           "replay": pr.replay_projection(("20B",), (8, 384), ("lbp", "zeropp"),
                                          pr.default_traces(), pj.LinkModel(),
                                          pj.ComputeModel())}
    return {"project": {"status": "ok", "result": out}}


def _by_id(goals):
    return {g["id"]: g for g in goals}


def test_replay_goals_follow_the_targets_and_a_miss_says_why_from_the_trace(project_run):
    rep = project_run["project"]["result"]["replay"]
    got = _by_id(rg.replay_goals(project_run))
    for gid, key, target in (("replay_efficiency", EFF_KEY, rg.REPLAY_EFFICIENCY),
                             ("replay_lbp_over_zeropp", RATIO_KEY, rg.REPLAY_LBP_OVER_ZEROPP)):
        value = rep["ratios"][key]
        assert got[gid]["value"] == value
        assert got[gid]["status"] == ("met" if value >= target else "missed"), got[gid]
    for gid, key in (("replay_efficiency", EFF_KEY), ("replay_lbp_over_zeropp", RATIO_KEY)):
        for value, status in ((9.0, "met"), (0.01, "missed")):
            runs = copy.deepcopy(project_run)
            runs["project"]["result"]["replay"]["ratios"][key] = value
            goal = _by_id(rg.replay_goals(runs))[gid]
            assert goal["status"] == status, (gid, value, goal)
            if status == "met":
                assert goal["reason"] == ""
                continue
            # why: lbp's step as compute + exposed, and the trace's top exposed phase and
            # what it waited behind, as the replay explains it
            lbp = rep["results"]["20B"]["lbp"]["384"]
            assert f"compute {lbp['compute_s']:.2f} + exposed {lbp['exposed_s']:.2f}" in \
                goal["reason"], goal["reason"]
            assert lbp["explain"][0] in goal["reason"], goal["reason"]
            assert "prefetch 1" in goal["reason"] and "paper" in goal["reason"]


def test_a_missed_ratio_says_whether_any_lbp_schedule_could_reach_it(project_run):
    """zeropp's replayed step over lbp's compute alone is the ratio with nothing of lbp's
    exposed; the reason says whether the target lies above it."""
    runs = copy.deepcopy(project_run)
    rep = runs["project"]["result"]["replay"]
    rep["ratios"][RATIO_KEY] = 0.01
    r20 = rep["results"]["20B"]
    best = r20["zeropp"]["384"]["step_s"] / r20["lbp"]["384"]["compute_s"]
    reason = _by_id(rg.replay_goals(runs))["replay_lbp_over_zeropp"]["reason"]
    assert f"the ratio would be {best:.3f}" in reason, reason
    reachable = "hiding the rest of lbp's exposed time would reach the goal"
    assert (reachable in reason) is (best >= rg.REPLAY_LBP_OVER_ZEROPP), reason
    # the other outcome, with zeropp's step moved across the target
    r20["zeropp"]["384"]["step_s"] = r20["lbp"]["384"]["compute_s"] * (
        rg.REPLAY_LBP_OVER_ZEROPP + (-0.1 if best >= rg.REPLAY_LBP_OVER_ZEROPP else 0.1))
    reason = _by_id(rg.replay_goals(runs))["replay_lbp_over_zeropp"]["reason"]
    assert (reachable in reason) is not (best >= rg.REPLAY_LBP_OVER_ZEROPP), reason


def test_replay_goals_say_when_the_traces_are_stale(project_run):
    runs = copy.deepcopy(project_run)
    rep = runs["project"]["result"]["replay"]
    rep["stale"] = "the committed traces were recorded with other sources: re-record"
    rep["ratios"][RATIO_KEY] = 0.01
    assert rep["stale"] in _by_id(rg.replay_goals(runs))["replay_lbp_over_zeropp"]["reason"]


def test_replay_goals_not_measured_without_the_project_run():
    runs = {"project": {"status": "failed", "reason": "timed out after 1 s"}}
    for goal in rg.replay_goals(runs):
        assert goal["status"] == "not measured" and "timed out after 1 s" in goal["reason"]


def _row(median, compute, link, trace_phases=None):
    row = {"median_s": median, "compute_s": compute, "link_s": link,
           "exposed_s": median - compute, "exposed_share": (median - compute) / link}
    if trace_phases is not None:
        row["trace"] = {"phases": trace_phases, "step_s": median,
                        "exposed_s": sum(p["exposed_s"] for p in trace_phases.values())}
    return row


def _frontier_run(lbp_median):
    phases = {"step_reduce": {"exposed_s": 0.04, "at_once_s": 0.04, "ahead_s": 0.0},
              "forward_gather": {"exposed_s": 0.02, "at_once_s": 0.005, "ahead_s": 0.015}}
    zphases = {"grad_reduce": {"exposed_s": 0.3, "at_once_s": 0.0, "ahead_s": 0.3}}
    schemes = {"lbp": _row(lbp_median, 0.5, 0.4, phases),
               "zeropp": _row(1.2, 0.5, 1.0, zphases), "zero3": _row(1.6, 0.5, 1.5, zphases),
               "megatron-fsdp": _row(1.7, 0.5, 1.6)}
    config = {"world_size": 8, "cpus": 2, "loadavg_start": [9.0, 8, 7],
              "loadavg_end": [12.0, 9, 8]}
    return {"network_frontier": {"status": "ok",
                                 "result": {"schemes": schemes, "config": config}}}


def test_frontier_goals_follow_the_targets_and_a_miss_says_why_from_the_trace():
    met = _by_id(rg.frontier_goals(_frontier_run(0.55)))
    assert met["frontier_exposed_share"]["status"] == "met"          # 0.05 / 0.4 = 12.5%
    assert met["frontier_speedup_vs_zeropp"]["status"] == "met"      # 1.2 / 0.55 = 2.18
    assert all(g["reason"] == "" for g in met.values() if g["status"] == "met")
    missed = _by_id(rg.frontier_goals(_frontier_run(0.75)))
    share = missed["frontier_exposed_share"]
    assert share["status"] == "missed" and share["value"] == pytest.approx(0.25 / 0.4)
    # why: what the lbp trace had the rank wait on, per phase and cause, and the load
    assert "step_reduce 0.040 s (0.040 waited for at once)" in share["reason"], share["reason"]
    assert "forward_gather 0.020 s (0.005 waited for at once, 0.015 issued ahead" in \
        share["reason"]
    assert "load average 9 at the start and 12 at the end" in share["reason"], share["reason"]
    fsdp = missed["frontier_speedup_vs_megatron-fsdp"]               # 1.7 / 0.75 = 2.27: met
    assert fsdp["status"] == "met"
    zpp = missed["frontier_speedup_vs_zeropp"]                       # 1.2 / 0.75 = 1.6: met
    z3 = missed["frontier_speedup_vs_zero3"]                         # 1.6 / 0.75 = 2.13: met
    assert zpp["status"] == z3["status"] == "met"
    slow = _by_id(rg.frontier_goals(_frontier_run(1.0)))["frontier_speedup_vs_zero3"]
    assert slow["status"] == "missed" and slow["value"] == pytest.approx(1.6)
    assert "lbp step 1.000 s = compute alone 0.500 + exposed 0.500" in slow["reason"]
    assert "grad_reduce 0.300 s (0.300 issued ahead of shorter compute)" in slow["reason"]


def test_frontier_goals_not_measured_when_the_run_was_skipped():
    runs = {"network_frontier": {"status": "skipped", "reason": "skipped (--skip)"}}
    goals = rg.frontier_goals(runs)
    assert len(goals) == 1 + len(rg.SPEEDUP_TARGETS)
    assert all(g["status"] == "not measured" and "skipped (--skip)" in g["reason"]
               for g in goals)
