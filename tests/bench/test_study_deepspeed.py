"""The DeepSpeed schemes in the adoption study (issue 29 with issue 28): the plan runs them,
and their result files (written by megatron_lbp/deepspeed_baseline/pretrain.py through
megatron_lbp/integration/study_result.py, recorded in tests/data/study_ds/ by ``python -m
tests.helpers.study_record_ds``) go through the report beside lbp's (tests/data/study/)."""
import shutil
from pathlib import Path

import pytest

from megatron_lbp.study import plan, report
from megatron_lbp.integration import study_result as result
from tests.bench.test_study import _row   # the report table's row of a scheme on a GCD count

DATA = Path(__file__).parents[1] / "data"
DS = ("ds-zero3", "ds-zeropp")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    d = tmp_path_factory.mktemp("study_ds")
    for p in [*DATA.glob("study/n2-*.json"), *DATA.glob("study_ds/*.json")]:
        shutil.copy(p, d / p.name)
    text, pngs = report.report(str(d))
    return d, text, pngs


def test_deepspeed_result_files_say_what_they_measured():
    for scheme in DS:
        r = result.load(str(DATA / "study_ds" / f"n2-{scheme}-s1234.json"))
        assert (r["status"], r["scheme"], r["nodes"], r["gcds"], r["global_batch"]) == (
            "ok", scheme, 2, 4, 8), r
        assert r["step_time"]["warmup_iterations_excluded"] == [1, 2] and r["step_time"]["median_s"] > 0
        assert sorted(map(int, r["loss"])) == list(range(1, 9)), r["loss"]
        assert r["throughput"]["flop_formula"] == result.FLOP_FORMULA
        # the same FLOP count per step as lbp's run of the same model and batch
        lbp = result.load(str(DATA / "study" / "n2-lbp-s1234.json"))
        assert r["throughput"]["flops_per_step"] == lbp["throughput"]["flops_per_step"]
        assert r["peak_memory_per_gcd"]["source"].startswith("not measured") and \
            "DeepSpeed" in r["peak_memory_per_gcd"]["source"], r["peak_memory_per_gcd"]
        assert r["ledger_bytes_per_step"]["source"] == "not measured: DeepSpeed keeps no ledger"
    zpp = result.load(str(DATA / "study_ds" / "n2-ds-zeropp-s1234.json"))
    assert zpp["group_sizes"] == {"hpz_partition_size": 2, "qwz": True, "qgz": True}, zpp


def test_report_puts_deepspeed_beside_lbp(study):
    d, text, pngs = study
    files = {p.name: result.load(str(p)) for p in d.glob("*.json")}
    lbp = [f["throughput"]["tflops_per_gcd"] for f in files.values() if f["scheme"] == "lbp"]
    for scheme in DS:
        r = files[f"n2-{scheme}-s1234.json"]
        cells = _row(text, scheme, 4)
        assert cells[1] == "2" and cells[3] == "1", cells
        assert cells[5] == f"{r['throughput']['tokens_per_s']:.1f}", cells
        assert cells[6] == f"{r['throughput']['tflops_per_gcd']:.4g}", cells
        ratio = r["throughput"]["tflops_per_gcd"] / (sum(lbp) / len(lbp))   # lbp's two seeds
        assert cells[7] == f"{ratio:.3f}", (cells, ratio)
        assert cells[9] == "— / —" and cells[10] == "—" and cells[11] == "not measured", cells
    assert "not measured: CPU run without the engine's ledger (DeepSpeed)" in text, text
    assert "no projection: the cost model has no scheme 'ds-zero3'" in text, text
    loss = [Path(p).name for p in pngs if Path(p).name.startswith("loss_")]
    assert loss == ["loss_2_nodes.png"], pngs


def test_plan_runs_deepspeed_schemes_and_starts_hpz_at_two_nodes():
    model = {"num_layers": 44, "hidden_size": 6144, "num_attention_heads": 64, "vocab_size": 50304}
    runs = plan.make_runs(nodes=[1, 2], schemes=["lbp", "ds-zero3", "ds-hpz", "ds-zeropp"],
                          scaling="weak", tasks_per_node=8, gcds_per_package=2, micro_batch_size=1,
                          micro_batches=2, global_batch=None, iters=10, seeds=[1], startup_s=60.0,
                          step_seconds=None, model=model, seq_length=2048)
    assert [(r.nodes, r.scheme) for r in runs] == [
        (1, "lbp"), (1, "ds-zero3"), (2, "lbp"), (2, "ds-zero3"), (2, "ds-hpz"), (2, "ds-zeropp")]
    # costed as the engine's nearest presets (bench project has no DeepSpeed scheme)
    step = {(r.nodes, r.scheme): r.step_s for r in runs}
    assert step[(2, "ds-zero3")] == pytest.approx(plan.projected_step_s(
        "zero3", 2, 8, 2, model, 1, 2, 2048))
    assert step[(2, "ds-hpz")] == step[(2, "ds-zeropp")] > 0
    assert plan.skipped([1, 2], ["lbp", "ds-hpz"]) == [
        "ds-hpz on 1 node(s): not run (hpZ's node-sized secondary partition would be the whole job)"]
    with pytest.raises(plan.PlanError, match="no runs"):
        plan.make_runs(nodes=[1], schemes=["ds-zeropp"], scaling="weak", tasks_per_node=8,
                       gcds_per_package=2, micro_batch_size=1, micro_batches=2, global_batch=None,
                       iters=10, seeds=[1], startup_s=60.0, step_seconds=5.0, model=model,
                       seq_length=2048)


def test_study_dry_run_plans_deepspeed_runs(tmp_path):
    """lbp_study.sh with STUDY_SCHEMES naming DeepSpeed schemes: the plan lists them (hpZ from
    2 nodes, saying why not at 1) and the job would run each through the launcher."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LBP_", "STUDY_"))}
    r = subprocess.run(["bash", str(repo / "scripts" / "launch" / "lbp_study.sh"),
                        str(repo / "scripts" / "frontier_gpt20b.sh"), "--dry-run"],
                       env={**env, "STUDY_NODES": "1,2", "STUDY_SCHEMES": "lbp,ds-zero3,ds-zeropp",
                            "STUDY_STEP_SECONDS": "10", "STUDY_DIR": str(tmp_path / "st")},
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    runs = [line.split("\t")[:3] for line in (tmp_path / "st" / "runs.tsv").read_text().splitlines()
            if not line.startswith("#")]
    assert runs == [["n001-lbp-s1234", "1", "lbp"], ["n001-ds-zero3-s1234", "1", "ds-zero3"],
                    ["n002-lbp-s1234", "2", "lbp"], ["n002-ds-zero3-s1234", "2", "ds-zero3"],
                    ["n002-ds-zeropp-s1234", "2", "ds-zeropp"]], runs
    assert "[study] ds-zeropp on 1 node(s): not run (hpZ's node-sized secondary partition" in r.stdout
