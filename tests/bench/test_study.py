"""The adoption study's pieces on CPU, without launching ranks: the result file's helpers,
the study plan and its cost, and the report on result files recorded by real runs
(tests/data/study/, written by ``python -m tests.helpers.study_record``)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lbp.study import plan, report
from megatron_lbp.integration import study_result as result

DATA = Path(__file__).parents[1] / "data" / "study"
REPO = Path(__file__).resolve().parents[2]


def test_step_times_exclude_and_name_the_warmup():
    s = result.summarize_times({1: 9.0, 2: 5.0, 3: 1.0, 4: 3.0, 5: 2.0}, 2)
    assert s["warmup_iterations_excluded"] == [1, 2] and s["iterations_measured"] == 3, s
    assert (s["median_s"], s["min_s"], s["max_s"]) == (2.0, 1.0, 3.0), s
    assert s["stdev_s"] == pytest.approx(1.0), s
    empty = result.summarize_times({1: 1.0}, 2)
    assert empty["iterations_measured"] == 0 and empty["median_s"] is None, empty


def test_interface_counters_read_or_not_measured(tmp_path):
    for name, tx, rx in (("hsn0", 100, 7), ("hsn1", 5, 9)):
        d = tmp_path / name / "statistics"
        d.mkdir(parents=True)
        (d / "tx_bytes").write_text(f"{tx}\n")
        (d / "rx_bytes").write_text(f"{rx}\n")
    got, why = result.read_interface_counters(["hsn0", "hsn1"], root=str(tmp_path))
    assert why == "ok" and got == {"hsn0": {"tx": 100, "rx": 7}, "hsn1": {"tx": 5, "rx": 9}}, (got, why)
    got, why = result.read_interface_counters(["hsn0", "hsn9"], root=str(tmp_path))
    assert got is None and why.startswith("not measured") and "hsn9" in why, why
    got, why = result.read_interface_counters([], root=str(tmp_path))
    assert got is None and "LBP_NET_IFACES" in why, why


def test_record_failure_keeps_a_result_the_run_wrote(tmp_path, monkeypatch):
    monkeypatch.delenv(result.ENV, raising=False)
    target = tmp_path / "r.json"
    result.record_failure(str(target), "srun exit 137\n(killed)", {"scheme": "zero3", "nodes": "4"})
    r = result.load(str(target))
    assert (r["status"], r["reason"], r["scheme"], r["nodes"]) == ("failed", "srun exit 137 (killed)", "zero3", 4), r
    result.record_failure(str(target), "another reason", {})
    assert result.load(str(target))["reason"] == "srun exit 137 (killed)"


MODEL = {"num_layers": 44, "hidden_size": 6144, "num_attention_heads": 64, "vocab_size": 50304}


def _runs(**kw):
    base = dict(nodes=[1, 2, 4], schemes=["lbp", "distopt"], scaling="weak", tasks_per_node=8,
                gcds_per_package=2, micro_batch_size=1, micro_batches=4, global_batch=None, iters=20,
                seeds=[1, 2], startup_s=300.0, step_seconds=10.0, model=MODEL, seq_length=2048)
    return plan.make_runs(**{**base, **kw})


def test_plan_weak_and_strong_scaling_and_the_cost():
    weak = _runs()
    # seeds only at the smallest node count
    assert [(r.nodes, r.scheme, r.seed) for r in weak] == [
        (1, "lbp", 1), (1, "lbp", 2), (1, "distopt", 1), (1, "distopt", 2),
        (2, "lbp", 1), (2, "distopt", 1), (4, "lbp", 1), (4, "distopt", 1)]
    assert [r.global_batch for r in weak if r.scheme == "lbp" and r.seed == 1] == [32, 64, 128]
    assert {r.micro_batches for r in weak} == {4}
    c = plan.cost(weak)
    assert c["allocation_nodes"] == 4 and c["seconds"] == 8 * (300 + 20 * 10.0), c
    assert c["node_hours"] == pytest.approx(4 * 8 * 500 / 3600), c
    strong = _runs(scaling="strong", micro_batches=None, global_batch=64, seeds=[1])
    assert [(r.nodes, r.global_batch, r.micro_batches) for r in strong if r.scheme == "lbp"] == [
        (1, 64, 8), (2, 64, 4), (4, 64, 2)]
    with pytest.raises(plan.PlanError, match="not a multiple of 64"):
        _runs(scaling="strong", micro_batches=None, global_batch=96, nodes=[1, 8])
    with pytest.raises(plan.PlanError, match="unknown"):
        _runs(schemes=["lbp", "zero9"])
    with pytest.raises(plan.PlanError, match="--micro-batches"):
        _runs(micro_batches=None)
    # Without --step-seconds: bench project's step model, slower per GCD for zero3 than lbp at 48 nodes.
    proj = _runs(nodes=[48], schemes=["lbp", "zero3"], step_seconds=None, seeds=[1])
    assert 0 < proj[0].step_s < proj[1].step_s, proj


def test_plan_cli_prints_runs_and_node_hours(tmp_path):
    runs_file = tmp_path / "runs.tsv"
    out = subprocess.run([sys.executable, "-m", "megatron_lbp.study", "plan", "--nodes", "1,2",
                          "--schemes", "lbp,zeropp,zero3,distopt", "--scaling", "weak", "--micro-batches", "2",
                          "--iters", "10", "--step-seconds", "6", "--startup-s", "120", "--num-layers", "44",
                          "--hidden-size", "6144", "--num-attention-heads", "64", "--seq-length", "2048",
                          "--runs-file", str(runs_file)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    # 8 runs of 120 + 10 x 6 s in a 2-node allocation: 2 x 8 x 180 s = 0.80 node-hours
    assert "[study] cost: 0.80 node-hours (2 nodes x 0.40 h" in out.stdout, out.stdout
    assert "weak scaling" in out.stdout and "n002-distopt-s1234" in out.stdout, out.stdout
    lines = [l.split("\t") for l in runs_file.read_text().splitlines() if not l.startswith("#")]
    assert lines[0] == ["n001-lbp-s1234", "1", "lbp", "16", "1234"] and len(lines) == 8, lines
    bad = subprocess.run([sys.executable, "-m", "megatron_lbp.study", "plan", "--nodes", "1,x",
                          "--scaling", "weak", "--micro-batches", "2", "--num-layers", "2", "--hidden-size",
                          "64", "--num-attention-heads", "4", "--seq-length", "32"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--nodes" in bad.stderr, bad.stderr


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The recorded study, plus a run that failed and one whose interfaces were counted."""
    d = tmp_path_factory.mktemp("study")
    for p in DATA.glob("*.json"):
        shutil.copy(p, d / p.name)
    result.record_failure(str(d / "n4-zero3-s9.json"), "srun exit 9: node lost",
                          {"scheme": "zero3", "nodes": "4", "gcds": "8", "seed": "9"})
    counted = json.loads((d / "n4-lbp-s1234.json").read_text())
    counted["interface_bytes"] = {"source": "test: counted", "tx_bytes": 8000, "rx_bytes": 8000,
                                  "tx_bytes_per_step": 1000.0, "rx_bytes_per_step": 1000.0}
    (d / "n4-lbp-s1234.json").write_text(json.dumps(counted))
    text, pngs = report.report(str(d))
    return d, text, pngs


def _row(text, scheme, gcds):
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 3 and cells[0] == scheme and cells[2] == str(gcds):
            return cells
    raise AssertionError(f"no row for {scheme} on {gcds} GCDs in:\n{text}")


def test_report_figures_are_the_result_files(study):
    d, text, _ = study
    assert (d / "report.md").read_text().strip() == text.strip()
    assert "Scaling: **weak**" in text
    files = {p.name: result.load(str(p)) for p in d.glob("*.json")}
    for name, r in files.items():
        if r["status"] != "ok" or r["seed"] != 1234 or (r["scheme"] in ("lbp", "distopt") and r["nodes"] == 2):
            continue  # seed-averaged rows are checked below
        cells = _row(text, r["scheme"], r["gcds"])
        assert cells[5] == f"{r['throughput']['tokens_per_s']:.1f}", (name, cells)
        assert cells[6] == f"{r['throughput']['tflops_per_gcd']:.4g}", (name, cells)
        lbp = [f["throughput"]["tflops_per_gcd"] for f in files.values()
               if f["status"] == "ok" and f["scheme"] == "lbp" and f["gcds"] == r["gcds"]]
        ratio = r["throughput"]["tflops_per_gcd"] / (sum(lbp) / len(lbp))   # lbp's seeds averaged
        assert cells[7] == f"{ratio:.3f}", (name, cells, ratio)
        assert cells[1] == str(r["nodes"]) and cells[3] == "1", (name, cells)
    two = [files[f"n2-lbp-s{s}.json"] for s in (1234, 1235)]
    cells = _row(text, "lbp", 4)
    mean = sum(r["throughput"]["tflops_per_gcd"] for r in two) / 2
    assert cells[3] == "2" and cells[6] == f"{mean:.4g}" and cells[7] == "1.000", cells
    # one counted interface, the rest say so
    assert _row(text, "lbp", 8)[11] == "1000", _row(text, "lbp", 8)
    assert _row(text, "zeropp", 8)[11] == "not measured", _row(text, "zeropp", 8)
    assert "LBP_NET_IFACES" in text


def test_report_names_the_failed_run_the_noise_floor_and_the_projection(study):
    _, text, _ = study
    assert "n4-zero3-s9.json: zero3 on 8 GCDs: failed: srun exit 9: node lost" in text, text
    floor = [l for l in text.splitlines() if l.startswith("Loss noise floor:")]
    assert floor and "seeds" in floor[0] and "not measured" not in floor[0], floor
    assert "## Measurement against the cost model's projection" in text
    assert "MI250X" in text and "disagrees by" in text, text
    assert "| distopt | 4 |" in text and "no projection: the cost model has no scheme 'distopt'" in text


def test_report_pngs_open_with_content(study):
    from PIL import Image

    _, _, pngs = study
    names = sorted(Path(p).name for p in pngs)
    assert names == ["loss_2_nodes.png", "loss_4_nodes.png", "network_bytes.png", "peak_memory.png",
                     "scaling_efficiency.png", "tflops_per_gcd.png"], names
    for p in pngs:
        with Image.open(p) as im:
            w, h = im.size
            colors = im.convert("L").getextrema()
        assert w > 200 and h > 150 and colors[0] < colors[1], (p, im.size, colors)


def test_report_cli_refuses_an_empty_directory(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_lbp.study", "report", str(tmp_path)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "no result files" in out.stderr, out.stderr


# --- the study launcher (scripts/launch/lbp_study.sh) with the site's Slurm stand-ins ---
from tests.launch.test_launchers import SCRIPTS, SMALL, flag, in_job, run, site, training_line  # noqa: E402,F401

STUDY = REPO / "scripts" / "launch" / "lbp_study.sh"


def _study(site, *args, **env):
    e = dict(site["env"])
    e.update({k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", str(STUDY), *map(str, args)], env=e, cwd=site["tmp"],
                          capture_output=True, text=True, timeout=300)


def test_study_dry_run_prints_runs_and_cost(site):
    r = _study(site, SCRIPTS["20b"], "--dry-run", STUDY_NODES="1,2,48", STUDY_SCALING="strong",
               STUDY_ITERS=20, STUDY_STEP_SECONDS=10, STUDY_STARTUP_S=240, STUDY_DIR=site["tmp"] / "st")
    assert r.returncode == 0, r.stderr
    assert "[study] strong scaling, 20 iterations per run, 12 runs in one allocation of 48 node(s)" in r.stdout
    # 12 runs x (240 + 20 x 10 s) in 48 nodes: 48 x 12 x 440 / 3600 = 70.40 node-hours
    assert "[study] cost: 70.40 node-hours" in r.stdout, r.stdout
    # wall time: 5280 s x 1.2 = 106 min, + 10
    assert "n048-distopt-s1234" in r.stdout and "1536" in r.stdout, r.stdout   # the profile's global batch
    assert "sbatch -N 48 -t 116 -J lbp-study" in r.stdout and "dry run: nothing submitted" in r.stdout
    assert not (site["srun_marker"] / "sbatch.log").exists()
    bad = _study(site, SCRIPTS["20b"], "--dry-run", STUDY_NODES="1,2", STUDY_SCALING="strong",
                 STUDY_GLOBAL_BATCH=12, STUDY_DIR=site["tmp"] / "st2")
    assert bad.returncode == 2 and "not a multiple of 8" in bad.stderr, bad.stderr


def test_distopt_scheme_is_stock_megatrons_distributed_optimizer(site):
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=2, HIER_PRESET="distopt", HIER_SECONDARY_GROUP_SIZE=0,
            **SMALL)
    assert r.returncode == 0, r.stderr
    cmd = training_line(r.stdout)
    assert "--use-distributed-optimizer" in cmd and not any(w.startswith("--hier-") for w in cmd), cmd


@pytest.mark.slow   # four launcher runs in the job: ~50 s on a busy 2-core machine
def test_study_job_runs_each_and_records_failures(site):
    """In the job: every run is one `bash PROFILE` with its own srun (the site's stand-in, which
    trains nothing, so each run is recorded as failed and the study goes on), then the report."""
    d = site["tmp"] / "st"
    r = _study(site, SCRIPTS["20b"], **in_job(2), STUDY_IN_JOB=1, STUDY_NODES="1,2",
               STUDY_SCHEMES="lbp,distopt", STUDY_ITERS=5, STUDY_DIR=d, LBP_HEALTH_CHECK=0)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p.name for p in (d / "runs").iterdir() if p.is_dir())
    assert runs == ["n001-distopt-s1234", "n001-lbp-s1234", "n002-distopt-s1234", "n002-lbp-s1234"], runs
    sruns = [l for l in (site["srun_marker"] / "srun.log").read_text().splitlines() if "--seed" in l]
    assert [l.split()[1] for l in sruns] == ["1", "1", "2", "2"], sruns   # srun -N <run's nodes>
    for name in runs:
        res = result.load(str(d / "runs" / name / "result.json"))
        assert res["status"] == "failed" and res["reason"].startswith("exit 0"), res
        assert res["study_run"] == name and res["scaling"] == "weak", res
    text = (d / "runs" / "report.md").read_text()
    assert text.count(": failed: exit 0") == 4, text


@pytest.mark.slow
def test_local_slurm_study(tmp_path, local_slurm):
    """Issue 29 item 4: a small study of the Frontier profile at small size
    (scripts/frontier_small.env) on the real two-node Slurm (conftest.py's local_slurm, the
    cluster test_local_slurm_job uses too): 1 and 2 nodes x lbp, zero3, distopt, 4 iterations
    each, in ONE sbatch; every run's result file agrees with its own log, the links are timed
    once per node count, and the report's PNGs open."""
    import re

    from PIL import Image

    from tests.helpers import frontier_small
    from tests.launch.test_launchers import FRONTIER, WHOLE_NODES, _wait_job

    env, study = local_slurm["env"], tmp_path / "study"
    run_env = {**env, **frontier_small.overrides(), **{k: str(v) for k, v in local_slurm["paths"].items()},
               "STUDY_NODES": "1,2", "STUDY_SCHEMES": "lbp,zero3,distopt", "STUDY_ITERS": "4",
               # STUDY_STARTUP_S sizes the job's -t only (42 min; it ends when its runs do): at load
               # 100-300 a run's start took 5-9 min, and a short -t leaves the last runs one iteration
               # of exit time, or refuses them
               "STUDY_SCALING": "weak", "STUDY_STEP_SECONDS": "5", "STUDY_STARTUP_S": "240",
               "STUDY_DIR": str(study), "LOG_INTERVAL": "1",
               "STUDY_SBATCH_ARGS": f"{' '.join(WHOLE_NODES)} --chdir {REPO}"}
    r = subprocess.run(["bash", str(STUDY), str(FRONTIER)], env=run_env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    job = r.stdout.strip().splitlines()[-1].split()[-1]
    state = _wait_job(job, env, timeout=1800)
    out = next(study.glob("study-*.out")).read_text()
    assert state == "COMPLETED", f"{state}\n{out[-3000:]}"
    runs = sorted(p for p in (study / "runs").iterdir() if p.is_dir())
    assert [p.name for p in runs] == sorted(f"n00{n}-{s}-s1234" for n in (1, 2)
                                            for s in ("lbp", "zero3", "distopt")), runs
    for run_dir in runs:
        res = result.load(str(run_dir / "result.json"))
        log = (run_dir / "log").read_text()
        assert res["status"] == "ok", (run_dir.name, res.get("reason"), log[-3000:])
        logged = {int(i): float(v) for i, v in
                  re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([\dE+\-.]+) \|", log)}
        loss = {int(k): v for k, v in res["loss"].items()}
        assert sorted(logged) == sorted(loss) == [1, 2, 3, 4], (run_dir.name, logged, loss)
        for i in (1, 3, 4):   # iteration 2's line is Megatron's mean of 1 and 2
            assert abs(loss[i] - logged[i]) <= 2e-6 * abs(logged[i]), (run_dir.name, i, loss[i], logged[i])
        assert res["nodes"] == int(run_dir.name[1:4]) and res["scaling"] == "weak", res
        # STUDY_HEALTH_CHECK=first: the first run at each node count (lbp, in plan order) checks the
        # nodes and times their links; the others on the same nodes of the allocation check nothing
        checked = "[lbp health] package: all-gather" in log
        skipped = "health check: none (LBP_HEALTH_CHECK=none" in log
        assert (checked, skipped) == ((True, False) if res["scheme"] == "lbp" else (False, True)), run_dir.name
    assert out.count("health check none (an earlier run checked these") == 4, out
    text = (study / "runs" / "report.md").read_text()
    for run_dir in runs:
        res = result.load(str(run_dir / "result.json"))
        assert f"{res['throughput']['tflops_per_gcd']:.4g}" in text, (run_dir.name, text)
    for png in (study / "runs").glob("*.png"):
        with Image.open(png) as im:
            assert im.size[0] > 200 and im.convert("L").getextrema()[0] < 255, png


def test_projection_uses_the_links_the_health_check_measured(tmp_path):
    """The launcher's health check prints one median per link class into each run's log; the
    report's projection takes those (median over runs) instead of the model's defaults."""
    for name in ("n2-lbp-s1234", "n4-lbp-s1234"):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        shutil.copy(DATA / f"{name}.json", run / "result.json")
    line = "[lbp_health] {}: 4 pairs: median {} GB/s, slowest 0.1 GB/s on node1; expected 50 GB/s per GCD\n"
    (tmp_path / "runs" / "n2-lbp-s1234" / "log").write_text(line.format("node", 0.5) + line.format("network", 0.2))
    (tmp_path / "runs" / "n4-lbp-s1234" / "log").write_text(line.format("network", 0.4))
    assert report.measured_links(str(tmp_path)) == {"node": 0.5, "network": pytest.approx(0.3)}
    text, _ = report.report(str(tmp_path))
    assert "the links the launcher's health check measured (network, node; median over runs)" in text, text
    assert "package 200, node 0.5, network 0.3" in text, text
    (tmp_path / "plain").mkdir()
    shutil.copy(DATA / "n4-lbp-s1234.json", tmp_path / "plain")
    default, _ = report.report(str(tmp_path / "plain"))   # no logs: the model's own links
    assert "with its default links" in default and "network 12.5" in default, default
