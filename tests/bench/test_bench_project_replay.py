"""The projection that replays the engine's traced schedule (megatron_lbp/projection/project_replay.py).

The replay rules themselves are checked on hand-made traces in
test_bench_replay.py; here: the committed traces are the engine's current
schedule at the 10B/20B unit structure, their bytes are the cost model's
collective by collective, the replay moves exactly the plan's bytes at every
GCD count, and its times add up (step = compute + exposed; infinite links
leave only compute).
"""
import json
import math
import re
import subprocess
import sys

import pytest

from megatron_lbp.core import costs
from megatron_lbp.projection import project as pj
from megatron_lbp.projection import project_replay as pr
from megatron_lbp.projection.replay import ALL_PHASES, ReplayError

CMD = [sys.executable, "-m", "benchmarks", "project"]
GCDS = (8, 384)


@pytest.fixture(scope="module")
def replayed():
    return pr.replay_projection(("10B", "20B"), GCDS, pj.DEFAULT_SCHEMES, pr.default_traces(),
                                pj.LinkModel(), pj.ComputeModel())


def test_committed_traces_are_in_the_readers_format_with_their_reference():
    """That they are today's schedule: tests/engine/test_schedule.py records the reference afresh."""
    from megatron_lbp.projection.trace import TRACE_FORMAT_VERSION

    index = pr.read_index()
    assert index["trace_format_version"] == TRACE_FORMAT_VERSION, (
        f"the committed traces are in trace format {index['trace_format_version']}, the "
        f"reader's is {TRACE_FORMAT_VERSION}: re-record with {pr.RECORD_COMMAND} "
        f"({pr.RECORD_MINUTES}) and commit the directory")
    assert index["command"] == pr.RECORD_COMMAND
    assert index["reference"] == pr.REFERENCE and (pr.TRACES_DIR / pr.REFERENCE["file"]).is_file()
    traces = pr.default_traces()
    for model in pj.MODELS.values():
        for scheme in pj.DEFAULT_SCHEMES:
            records = pr.load(traces[scheme][model["num_layers"]])
            pr.check_units(records, model, scheme)
            assert records[-1]["micro_batches"] == index["micro_batches"]
            assert any(i["pass"] == "recompute" for i in records[-1]["compute"])


def _reference_records():
    return pr.load(pr.TRACES_DIR / pr.REFERENCE["file"])


def test_the_structure_keeps_the_program_and_drops_the_machine():
    """A test of test_schedule's comparison: what the host's timing decides (times, trace ids)
    leaves the structure; a changed order, overlap, collective or byte count does not."""
    import copy

    from megatron_lbp.projection.structure import difference, structure

    records = _reference_records()
    want = structure(records)
    assert len(want) == 3 and all(len(s["program"]) > 50 for s in want), want[0]["program"][:5]

    retimed = copy.deepcopy(records)
    for r in retimed:
        for c in [*r["collectives"], *r["carried"]]:
            for key in ("issued", "wait", "done"):
                c[key] = None if c[key] is None else c[key] * 3 + 1
            c["id"] += 1000
            c["after"] = None if c["after"] is None else c["after"] + 1000
        for n in r["needs"]:
            n["id"] += 1000
            n["time"] *= 3
    assert difference(structure(retimed), want) == ""

    def changed(edit) -> str:
        other = copy.deepcopy(records)
        edit(other[-1])
        return difference(structure(other), want)

    def swap_two_computes(r):   # the order of two compute intervals
        a, b = r["compute"][3], r["compute"][4]
        a["start_seq"], b["start_seq"] = b["start_seq"], a["start_seq"]

    def gather_one_interval_later(r):   # a prefetch gather issued after the compute it hid under
        c = next(c for c in r["collectives"] if c["after"] is None and c["async"]
                 and c["phase"] == "forward_gather" and c["micro_batch"] == 1)
        later = min(i["start_seq"] for i in r["compute"] if i["start_seq"] > c["issued_seq"])
        c["issued_seq"] = later + 0.5

    def drop_a_collective(r):
        r["collectives"].pop(len(r["collectives"]) // 2)

    def more_bytes(r):
        r["collectives"][0]["bytes"] += 2

    for edit in (swap_two_computes, gather_one_interval_later, drop_a_collective, more_bytes):
        why = changed(edit)
        assert why.startswith(f"step {records[-1]['step']}, "), (edit.__name__, why)


def test_phases_are_the_engines():
    from megatron_lbp.engine.comm import ALL_PHASES as ENGINE_PHASES

    assert ALL_PHASES == ENGINE_PHASES


@pytest.mark.parametrize("scheme", ["lbp", "zeropp"])
def test_recorded_bytes_are_the_cost_models_collective_by_collective(scheme):
    """At the shape it was recorded at, every unit's collectives carry unit_collective_bytes."""
    index = pr.read_index()
    entry = next(e for e in index["traces"] if e["scheme"] == scheme and e["layers"] == 32)
    records = pr.load(pr.TRACES_DIR / entry["file"])
    model = {"num_layers": entry["layers"], "hidden_size": entry["hidden"],
             "vocab_size": entry["vocab"]}
    plan = pj.plan_for(model, index["ranks"], scheme, index["micro_batches"],
                       gpus_per_node=index["gpus_per_node"])
    d = pr.FrontierDurations(records, plan, model, pj.LinkModel(), pj.ComputeModel())
    recorded = {}
    for c in records[-1]["collectives"]:
        if c["phase"] != "control":
            key = (c["unit"], c["phase"], c["family"], c["micro_batch"])
            recorded[key] = recorded.get(key, 0) + c["bytes"]
    assert recorded
    for (unit, phase, family, _), nbytes in recorded.items():
        assert nbytes == pytest.approx(float(d.unit_bytes[unit][(phase, family)])), (
            unit, phase, family)


def test_the_replay_moves_the_plans_bytes_and_its_times_add_up(replayed):
    for name, per_scheme in replayed["results"].items():
        assert set(per_scheme) == set(pj.DEFAULT_SCHEMES), name
        for scheme, rows in per_scheme.items():
            for g, r in rows.items():
                where = (name, scheme, g)
                assert r["bytes_match_plan"], where
                assert r["step_s"] == pytest.approx(r["compute_s"] + r["exposed_s"]), where
                assert 0 <= r["exposed_s"] <= r["link_s"] + 1e-12, where
                assert r["tflops_per_gcd"] < 191.5 * 0.35, where
            assert rows["8"]["scaling_efficiency"] == 1.0
    assert set(replayed["ratios"]) == set(pj.project(GCDS and ("10B", "20B"), GCDS)["ratios"])
    # Traces of another format are test_committed_traces_are_in_the_readers_format's failure;
    # here the replay says so (with the command that re-records them) exactly when they are.
    from megatron_lbp.projection.trace import TRACE_FORMAT_VERSION

    fresh = pr.read_index()["trace_format_version"] == TRACE_FORMAT_VERSION
    assert (replayed["stale"] == "") is fresh, replayed["stale"]
    assert fresh or pr.RECORD_COMMAND in replayed["stale"]
    assert replayed["idealised"]["micro_batches"] == 2 and replayed["idealised"]["recompute"]


def test_compute_is_the_model_flops_plus_the_recomputed_layers():
    """fwd + bwd = 3 x forward of every unit, recomputation = the layers' forward once more."""
    model = pj.MODELS["20B"]
    records = pr.load(pr.default_traces()["lbp"][44])
    plan = pj.plan_for(model, 384, "lbp", 2)
    compute = pj.ComputeModel()
    d = pr.FrontierDurations(records, plan, model, pj.LinkModel(), compute)
    L, h, V, s = 44, model["hidden_size"], model["vocab_size"], compute.seq_length
    layer = costs.gpt_units(L, h, V)[1][1]
    fwd_layer = 2 * layer + 4 * h * s
    fwd_all = L * fwd_layer + 2 * (2 * h + V * h)
    per_token = pj.model_flops_per_token(plan.params, L, h, s)
    assert 3 * fwd_all == pytest.approx(per_token, rel=1e-12)
    want = 2 * (3 * fwd_all + L * fwd_layer) * s / (compute.peak_flops * compute.mfu) + d.adam_s
    got = sum(d.compute_s(records[-1], i) for i in records[-1]["compute"])
    assert got == pytest.approx(want, rel=1e-12)


def test_infinite_links_leave_only_compute():
    fast = pj.LinkModel.from_measured({c: 1e30 for c in costs.LINK_CLASS_ORDER},
                                      {c: 0.0 for c in costs.LINK_CLASS_ORDER})
    out = pr.replay_projection(("20B",), GCDS, ("zeropp",), pr.default_traces(), fast,
                               pj.ComputeModel())
    for r in out["results"]["20B"]["zeropp"].values():
        assert r["exposed_s"] == pytest.approx(0.0, abs=1e-9)
        assert r["step_s"] == pytest.approx(r["compute_s"])


def test_a_trace_of_another_model_is_refused():
    records = pr.load(pr.default_traces()["lbp"][32])
    with pytest.raises(ReplayError, match="33 layer.*44 layer|32 layer.*44 layer"):
        pr.check_units(records, pj.MODELS["20B"], "20B lbp")


def test_cli_replays_a_given_trace_and_refuses_bad_ones(tmp_path):
    l44 = str(pr.default_traces()["zeropp"][44])
    out = subprocess.run(CMD + ["--models", "20B", "--gcds", "8,384", "--schemes", "lbp,zeropp",
                                "--trace", f"zeropp={l44}", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout)["replay"]
    assert rep["traces"]["zeropp"]["20B"]["path"].endswith("L44-zeropp.jsonl.gz")
    assert "20B lbp/zeropp TFLOPS at 384" in rep["ratios"]
    text = subprocess.run(CMD + ["--models", "20B", "--gcds", "8,384", "--schemes", "lbp,zeropp"],
                          capture_output=True, text=True, timeout=300)
    assert text.returncode == 0 and "replayed" in text.stdout and "paper 1.71" in text.stdout
    # the replayed ratios stand beside the idealised ones at the trace's settings and at the
    # command's own (the tables above: 1 micro-batch, no recomputation)
    lbp_line = next(ln for ln in text.stdout.splitlines() if "20B lbp/zeropp" in ln
                    and "replayed" in ln)
    assert re.search(r"replayed 1\.\d{3}   idealised \d\.\d{3}   as above \d\.\d{3}   paper 1\.71",
                     lbp_line), lbp_line
    assert "idealised as above (1 micro-batch(es), no recomputation)" in text.stdout
    for args, says in ((["--trace", "lbp"], "give SCHEME=PATH"),
                       (["--trace", f"nosuch={l44}"], "give SCHEME=PATH"),
                       (["--trace", f"lbp={tmp_path}/none.jsonl"], "does not exist"),
                       (["--models", "10B", "--trace", f"lbp={l44}"], "not the model's")):
        bad = subprocess.run(CMD + ["--gcds", "8,384", *args], capture_output=True, text=True,
                             timeout=300)
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and says in lines[0], (args, bad.stderr)


def test_bench_trace_reads_a_compressed_trace(capsys):
    from megatron_lbp.projection import trace

    assert trace.main([str(pr.default_traces()["lbp"][32]), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == [2, 3] and summary["median"]["phases"]["step_reduce"]["count"] == 34


def test_the_step_chains_run_on_streams_and_hide_but_for_the_tail():
    """The engine takes nothing by a poll: its optimizer step's chains run on streams, each
    hop after the one it names (``after``) has landed, whether or not the host waited.
    Replayed so, lbp's step reduce-scatters and gathers hide behind compute but for the tail."""
    model = pj.MODELS["20B"]
    records = pr.load(pr.default_traces()["lbp"][44])
    assert not any(c["polled"] for r in records for c in r["collectives"])
    assert not any(r["needs"] for r in records)
    assert any(c["after"] for c in records[-1]["collectives"] if c["phase"] == "step_gather")
    plan = pj.plan_for(model, 384, "lbp", 2)
    r = pr.replay_one(records, plan, model, pj.LinkModel(), pj.ComputeModel())
    assert r["bytes_match_plan"]
    assert r["step_s"] == pytest.approx(r["compute_s"] + r["exposed_s"])
    for phase in ("step_reduce", "step_gather"):
        p = r["phases"][phase]
        # What is left is the tail: at most a few units' link time.
        assert p["exposed_s"] < 4 * p["link_s"] / p["count"] * (2 if phase == "step_gather"
                                                                 else 1), (phase, p)


def test_optimizer_intervals_share_adam_and_an_unknown_pass_is_refused():
    model = pj.MODELS["20B"]
    records = pr.load(pr.default_traces()["lbp"][44])
    d = pr.FrontierDurations(records, pj.plan_for(model, 384, "lbp", 2), model, pj.LinkModel(),
                             pj.ComputeModel())
    one = {"unit": None, "micro_batch": None, "pass": "optimizer"}
    per_unit = [dict(one, unit=u) for u in range(len(d.units) - 1)] + [dict(one), dict(one)]
    split = {"compute": per_unit}
    assert sum(d.compute_s(split, i) for i in per_unit) == pytest.approx(d.adam_s)
    assert d.compute_s({"compute": [one]}, one) == pytest.approx(d.adam_s)
    with pytest.raises(ReplayError, match="compute pass 'wgrad'"):
        d.compute_s(split, dict(one, unit=1, **{"pass": "wgrad"}))
