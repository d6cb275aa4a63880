"""The link survey (megatron_lbp/launch/link_survey.py) on real gloo ranks: 2 emulated nodes x 2
packages x 2 GCDs, tiny messages; its file read back by the one reader (projection/survey_file.py)."""
from __future__ import annotations

import json

import pytest

from megatron_lbp.launch import link_survey as ls
from megatron_lbp.projection import survey_file as sf
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks

SIZES = [4096, 65536]
CODEC_ELEMENTS = [1024, 8192]


def _survey(out_path, sizes, max_seconds, overlap_bytes):
    import torch

    lines = []
    data = ls.run(out_path=out_path, tasks_per_node=4, gcds_per_package=2, sizes=sizes, reps=2,
                  max_seconds=max_seconds, overlap_bytes=overlap_bytes, gemm_dim=32,
                  device=torch.device("cpu"), log=lines.append, codec_elements=CODEC_ELEMENTS)
    return data, lines


@pytest.fixture(scope="module")
def surveyed(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("survey") / "survey.json")
    out = run_on_ranks(_survey, 8, path, SIZES, 300.0, 16384, rank_env=rank_location_env(4),
                       timeout=600)
    return path, out


def test_every_shape_op_and_dtype_is_timed_and_the_file_reads_back(surveyed):
    path, out = surveyed
    data, lines = out[0]
    assert all(o[0] is None for o in out[1:]), "only rank 0 writes the survey"
    back = sf.read(path)
    assert back == json.loads(json.dumps(data))
    assert back["shapes"] == {
        "package": {"group_size": 2, "groups": 4, "link": "package"},
        "node": {"group_size": 4, "groups": 2, "link": "node"},
        "cross_node": {"group_size": 2, "groups": 4, "link": "network"},
        "world": {"group_size": 8, "groups": 1, "link": "network"}}, back["shapes"]
    want = {(s, op, dt) for s, op, dt, _ in ls.cases(list(back["shapes"]), SIZES)}
    got = {(t["shape"], t["op"], t["dtype"]) for t in back["tables"]}
    assert got == want, f"missing {want - got}, extra {got - want}"
    assert len(want) == 4 * (4 + 4 + 2 + 2)
    for t in back["tables"]:
        n = t["group_size"]
        item = {"int8": 1, "int4": 1, "bf16": 2, "fp32": 4}[t["dtype"]]
        assert t["bytes"] == [b // item // n * n * item for b in SIZES], t
        per = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2}[t["op"]]
        assert t["sent_bytes"] == [per * b * (n - 1) / n for b in t["bytes"]], t
    assert back["skipped"] == []
    # one progress line per shape, then the overlap probe's and the summary
    shape_lines = [l for l in lines if l.startswith("shape ")]
    assert [l.split()[1].rstrip(":") for l in shape_lines] == list(back["shapes"]), lines
    assert any(l.startswith("overlap on cross_node:") for l in lines), lines
    ov = back["overlap"]
    assert ov["shape"] == "cross_node" and set(ov["by_op"]) == set(sf.OPS), ov
    for op, o in ov["by_op"].items():
        assert o["gemm_alone_s"] > 0 and o["comm_alone_s"] > 0 and o["together_s"] > 0, (op, o)
        assert o["slowdown"] == pytest.approx(o["gemm_with_s"] / o["gemm_alone_s"])
    # the codec probe: both codecs, both directions, a time per size
    codecs = back["codecs"]
    assert codecs["elements"] == CODEC_ELEMENTS and set(codecs["by_codec"]) == {"int8", "int4"}
    for name, c in codecs["by_codec"].items():
        for direction in ("encode", "decode"):
            assert len(c[direction]["seconds"]) == len(CODEC_ELEMENTS), (name, direction, c)
        assert c["slowdown"] > 0, (name, c)
    assert any(l.startswith("codecs: int8 encode") for l in lines), lines


def test_the_time_bound_stops_scheduling_cases_once_spent(tmp_path):
    """A bound below the first case's time: that case runs (nothing predicts it), every later one
    is skipped and listed (the ranks agree on it, or the survey would hang), and the file is a
    complete survey of what was timed."""
    path = str(tmp_path / "s.json")
    out = run_on_ranks(_survey, 8, path, [1024, 1 << 20], 1e-9, 0,
                       rank_env=rank_location_env(4), timeout=600)
    data = sf.read(path)
    (only,) = data["tables"]
    assert (only["shape"], only["op"], only["dtype"], only["bytes"]) == (
        "package", "all_gather", "int8", [1024]), only
    every = [(s, op, dt, b) for s, op, dt, sz in ls.cases(list(data["shapes"]), [1024, 1 << 20])
             for b in sz]
    assert data["skipped"] == [f"{op} {dt} {s} {b}: past --max-seconds=1e-09"
                               for s, op, dt, b in every[1:]]
    assert data["overlap"] is None and out[0][0]["skipped"] == data["skipped"]


def _health(argv):
    import contextlib
    import io
    import os

    from megatron_lbp.launch import health

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = health.main(argv, env=dict(os.environ))
    return code, out.getvalue()


def test_the_health_check_runs_the_survey(tmp_path):
    """``health --survey-out``: the link check, then the survey on the same ranks, one progress
    line per shape on rank 0 and the file the estimate reads."""
    path = str(tmp_path / "lbp_survey.json")
    argv = ["--tasks-per-node", "4", "--gcds-per-package", "2", "--gpus-per-task", "0",
            "--require-gpu", "none", "--megabytes", "0.01", "--min-fraction", "0",
            "--survey-out", path,
            "--survey-sizes-mib", "0.00390625", "--survey-reps", "1", "--survey-overlap-mib", "0.004",
            "--survey-gemm-dim", "16", "--survey-codec-mi-elements", "0.001953125"]
    out = run_on_ranks(_health, 8, argv, rank_env=rank_location_env(4), init_process_group=False,
                       timeout=600)
    assert [code for code, _ in out] == [0] * 8, out[0][1]
    log = out[0][1]
    assert "[lbp health] network: all-gather" in log, log
    assert [l.split()[3] for l in log.splitlines() if l.startswith("[lbp survey] shape ")] == [
        "package:", "node:", "cross_node:", "world:"], log
    data = sf.read(path)
    assert data["command"] == "python -m megatron_lbp.launch health"
    assert {t["bytes"][0] for t in data["tables"] if t["dtype"] == "int8"} == {4096}
    assert data["codecs"]["elements"] == [2048], data["codecs"]
    assert all(o[1] == "" for o in out[1:]), "only rank 0 prints"


def _survey_command(argv):
    import os

    from megatron_lbp.launch import link_survey

    return link_survey.main(argv, env=dict(os.environ))


def test_the_survey_command_joins_the_job_and_writes_its_file(tmp_path):
    """``python -m megatron_lbp.launch survey`` on its own: each rank brings up the job's process
    group as the health check does (health.join_job), and rank 0 writes the file."""
    path = str(tmp_path / "own.json")
    argv = ["--out", path, "--tasks-per-node", "2", "--gcds-per-package", "2",
            "--gpus-per-task", "0", "--sizes-mib", "0.00390625", "--reps", "1",
            "--overlap-mib", "0", "--codec-mi-elements", "0"]
    codes = run_on_ranks(_survey_command, 4, argv, rank_env=rank_location_env(2),
                         init_process_group=False, timeout=600)
    assert codes == [0] * 4, codes
    data = sf.read(path)
    assert data["machine"]["backend"] == "gloo" and data["machine"]["world"] == 4, data["machine"]
    assert data["shapes"]["cross_node"]["groups"] == 2, data["shapes"]
    assert data["codecs"] is None, "--codec-mi-elements 0: no codec probe"


def test_the_estimate_of_the_bound_is_the_public_models_sum_of_cases():
    """--estimate: (1 + reps) x every case at the public figures' slow end, per shape; the
    world shape is left out where it is the node (one node)."""
    from megatron_lbp.core.costs import ring_sent
    from megatron_lbp.projection import collectives as cm

    sizes = [1 << 20, 1 << 30]
    est = ls.estimate_seconds(48, 8, 2, sizes, reps=3, overlap_bytes=0)
    m = cm.CollectiveModel.public()
    want = sum(4 * m.seconds(op, dt, "world", float(ring_sent(op, b, 384)), 384, "slow")
               for _, op, dt, sz in ls.cases(["world"], sizes) for b in sz)
    assert est["world"] == pytest.approx(want)
    assert set(est) == {"package", "node", "cross_node", "world", "overlap", "codecs", "total"}
    assert est["total"] == pytest.approx(sum(v for k, v in est.items() if k != "total"))
    assert "world" not in ls.estimate_seconds(1, 8, 2, sizes, 3, 0)


@pytest.mark.parametrize("argv,needle", [
    (["--out", "x.json", "--sizes-mib", "a,b"], "--sizes-mib='a,b'"),
    (["--out", "x.json", "--reps", "0"], "--reps=0"),
    (["--out", "x.json", "--tasks-per-node", "3"], "--tasks-per-node=3"),
    (["--sizes-mib", "1"], "--out FILE"),
    (["--out", "/no/such/dir/x.json"], "its directory does not exist"),
    (["--out", "x.json", "--codec-mi-elements", "x"], "--codec-mi-elements='x'"),
    (["--out", "x.json", "--codec-mi-elements", "0.0001"], "at least 256 elements"),
])
def test_bad_arguments_are_refused_in_one_line_before_any_rank_work(argv, needle, capsys):
    assert ls.main(argv, env={}) == 2      # no RANK: it never reached the ranks
    err = capsys.readouterr().err.strip()
    assert err.startswith("lbp_survey: error: ") and needle in err and "\n" not in err, err
