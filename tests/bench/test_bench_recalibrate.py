"""Re-deriving a stored emulated-network result's predictions with today's cost model.

No namespaces: the inputs are the committed results.json's real network runs and
network._calibration itself, which the run calls.
"""
import copy
import json
from pathlib import Path

import pytest

from benchmarks import network, recalibrate, report, report_render

REPO = Path(__file__).resolve().parents[2]
COMMITTED = json.loads((REPO / "docs" / "benchmarks" / "results.json").read_text())
WITH = "the cost model under test"
REL = 1e-9


def _committed(key: str) -> dict:
    run = COMMITTED["runs"][key]
    assert run["status"] == "ok", f"committed {key} did not run: {run.get('reason')}"
    return run["result"]


def _predictions(cal: dict) -> dict:
    return {s: c for s, c in cal.items() if s != "fit"}


def _assert_same_predictions(got: dict, want: dict, what: str) -> None:
    assert set(_predictions(got)) == set(_predictions(want)), what
    for s, w in _predictions(want).items():
        g = got[s]
        assert g["measured_s"] == w["measured_s"], (what, s, "measured changed")
        for key in ("predicted_s", "predicted_ratio"):
            assert g[key] == pytest.approx(w[key], rel=REL, abs=0), (what, s, key, g[key], w[key])
        for part, v in w["predicted_parts_s"].items():
            assert g["predicted_parts_s"][part] == pytest.approx(v, rel=REL, abs=1e-15), (
                what, s, part, g["predicted_parts_s"][part], v)
        assert g["rel_error"] == pytest.approx(w["rel_error"], rel=REL, abs=1e-12), (
            what, s, g["rel_error"], w["rel_error"])
        assert g["within_20pct"] == w["within_20pct"], (what, s, g["rel_error"], w["rel_error"])


def test_committed_network_runs_are_reproduced_from_their_stored_fit():
    """The Frontier-shaped run was measured with today's cost model (10e31eb, after the
    shared-uplink exchange rule of 9000c29): its predictions come back from config + fit alone, to
    1e-9. So does any run the report re-derived (``predicted_with``). The default run predates
    9000c29 and was not re-derived, so its stored predictions are that older model's. When the
    cost model changes this fails until the report is regenerated (which re-derives them)."""
    runs = ["network_frontier"] + [k for k in ("network",) if "predicted_with" in
                                   _committed(k)["calibration"]["fit"]]
    for key in runs:
        stored = _committed(key)
        again = recalibrate.recalibrate(stored, WITH)
        _assert_same_predictions(again["calibration"], stored["calibration"],
                                 f"{key}: committed predictions are not the current cost model's "
                                 f"(regenerate: python -m benchmarks report --only project)")
        fit = dict(again["calibration"]["fit"])
        assert fit.pop("predicted_with") == WITH
        stored_fit = {k: v for k, v in stored["calibration"]["fit"].items()
                      if k != "predicted_with"}
        assert fit == stored_fit, key
        assert again["schemes"] == stored["schemes"] and again["config"] == stored["config"]


@pytest.mark.parametrize("argv", [[], ["--model", "frontier-shaped"]])
def test_the_run_and_the_rederivation_are_one_computation(argv):
    """network._calibration's output, as the run stores it, is reproduced from config() + fit."""
    args = network.parse(argv)
    real = _committed("network_frontier")["calibration"]["fit"]  # a real link fit and compute
    measured = {s: 10.0 + i for i, s in enumerate(args.schemes)}
    cal = network._calibration(args, measured, {**real["links"], "samples": real["link_samples"]},
                               real["compute_measured"])
    result = json.loads(json.dumps({"config": network.config(args), "calibration": cal,
                                    "schemes": {s: {"median_s": t} for s, t in measured.items()}}))
    again = recalibrate.recalibrate(result, WITH)["calibration"]
    _assert_same_predictions(again, cal, f"{argv}: re-derived differs from the run's")
    assert {k: v for k, v in again["fit"].items() if k != "predicted_with"} == result[
        "calibration"]["fit"]


def test_a_perturbed_fit_predicts_otherwise():
    stored = _committed("network_frontier")
    slow = copy.deepcopy(stored)
    slow["calibration"]["fit"]["model_links_MB_per_s"]["network"] /= 2
    base = recalibrate.recalibrate(stored, WITH)["calibration"]
    got = recalibrate.recalibrate(slow, WITH)["calibration"]
    for s in _predictions(base):
        # every scheme's step crosses the uplink: half its bandwidth costs time
        assert got[s]["predicted_s"] > base[s]["predicted_s"], (s, got[s], base[s])
        assert got[s]["measured_s"] == base[s]["measured_s"]
    assert got["zero3"]["predicted_ratio"] != pytest.approx(base["zero3"]["predicted_ratio"])
    faster = copy.deepcopy(stored)
    faster["calibration"]["fit"]["compute_model"]["peak_flops"] *= 2
    got = recalibrate.recalibrate(faster, WITH)["calibration"]
    assert got["lbp"]["predicted_parts_s"]["compute_s"] == pytest.approx(
        base["lbp"]["predicted_parts_s"]["compute_s"] / 2, rel=REL)
    assert stored == _committed("network_frontier"), "recalibrate changed its input"


@pytest.mark.parametrize("path,named", [
    (("config", "micro_batches"), "config.micro_batches"),
    (("config", "model", "vocab_size"), "config.model.vocab_size"),
    (("calibration", "fit", "network_model"), "calibration.fit.network_model"),
    (("calibration", "fit", "model_links_MB_per_s", "network"),
     "calibration.fit.model_links_MB_per_s.network"),
    (("calibration", "fit", "model_latency_us", "package"),
     "calibration.fit.model_latency_us.package"),
    (("calibration", "fit", "compute_model", "peak_flops"),
     "calibration.fit.compute_model.peak_flops"),
    (("calibration", "fit"), "calibration.fit"),
    (("schemes", "zero3", "median_s"), "schemes.zero3.median_s"),
])
def test_a_result_missing_an_input_is_refused_by_name(path, named):
    old = copy.deepcopy(_committed("network_frontier"))
    parent = old
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    with pytest.raises(recalibrate.NotRederivable) as e:
        recalibrate.recalibrate(old, WITH)
    assert f"no {named}:" in str(e.value), str(e.value)


def test_a_compute_model_field_today_s_model_lacks_is_refused():
    old = copy.deepcopy(_committed("network_frontier"))
    old["calibration"]["fit"]["compute_model"]["tensor_cores"] = 4
    with pytest.raises(recalibrate.NotRederivable, match="compute_model has tensor_cores"):
        recalibrate.recalibrate(old, WITH)


def test_the_report_rederives_every_network_run_and_says_so():
    runs = copy.deepcopy(COMMITTED["runs"])
    broken = runs["network_frontier"]["result"]["calibration"]["fit"]
    del broken["compute_model"]
    warned = []
    git = {"commit": "c0ffee" * 6 + "abcd", "dirty_code_paths": []}
    report.rederive_predictions(runs, git, log=warned.append)
    fit = runs["network"]["result"]["calibration"]["fit"]
    assert fit["predicted_with"] == (f"the cost model at commit {git['commit']} (re-derived at "
                                     f"report time from the run's fitted links and compute)")
    want = recalibrate.recalibrate(COMMITTED["runs"]["network"]["result"], fit["predicted_with"])
    assert runs["network"]["result"] == want
    assert "not_rederived" not in runs["network"]
    # the broken run keeps its own predictions, says why, and the report warns
    assert runs["network_frontier"]["result"]["calibration"]["lbp"] == \
        COMMITTED["runs"]["network_frontier"]["result"]["calibration"]["lbp"]
    why = runs["network_frontier"]["not_rederived"]
    frontier = COMMITTED["runs"]["network_frontier"]
    # whose predictions they still are: the last re-derivation's model, else the run's own
    said = frontier["result"]["calibration"]["fit"].get("predicted_with") or \
        frontier["git"]["commit"]
    assert "calibration.fit.compute_model" in why and said in why, why
    assert warned == [f"[report] WARNING: network_frontier: {why}"]
    md = "\n".join(report_render.network_section(
        {"runs": runs, "plots": {}}, REPO / "BENCHMARKS.md", REPO / "docs" / "benchmarks"))
    assert f"Predicted by {fit['predicted_with']}." in md
