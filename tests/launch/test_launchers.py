"""The Frontier launchers (scripts/frontier_gpt{20,10}b.sh) and their local profile.

Dry runs need no Slurm: the node count comes from NNODES (or the allocation's
SLURM_JOB_NUM_NODES, or the script's #SBATCH -N). Recording stand-ins for srun, sbatch,
scancel and squeue come first on PATH, so every bad-input case also proves that it
stopped before srun, and a launch "in a job" (SLURM_JOB_ID set) shows every command the
batch script would run and the environment it gives them.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import frontier_small

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {"20b": REPO / "scripts" / "frontier_gpt20b.sh",
           "10b": REPO / "scripts" / "frontier_gpt10b.sh"}
LOCAL = REPO / "scripts" / "local_profile.sh"
LAUNCH = REPO / "scripts" / "launch"
SHAPES = {"20b": dict(layers=44, hidden=6144, heads=64, target=20e9),
          "10b": dict(layers=32, hidden=5120, heads=40, target=10e9)}


# Stand-ins for the site's Slurm commands (they cannot run here): each records its
# arguments, one line per call, in <tmp>/calls/<name>.log and the environment it was
# given in <tmp>/calls/<name>.<n>.env; squeue prints what Slurm prints for job 42.
STAND_INS = {
    "srun": "",
    "sbatch": "echo 4242",
    "scancel": "",
    "squeue": ("case \"$*\" in *'%L'*) echo \"${FAKE_TIME_LEFT:-1:59:00}\" ;; "
               "*) echo 'proj123|batch|(null)|2:00:00|(null)|lbp-gpt20b' ;; esac"),
}


@pytest.fixture
def site(tmp_path):
    """Fake site paths (data prefix, GPT-2 BPE files, checkpoint dir) and recording Slurm commands."""
    for name in ("corpus_text_document.bin", "corpus_text_document.idx", "gpt2-vocab.json",
                 "gpt2-merges.txt"):
        (tmp_path / name).write_text("x")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls"
    for name, body in STAND_INS.items():
        tool = bindir / name
        tool.write_text(f"#!/bin/bash\nmkdir -p {calls}\necho \"$*\" >> {calls}/{name}.log\n"
                        f"env > {calls}/{name}.$(wc -l < {calls}/{name}.log).env\n{body}\n")
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "NCCL_", "FI_", "MEGATRON_LM_DIR", "LBP_", "NNODES",
                                "DATA_PATH", "CHECKPOINT_DIR", "VOCAB_FILE", "MERGE_FILE",
                                "TOKENIZER_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                "CUDA_DEVICE_MAX_CONNECTIONS", "CRAY_", "OMP_NUM_THREADS"))}
    env.update(
        PATH=f"{bindir}:{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        DATA_PATH=str(tmp_path / "corpus_text_document"),
        VOCAB_FILE=str(tmp_path / "gpt2-vocab.json"),
        MERGE_FILE=str(tmp_path / "gpt2-merges.txt"),
        CHECKPOINT_DIR=str(tmp_path / "ckpt"),
        LBP_ACTIVATE="",  # the test's own interpreter is first on PATH
        # The stand-in files above are not a tokenizer or a dataset: the content checks have
        # their own tests on real files (tests/launch/test_launch_contents.py, the bad-input matrix).
        LBP_CHECK_CONTENTS="0",
        # The tests read the estimate's full table (every candidate, the ranking); a dry run
        # without it is the summary's test (test_dry_run_leads_with_its_summary).
        LBP_VERBOSE="1",
    )
    return {"env": env, "tmp": tmp_path, "srun_marker": calls}


def calls(site, name: str) -> list[str]:
    log = site["srun_marker"] / f"{name}.log"
    return log.read_text().splitlines() if log.exists() else []


def call_env(site, name: str, n: int) -> dict:
    text = (site["srun_marker"] / f"{name}.{n}.env").read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


# A job of the Frontier profile at a small size (the override set issue 16 runs locally):
# what differs is the model, the node count and, on this CPU-only machine, the GPU check.
SMALL = {"NUM_LAYERS": "2", "HIDDEN_SIZE": "256", "NUM_ATTENTION_HEADS": "4", "SEQ_LENGTH": "256",
         "GLOBAL_BATCH_SIZE": "64"}


def in_job(nodes: int = 2, **over) -> dict:
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": str(nodes), "NNODES": str(nodes),
           "SLURM_JOB_END_TIME": str(int(time.time()) + 7200), "LBP_REQUIRE_GPU": "none",
           "SLURM_SUBMIT_DIR": str(REPO), **SMALL}
    env.update(over)
    return env


def run(script: Path, site, *args, **env):
    e = dict(site["env"])
    for k, v in env.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = str(v)
    return subprocess.run(["bash", str(script), *args], env=e, cwd=site["tmp"],
                          capture_output=True, text=True, timeout=180)


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


# Frontier's RCCL/libfabric list as OLCF's "PyTorch on Frontier" page gives it.
OLCF_ENV = ("NCCL_CROSS_NIC=1", "NCCL_NET_GDR_LEVEL=PHB", "NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3",
            "HSA_FORCE_FINE_GRAIN_PCIE=1", "FI_MR_CACHE_MONITOR=kdreg2",
            "FI_CXI_DISABLE_HOST_REGISTER=1", "FI_CXI_DEFAULT_CQ_SIZE=131072",
            "FI_CXI_RDZV_PROTO=alt_read", "FI_CXI_RDZV_EAGER_SIZE=0", "FI_CXI_RDZV_THRESHOLD=0",
            "FI_CXI_RDZV_GET_MIN=0", "FI_CXI_DEFAULT_TX_SIZE=2048", "FI_CXI_RX_MATCH_MODE=hybrid")


@pytest.mark.parametrize("model", ["20b", "10b"])
@pytest.mark.parametrize("nodes", [4, 48])
def test_dry_run_frontier(site, model, nodes):
    # 48 nodes: the launcher chooses the scheme too; 4: the explicit HIER_PRESET wins.
    r = run(SCRIPTS[model], site, "--dry-run", NNODES=nodes,
            HIER_PRESET=None if nodes == 48 else "lbp")
    assert r.returncode == 0, r.stderr + r.stdout
    out = r.stdout
    assert not site["srun_marker"].exists()
    srun = srun_line(out)
    assert srun.startswith(f"srun -N {nodes} -n {8 * nodes} --ntasks-per-node=8 -c 7 ")
    assert "--gpus-per-task=1 --gpu-bind=closest" in srun
    assert srun.endswith(f"bash {LAUNCH / 'lbp_task.sh'} \\")

    cmd = training_line(out)
    assert cmd[:4] == ["python", "-u", "-m", "megatron_lbp.pretrain_gpt"]
    # the command as the entry runs it: the capability-resolved flags of a GPU run here
    assert "flags for a GPU run (python -m megatron_lbp.capabilities, LBP_DEVICE=gpu)" in out
    if importlib.util.find_spec("transformer_engine") is None:
        assert flag(cmd, "--transformer-impl") == "local"
        assert "[megatron-lbp] adding --transformer-impl local: Transformer Engine is not importable" in out
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        assert "--no-gradient-accumulation-fusion" in cmd
    assert "--distributed-backend" not in cmd            # a GPU run: NCCL, Megatron's default
    shape = SHAPES[model]
    assert flag(cmd, "--num-layers") == str(shape["layers"])
    assert flag(cmd, "--hidden-size") == str(shape["hidden"])
    assert flag(cmd, "--num-attention-heads") == str(shape["heads"])
    assert flag(cmd, "--seq-length") == "2048"
    # The ranking's chosen row (the fastest that fits, or the tied scheme with the most
    # headroom: megatron_lbp/launch/choose.py) is what
    # the training command runs; tests/launch/test_launch_choose.py checks the ranking itself.
    m = re.search(r"^\[lbp\]   (?:\.\.\. \(#\d+\) )?(lbp S=\w+|zeropp|zero3|zero2) +RECOMPUTE=(\w+) +"
                  r"MICRO_BATCH_SIZE=(\d+) .*<- chosen$", out, re.M)
    assert m, out
    scheme, rc, mbs = m.group(1), m.group(2), int(m.group(3))
    assert nodes == 48 or scheme == "lbp S=node", scheme      # explicit HIER_PRESET=lbp, S = 8
    assert flag(cmd, "--micro-batch-size") == str(mbs)
    assert (f"choice: RECOMPUTE={rc} MICRO_BATCH_SIZE={mbs} (the fastest fitting by projected "
            "step time") in out
    assert re.search(rf"  RECOMPUTE={rc} +MICRO_BATCH_SIZE={mbs} .* fits  <- chosen", out)
    assert "best zeropp: " in out and "best zero3: " in out
    assert (flag(cmd, "--recompute-granularity") if "--recompute-granularity" in cmd
            else "none") == rc
    assert int(flag(cmd, "--global-batch-size")) % (8 * nodes * mbs) == 0
    for f in ("--bf16", "--hier-partition", "--log-throughput", "--exit-signal-handler"):
        assert f in cmd
    secondary = {"lbp S=node": 8, "lbp S=package": 2, "zeropp": 8}.get(scheme, 0)
    assert flag(cmd, "--hier-preset") == scheme.split()[0]
    assert flag(cmd, "--hier-gpus-per-node") == "8"
    assert flag(cmd, "--hier-gcds-per-package") == "2"
    assert flag(cmd, "--hier-secondary-group-size") == str(secondary)
    # zeropp's hpZ copy is in the weights' dtype (DeepSpeed's), lbp's int8
    assert secondary == 0 or flag(cmd, "--hier-secondary-dtype") == (
        "param" if scheme == "zeropp" else "int8")
    # The transient knobs the estimate resolved reach the command, said only when they are not
    # the engine's defaults (1 unit ahead, 2 reduce-scatters in flight, whole layers, the
    # embedding gathered). At 20B on 48 nodes (the scheme chosen too) lbp's fastest row needs
    # split layers, but zeropp's step-time band ties with it and, with more memory left, is
    # launched with the engine's defaults, the dry run saying so in its tie line
    # (docs/frontier.md, tests/launch/test_launch_choose.py).
    m = re.search(r"transient knobs: HIER_PREFETCH_UNITS=(\d+) HIER_MAX_PENDING_REDUCES=(\d+) "
                  r"HIER_LAYER_UNIT=(\w+) HIER_EMBEDDING_BACKWARD_GATHER=(\w+)", out)
    assert m, out
    for name, default, value in (("--hier-prefetch-units", "1", m.group(1)),
                                 ("--hier-max-pending-reduces", "2", m.group(2)),
                                 ("--hier-layer-unit", "whole", m.group(3)),
                                 ("--hier-embedding-backward-gather", "gather", m.group(4))):
        assert (flag(cmd, name) if name in cmd else default) == value, (name, value)
        assert name not in cmd or value != default, name
    assert (model, nodes) != ("20b", 48) or (scheme, m.groups()) == (
        "zeropp", ("1", "2", "whole", "gather")), (scheme, m.group(0))
    assert (model, nodes) != ("20b", 48) or "[lbp] tie: 2 schemes within 1% of the fastest's step time" in out, out
    ckpt = site["env"]["CHECKPOINT_DIR"]
    assert flag(cmd, "--save") == ckpt and flag(cmd, "--load") == ckpt
    assert flag(cmd, "--ckpt-format") == "torch_dist"
    assert flag(cmd, "--data-cache-path") == f"{ckpt}/data_cache"
    assert flag(cmd, "--tensorboard-dir") == f"{ckpt}/tensorboard"
    assert flag(cmd, "--data-path") == site["env"]["DATA_PATH"]
    assert flag(cmd, "--vocab-file") == site["env"]["VOCAB_FILE"]
    assert flag(cmd, "--merge-file") == site["env"]["MERGE_FILE"]
    # SAVE_INTERVAL=auto from the estimated step time, a divisor of the 10000 milestones;
    # the exit time for the script's 2-hour job leaves one save, one step and the slack
    step = float(re.search(r"step time: ([\d.]+) s per iteration \(cost model", out).group(1))
    interval = int(flag(cmd, "--save-interval"))
    assert 10000 % interval == 0 and 30 <= interval * step / 60 <= 60, (interval, step)
    # the margin also covers the #SBATCH --signal=TERM@150 lead as early as Slurm may send it
    m = re.search(r"-t 02:00:00\); margin (\d+) s \((.*)\) -> --exit-duration-in-mins (\d+)", out)
    assert m and int(flag(cmd, "--exit-duration-in-mins")) == int(m.group(3)) == (7200 - int(m.group(1))) // 60
    assert int(m.group(1)) >= 150 + 60 + step - 1, m.group(0)   # printed to the second
    assert ("the --signal lead 150 s" in m.group(2)) == (nodes == 48), m.group(0)   # the larger term
    assert re.search(r"checkpoint: [\d.]+ GB per save \(14 B/param\)", out)

    for setting in OLCF_ENV + ("NCCL_NET=OFI", "OMP_NUM_THREADS=7"):
        assert f" {setting}" in out, setting
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in out and "FI_CXI_ATS" not in out
    assert "MIOpen and Triton per task under /tmp (node-local)" in out

    params = int(re.search(r"parameters: ([\d,]+)", out).group(1).replace(",", ""))
    assert abs(params - shape["target"]) / shape["target"] < 0.05
    W = 8 * nodes
    assert {"lbp S=node": f"W={W} ranks, P=2 G=8 O={W} S=8 (int8)",
            "lbp S=package": f"W={W} ranks, P=2 G=8 O={W} S=2 (int8)",
            "lbp S=0": f"W={W} ranks, P=2 G=8 O={W} S=0 (no secondary)",
            "zeropp": f"W={W} ranks, P={W} G={W} O={W} S=8 (param)",
            "zero3": f"W={W} ranks, P={W} G={W} O={W} S=0 (no secondary)",
            "zero2": f"W={W} ranks, P=1 G={W} O={W} S=0 (no secondary)"}[scheme] in out
    m = re.search(r"memory per GCD total: state ([\d.]+) GB \+ transient ([\d.]+) GB .*\+ "
                  r"activations ([\d.]+) GB \+ margin ([\d.]+) GB = ([\d.]+) GB of 64 GB \(fits\)", out)
    assert m, out
    parts = [float(x) for x in m.groups()]
    assert 0 < parts[4] <= 64 and abs(sum(parts[:4]) - parts[4]) < 0.02, parts
    # issue 12: the construction peak per GCD (sharded initialization) next to the steady state
    assert re.search(r"construction peak per GCD \(plan: the model built module by module into its "
                     r"slices, --hier-sharded-init\): [\d.]+ GB", out), out
    assert "dry run: not launching" in out


@pytest.mark.slow
def test_memory_shrinks_with_nodes_and_matches_plan(site):
    """The printed plan memory and construction peak are the plan tool's for that world size."""
    from megatron_lbp.launch import plan

    totals = []
    for nodes in (2, 8, 48):
        # one scheme at every size (left open, the choice may take another at each)
        out = run(SCRIPTS["20b"], site, "--dry-run", NNODES=nodes, HIER_PRESET="lbp").stdout
        printed = float(re.search(r"memory per GCD \(plan\):.* = ([\d.]+) GB", out).group(1))
        peak = float(re.search(r"construction peak per GCD .*: ([\d.]+) GB", out).group(1))
        argv = re.search(r"plan: python -m megatron_lbp.plan (.*)", out).group(1).split()
        p = plan.plan_json(argv)
        assert abs(p["memory_bytes"]["total"] / 1e9 - printed) < 0.01
        assert abs(p["construction_peak_bytes"] / 1e9 - peak) < 0.01, (peak, p["construction_peak_bytes"])
        totals.append(printed)
    assert totals[0] > totals[1] > totals[2]


def test_dry_run_leads_with_its_summary(site):
    """The dry run's first lines: the model, the hierarchy, the choice and why (its band, the
    tie), memory per GCD, step time, saving, the exit time and what a job would refuse, in at
    most 15 lines; the full table only with LBP_VERBOSE=1, and the summary's choice is the
    one the training command runs."""
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=48, LBP_VERBOSE=None, HIER_PRESET=None)
    assert r.returncode == 0, r.stderr + r.stdout
    out = r.stdout.splitlines()
    # only the shell's environment lines (modules, Python) come before the summary
    start = next((i for i, l in enumerate(out) if l.startswith("[lbp] summary (")), None)
    assert start is not None and start <= 2, out[:4]
    lines = out[start:]
    summary = lines[:next(i for i, l in enumerate(lines[1:], 1) if not l.startswith("[lbp]   "))]
    assert len(summary) <= 15, "\n".join(summary)
    text = "\n".join(summary)
    for part in ("model: 44 layers, hidden 6144", "hierarchy: 48 node(s) x 8 ranks",
                 "choice: ", "memory per GCD total: ", "step time: ", "band [",
                 "save interval: ", "checkpoint: ", "tie: ", "exit time: "):
        assert part in text, (part, text)
    m = re.search(r"choice: (lbp S=\w+|zeropp|zero3|zero2) RECOMPUTE=(\w+) "
                  r"MICRO_BATCH_SIZE=(\d+)", text)
    assert m, text
    cmd = training_line(r.stdout)
    assert flag(cmd, "--hier-preset") == m.group(1).split()[0]
    assert flag(cmd, "--micro-batch-size") == m.group(3)
    assert (flag(cmd, "--recompute-granularity") if "--recompute-granularity" in cmd
            else "none") == m.group(2)
    # the free-space check speaks in the summary too, when the job would refuse
    refusals = [l for l in lines[len(summary):] if l.startswith("[lbp] a job would refuse:")]
    assert all(l.replace("[lbp] ", "[lbp]   ", 1) in summary for l in refusals), refusals
    assert "<- chosen" not in r.stdout and "memory per GCD by choice" not in r.stdout


@pytest.mark.slow
def test_dry_run_node_count_from_env_allocation_or_script(site):
    """LBP_DRY_RUN=1 is --dry-run; the node count is NNODES, the allocation's, or #SBATCH -N."""
    a = run(SCRIPTS["20b"], site, LBP_DRY_RUN=1, NNODES=8)
    b = run(SCRIPTS["20b"], site, LBP_DRY_RUN=1, SLURM_JOB_NUM_NODES=8, SLURM_JOB_ID=1)
    c = run(SCRIPTS["20b"], site, "--dry-run")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr + c.stderr
    assert srun_line(a.stdout) == srun_line(b.stdout)
    assert srun_line(c.stdout).startswith("srun -N 48 -n 384 ")
    assert "48 node(s) (the script's #SBATCH -N)" in c.stdout
    assert not site["srun_marker"].exists()


@pytest.mark.slow
def test_selective_recompute_where_the_estimate_allows_it(site):
    # 10B on 48 nodes, lbp: selective fits up to micro-batch 2 (~54 GB; 4 would need ~81 GB)
    r = run(SCRIPTS["10b"], site, "--dry-run", NNODES=48, RECOMPUTE="selective", HIER_PRESET="lbp")
    assert r.returncode == 0, r.stderr
    cmd = training_line(r.stdout)
    assert flag(cmd, "--recompute-granularity") == "selective" and "--recompute-method" not in cmd
    assert flag(cmd, "--micro-batch-size") == "2"
    # 20B: selective keeps 34sbh per layer, ~68 GB with whole layers' buffers even on 48 nodes
    # (split layers, HIER_LAYER_UNIT=auto's second try, fit it: the next test and
    # tests/launch/test_launch_choose.py)
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=48, RECOMPUTE="selective", HIER_PRESET="lbp",
            HIER_LAYER_UNIT="whole")
    assert r.returncode == 3 and "RECOMPUTE=selective" in r.stderr and "or set RECOMPUTE=full" in r.stderr
    r = run(SCRIPTS["10b"], site, "--dry-run", NNODES=16, RECOMPUTE="auto", HIER_PRESET="lbp")
    assert r.returncode == 0 and "choice: RECOMPUTE=selective MICRO_BATCH_SIZE=2 (the fastest" \
        in r.stdout, r.stderr + r.stdout


@pytest.mark.slow
def test_exit_time_for_a_debug_and_an_extended_job(site):
    """A 30-minute debug job and a 24-hour extended one both stop with room for one save."""
    for walltime, step in (("0:30:00", ""), ("1-00:00:00", "30")):
        r = run(SCRIPTS["10b"], site, "--dry-run", NNODES=16, LBP_WALLTIME=walltime,
                LBP_STEP_SECONDS=step or None)
        assert r.returncode == 0, r.stderr
        m = re.search(r"would have (\d+):(\d\d):(\d\d) left .* margin (\d+) s .*"
                      r"--exit-duration-in-mins (\d+)", r.stdout)
        left = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3))
        margin, exit_mins = int(m.group(4)), int(m.group(5))
        assert exit_mins * 60 <= left - margin < exit_mins * 60 + 60
        assert flag(training_line(r.stdout), "--exit-duration-in-mins") == str(exit_mins)
    # LBP_STEP_SECONDS=30 replaces the cost model's step: 45 min / 30 s = 90 -> 100 (divides 10000)
    assert "save interval: 100 iterations = 50.0 min of training" in r.stdout
    assert flag(training_line(r.stdout), "--save-interval") == "100"


@pytest.mark.slow
def test_retention_by_megatron_where_it_serves(site):
    """LBP_KEEP_LAST=1 with milestones that land on saves: Megatron's --save-retain-interval."""
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=48, LBP_KEEP_LAST=1)
    assert r.returncode == 0, r.stderr
    cmd = training_line(r.stdout)
    # the interval follows the projected step (a divisor of 10000, so milestones land on saves)
    interval = re.search(r"save interval: (\d+) iterations", r.stdout).group(1)
    assert flag(cmd, "--save-retain-interval") == "10000" and 10000 % int(interval) == 0
    assert flag(cmd, "--save-interval") == interval, (interval, cmd)
    assert "retention: newest 1 complete + the first at or after every 10000 iterations, by " \
           "Megatron (--save-retain-interval 10000)" in r.stdout
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=48, LBP_KEEP_LAST=1, SAVE_INTERVAL=300)
    assert "--save-retain-interval" not in training_line(r.stdout)   # 300 does not divide 10000
    assert "by the launcher" in r.stdout


def test_real_launch_health_step_then_training(site):
    r = run(SCRIPTS["10b"], site, "--", "--seed", "7", **in_job(MASTER_ADDR="10.0.0.1"))
    assert r.returncode == 0, r.stdout + r.stderr
    health, train = calls(site, "srun")
    assert health.startswith("-N 2 -n 16 --ntasks-per-node=8 -c 7 --kill-on-bad-exit=1")
    assert "lbp_task.sh python -m megatron_lbp.launch health --tasks-per-node 8" in health
    assert call_env(site, "srun", 1)["MASTER_PORT"] == "3443"
    words = train.split()
    assert words[:3] == ["-N", "2", "-n"] and words[-2:] == ["--seed", "7"]
    assert "megatron_lbp.pretrain_gpt" in words
    # 7200 s left (SLURM_JOB_END_TIME), minus one save, one step and 120 s of slack
    assert 115 <= int(flag(words, "--exit-duration-in-mins")) <= 117
    env = call_env(site, "srun", 2)
    assert env["LBP_TASKS_PER_NODE"] == "8" and env["LBP_GPUS_PER_TASK"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env
    assert (site["tmp"] / "ckpt" / "data_cache").is_dir() and (site["tmp"] / "ckpt" / "tensorboard").is_dir()
    assert "MASTER_ADDR=10.0.0.1 MASTER_PORT=3442" in r.stdout
    assert calls(site, "sbatch") == []          # no chain asked for


def test_environment_precedence_module_defaults_user(site):
    """Modules first, then the launcher's defaults, and what the user exported over both."""
    module = ('module() { [ "$1" = load ] || return 1; shift; echo "$*" >> "$MODULE_LOG"; '
              'export NCCL_SOCKET_IFNAME=hsn0 FI_CXI_RX_MATCH_MODE=software NCCL_CROSS_NIC=0 '
              'CRAY_LD_LIBRARY_PATH=/opt/cray/pe/lib64/cce-new '
              'LD_LIBRARY_PATH=/opt/rocm-7.1.1/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; }')
    env = in_job(MODULE_LOG=site["tmp"] / "modules.log", FI_CXI_RX_MATCH_MODE="hardware",
                 CUDA_DEVICE_MAX_CONNECTIONS="8", LD_LIBRARY_PATH="/home/me/lib",
                 CRAY_LD_LIBRARY_PATH="/opt/cray/pe/lib64/stale")
    e = dict(site["env"], **{k: str(v) for k, v in env.items()})
    r = subprocess.run(["bash", "-c", f'{module}; export -f module; exec bash "$0"', SCRIPTS["20b"]],
                       env=e, cwd=site["tmp"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (site["tmp"] / "modules.log").read_text().split() == [
        "PrgEnv-gnu/8.7.0", "cpe/26.03", "miniforge3/23.11.0-0", "rocm/7.1.1", "rccl-net-plugin",
        "craype-accel-amd-gfx90a"]
    task = call_env(site, "srun", 2)
    assert task["FI_CXI_RX_MATCH_MODE"] == "hardware"            # the user's value wins
    assert task["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"             # yours, not forced
    assert task["NCCL_SOCKET_IFNAME"] == "hsn0,hsn1,hsn2,hsn3"    # defaults over the module
    assert task["NCCL_CROSS_NIC"] == "1"
    # the module's CRAY_LD_LIBRARY_PATH (not the stale one from before it) first
    assert task["LD_LIBRARY_PATH"] == "/opt/cray/pe/lib64/cce-new:/opt/rocm-7.1.1/lib:/home/me/lib"
    assert "modules: loaded PrgEnv-gnu/8.7.0" in r.stdout
    assert "(yours: FI_CXI_RX_MATCH_MODE)" in r.stdout


def test_exit_time_from_squeue_in_a_job(site):
    r = run(SCRIPTS["20b"], site, **in_job(SLURM_JOB_END_TIME=None, FAKE_TIME_LEFT="29:30"))
    assert r.returncode == 0, r.stderr
    # 29:30 left (a debug job), small model: the --signal lead 150 s + 60 s + a step (more than
    # save 61 s + step + 120 s slack) -> 25 minutes
    assert "job 42 has 0:29:30 left (squeue -o %L: 29:30)" in r.stdout
    assert flag(calls(site, "srun")[-1].split(), "--exit-duration-in-mins") == "25"
    assert all(c.startswith("-h -j 42 -o") for c in calls(site, "squeue"))


def test_chain_submits_the_next_job_with_this_jobs_options(site):
    env = in_job(NCCL_CROSS_NIC="0", SLURM_CONF="/etc/slurm/slurm.conf")
    r = run(SCRIPTS["20b"], site, "--chain", "3", "--", "--seed", "7", **env)
    assert r.returncode == 0, r.stdout + r.stderr
    (sub,) = calls(site, "sbatch")
    script = REPO / "scripts" / "frontier_gpt20b.sh"
    assert sub == (f"--parsable --dependency=afterany:42 --chdir {REPO} -J lbp-gpt20b -A proj123 "
                   f"-p batch -t 2:00:00 -N 2 {script} --chain 2 -- --seed 7")
    e = call_env(site, "sbatch", 1)
    assert e["LBP_CHAIN_PREVIOUS_ITERATION"] == "0" and e["LBP_CHAIN_PREVIOUS_JOB"] == "42"
    # the environment the job started with: the user's value, no launcher default, no job variables
    assert e["NCCL_CROSS_NIC"] == "0" and "FI_CXI_RDZV_PROTO" not in e
    assert e["SLURM_CONF"] == "/etc/slurm/slurm.conf" and "SLURM_JOB_ID" not in e
    # submitted after the health check, before training
    assert "chain: submitted job 4242 (--dependency=afterany:42, chain of 2 more)" in r.stdout
    assert len(calls(site, "srun")) == 2


def test_chain_stops_when_complete_or_without_progress(site):
    ckpt = site["tmp"] / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("150000")
    r = run(SCRIPTS["20b"], site, "--chain", "3", **in_job())
    assert r.returncode == 0 and "chain: training complete" in r.stdout, r.stderr
    assert calls(site, "srun") == [] and calls(site, "sbatch") == []
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1250")
    r = run(SCRIPTS["20b"], site, "--chain", "2",
            **in_job(LBP_CHAIN_PREVIOUS_ITERATION="1250", LBP_CHAIN_PREVIOUS_JOB="41"))
    assert r.returncode == 5 and "no progress since job 41 started" in r.stderr
    assert calls(site, "srun") == [] and calls(site, "sbatch") == []


def test_local_profile_dry_run(site):
    env = {k: None for k in ("DATA_PATH", "VOCAB_FILE", "MERGE_FILE", "CHECKPOINT_DIR")}
    data = REPO / "data" / "lbp_demo_text_document"
    if not Path(f"{data}.bin").exists():
        env["DATA_PATH"] = site["env"]["DATA_PATH"]
    r = run(LOCAL, site, "--dry-run", NNODES=2, **env)
    assert r.returncode == 0, r.stderr
    srun = srun_line(r.stdout)
    assert srun.startswith("srun -N 2 -n 8 --ntasks-per-node=4 -c 1 ")
    assert "--gpus-per-task=1 --gpu-bind=map_gpu:4,5,2,3" in srun and "NCCL_NET" not in r.stdout
    cmd = training_line(r.stdout)
    assert flag(cmd, "--hier-gpus-per-node") == "4"
    assert flag(cmd, "--hier-secondary-group-size") == "4"
    assert flag(cmd, "--tokenizer-type") == "SentencePieceTokenizer"
    assert "W=8 ranks, P=2 G=4 O=8 S=4 (int8)" in r.stdout
    assert "--recompute-granularity" not in cmd and flag(cmd, "--exit-duration-in-mins") == "13"


@pytest.mark.slow
def test_frontier_small_differs_only_in_its_overrides(site):
    """Issue 16: scripts/frontier_small.env sets only size, node and task counts and the device,
    and the Frontier profile's dry run with it differs from the profile's own (#SBATCH -N 48,
    -t 2 h) only where those values (and the job length) explain it."""
    small = frontier_small.overrides()
    assert set(small) <= set(frontier_small.ALLOWED), \
        f"overrides issue 16 does not allow: {sorted(set(small) - set(frontier_small.ALLOWED))}"
    assert not set(small) & {"DATA_PATH", "VOCAB_FILE", "MERGE_FILE", "CHECKPOINT_DIR"}  # yours
    real = run(SCRIPTS["20b"], site, "--dry-run")
    r = run(SCRIPTS["20b"], site, "--dry-run", LBP_WALLTIME="6", **small)
    assert real.returncode == 0 and r.returncode == 0, real.stderr + r.stderr
    given = set(small) | {"LBP_WALLTIME"}
    bad = frontier_small.unexplained(real.stdout, r.stdout, given)
    assert not bad, "the small profile differs from frontier_gpt20b.sh's beyond its overrides:\n" \
        + "\n".join(bad)
    cmd = training_line(r.stdout)
    # what stays the profile's: GPT-2 BPE from files, full recomputation, the int8 secondary copy
    # over the node (S = TASKS_PER_NODE), bf16, the save and exit settings
    assert flag(cmd, "--tokenizer-type") == "GPT2BPETokenizer"
    assert flag(cmd, "--recompute-granularity") == "full" and "--bf16" in cmd
    assert flag(cmd, "--hier-secondary-group-size") == small["TASKS_PER_NODE"] == flag(cmd, "--hier-gpus-per-node")
    assert flag(cmd, "--hier-secondary-dtype") == "int8" and "--exit-signal-handler" in cmd
    assert "W=8 ranks, P=2 G=4 O=8 S=4 (int8)" in r.stdout and "flags for a CPU run" in r.stdout
    assert "SAVE_INTERVAL=auto" in r.stdout and "the --signal lead 150 s" in r.stdout
    # the diff names what no override explains (the small run's printout with two settings changed)
    smuggled = r.stdout.replace(" --hier-gcds-per-package 2", " --hier-gcds-per-package 4") \
        .replace(" --bf16", "").replace("OMP_NUM_THREADS=1", "OMP_NUM_THREADS=1 NCCL_DEBUG=INFO")
    named = [b.split(":")[0] for b in frontier_small.unexplained(real.stdout, smuggled, given)]
    assert sorted(named) == ["--bf16", "--hier-gcds-per-package", "env NCCL_DEBUG"], named


def _code(text: str) -> list[str]:
    """A script's lines that bash runs (comments and blank lines dropped)."""
    return [l for l in text.splitlines() if l.strip() and not l.lstrip().startswith("#")]


def test_the_three_profiles_share_one_launcher():
    body = LAUNCH / "frontier_body.sh"
    for script in (LOCAL, body):   # each sources the launcher and runs it
        text = script.read_text()
        assert 'scripts/launch/lbp_launch.sh"' in text and text.rstrip().endswith('lbp_main "$@"'), script
    for script in SCRIPTS.values():   # its model's defaults, then the Frontier body
        assert script.read_text().rstrip().endswith('. "$LBP_REPO/scripts/launch/frontier_body.sh"'), script
    for script in (*SCRIPTS.values(), LOCAL, body):
        code = _code(script.read_text())
        assert not [l for l in code if "srun " in l], script
        # Ranks are per task (lbp_task.sh), never exported from the batch script.
        assert not [l for l in code if re.match(r"\s*export\s+(RANK|LOCAL_RANK)=", l)], script
    # One body: the two profiles' code differs only in their model's defaults.
    a, b = (_code(SCRIPTS[m].read_text()) for m in ("20b", "10b"))
    differ = [(x, y) for x, y in zip(a, b) if x != y]
    assert len(a) == len(b) and all(x.startswith(": ") and y.startswith(": ") for x, y in differ), differ
    for script in SCRIPTS.values():
        head = script.read_text().split("set -euo pipefail")[0]
        for directive in ("#SBATCH -A ", "#SBATCH -J ", "#SBATCH -N ", "#SBATCH -t ",
                          "#SBATCH -p batch", "#SBATCH -o logs/%x-%j.out", "#SBATCH -e logs/%x-%j.err",
                          "#SBATCH --network=disable_rdzv_get", "#SBATCH --signal=TERM@"):
            assert directive in head, (script, directive)


# --------------------------------------------------------------------------- bad input


# Malformed input (unset or missing paths, node counts that do not fit, outside Slurm):
# tests/e2e/test_bad_input_matrix.py. Refusals of inputs that are well-formed but do not fit stay here.


def test_a_preset_implies_its_defaults_and_the_grad_dtype_is_one_setting(site):
    # zero3 has no secondary copy: the preset says so, without HIER_SECONDARY_GROUP_SIZE=0
    r = run(SCRIPTS["10b"], site, "--dry-run", NNODES=48, HIER_PRESET="zero3",
            HIER_GRAD_REDUCE_DTYPE="bf16")
    assert r.returncode == 0, r.stderr + r.stdout
    cmd = training_line(r.stdout)
    assert flag(cmd, "--hier-preset") == "zero3" and flag(cmd, "--hier-secondary-group-size") == "0"
    assert "--hier-secondary-dtype" not in cmd
    assert "W=384 ranks, P=384 G=384 O=384 S=0 (no secondary)" in r.stdout, r.stdout
    # bf16 gradient reductions: in the training flags and in the plan the estimate asked
    assert flag(cmd, "--hier-grad-reduce-dtype") == "bf16"
    argv = re.search(r"plan: python -m megatron_lbp.plan (.*)", r.stdout).group(1).split()
    assert flag(argv, "--hier-grad-reduce-dtype") == "bf16"


def test_refuses_when_memory_exceeds_the_gcd(site):
    r = run(SCRIPTS["20b"], site, NNODES=1, SLURM_JOB_ID=1, SLURM_JOB_NUM_NODES=1, HIER_PRESET="lbp")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "DOES NOT FIT" in r.stdout
    assert "refusing to launch" in r.stderr and "exceeds the GCD's 64 GB" in r.stderr
    assert "NNODES=3" in r.stderr
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
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=4, MEGATRON_LM_DIR=tree)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is not patched" in r.stderr and f"scripts/apply_patches.sh {tree}" in r.stderr

    if shutil.which("patch") is None:
        pytest.skip("patch(1) not installed")
    subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), str(tree)], check=True,
                   capture_output=True)
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=4, MEGATRON_LM_DIR=tree)
    assert r.returncode == 0, r.stderr
    assert training_line(r.stdout)[:3] == ["python", "-u", f"{tree}/pretrain_gpt.py"]

    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=4, MEGATRON_LM_DIR=site["tmp"] / "none")
    assert r.returncode == 2 and "has no pretrain_gpt.py" in r.stderr


def test_task_wrapper_reads_ranks_per_task(tmp_path):
    """lbp_task.sh: RANK/WORLD_SIZE from this task's SLURM_*; no LOCAL_RANK, so Megatron uses
    device 0 (the one GCD a task sees) and megatron-lbp's topology reads Slurm's variables."""
    probe = ("import os, json; from megatron_lbp.core.topology import launcher_info_from_env, "
             "location_of; i = launcher_info_from_env(os.environ); l = location_of(i, 8, 2, 'h'); "
             "print(json.dumps([os.environ['RANK'], os.environ['WORLD_SIZE'], "
             "'LOCAL_RANK' in os.environ, i.source, l.node, l.package, "
             "os.environ['MIOPEN_USER_DB_PATH'], os.environ['TRITON_CACHE_DIR']]))")
    env = dict(os.environ, SLURM_PROCID="13", SLURM_NTASKS="16", SLURM_LOCALID="5",
               SLURM_NODEID="1", SLURM_TASKS_PER_NODE="8(x2)", SLURM_JOB_ID="77",
               LOCAL_RANK="5", RANK="0", LBP_NODE_LOCAL_ROOT=str(tmp_path))
    r = subprocess.run(["bash", str(LAUNCH / "lbp_task.sh"), sys.executable, "-c", probe],
                       env=env, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    import json

    rank, world, has_local, source, node, package, miopen, triton = json.loads(r.stdout.splitlines()[-1])
    assert (rank, world, has_local, source, node, package) == ("13", "16", False, "slurm", 1, 2)
    assert miopen == str(tmp_path / "lbp-cache-77-13" / "miopen") and Path(miopen).is_dir()
    assert triton == str(tmp_path / "lbp-cache-77-13" / "triton") and Path(triton).is_dir()


def test_sbcast_of_a_packed_environment(tmp_path):
    """lbp_sbcast_env on one node: sbcast (a copy to the node's disk) and one task per node
    (the unpack) stand for Slurm's; the unpacked environment is the one activated."""
    packed = tmp_path / "pack"
    (packed / "bin").mkdir(parents=True)
    (packed / "bin" / "activate").write_text('PACKED_ENV="${BASH_SOURCE[0]%/bin/activate}"\n'
                                             'export PATH="$PACKED_ENV/bin:$PATH"\n')
    (packed / "bin" / "python").symlink_to(sys.executable)
    subprocess.run(["tar", "-czf", str(tmp_path / "env.tar.gz"), "-C", str(packed), "."], check=True)
    (tmp_path / "nvme").mkdir()   # what -C nvme gives a job: /mnt/bb/$USER on each node
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbcast").write_text('#!/bin/bash\n[ "$1" = -pf ] && cp "$2" "$3"\n')
    (bindir / "srun").write_text('#!/bin/bash\n'   # srun -N n --ntasks-per-node=1 CMD...: one node
                                 'while [[ "$1" == -* ]]; do case "$1" in -N) shift 2 ;; *) shift ;; esac; done\n'
                                 'exec "$@"\n')
    for tool in ("sbcast", "srun"):
        (bindir / tool).chmod(0o755)
    script = (f'LBP_REPO={REPO}; . "$LBP_REPO/scripts/launch/lbp_launch.sh"; NNODES_RESOLVED=1; '
              f'LBP_SBCAST_ENV={tmp_path}/env.tar.gz; LBP_SBCAST_DIR={tmp_path}/nvme; '
              'lbp_sbcast_env && lbp_setup_python && echo "ACTIVATE=$LBP_ACTIVATE" && '
              'echo "PYTHON=$(command -v python)"')
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    dest = tmp_path / "nvme" / "lbp_env"
    assert f"[lbp] sbcast: {tmp_path}/env.tar.gz -> {dest} on 1 node(s)" in r.stdout
    assert f"ACTIVATE={dest}/bin/activate" in r.stdout and f"PYTHON={dest}/bin/python" in r.stdout


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck; CI installs it)")
    files = [*SCRIPTS.values(), LOCAL, frontier_small.ENV_FILE, *sorted(LAUNCH.glob("*.sh"))]
    r = subprocess.run(["shellcheck", "-x", *map(str, files)], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------- real Slurm
#
# bash scripts/test.sh --slow -k local_slurm_job   (root, Debian: installs slurm + munge with
# apt-get). Starts a two-node Slurm on this machine (scripts/launch/local_slurm.sh), sbatch's
# scripts/frontier_gpt20b.sh itself with scripts/frontier_small.env (issue 16: the Frontier
# profile at small size, GPT-2 BPE built from the shipped corpus) as a chain of two jobs
# (issue 14), and stops every daemon it started by PID whatever the outcome.

LOCAL_SLURM = LAUNCH / "local_slurm.sh"
FRONTIER = SCRIPTS["20b"]
WHOLE_NODES = ("--exclusive", "--gpus-per-node=8")


def _job_state(job: str, env: dict) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                         text=True).stdout
    m = re.search(r"JobState=(\w+)", out)
    return m.group(1) if m else "UNKNOWN"


def _wait_job(job: str, env: dict, timeout: float = 900.0) -> str:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = _job_state(job, env)
        # SIGNALING: Slurm is delivering the --signal (or a cancel) to the steps, the job is not over
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT",
                         "SUSPENDED", "REQUEUED", "RESIZING"):
            return state
        time.sleep(2)
    subprocess.run(["scancel", job], env=env)
    return f"TIMEOUT (last {state})"


def _sbatch(env: dict, jobs: Path, *args: str, time_limit: str = "10", **export) -> str:
    """sbatch the Frontier profile on the two nodes with ``export`` in the job's environment
    (values with commas, which sbatch's --export list cannot hold, go through sbatch's own
    environment). The script's other #SBATCH options (-A, -J, -p batch, --network, --signal)
    are taken as shipped; --exclusive --gpus-per-node=8 ask this cluster for whole nodes with
    their fake GPUs, which Frontier gives every job without asking."""
    plain = {k: str(v) for k, v in export.items() if "," not in str(v)}
    exports = ",".join(["ALL"] + [f"{k}={v}" for k, v in plain.items()])
    r = subprocess.run(["sbatch", "--parsable", "--chdir", str(REPO), "-N", "2", *WHOLE_NODES, "-t", time_limit,
                        "-o", f"{jobs}/%x-%j.out", "-e", f"{jobs}/%x-%j.err",
                        f"--export={exports}", str(FRONTIER), *args],
                       env={**env, **{k: str(v) for k, v in export.items() if k not in plain}},
                       capture_output=True, text=True, check=True)
    return r.stdout.strip().split(";")[0]


def _logs(jobs: Path, job: str) -> tuple[str, str]:
    return ((jobs / f"lbp-gpt20b-{job}.out").read_text(), (jobs / f"lbp-gpt20b-{job}.err").read_text())


def _losses(path: Path) -> dict[int, float]:
    out = {}
    for line in path.read_text().splitlines():
        it, name, value = line.split("\t")
        if name == "lm loss":
            out[int(it)] = float(value)
    return out


def _exit_point(log: str, job: str) -> int:
    """The iteration a job stopped at by its computed exit time (and saved), from its log."""
    # the last exit time: the one computed just before training (the first, at the job's start,
    # only refuses a job too short for the pre-flight)
    m = re.findall(rf"exit time: job {job} has 0:0\d:\d\d left \(squeue -o %L: .*"
                   r"-> --exit-duration-in-mins (\d+) ", log)
    assert m, log[-3000:]
    assert f"exiting program after {m[-1]}." in log, log[-3000:]
    assert "exiting program after receiving SIGTERM" not in log, log[-3000:]   # not the backstop
    return _last_save(log)


def _last_save(log: str) -> int:
    return [int(m) for m in re.findall(r"successfully saved checkpoint from iteration +(\d+)", log)][-1]


def _gpt2_data(tmp: Path, env: dict) -> dict:
    """A GPT-2-format vocabulary built from the shipped corpus, and every 2nd document of it
    preprocessed with that vocabulary (enough documents for the profile's 949,50,1 split)."""
    corpus = REPO / "data_src" / "python-docs-3.11.jsonl.gz"
    out = tmp / "gpt2"
    subprocess.run([sys.executable, "-m", "megatron_lbp.integration.build_gpt2_bpe", "--out", str(out)],
                   check=True, env=env, capture_output=True)
    import gzip

    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        docs = [line for line in f if line.strip()][::2]
    (out / "docs.jsonl").write_text("".join(docs), encoding="utf-8")
    paths = {"VOCAB_FILE": out / "vocab.json", "MERGE_FILE": out / "merges.txt"}
    subprocess.run([sys.executable, "-m", "megatron_lbp.preprocess_data", "--input",
                    str(out / "docs.jsonl"), "--output-prefix", str(out / "docs"),
                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(paths["VOCAB_FILE"]),
                    "--merge-file", str(paths["MERGE_FILE"])], check=True, env=env, capture_output=True)
    return {**paths, "DATA_PATH": out / "docs_text_document"}


def _assert_placed_as_the_profile_places(out: str) -> None:
    """The two-node Slurm job's 8 ranks on the nodes and packages the profile places them on."""
    for rank in range(8):
        node, package = rank // 4, (rank % 4) // 2
        assert re.search(rf"rank {rank} on \S+ node {node} package {package}\n", out)


def _assert_health_checked(log: str) -> None:
    assert log.count("[lbp health] package: all-gather") == 1, log[-2000:]
    assert "[lbp health] network: " in log and "between node1 and node2" in log


def _assert_ran_the_profiles_command(out: str, env: dict, paths: dict, ckpt: Path, cwd: Path,
                                     overridden: set) -> None:
    """What the job ran is the profile's own command but for the overrides (issue 16): the
    job's printout against the dry run of frontier_gpt20b.sh as shipped, same paths."""
    as_shipped = {k: v for k, v in env.items() if k != "SLURM_CONF"}
    as_shipped.update({k: str(v) for k, v in paths.items()}, CHECKPOINT_DIR=str(ckpt))
    real = subprocess.run(["bash", str(FRONTIER), "--dry-run"], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env=as_shipped)
    assert real.returncode == 0, real.stderr
    bad = frontier_small.unexplained(real.stdout, out, overridden)
    assert not bad, "the job ran more than the profile's overrides change:\n" + "\n".join(bad)


@pytest.mark.slow
def test_local_slurm_short_job(tmp_path, local_slurm):
    """.ci/run's real-Slurm test: scripts/frontier_gpt20b.sh at small size on the two-node
    Slurm, one job of 3 iterations: the ranks on the nodes and packages the profile places
    them on, the health check, a hierarchy spanning both nodes, 3 finite losses logged, a
    checkpoint at the last one, and a command that is the profile's dry run but for the
    overrides. A data path the launcher cannot read fails before srun. The exit-time chain
    and its resume against an uninterrupted run are test_local_slurm_job's (slow command)."""
    env, paths = local_slurm["env"], local_slurm["paths"]
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    run_env = {**frontier_small.overrides(), **paths}
    ckpt = tmp_path / "ckpt"
    job = _sbatch(env, jobs, CHECKPOINT_DIR=ckpt, LBP_LOSS_LOG=tmp_path / "loss",
                  LBP_LOG_ALL_RANKS=1, EXTRA_ARGS="--exit-interval=3", **run_env)
    state = _wait_job(job, env)
    out, err = _logs(jobs, job)
    assert state == "COMPLETED", f"{state}\n{out[-3000:]}\n{err[-3000:]}"
    _assert_placed_as_the_profile_places(out)
    _assert_health_checked(out)
    assert "megatron-lbp hierarchy (lbp): W=8 P=2 S=4 G=4 O=8 R=1" in out, out[-3000:]
    losses = _losses(tmp_path / "loss")
    assert sorted(losses) == [1, 2, 3] and all(0 < v < 20 for v in losses.values()), losses
    assert _last_save(out) == 3
    _assert_ran_the_profiles_command(out, env, paths, ckpt, tmp_path,
                                     set(run_env) | {"LBP_WALLTIME", "EXTRA_ARGS"})
    job = _sbatch(env, jobs, **{**run_env, "DATA_PATH": tmp_path / "missing",
                                "CHECKPOINT_DIR": tmp_path / "c2"})
    assert _wait_job(job, env, 120) == "FAILED"
    err = _logs(jobs, job)[1]
    assert "lbp_launch: error: DATA_PATH:" in err and "missing.bin" in err


@pytest.mark.slow
def test_local_slurm_job(tmp_path, local_slurm):
    """scripts/frontier_gpt20b.sh at small size (scripts/frontier_small.env) on a real two-node
    Slurm, as a chain of two jobs: the first stops at the exit time it computed from its wall
    time, with a checkpoint, and what it ran differs from the profile's dry run only in the
    overrides; the second resumes from it with the losses of one uninterrupted run; the health
    check runs in both."""
    env, paths = local_slurm["env"], local_slurm["paths"]
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    small = frontier_small.overrides()
    run_env = {**small, **paths}
    # 1. The first job of a chain of two: 5 minutes, minus the pre-flight (health check
    #    included) and the margin of 210 s (the profile's --signal=TERM@150 + the 60 s
    #    Slurm may send it early; more than save 60 s + step + slack 120 s), leaves one
    #    minute of Megatron's clock: the fewest iterations that show the exit time, and the
    #    fewest the uninterrupted run of step 3 repeats (every minute of training here is
    #    two of the test). It is asked again (at most 4 times) where the
    #    machine is so busy that the pre-flight took more than 30 s (the job refuses as too
    #    short and submits nothing: then with the -t that this pre-flight, a quarter more,
    #    the margin and 90 s need), or that the first iteration ended only after Slurm's
    #    signal (Megatron looks at the signal before its clock: the backstop stopped it;
    #    its chain is cancelled; then 3 minutes more). The second job (10 minutes) stops
    #    at the next multiple of 10 iterations (--exit-interval): it shows the resume, not
    #    the exit time again.
    next_args = (f"{' '.join(WHOLE_NODES)} -t 10 -o {jobs}/%x-%j.out -e {jobs}/%x-%j.err "
                 "--export=ALL,EXTRA_ARGS=--exit-interval=10")
    retries, minutes = [], 5
    while len(retries) < 4:
        ckpt = tmp_path / f"ckpt{minutes}"
        first = _sbatch(env, jobs, "--chain", "2", time_limit=str(minutes), CHECKPOINT_DIR=ckpt,
                        LBP_LOSS_LOG=tmp_path / f"chain{minutes}.loss", LBP_LOG_ALL_RANKS=1,
                        LBP_CHAIN_SBATCH_ARGS=next_args, **run_env)
        state = _wait_job(first, env)
        out, err = _logs(jobs, first)
        left = re.search(r"has (\d+):(\d\d):(\d\d) left \(squeue", err)
        if state == "FAILED" and "less than one minute of training" in err and left:
            # the next -t: this pre-flight, a quarter more, the margin and a minute and a half
            h, m, s = map(int, left.groups())
            preflight = minutes * 60 - (h * 3600 + m * 60 + s)
            retries.append(f"-t {minutes}: refused as too short after a {preflight} s pre-flight")
            minutes = max(minutes + 1, -(-(preflight * 5 // 4 + 210 + 90) // 60))
        elif ("exiting program after receiving SIGTERM" in out
              or re.search(r"training step ended at \S+ with status 143", out)
              or ("the health check failed" in err and "CANCELLED AT" in err)):
            # the signal came before the first iteration ended (or before Megatron's handler,
            # or during the health check)
            retries.append(f"-t {minutes}: Megatron's start took longer than its clock allows")
            for job in re.findall(r"chain: submitted job (\d+)", out):
                subprocess.run(["scancel", job], env=env)
                _wait_job(job, env, 120)
            minutes += 3
        else:
            break
    assert state == "COMPLETED", f"{state} after {retries}\n{out[-3000:]}\n{err[-3000:]}"
    k1 = _exit_point(out, first)
    second = re.search(r"chain: submitted job (\d+) \(--dependency=afterany:" + first, out).group(1)
    _assert_placed_as_the_profile_places(out)
    assert "[lbp_task] placement verified: rank 0 is local rank 0 of node 0 (node1); local " \
           "ranks 0,1 on devices 4,5 = package 2" in out
    _assert_ran_the_profiles_command(out, env, paths, ckpt, tmp_path,
                                     set(run_env) | {"LBP_WALLTIME"})
    cmd = training_line(out)
    assert flag(cmd, "--tokenizer-type") == "GPT2BPETokenizer" and "--bf16" in cmd
    assert flag(cmd, "--recompute-granularity") == "full" and flag(cmd, "--hier-secondary-dtype") == "int8"
    assert "megatron-lbp hierarchy (lbp): W=8 P=2 S=4 G=4 O=8 R=1" in out, out[-3000:]

    # 2. The second resumes from that checkpoint.
    state = _wait_job(second, env)
    out2, err2 = _logs(jobs, second)
    assert state == "COMPLETED", f"{state}\n{out2[-3000:]}\n{err2[-3000:]}"
    assert f"the tracker names iteration {k1} of 150000, up from 0 when job {first} started" in out2
    assert re.search(rf"successfully loaded checkpoint from \S+ .*at iteration {k1}\b", out2), out2[-3000:]
    k2 = _last_save(out2)
    assert k1 < k2 <= k1 + 10 and k2 % 10 == 0 and "chain: submitted" not in out2
    for log in (out, out2):
        _assert_health_checked(log)
    # retention (newest 2 + milestones every 10000): SAVE_INTERVAL=auto is 10000 at this
    # size, so the two exits' checkpoints are the ones written, and both are kept
    kept = sorted(int(p.name[5:]) for p in ckpt.glob("iter_*"))
    assert kept == [k1, k2], kept
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(k2)

    # 3. One uninterrupted run to the same iteration: the same losses.
    ref = _sbatch(env, jobs, time_limit="15", CHECKPOINT_DIR=tmp_path / "ref", LBP_HEALTH_CHECK=0,
                  LBP_LOSS_LOG=tmp_path / "ref.loss", EXTRA_ARGS=f"--exit-interval={k2}",
                  **run_env)
    assert _wait_job(ref, env) == "COMPLETED", _logs(jobs, ref)[1][-3000:]
    chain, single = _losses(tmp_path / f"chain{minutes}.loss"), _losses(tmp_path / "ref.loss")
    assert sorted(chain) == sorted(single) == list(range(1, k2 + 1)), (sorted(chain)[-3:], k2)
    differ = [(i, chain[i], single[i]) for i in single if chain[i] != single[i]]
    assert not differ, f"resumed at {k1}; iterations whose loss differs: {differ[:5]}"

    # 4. A bad data path the launcher sees: FAILED before srun, the reason in the log.
    job = _sbatch(env, jobs, **{**run_env, "DATA_PATH": tmp_path / "missing",
                                "CHECKPOINT_DIR": tmp_path / "c2"})
    assert _wait_job(job, env, 120) == "FAILED"
    err = _logs(jobs, job)[1]
    assert "lbp_launch: error: DATA_PATH:" in err and "missing.bin" in err
    print(f"local Slurm chain of the Frontier profile at small size: first job -t {minutes} "
          f"(retried: {retries or 'no'}), stopped at iteration {k1} by its exit "
          f"time; second resumed, stopped at {k2}; {len(single)} losses equal to one "
          f"uninterrupted run (first {single[1]:.4f}, last {single[k2]:.4f}); kept {kept}")


@pytest.mark.slow
def test_embedding_backward_gather_reaches_the_estimate_and_the_command(site):
    """HIER_EMBEDDING_BACKWARD_GATHER=skip: the flag reaches the training command and the
    estimate's transient (the tied embedding freed after the output layer's backward) is
    the plan's smaller figure; the default says nothing."""
    fixed = dict(NNODES=16, HIER_PRESET="lbp", RECOMPUTE="full", MICRO_BATCH_SIZE=1)
    transient = {}
    for setting in ("gather", "skip"):
        r = run(SCRIPTS["20b"], site, "--dry-run", HIER_EMBEDDING_BACKWARD_GATHER=setting, **fixed)
        assert r.returncode == 0, r.stderr
        cmd = training_line(r.stdout)
        assert ("--hier-embedding-backward-gather" in cmd) == (setting == "skip"), cmd
        assert setting == "gather" or flag(cmd, "--hier-embedding-backward-gather") == "skip"
        m = re.search(r"transient ([\d.]+) GB, activations .* fits  <- chosen", r.stdout)
        assert m, r.stdout[-3000:]
        transient[setting] = float(m.group(1))
    # 44 layers, hidden 6144, vocab 50304: the tied V*h bf16 weights, 0.62 GB
    assert transient["gather"] - transient["skip"] == pytest.approx(0.62, abs=0.011), transient


@pytest.mark.slow
def test_layer_unit_split_reaches_the_estimate_and_the_command_and_full_recompute_is_refused(site):
    """HIER_LAYER_UNIT=auto (the default) at 20B on 48 nodes, lbp, selective recomputation:
    whole layers do not fit, split ones do; the flag reaches the training command and the
    estimate's transient is the plan's for split layers (half a layer's weights and gradient
    at a time). With RECOMPUTE=full an explicit split is refused in one line, before any
    estimate."""
    fixed = dict(NNODES=48, HIER_PRESET="lbp", RECOMPUTE="selective", MICRO_BATCH_SIZE=1)
    r = run(SCRIPTS["20b"], site, "--dry-run", **fixed)
    assert r.returncode == 0, r.stderr
    assert flag(training_line(r.stdout), "--hier-layer-unit") == "split", training_line(r.stdout)
    m = re.search(r"\((\d+) per step\) with .*HIER_LAYER_UNIT=split.*transient ([\d.]+) GB, "
                  r"activations .* fits  <- chosen", r.stdout)
    assert m, r.stdout[-3000:]
    from megatron_lbp.launch import plan

    shape = ["--world-size", "384", "--num-layers", "44", "--hidden-size", "6144",
             "--vocab-size", "50304", "--seq-length", "2048", "--hier-secondary-group-size", "8",
             "--recompute", "selective", "--micro-batches", m.group(1), "--hier-layer-unit",
             "split"]
    knobs = re.search(r"HIER_PREFETCH_UNITS=(\d+) HIER_MAX_PENDING_REDUCES=(\d+) "
                      r"HIER_LAYER_UNIT=split", m.group(0))
    if knobs:
        shape += ["--hier-prefetch-units", knobs.group(1), "--hier-max-pending-reduces",
                  knobs.group(2)]
    planned = plan.plan_json(shape, knob_table=False)["transient_bytes"]["peak"] / 1e9
    assert float(m.group(2)) == pytest.approx(planned, abs=0.006), (m.group(0), planned)
    r = run(SCRIPTS["20b"], site, "--dry-run", HIER_LAYER_UNIT="split",
            **{**fixed, "RECOMPUTE": "full"})
    assert r.returncode == 2 and "HIER_LAYER_UNIT=split with RECOMPUTE=full" in r.stderr, r.stderr
