"""The Frontier launchers (scripts/frontier_gpt{20,10}b.sh) and their local profile.

Dry runs need no Slurm: the node count comes from NNODES (or the allocation's
SLURM_JOB_NUM_NODES). A fake ``srun`` first on PATH records any call, so every
bad-input case also proves that it stopped before srun.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {"20b": REPO / "scripts" / "frontier_gpt20b.sh",
           "10b": REPO / "scripts" / "frontier_gpt10b.sh"}
LOCAL = REPO / "scripts" / "local_profile.sh"
LAUNCH = REPO / "scripts" / "launch"
SHAPES = {"20b": dict(layers=44, hidden=6144, heads=64, target=20e9),
          "10b": dict(layers=32, hidden=5120, heads=40, target=10e9)}


@pytest.fixture
def site(tmp_path):
    """Fake site paths (data prefix, GPT-2 BPE files, checkpoint dir) and a recording srun."""
    for name in ("corpus_text_document.bin", "corpus_text_document.idx", "gpt2-vocab.json",
                 "gpt2-merges.txt"):
        (tmp_path / name).write_text("x")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    marker = tmp_path / "srun_was_called"
    srun = bindir / "srun"
    srun.write_text(f"#!/bin/sh\necho \"$@\" > {marker}\n")
    srun.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "NCCL_", "FI_", "MEGATRON_LM_DIR", "LBP_", "NNODES",
                                "DATA_PATH", "CHECKPOINT_DIR", "VOCAB_FILE", "MERGE_FILE",
                                "TOKENIZER_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    env.update(
        PATH=f"{bindir}:{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        DATA_PATH=str(tmp_path / "corpus_text_document"),
        VOCAB_FILE=str(tmp_path / "gpt2-vocab.json"),
        MERGE_FILE=str(tmp_path / "gpt2-merges.txt"),
        CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        LBP_ACTIVATE="",  # the test's own interpreter is first on PATH
    )
    return {"env": env, "tmp": tmp_path, "srun_marker": marker}


def run(script: Path, site, *args, **env):
    e = dict(site["env"])
    for k, v in env.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = str(v)
    return subprocess.run(["bash", str(script), *args], env=e, cwd=site["tmp"],
                          capture_output=True, text=True, timeout=120)


def srun_line(out: str) -> str:
    lines = out.splitlines()
    i = lines.index("[lbp] srun command:")
    return lines[i + 1].strip()


def training_line(out: str) -> list[str]:
    lines = out.splitlines()
    i = lines.index("[lbp] training command (each task):")
    return lines[i + 1].split()


def flag(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


@pytest.mark.parametrize("model", ["20b", "10b"])
@pytest.mark.parametrize("nodes", [2, 8, 48])
def test_dry_run_frontier(site, model, nodes):
    r = run(SCRIPTS[model], site, "--dry-run", NNODES=nodes)
    assert r.returncode == 0, r.stderr + r.stdout
    out = r.stdout
    assert not site["srun_marker"].exists()
    srun = srun_line(out)
    assert srun.startswith(f"srun -N {nodes} -n {8 * nodes} --ntasks-per-node=8 -c 7 ")
    assert "--gpus-per-task=1 --gpu-bind=closest" in srun
    assert srun.endswith(f"bash {LAUNCH / 'lbp_task.sh'} \\")

    cmd = training_line(out)
    assert cmd[:4] == ["python", "-u", "-m", "megatron_lbp.pretrain_gpt"]
    shape = SHAPES[model]
    assert flag(cmd, "--num-layers") == str(shape["layers"])
    assert flag(cmd, "--hidden-size") == str(shape["hidden"])
    assert flag(cmd, "--num-attention-heads") == str(shape["heads"])
    assert flag(cmd, "--seq-length") == "2048"
    assert flag(cmd, "--micro-batch-size") == "1"
    assert int(flag(cmd, "--global-batch-size")) % (8 * nodes) == 0
    for f in ("--bf16", "--hier-partition", "--log-throughput"):
        assert f in cmd
    assert flag(cmd, "--hier-preset") == "lbp"
    assert flag(cmd, "--hier-gpus-per-node") == "8"
    assert flag(cmd, "--hier-gcds-per-package") == "2"
    assert flag(cmd, "--hier-secondary-group-size") == "8"
    assert flag(cmd, "--hier-secondary-dtype") == "int8"
    ckpt = site["env"]["CHECKPOINT_DIR"]
    assert flag(cmd, "--save") == ckpt and flag(cmd, "--load") == ckpt
    assert flag(cmd, "--ckpt-format") == "torch_dist"
    assert int(flag(cmd, "--save-interval")) > 0
    assert flag(cmd, "--data-path") == site["env"]["DATA_PATH"]
    assert flag(cmd, "--vocab-file") == site["env"]["VOCAB_FILE"]
    assert flag(cmd, "--merge-file") == site["env"]["MERGE_FILE"]
    assert flag(cmd, "--recompute-granularity") == "full"

    for setting in ("NCCL_NET=OFI", "NCCL_SOCKET_IFNAME=hsn0", "FI_MR_CACHE_MONITOR=kdreg2",
                    "FI_CXI_ATS=0", "CUDA_DEVICE_MAX_CONNECTIONS=1", "LBP_MIOPEN_CACHE_ROOT=/tmp"):
        assert setting in out

    params = int(re.search(r"parameters: ([\d,]+)", out).group(1).replace(",", ""))
    assert abs(params - shape["target"]) / shape["target"] < 0.05
    assert f"W={8 * nodes} ranks, P=2 G=8 O={8 * nodes} S=8 (int8)" in out
    total = float(re.search(r"memory per GCD total: ([\d.]+) GB of 64 GB \(fits\)", out).group(1))
    assert 0 < total <= 64
    assert "dry run: not launching" in out


def test_memory_shrinks_with_nodes_and_matches_plan(site):
    """The printed plan memory is the plan tool's total for that world size."""
    from megatron_lbp import plan

    totals = []
    for nodes in (2, 8, 48):
        out = run(SCRIPTS["20b"], site, "--dry-run", NNODES=nodes).stdout
        printed = float(re.search(r"memory per GCD \(plan\):.* = ([\d.]+) GB", out).group(1))
        argv = re.search(r"plan: python -m megatron_lbp.plan (.*)", out).group(1).split()
        assert abs(plan.make_plan(argv)["memory_bytes"]["total"] / 1e9 - printed) < 0.01
        totals.append(printed)
    assert totals[0] > totals[1] > totals[2]


def test_env_dry_run_and_slurm_node_count(site):
    """LBP_DRY_RUN=1 is --dry-run; inside an allocation the node count is the allocation's."""
    a = run(SCRIPTS["20b"], site, LBP_DRY_RUN=1, NNODES=8)
    b = run(SCRIPTS["20b"], site, LBP_DRY_RUN=1, SLURM_JOB_NUM_NODES=8, SLURM_JOB_ID=1)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert srun_line(a.stdout) == srun_line(b.stdout)
    assert not site["srun_marker"].exists()


def test_real_launch_calls_srun_once_with_the_printed_command(site):
    r = run(SCRIPTS["10b"], site, "--", "--seed", "7", NNODES=2, SLURM_JOB_NUM_NODES=2,
            SLURM_JOB_ID=42, MASTER_ADDR="10.0.0.1")
    assert r.returncode == 0, r.stderr
    called = site["srun_marker"].read_text().split()
    assert called[:3] == ["-N", "2", "-n"]
    assert called[-2:] == ["--seed", "7"]
    assert "megatron_lbp.pretrain_gpt" in called
    assert (site["tmp"] / "ckpt").is_dir()
    assert "MASTER_ADDR=10.0.0.1 MASTER_PORT=3442" in r.stdout


def test_local_profile_dry_run(site):
    env = {k: None for k in ("DATA_PATH", "VOCAB_FILE", "MERGE_FILE", "CHECKPOINT_DIR")}
    data = REPO / "data" / "lbp_demo_text_document"
    if not Path(f"{data}.bin").exists():
        env["DATA_PATH"] = site["env"]["DATA_PATH"]
    r = run(LOCAL, site, "--dry-run", NNODES=2, **env)
    assert r.returncode == 0, r.stderr
    srun = srun_line(r.stdout)
    assert srun.startswith("srun -N 2 -n 8 --ntasks-per-node=4 -c 1 ")
    assert "--gpus-per-task" not in srun and "NCCL_NET" not in r.stdout
    cmd = training_line(r.stdout)
    assert flag(cmd, "--hier-gpus-per-node") == "4"
    assert flag(cmd, "--hier-secondary-group-size") == "4"
    assert flag(cmd, "--tokenizer-type") == "SentencePieceTokenizer"
    assert "W=8 ranks, P=2 G=4 O=8 S=4 (int8)" in r.stdout


def test_the_three_profiles_share_one_launcher():
    for script in (*SCRIPTS.values(), LOCAL):
        text = script.read_text()
        assert 'scripts/launch/lbp_launch.sh"' in text and text.rstrip().endswith('lbp_main "$@"')
        assert "srun " not in text.split("set -euo pipefail", 1)[1]
        # Ranks are per task (lbp_task.sh), never exported from the batch script.
        assert not re.search(r"^\s*export\s+(RANK|LOCAL_RANK)=", text, re.M)
    head = SCRIPTS["20b"].read_text().split("set -euo pipefail")[0]
    for directive in ("#SBATCH -A ", "#SBATCH -J ", "#SBATCH -N 48", "#SBATCH -t ",
                      "#SBATCH -p batch", "#SBATCH -o logs/%x-%j.out", "#SBATCH -e logs/%x-%j.err"):
        assert directive in head


# --------------------------------------------------------------------------- bad input


# Malformed input (unset or missing paths, node counts that do not fit, outside Slurm):
# tests/test_bad_input_matrix.py. Refusals of inputs that are well-formed but do not fit stay here.


def test_refuses_when_memory_exceeds_the_gcd(site):
    r = run(SCRIPTS["20b"], site, NNODES=1, SLURM_JOB_ID=1, SLURM_JOB_NUM_NODES=1)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "DOES NOT FIT" in r.stdout
    assert "refusing to launch" in r.stderr and "exceeds the GCD's 64 GB" in r.stderr
    assert "NNODES=2" in r.stderr
    assert not site["srun_marker"].exists()
    # S = 2 on 2 nodes fits the states but not with micro-batch 8 activations
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=2, HIER_SECONDARY_GROUP_SIZE=2,
            MICRO_BATCH_SIZE=8, GLOBAL_BATCH_SIZE=1536)
    assert r.returncode == 3 and "HIER_SECONDARY_GROUP_SIZE=8" in r.stderr, r.stderr


def _megatron_tree(root: Path) -> Path:
    """A Megatron-LM-shaped tree: the three files the patch touches, from the installed wheel."""
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core wheel not found")
    src = Path(next(iter(spec.submodule_search_locations)))
    tree = root / "Megatron-LM"
    for rel in ("training/arguments.py", "training/training.py", "training/models/dist_utils.py",
                "core/package_info.py"):
        (tree / "megatron" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, tree / "megatron" / rel)
    (tree / "pretrain_gpt.py").write_text("# Megatron-LM's entry\n")
    return tree


def test_unpatched_and_patched_megatron_tree(site):
    tree = _megatron_tree(site["tmp"])
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=2, MEGATRON_LM_DIR=tree)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is not patched" in r.stderr and f"scripts/apply_patches.sh {tree}" in r.stderr

    if shutil.which("patch") is None:
        pytest.skip("patch(1) not installed")
    subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), str(tree)], check=True,
                   capture_output=True)
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=2, MEGATRON_LM_DIR=tree)
    assert r.returncode == 0, r.stderr
    assert training_line(r.stdout)[:3] == ["python", "-u", f"{tree}/pretrain_gpt.py"]

    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=2, MEGATRON_LM_DIR=site["tmp"] / "none")
    assert r.returncode == 2 and "has no pretrain_gpt.py" in r.stderr


def test_task_wrapper_reads_ranks_per_task(tmp_path):
    """lbp_task.sh: RANK/WORLD_SIZE from this task's SLURM_*; no LOCAL_RANK, so Megatron uses
    device 0 (the one GCD a task sees) and megatron-lbp's topology reads Slurm's variables."""
    probe = ("import os, json; from megatron_lbp.topology import launcher_info_from_env, "
             "location_of; i = launcher_info_from_env(os.environ); l = location_of(i, 8, 2, 'h'); "
             "print(json.dumps([os.environ['RANK'], os.environ['WORLD_SIZE'], "
             "'LOCAL_RANK' in os.environ, i.source, l.node, l.package, "
             "os.environ['MIOPEN_USER_DB_PATH']]))")
    env = dict(os.environ, SLURM_PROCID="13", SLURM_NTASKS="16", SLURM_LOCALID="5",
               SLURM_NODEID="1", SLURM_TASKS_PER_NODE="8(x2)", SLURM_JOB_ID="77",
               LOCAL_RANK="5", RANK="0", LBP_MIOPEN_CACHE_ROOT=str(tmp_path))
    r = subprocess.run(["bash", str(LAUNCH / "lbp_task.sh"), sys.executable, "-c", probe],
                       env=env, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    import json

    rank, world, has_local, source, node, package, miopen = json.loads(r.stdout.splitlines()[-1])
    assert (rank, world, has_local, source, node, package) == ("13", "16", False, "slurm", 1, 2)
    assert miopen == str(tmp_path / "miopen-77-13") and Path(miopen).is_dir()


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck; CI installs it)")
    files = [*SCRIPTS.values(), LOCAL, LAUNCH / "lbp_launch.sh", LAUNCH / "lbp_task.sh",
             LAUNCH / "local_slurm.sh"]
    r = subprocess.run(["shellcheck", "-x", *map(str, files)], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------- real Slurm
#
# bash scripts/test.sh --slow -k local_slurm   (root, Debian: installs slurm + munge with
# apt-get; 5-7 min on 2 cores). Starts a two-node Slurm on this machine
# (scripts/launch/local_slurm.sh), sbatch's the local profile, the same launcher as the
# Frontier scripts, and stops every daemon it started by PID whatever the outcome.

LOCAL_SLURM = LAUNCH / "local_slurm.sh"


def _wait_job(job: str, env: dict, timeout: float = 900.0) -> str:
    import time

    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                             text=True).stdout
        m = re.search(r"JobState=(\w+)", out)
        state = m.group(1) if m else "UNKNOWN"
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state
        time.sleep(2)
    subprocess.run(["scancel", job], env=env)
    return f"TIMEOUT (last {state})"


def _sbatch(env: dict, jobs: Path, **export) -> str:
    exports = ",".join(["ALL"] + [f"{k}={v}" for k, v in export.items()])
    r = subprocess.run(["sbatch", "--parsable", "--chdir", str(REPO),
                        "-o", f"{jobs}/%x-%j.out", "-e", f"{jobs}/%x-%j.err",
                        f"--export={exports}", str(LOCAL)],
                       env=env, capture_output=True, text=True, check=True)
    return r.stdout.strip().split(";")[0]


@pytest.mark.slow
def test_local_slurm_job(tmp_path):
    if os.geteuid() != 0 or (shutil.which("apt-get") is None and shutil.which("slurmctld") is None):
        pytest.skip("needs root and Debian's slurm packages (or apt-get)")
    subprocess.run(["bash", str(LOCAL_SLURM), "install"], check=True)
    from megatron_lbp.data import build_demo_data

    data = build_demo_data(REPO / "data", quiet=True)
    cluster, jobs = tmp_path / "slurm", tmp_path / "jobs"
    jobs.mkdir()
    env = dict(os.environ, SLURM_CONF=str(cluster / "etc" / "slurm.conf"))
    for k in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(k)
    try:
        subprocess.run(["bash", str(LOCAL_SLURM), "start", str(cluster)], check=True, env=env)

        # 1. A real run: 2 emulated nodes x 4 CPU ranks, lbp; it stops at iteration 10 of 15
        #    (as a Frontier job stops at EXIT_DURATION_MINS) and saves a checkpoint.
        ckpt = tmp_path / "ckpt"
        job = _sbatch(env, jobs, TRAIN_ITERS=15, SAVE_INTERVAL=100, LOG_INTERVAL=5,
                      CHECKPOINT_DIR=ckpt, DATA_PATH=data, LBP_LOG_ALL_RANKS=1,
                      EXTRA_ARGS="--exit-interval 10")
        state = _wait_job(job, env)
        out = (jobs / f"lbp-local-{job}.out").read_text()
        err = (jobs / f"lbp-local-{job}.err").read_text()
        assert state == "COMPLETED", f"{state}\n{out[-3000:]}\n{err[-3000:]}"
        assert "srun -N 2 -n 8 --ntasks-per-node=4" in out
        assert re.search(r"iteration\s+10/\s+15 \|.*lm loss", out)
        for rank in range(8):
            node, package = rank // 4, (rank % 4) // 2
            assert (f"megatron-lbp hierarchy (lbp): W=8 P=2 S=4 G=4 O=8 R=1; rank {rank} on "
                    in out)
            assert re.search(rf"rank {rank} on \S+ node {node} package {package}\n", out)
        assert "  grad           node     ranks [0, 1, 2, 3]" in out
        assert "  grad           node     ranks [4, 5, 6, 7]" in out
        assert "  optim          network  ranks [0, 1, 2, 3, 4, 5, 6, 7]" in out
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
        assert (ckpt / "iter_0000010").is_dir()

        # 2. The same job submitted again resumes from the checkpoint and finishes.
        job = _sbatch(env, jobs, TRAIN_ITERS=15, SAVE_INTERVAL=100, LOG_INTERVAL=5,
                      CHECKPOINT_DIR=ckpt, DATA_PATH=data)
        state = _wait_job(job, env)
        out = (jobs / f"lbp-local-{job}.out").read_text()
        assert state == "COMPLETED", f"{state}\n{out[-3000:]}"
        assert re.search(r"successfully loaded checkpoint from \S+ .*at iteration 10", out), out[-3000:]
        assert re.search(r"iteration\s+15/\s+15 \|", out)
        assert not re.search(r"iteration\s+5/\s+15 \|", out)
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "15"

        # 3. A bad data path the launcher sees: FAILED before srun, the reason in the log.
        job = _sbatch(env, jobs, DATA_PATH=tmp_path / "missing", CHECKPOINT_DIR=tmp_path / "c2")
        assert _wait_job(job, env, 120) == "FAILED"
        err = (jobs / f"lbp-local-{job}.err").read_text()
        assert "lbp_launch: error: DATA_PATH:" in err and "missing.bin" in err

        # 4. One only training can see (unreadable files): every task stops, the job FAILED.
        for suffix in (".bin", ".idx"):
            (tmp_path / f"garbage{suffix}").write_text("not an indexed dataset\n")
        job = _sbatch(env, jobs, DATA_PATH=tmp_path / "garbage", CHECKPOINT_DIR=tmp_path / "c3")
        assert _wait_job(job, env, 600) == "FAILED"
        err = (jobs / f"lbp-local-{job}.err").read_text()
        assert "error: --data-path" in err and "cannot read the indexed dataset" in err
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM), "stop", str(cluster)], env=env)
