"""The launchers' Python side (megatron_lbp.launch): estimates, exit time, retention, chain,
placement, health check. Real checkpoints, real gloo ranks, real srun-task wrappers; the
only stand-in is ``squeue`` (a site command that cannot run here), on PATH as a script
that prints what Slurm's squeue prints for a job.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_lbp.core import costs
from megatron_lbp.launch import plan
from megatron_lbp.launch.job import Job
from megatron_lbp.launch import candidates, checkpoints, estimate, health, placement, walltime
from megatron_lbp.testing.multirank import run_on_ranks
from tests.helpers.pretrain_runner import REPO, TINY, demo_data, run_pretrain, why

PY = sys.executable


def launch(*argv, env=None, path_prepend=None):
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    for k in [k for k in e if k.startswith("SLURM_")]:
        if not (env and k in env):
            e.pop(k)
    if path_prepend:
        e["PATH"] = f"{path_prepend}:{e['PATH']}"
    return subprocess.run([PY, "-m", "megatron_lbp.launch", *map(str, argv)], env=e,
                          capture_output=True, text=True, timeout=120, cwd=REPO)


# --------------------------------------------------------------------------- estimate


def _shape(**over):
    a = dict(nodes=48, tasks_per_node=8, gcds_per_package=2, preset="lbp", num_layers=44,
             hidden_size=6144, num_attention_heads=64, seq_length=2048, vocab_size=50304,
             # the CLI's defaults: the preset's secondary dtype and gradient dtype
             ffn_hidden_size=0, hier_secondary_group_size=8, hier_secondary_dtype=None,
             position_embedding_type="rope", untie_embeddings_and_output_weights=False,
             hier_grad_reduce_dtype=None, compare=False,
             params_dtype="bf16", bucket_size=40_000_000,
             global_batch_size=1536, micro_batch_size="auto", recompute="full",
             gcd_memory_gb=64.0, reserve_gb=4.0, train_iters=150000, save_interval="auto",
             save_minutes=45.0, milestone_every=10000, step_seconds=0.0, mfu=0.35,
             write_gbps_per_node=1.0, save_fixed_s=60.0,
             # whole layers and the embedding gathered, as given (the launcher's auto tries
             # the others where these do not fit)
             hier_layer_unit="whole", hier_embedding_backward_gather="gather")
    a.update(over)
    return Job(**a)


def test_activation_estimate_orders_the_recomputation_choices():
    a = _shape()
    for b in (1, 2):
        full, sel, none = (candidates.activation_bytes(a, rc, b) for rc in ("full", "selective", "none"))
        assert full < sel < none, (full, sel, none)
    # Korthikanti: selective keeps 34sbh per layer; the 5as^2b scores only for one layer
    s, h, L, n = 2048, 6144, 44, 64
    assert candidates.activation_bytes(a, "selective", 2) - candidates.activation_bytes(a, "selective", 1) \
        == 34 * s * h * L + 5 * n * s * s + 10 * s * 50304


def test_auto_picks_the_largest_micro_batch_that_fits_and_refuses_what_does_not():
    options, _ = candidates.choices(_shape())
    chosen = candidates.pick(options, "full")
    assert (chosen.recompute, chosen.micro_batch_size) == ("full", 4)   # 1536 / 384 ranks = 4
    auto = candidates.pick(options, "auto")
    # At 20B neither no recomputation nor selective fits once the engine's transient
    # buffers are counted (selective at micro-batch 1: ~68 GB): full it is.
    assert auto.recompute == "full" and auto.fits
    assert all(not c.fits for c in options if c.recompute in ("none", "selective"))
    # 10B on 16 nodes: full recompute at micro-batch 1 leaves half the GCD idle
    small, _ = candidates.choices(_shape(nodes=16, num_layers=32, hidden_size=5120,
                                       num_attention_heads=40))
    by = {(c.recompute, c.micro_batch_size): c for c in small}
    assert by[("full", 1)].total_bytes < 32e9 and candidates.pick(small, "full").micro_batch_size == 4
    lines, resolved, refusal = estimate.report(_shape(nodes=1))
    assert refusal and "use at least NNODES=3" in refusal and not resolved


@pytest.mark.parametrize("model,nodes", [("20b", 16), ("20b", 48), ("10b", 16), ("10b", 48)])
def test_total_is_plan_state_plus_plan_transient_plus_activations_plus_the_margin(model, nodes):
    """One memory model: every row's total is the plan's own figures, asked independently here,
    plus the activation estimate and the named allocator margin; the construction peak counts."""
    shape = {"20b": {}, "10b": dict(num_layers=32, hidden_size=5120, num_attention_heads=40)}
    a = _shape(nodes=nodes, **shape[model])
    options, _ = candidates.choices(a)
    world = nodes * 8
    for c in options:
        p = plan.plan_json(["--world-size", str(world), "--num-layers", str(a.num_layers),
                            "--hidden-size", str(a.hidden_size), "--vocab-size", "50304",
                            "--seq-length", "2048", "--hier-secondary-group-size", "8",
                            "--micro-batches", str(c.micro_batches),
                            "--hier-prefetch-units", str(c.prefetch_units),
                            "--hier-max-pending-reduces", str(c.max_pending_reduces)])
        want = (p["memory_bytes"]["total"] + p["transient_bytes"]["peak"]
                + candidates.activation_bytes(a, c.recompute, c.micro_batch_size) + 4 * 10**9)
        assert c.total_bytes == want, (c, want)
        assert c.state_bytes == p["memory_bytes"]["total"]
        assert c.transient_bytes == p["transient_bytes"]["peak"]
        assert c.construction_bytes == p["construction_peak_bytes"] + 4 * 10**9
        assert c.fits == (max(c.total_bytes, c.construction_bytes) <= 64e9), c
    chosen = candidates.pick(options, "full")
    assert chosen is not None and chosen.fits
    lines, _, _ = estimate.report(a)
    total = next(l for l in lines if l.startswith("memory per GCD total:"))
    assert "+ margin 4.00 GB" in total and "(fits)" in total, total
    assert any("allocator margin" in l for l in lines)


def test_scheme_comparison_ranks_by_projected_step_time_and_names_zeropp_and_zero3():
    a = _shape(nodes=4, num_layers=32, hidden_size=5120, num_attention_heads=40)
    rows = candidates.scheme_rows(a)
    steps = [r.choice.step_s for r in rows]
    assert steps == sorted(steps) and all(r.choice.fits for r in rows), steps
    assert {r.scheme for r in rows} >= {"lbp S=node", "zeropp", "zero3"}, {r.scheme for r in rows}
    for r in rows:   # identical conditions: the user's global batch in every row
        assert r.choice.micro_batch_size * r.choice.micro_batches * 32 == 1536, r
    lines, resolved, _ = estimate.report(_shape(nodes=4, num_layers=32, hidden_size=5120,
                                                num_attention_heads=40, compare=True))
    chosen = float(resolved["LBP_STEP_S"])   # six digits: the printed line keeps three
    for name in ("zeropp", "zero3"):
        best = next(r for r in rows if r.scheme == name)
        line = next(l for l in lines if l.startswith(f"best {name}:"))
        ratio = float(re.search(r"([\d.]+)x the chosen's", line).group(1))
        assert ratio == pytest.approx(best.choice.step_s / chosen, abs=2e-3), (line, chosen)
    faster = [l for l in lines if l.startswith("projected faster:")]
    assert len(faster) == (rows[0].scheme != "lbp S=node" and rows[0].choice.step_s < chosen)
    # The explicit preset and micro-batch still decide the launch: the comparison only advises.
    assert estimate.report(a)[1] == estimate.report(_shape(
        nodes=4, num_layers=32, hidden_size=5120, num_attention_heads=40, compare=True))[1]


def test_tied_embedding_gradient_and_untied_output_are_counted():
    a, b = _shape(), _shape(untie_embeddings_and_output_weights=True)
    # Tied: the output layer's gradient of the shared weight waits in autograd (bf16 V*h).
    assert candidates.activation_bytes(a, "full", 1) - candidates.activation_bytes(b, "full", 1) \
        == 2 * 50304 * 6144
    ta, tb = (candidates.choices(x)[0][0] for x in (a, b))
    assert tb.state_bytes > ta.state_bytes   # the output layer's own V*h weights


def test_save_interval_and_checkpoint_size():
    assert candidates.nice_interval(90, 150000, 10000) == 100        # a divisor of 10000
    assert candidates.nice_interval(117, 150000, 10000) == 125
    assert candidates.nice_interval(117, 150000, 0) == 120           # two significant digits
    assert candidates.nice_interval(5000, 300, 0) == 300             # at most TRAIN_ITERS
    lines, resolved, _ = estimate.report(_shape(step_seconds=30.0))
    assert resolved["SAVE_INTERVAL"] == 100 and resolved["LBP_STEP_S"] == "30"
    assert any("save interval: 100 iterations = 50.0 min of training" in l for l in lines)
    assert resolved["LBP_CKPT_BYTES"] == 14 * resolved["LBP_PARAMS"]
    assert candidates.save_seconds(283e9, 48, 1.0, 60) == pytest.approx(2 * 283 / 48 + 60)


# --------------------------------------------------------------------------- exit time


@pytest.mark.parametrize("text,seconds", [("30", 1800), ("2:00", 120), ("1:59:30", 7170),
                                          ("1-00:00:00", 86400), ("2-12", 216000),
                                          ("1-01:02", 90120), ("UNLIMITED", None),
                                          ("NOT_SET", None)])
def test_slurm_durations(text, seconds):
    assert walltime.parse_slurm_duration(text) == seconds


def test_remaining_time_from_end_time_or_squeue():
    assert walltime.remaining_seconds({"SLURM_JOB_END_TIME": "1000", "SLURM_JOB_ID": "7"},
                                      now=400) == (600, "SLURM_JOB_END_TIME")
    left, source = walltime.remaining_seconds({"SLURM_JOB_ID": "7"}, now=0,
                                              squeue=lambda job: "1:02:03")
    assert left == 3723 and "1:02:03" in source
    assert walltime.exit_minutes(7200, 214) == 116 and walltime.exit_minutes(100, 66) == 0


def test_exit_margin_covers_the_signal_as_early_as_slurm_sends_it():
    """Training stops before the --signal backstop can arrive (up to 60 s before its lead)."""
    assert walltime.margin_seconds(72, 22.5, 120) == walltime.margin_seconds(72, 22.5, 120, 0) == 214.5
    assert walltime.margin_seconds(72, 22.5, 120, 150) == 150 + 60 + 22.5     # the signal's is larger
    assert walltime.margin_seconds(343, 5, 120, 150) == 468                   # the save's is larger


@pytest.fixture
def fake_squeue(tmp_path):
    """squeue as Slurm prints it for job 42: -o %L the time left, -o %l the limit."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "squeue").write_text(
        "#!/bin/sh\n# squeue -h -j JOB -o FORMAT\n"
        "case \"$*\" in *'%L'*) echo \"${FAKE_TIME_LEFT:-1:23:45}\" ;; "
        "*) echo '(null)|batch|(null)|2:00:00|(null)|lbp-gpt20b' ;; esac\n")
    (bindir / "squeue").chmod(0o755)
    return bindir


def test_exit_time_command_in_a_job(fake_squeue, tmp_path):
    out = tmp_path / "exit"
    r = launch("exit-time", "--save-s", "72", "--step-s", "22.5", "--slack-s", "120",
               "--resolved", out, env={"SLURM_JOB_ID": "42"}, path_prepend=fake_squeue)
    assert r.returncode == 0, r.stderr
    # 1:23:45 = 5025 s left, margin 214.5 s -> 80 whole minutes
    assert "--exit-duration-in-mins 80" in r.stdout and "squeue -o %L: 1:23:45" in r.stdout
    assert out.read_text() == "EXIT_DURATION_MINS=80\n"
    end = int(time.time()) + 1800
    r = launch("exit-time", "--save-s", "72", "--step-s", "22.5", "--slack-s", "120",
               env={"SLURM_JOB_ID": "42", "SLURM_JOB_END_TIME": str(end)})
    assert r.returncode == 0 and "--exit-duration-in-mins 26" in r.stdout, r.stdout + r.stderr
    r = launch("exit-time", "--save-s", "72", "--step-s", "22.5", "--slack-s", "120",
               env={"SLURM_JOB_ID": "42", "FAKE_TIME_LEFT": "4:00"}, path_prepend=fake_squeue)
    assert r.returncode == 4 and r.stderr.count("\n") == 1, r.stderr
    assert "0:04:00 left" in r.stderr and "less than one minute of training" in r.stderr
    r = launch("exit-time", "--save-s", "60", "--step-s", "1", "--slack-s", "120", "--signal-s", "150",
               env={"SLURM_JOB_ID": "42", "FAKE_TIME_LEFT": "6:00"}, path_prepend=fake_squeue)
    assert r.returncode == 0 and "margin 211 s (the --signal lead 150 s + 60 s" in r.stdout, r.stdout
    assert "--exit-duration-in-mins 2 " in r.stdout       # (360 - 211) // 60
    r = launch("exit-time", "--save-s", "1", "--step-s", "1", "--slack-s", "1",
               env={"SLURM_JOB_ID": "42", "FAKE_TIME_LEFT": "UNLIMITED"}, path_prepend=fake_squeue)
    assert r.returncode == 0 and "no wall-clock limit" in r.stdout


# --------------------------------------------------------------------------- real checkpoints


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """A real run's checkpoint directory: iter_0000001 .. iter_0000005, tracker at 5."""
    root = tmp_path_factory.mktemp("saves")
    data = demo_data(root / "data")
    ckpt = root / "ckpt"
    code, log, _ = run_pretrain(1, TINY + ["--data-path", data, "--train-iters", "5",
                                           "--global-batch-size", "2", "--save", str(ckpt),
                                           "--save-interval", "1", "--ckpt-format", "torch_dist"])
    assert code == 0, why(log)
    return ckpt


@pytest.fixture
def ckpt(saves, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(saves, dst)
    return dst


def _iters(d: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in d.glob("iter_*"))


def test_retention_keeps_newest_milestones_and_the_tracker(ckpt):
    tracker, found = checkpoints.scan(ckpt)
    assert tracker == 5 and [c.iteration for c in found] == [1, 2, 3, 4, 5]
    assert all(c.complete and c.nbytes > 0 for c in found)
    r = launch("checkpoints", "prune", ckpt, "--keep-last", "2", "--milestone-every", "2",
               "--dry-run")
    assert r.returncode == 0 and _iters(ckpt) == [1, 2, 3, 4, 5], r.stderr
    assert "would delete iter_0000001, iter_0000003" in r.stdout, r.stdout
    r = launch("checkpoints", "prune", ckpt, "--keep-last", "2", "--milestone-every", "2")
    assert r.returncode == 0 and _iters(ckpt) == [2, 4, 5], r.stdout + r.stderr
    assert "iter_0000002 (milestone (first at or after 2))" in r.stdout
    # The tracker naming an older checkpoint (a later save never named): both stay.
    (ckpt / checkpoints.TRACKER).write_text("2")
    r = launch("checkpoints", "prune", ckpt, "--keep-last", "1")
    assert _iters(ckpt) == [2, 5], r.stdout
    assert "iter_0000002 (named by the tracker)" in r.stdout and "iter_0000005 (newest complete)" in r.stdout


def test_retention_never_touches_a_save_in_progress_and_clears_torn_ones_at_start(ckpt):
    torn = ckpt / "iter_0000006"
    shutil.copytree(ckpt / "iter_0000005", torn)
    (torn / "metadata.json").unlink()               # shards written, metadata.json not yet
    r = launch("checkpoints", "prune", ckpt, "--keep-last", "1")
    assert _iters(ckpt) == [5, 6], r.stdout         # during training: may be in progress
    assert "left in place (incomplete" in r.stdout and "iter_0000006" in r.stdout
    r = launch("checkpoints", "prune", ckpt, "--keep-last", "1", "--at-start")
    assert _iters(ckpt) == [5], r.stdout            # at job start nobody writes: a torn save
    assert "iter_0000006 (torn save)" in r.stdout
    # The newest complete checkpoint survives even a tracker that names a missing one.
    (ckpt / checkpoints.TRACKER).write_text("9")
    launch("checkpoints", "prune", ckpt, "--keep-last", "1", "--at-start")
    assert _iters(ckpt) == [5]


def test_checkpoint_estimate_matches_a_real_checkpoint(saves):
    _, found = checkpoints.scan(saves)
    params = costs.gpt_param_count(2, 64, 4096, seq_length=32, position_embedding_type="rope")
    est = candidates.checkpoint_bytes(params, "fp32")   # the TINY run's weights are fp32
    assert abs(found[-1].nbytes - est) / est < 0.15, (found[-1].nbytes, est)


def test_free_space_refusal_names_the_numbers(ckpt):
    free, _ = checkpoints.free_bytes(ckpt)
    r = launch("checkpoints", "space", ckpt, "--checkpoint-bytes", str(free))   # two won't fit
    assert r.returncode == 4 and r.stderr.count("\n") == 1 and r.stdout == "", r.stderr
    assert f"CHECKPOINT_DIR={ckpt}" in r.stderr and "two checkpoints need 2 x" in r.stderr
    r = launch("checkpoints", "space", ckpt, "--checkpoint-bytes", "1")
    assert r.returncode == 0 and "the newest on disk, iter_0000005" in r.stdout, r.stdout
    r = launch("checkpoints", "space", ckpt / "not" / "yet", "--checkpoint-bytes", "1")
    assert r.returncode == 0 and "enough" in r.stdout


def test_chain_decision(ckpt, tmp_path):
    r = launch("checkpoints", "chain", ckpt, "--train-iters", "5", "--resolved", tmp_path / "c")
    assert r.returncode == 0 and "training complete" in r.stdout
    assert "CHAIN_STATE=complete" in (tmp_path / "c").read_text()
    r = launch("checkpoints", "chain", ckpt, "--train-iters", "9", "--previous-iteration", "5",
               "--previous-job", "41")
    assert r.returncode == 5 and r.stderr.count("\n") == 1, r.stderr
    assert "no progress since job 41 started" in r.stderr and "still names iteration 5" in r.stderr
    r = launch("checkpoints", "chain", ckpt, "--train-iters", "9", "--previous-iteration", "3",
               "--previous-job", "41", "--resolved", tmp_path / "c")
    assert r.returncode == 0 and "up from 3 when job 41 started" in r.stdout
    assert "CHAIN_STATE=continue" in (tmp_path / "c").read_text()
    (ckpt / checkpoints.TRACKER).write_text("")
    r = launch("checkpoints", "chain", ckpt, "--train-iters", "9")
    assert r.returncode == 2 and "torn tracker" in r.stderr


# --------------------------------------------------------------------------- placement


def _tasks(tmp_path, devices, procids=None, extra=()):
    """One lbp_task.sh per task of one node of len(devices) tasks, all at once."""
    procs = []
    for local, dev in enumerate(devices):
        env = dict(os.environ, PYTHONPATH=str(REPO), SLURM_PROCID=str((procids or range(99))[local]),
                   SLURM_NTASKS=str(len(devices)), SLURM_LOCALID=str(local), SLURM_NODEID="0",
                   SLURMD_NODENAME="frontier00001", SLURM_JOB_ID="77", SLURM_STEP_ID="3",
                   ROCR_VISIBLE_DEVICES=dev, CUDA_VISIBLE_DEVICES=dev, GPU_DEVICE_ORDINAL=dev,
                   LBP_TASKS_PER_NODE=str(len(devices)), LBP_GCDS_PER_PACKAGE="2",
                   LBP_GPUS_PER_TASK="1", LBP_PYTHON=PY, LBP_NODE_LOCAL_ROOT=str(tmp_path))
        probe = ("import os; print('ENV', os.environ.get('ROCR_VISIBLE_DEVICES'), "
                 "os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ.get('TRITON_CACHE_DIR'))")
        procs.append(subprocess.Popen(["bash", str(REPO / "scripts/launch/lbp_task.sh"), PY, "-c",
                                       probe, *extra], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]


def test_placement_of_frontier_closest_binding(tmp_path):
    results = _tasks(tmp_path, ["4", "5", "2", "3", "6", "7", "0", "1"])
    assert all(code == 0 for code, _, _ in results), results
    out0 = results[0][1]
    assert "placement verified: rank 0 is local rank 0 of node 0 (frontier00001); local ranks 0,1 " \
           "on devices 4,5 = package 2" in out0
    # ROCR_VISIBLE_DEVICES kept, the other visibility variables unset, Triton's cache per task
    env_line = [l for l in out0.splitlines() if l.startswith("ENV ")][0].split()
    assert env_line[1:3] == ["4", "None"]
    assert env_line[3] == str(tmp_path / "lbp-cache-77-0" / "triton")


def test_placement_refuses_a_package_split_and_ranks_out_of_order(tmp_path):
    results = _tasks(tmp_path / "a", ["4", "2", "5", "3"])
    codes = [c for c, _, _ in results]
    assert codes == [4, 4, 4, 4], results
    err = results[0][2].strip()
    assert err.count("\n") == 0 and err.startswith("lbp_task: error: placement:"), err
    assert "local ranks [0, 1] on frontier00001 form one weight group (P=2) but sit on different " \
           "packages: local rank 0 -> device 4 (package 2), local rank 1 -> device 2 (package 1)" in err
    results = _tasks(tmp_path / "b", ["4", "5", "2", "3"], procids=[0, 2, 1, 3])
    assert results[1][0] == 4 and "rank 2 is local rank 1 on node 0" in results[1][2]
    results = _tasks(tmp_path / "c", ["4", "2", "5", "3"], extra=["--hier-allow-non-colocated"])
    assert [c for c, _, _ in results] == [0, 0, 0, 0]
    assert "warning (--hier-allow-non-colocated)" in results[0][2]


def test_placement_refuses_a_task_that_sees_several_devices(tmp_path):
    results = _tasks(tmp_path, ["4,5", "2,3"])
    assert results[0][0] == 4 and "sees 2 devices (ROCR_VISIBLE_DEVICES=4,5)" in results[0][2]


def test_pci_locations_against_the_layout():
    bus = health.FRONTIER_BUS_IDS.split(",")
    recs = [{"rank": r, "host": "n1", "pci_bus": b, "rocr": str(g)}
            for r, (g, b) in enumerate(zip([4, 5, 2, 3, 6, 7, 0, 1],
                                           ["d1", "d6", "c9", "ce", "d9", "de", "c1", "c6"]))]
    assert "match" in health.check_pci(recs, 8, 2, bus)
    recs[1] = {**recs[1], "pci_bus": "c9"}
    with pytest.raises(health.HealthError, match="ROCR_VISIBLE_DEVICES=5 but its device is on PCI bus c9"):
        health.check_pci(recs, 8, 2, bus)


# --------------------------------------------------------------------------- health


def test_health_verdict_names_slow_nodes():
    # 3 nodes x 2 ranks; network pairs: round 0 (node0, node1), round 1 (node1, node2)
    assert health.network_rounds(3) == [[(0, 1)], [(1, 2)]]
    assert health.network_rounds(4) == [[(0, 1), (2, 3)], [(1, 2), (3, 0)]]
    assert health.network_rounds(2) == [[(0, 1)]] and health.network_rounds(1) == []
    hosts = [f"node{n}" for n in range(3) for _ in range(2)]
    samples = {"package": {r: 150.0 for r in range(6)},
               "network0": {0: 12.0, 1: 12.0, 2: 12.0, 3: 12.0},
               "network1": {2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}}
    samples["package"][4] = 3.0
    sizes = {c: "x" for c in health.CLASSES}
    lines, slow = health.evaluate(samples, hosts, 2, {"package": 200, "node": 50, "network": 12.5},
                                  0.25, sizes)
    # node2: its package is slow and its only network pair is; node1 has a good pair left
    assert list(slow) == ["node2"], slow
    assert slow["node2"] == ["package 3 GB/s", "network 1 GB/s with node1"]
    assert any(l.startswith("package:") and "slowest 3 GB/s on node2" in l for l in lines)
    assert any(l.startswith("network:") and "slowest 1 GB/s between node1 and node2" in l
               for l in lines)


def _health_rank(argv, hosts):
    """One rank of the health check (run_on_ranks): (status, stdout, stderr)."""
    env = dict(os.environ, SLURMD_NODENAME=hosts[int(os.environ["RANK"])])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = health.main(argv, env)
    return code, out.getvalue(), err.getvalue()


def test_health_check_on_real_ranks(tmp_path):
    """2 emulated nodes x 2 ranks: one all-gather per link class, the measured figures written
    for the estimate (--links-out), and a refusal naming nodes."""
    hosts = ["nodeA", "nodeA", "nodeB", "nodeB"]
    base = ["--tasks-per-node", "2", "--gcds-per-package", "2", "--gpus-per-task", "0",
            "--megabytes", "0.25"]
    links = tmp_path / "links.json"
    res = run_on_ranks(_health_rank, 4, base + ["--expect", "package=0.0001,network=0.0001",
                                                "--links-out", str(links)],
                       hosts, init_process_group=False, timeout=240)
    assert [c for c, _, _ in res] == [0, 0, 0, 0], res
    out = res[0][1]
    # the file holds the medians the check printed (3 significant digits there)
    measured = health.read_links(str(links))
    assert set(measured) == {"package", "network"}, measured
    for cls, bw in measured.items():
        printed = float(re.search(rf"\[lbp health\] {cls}: .*?median ([\d.e+-]+) GB/s", out).group(1))
        assert bw / 1e9 == pytest.approx(printed, rel=5e-3), (cls, bw, printed)
    assert "[lbp health] 2 node(s) x 2 ranks, torch" in out and "backend gloo" in out
    assert "[lbp health] package: all-gather of 0.25 MiB per rank" in out
    assert "[lbp health] network: " in out and "between nodeA and nodeB" in out
    assert "node:" not in out          # nodes of one package: no separate node class
    res = run_on_ranks(_health_rank, 4, base + ["--expect", "package=1e6,network=0.0001"],
                       hosts, init_process_group=False, timeout=240)
    assert [c for c, _, _ in res] == [4, 4, 4, 4]
    err = res[0][2].strip()
    assert err.count("\n") == 0 and err.startswith("lbp_health: error: slow links on 2 node(s)")
    assert "sbatch -x nodeA,nodeB" in err and res[1][2] == ""


def test_gpu_profile_refuses_a_cpu_torch(capsys):
    import torch

    if torch.version.hip:
        pytest.skip("a ROCm torch is installed here")
    assert health.main(["--build-only", "--require-gpu", "rocm", "--devices-per-node", "8"], {}) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"torch {torch.__version__} (torch.version.hip=None, torch.version.cuda=" in err
    assert "needs the ROCm build" in err and "GPUS_PER_TASK=0" in err
    assert health.main(["--build-only", "--require-gpu", "none"], {}) == 0
    assert "no GPU required" in capsys.readouterr().out


def test_megatrons_exit_clock_starts_at_the_launch(monkeypatch):
    """LBP_LAUNCH_TIME: --exit-duration-in-mins counts from when the launcher measured the time left."""
    from megatron.training import training

    from megatron_lbp.integration import training_hooks

    saved = training._TRAIN_START_TIME, dict(training._STARTUP_TIMESTAMPS)
    try:
        launched = time.time() - 90
        monkeypatch.setenv("LBP_LAUNCH_TIME", str(launched))
        training_hooks.start_clock_at_launch()
        assert training._TRAIN_START_TIME == launched
        assert training._STARTUP_TIMESTAMPS["program_start"] == launched
        for bad in ("", "soon", str(time.time() + 3600)):   # unset, garbage, the future: no change
            training.set_startup_timestamps(program_start=123.0)
            monkeypatch.setenv("LBP_LAUNCH_TIME", bad)
            training_hooks.start_clock_at_launch()
            assert training._TRAIN_START_TIME == 123.0
    finally:
        training._TRAIN_START_TIME = saved[0]
        training._STARTUP_TIMESTAMPS.clear()
        training._STARTUP_TIMESTAMPS.update(saved[1])
