"""HIER_PRESET=ds-zero3 | ds-hpz | ds-zeropp in the Frontier launchers (issue 28 item 5).

The launcher runs megatron_lbp/deepspeed_baseline's pretrain runner instead of pretrain_gpt on the same
model, data and batch; its dry run prints the DeepSpeed config (megatron_lbp.deepspeed_baseline.schemes,
the function the runner calls) and refuses, before any work, what a DeepSpeed run cannot
honour. Fast: the ds-zeropp dry run, the refusals (they stop in bash, before Python), a
DeepSpeed that does not import. Slow: the ds-zero3 and ds-hpz dry runs, the job's srun line
with the site's stand-in srun, and the Frontier profile at small size with ds-zeropp on the
real two-node Slurm (scripts/launch/local_slurm.sh; run it under flock /tmp/lbp-slurm.lock).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess

import pytest

from tests.launch.test_launchers import SCRIPTS, SMALL, calls, call_env, flag, in_job, run, site, training_line  # noqa: F401

REPO = SCRIPTS["20b"].parents[1]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is a test dependency: scripts/install.sh --test")

# What each scheme switches on in DeepSpeed's zero_optimization, TASKS_PER_NODE = 8 (the node).
WANT = {"ds-zero3": {},
        "ds-hpz": {"zero_hpz_partition_size": 8},
        "ds-zeropp": {"zero_hpz_partition_size": 8, "zero_quantized_weights": True,
                      "zero_quantized_gradients": True}}


def printed_config(out: str) -> dict:
    lines = out.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("[lbp] DeepSpeed config ("))
    body = []
    for line in lines[i + 1:]:
        if not line.startswith("[lbp]   "):
            break
        body.append(line[len("[lbp]   "):])
    return json.loads("\n".join(body))


# Each dry run is ~10-20 s on the loaded 2-core machine (DeepSpeed's import alone ~9 s): ds-zeropp,
# the scheme with every feature, in the default suite; ds-zero3 and ds-hpz slow.
@needs_deepspeed
@pytest.mark.parametrize("scheme", [pytest.param("ds-zero3", marks=pytest.mark.slow),
                                    pytest.param("ds-hpz", marks=pytest.mark.slow), "ds-zeropp"])
def test_dry_run_runs_the_deepspeed_runner_with_its_config(site, scheme):
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=2, HIER_PRESET=scheme, **SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    cmd = training_line(r.stdout)
    assert cmd[1:6] == ["-u", "-m", "megatron_lbp.deepspeed_baseline.pretrain", "--ds-scheme", scheme], cmd[:8]
    assert flag(cmd, "--ds-ranks-per-node") == "8", cmd
    # the same model, data and batch as pretrain_gpt's; nothing of the engine's, no checkpoints
    assert flag(cmd, "--num-layers") == SMALL["NUM_LAYERS"] and flag(cmd, "--global-batch-size") == "64"
    assert flag(cmd, "--data-path").endswith("corpus_text_document") and "--bf16" in cmd
    assert not [w for w in cmd if w.startswith("--hier-") or w in (
        "--save", "--load", "--use-distributed-optimizer", "--exit-duration-in-mins")], cmd
    assert re.search(r"\[lbp\] entry: python -m megatron_lbp.deepspeed_baseline.pretrain \(DeepSpeed \d+\.\d+",
                     r.stdout), r.stdout
    printed = printed_config(r.stdout)
    assert printed["scheme"] == scheme
    ds = printed["deepspeed_config"]
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and {k: zero[k] for k in WANT[scheme]} == WANT[scheme], zero
    assert not {"zero_hpz_partition_size", "zero_quantized_weights"} & set(zero) - set(WANT[scheme]), zero
    # 64 sequences = micro-batch 1 (the estimate's choice at this size) x 16 ranks x 4
    mbs = int(flag(cmd, "--micro-batch-size"))
    assert ds["train_batch_size"] == 64 and ds["gradient_accumulation_steps"] == 64 // (mbs * 16), ds
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == 1.0, ds
    assert "checkpoints: none (the DeepSpeed runner" in r.stdout
    assert not calls(site, "srun"), "a dry run launched srun"


@pytest.mark.parametrize("env, args, message", [
    ({"HIER_SECONDARY_GROUP_SIZE": "8"}, (), "HIER_SECONDARY_GROUP_SIZE=8 does not apply to HIER_PRESET=ds-zeropp"),
    ({"HIER_GRAD_REDUCE_DTYPE": "bf16"}, (), "HIER_GRAD_REDUCE_DTYPE=bf16 does not apply"),
    ({"HIER_MAX_PENDING_REDUCES": "1"}, (), "HIER_MAX_PENDING_REDUCES=1 does not apply"),
    ({"HIER_EMBEDDING_BACKWARD_GATHER": "skip"}, (), "HIER_EMBEDDING_BACKWARD_GATHER=skip does not apply"),
    ({"EXTRA_ARGS": "--hier-trace /tmp/t"}, (), "--hier-trace does not apply to HIER_PRESET=ds-zeropp"),
    ({}, ("--", "--hier-overlap-grad-reduce"), "--hier-overlap-grad-reduce does not apply"),
    ({}, ("--chain", "2"), "--chain 2 does not apply"),
    ({"MEGATRON_LM_DIR": "/nonexistent"}, (), "MEGATRON_LM_DIR does not apply"),
    ({"NNODES": "1"}, (), "HIER_PRESET=ds-zeropp needs at least 2 nodes"),
    ({"HIER_PRESET": "ds-zero4"}, (), "HIER_PRESET=ds-zero4: the DeepSpeed schemes are ds-zero3, ds-hpz, ds-zeropp"),
])
def test_refuses_what_a_deepspeed_run_cannot_honour(site, env, args, message):
    e = {"NNODES": "2", "HIER_PRESET": "ds-zeropp", **SMALL, **env}
    r = run(SCRIPTS["20b"], site, "--dry-run", *args, **e)
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("lbp_launch: error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "[lbp] srun command:" not in r.stdout and not calls(site, "srun")


def test_a_deepspeed_that_does_not_import_is_named(site, tmp_path):
    broken = tmp_path / "broken" / "deepspeed"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libaio.so: cannot open shared object file')\n")
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=2, HIER_PRESET="ds-zero3",
            PYTHONPATH=tmp_path / "broken", **SMALL)
    assert r.returncode == 2, r.stdout[-2000:]
    assert "lbp_launch: error: HIER_PRESET=ds-zero3 needs DeepSpeed" in r.stderr, r.stderr
    assert "libaio.so" in r.stderr and "scripts/install.sh --test" in r.stderr, r.stderr


@needs_deepspeed
@pytest.mark.slow   # the launcher's whole in-job path: ~18 s
def test_the_job_sruns_the_runner_with_the_repo_on_its_path(site):
    r = run(SCRIPTS["20b"], site, **in_job(2), HIER_PRESET="ds-zero3", LBP_HEALTH_CHECK=0)
    assert r.returncode == 0, r.stderr[-3000:]
    train = [line for line in calls(site, "srun") if "megatron_lbp.deepspeed_baseline.pretrain" in line]
    assert len(train) == 1 and "--ds-scheme ds-zero3 --ds-ranks-per-node 8" in train[0], calls(site, "srun")
    n = calls(site, "srun").index(train[0]) + 1
    assert str(REPO) in call_env(site, "srun", n)["PYTHONPATH"].split(":")
    assert "--save" not in train[0].split() and "--hier-partition" not in train[0]


# --------------------------------------------------------------------------- real Slurm

@pytest.mark.slow
def test_local_slurm_deepspeed_zeropp(tmp_path):
    """scripts/frontier_gpt20b.sh at small size (scripts/frontier_small.env) with
    HIER_PRESET=ds-zeropp on the real two-node Slurm: 8 CPU ranks (2 nodes x 4) train 4
    iterations under DeepSpeed ZeRO++ (hpZ over the node, qwZ, qgZ) on the profile's data; the
    config the job used is the one its dry run printed; the result file holds its 4 losses.
    Run it under flock /tmp/lbp-slurm.lock (the cluster is shared)."""
    from tests.helpers import frontier_small
    from tests.launch.test_launchers import FRONTIER, LOCAL_SLURM, WHOLE_NODES, _gpt2_data, _wait_job

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is a test dependency: scripts/install.sh --test")
    if os.geteuid() != 0 or (shutil.which("apt-get") is None and shutil.which("slurmctld") is None):
        pytest.skip("needs root and Debian's slurm packages (or apt-get)")
    subprocess.run(["bash", str(LOCAL_SLURM), "install"], check=True)
    cluster, jobs = tmp_path / "slurm", tmp_path / "jobs"
    jobs.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("SLURM_") or k.startswith("LBP_") or k == "OMP_NUM_THREADS")}
    env["SLURM_CONF"] = str(cluster / "etc" / "slurm.conf")
    paths = {k: str(v) for k, v in _gpt2_data(tmp_path, {**env, "PYTHONWARNINGS": "ignore"}).items()}
    run_env = {**frontier_small.overrides(), **paths, "HIER_PRESET": "ds-zeropp", "TRAIN_ITERS": "4",
               "LOG_INTERVAL": "1", "LR_WARMUP_ITERS": "1", "CHECKPOINT_DIR": str(tmp_path / "ckpt"),
               "LBP_RESULT_FILE": str(tmp_path / "result.json")}
    dry = subprocess.run(["bash", str(FRONTIER), "--dry-run"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300, env={**env, **run_env})
    assert dry.returncode == 0, dry.stderr[-3000:]
    want = printed_config(dry.stdout)["deepspeed_config"]
    try:
        subprocess.run(["bash", str(LOCAL_SLURM), "start", str(cluster)], check=True, env=env)
        plain = {k: v for k, v in run_env.items() if "," not in v}
        exports = ",".join(["ALL"] + [f"{k}={v}" for k, v in plain.items()])
        job = subprocess.run(
            ["sbatch", "--parsable", "--chdir", str(REPO), "-N", "2", *WHOLE_NODES, "-t", "15",
             "-o", f"{jobs}/%x-%j.out", "-e", f"{jobs}/%x-%j.err", f"--export={exports}", str(FRONTIER)],
            env={**env, **{k: v for k, v in run_env.items() if k not in plain}},
            capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
        state = _wait_job(job, env, timeout=1500)
        out = (jobs / f"lbp-gpt20b-{job}.out").read_text()
        err = (jobs / f"lbp-gpt20b-{job}.err").read_text()
        assert state == "COMPLETED", f"{state}\n{out[-4000:]}\n{err[-4000:]}"
        used = json.loads(re.search(r"\[ds-zeropp\] DeepSpeed config: (\{.*\})", out).group(1))
        assert used == want, f"the job ran {used}\nits dry run printed {want}"
        assert printed_config(out) == printed_config(dry.stdout)   # the job prints it too
        logged = {int(i): float(v) for i, v in
                  re.findall(r"\[ds-zeropp\] iteration\s+(\d+)/\s*4 \|.*?lm loss: ([\dE+\-.]+) \|", out)}
        assert sorted(logged) == [1, 2, 3, 4], out[-3000:]
        assert all(0 < v < 20 for v in logged.values()), logged
        assert "[ds-zeropp] training done: 4 iterations" in out
        res = json.loads((tmp_path / "result.json").read_text())
        assert res["status"] == "ok" and res["scheme"] == "ds-zeropp" and res["gcds"] == 8, res
        assert {int(k): v for k, v in res["loss"].items()} == pytest.approx(logged, rel=1e-5), res["loss"]
        assert res["group_sizes"] == {"hpz_partition_size": 4, "qwz": True, "qgz": True}, res
        assert res["throughput"]["tflops_per_gcd"] > 0, res["throughput"]
        assert res["peak_memory_per_gcd"]["source"].startswith("not measured"), res
        print(f"local Slurm ds-zeropp at small size: losses {logged}; step median "
              f"{res['step_time']['median_s']:.2f} s")
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM), "stop", str(cluster)], env=env)
