"""A rank killed mid-step: every survivor exits non-zero, in bounded time, naming it and the phase.

Real gloo ranks as plain processes (tests/fault_fns.launch: nobody kills the
survivors for us), 8 ranks placed as 2 nodes x 2 packages x 2 GCDs, the tiny
GPT trained through the engine; LBP_FAULT_INJECT makes one rank SIGKILL itself
right before a collective of the given phase at iteration 2. The bound a
survivor must meet is the hierarchy's collective timeout (60 s here) plus a
margin: a survivor that relied on that timeout instead of the diagnosis would
show up as a detection time near 60 s in the printed numbers.
"""
import pytest

from megatron_lbp.engine import faults
from megatron_lbp.testing.multirank import rank_location_env
from tests.helpers.fault_fns import TOPOLOGY_ARGS, launch, launch_pretrain, train_tiny
from tests.helpers.pretrain_runner import TINY

WORLD = 8
CHECKIN_S = 3
COLLECTIVE_TIMEOUT_S = 60
ARGS = TOPOLOGY_ARGS + ["--hier-fault-checkin-s", str(CHECKIN_S),
                        "--hier-collective-timeout-s", str(COLLECTIVE_TIMEOUT_S)]
# Start-up of 8 ranks on a 2-core machine, plus the bound, plus slack.
DEADLINE_S = 90 + COLLECTIVE_TIMEOUT_S


def kill_and_watch(tmp_path, victim: int, phase: str):
    runs = launch(train_tiny, (3, ARGS), WORLD, tmp_path,
                  env={faults.INJECT_ENV: f"rank={victim},phase={phase},iteration=2"},
                  rank_env=rank_location_env(4), deadline_s=DEADLINE_S)
    return check_survivors(runs, victim, phase, iteration=2)


def check_survivors(runs, victim: int, phase: str, iteration: int):
    dead = runs[victim]
    assert dead.exitcode == -9, (
        f"rank {victim} was to SIGKILL itself before {phase} but ended with {dead.exitcode}:\n"
        f"{dead.output[-2000:]}")
    assert "fault injection" in dead.output
    hung = [r.rank for r in runs if r.exitcode is None]
    assert not hung, (f"rank(s) {hung} still running {DEADLINE_S} s after launch (hang); "
                      f"rank {hung[0]} log tail:\n{runs[hung[0]].output[-3000:]}")
    detection, exits = {}, {}
    for r in runs:
        if r.rank == victim:
            continue
        assert r.exitcode != 0, (
            f"rank {r.rank} exited 0 after losing rank {victim}:\n{r.output[-2000:]}")
        lines = [l for l in r.output.splitlines() if l.startswith("[megatron-lbp] rank ")]
        assert lines, f"rank {r.rank}: no diagnosis line:\n{r.output[-2000:]}"
        # A second line can only be the monitor ending a main thread stuck after the verdict.
        assert all("still running" in l for l in lines[1:]), f"rank {r.rank}: {lines}"
        want = f"[megatron-lbp] rank {r.rank} lost rank(s) [{victim}] during {phase} "
        assert lines[0].startswith(want) and f"at iteration {iteration} " in lines[0], (
            f"rank {r.rank} said\n  {lines[0]}\nexpected it to start with\n  {want}")
        detection[r.rank] = r.said_at - dead.ended_at
        exits[r.rank] = r.ended_at - dead.ended_at
        assert exits[r.rank] < COLLECTIVE_TIMEOUT_S, (
            f"rank {r.rank} took {exits[r.rank]:.1f} s, as long as the collective timeout")
    print(f"\n{phase}: rank {victim} killed; survivors named it after "
          f"{min(detection.values()):.1f}-{max(detection.values()):.1f} s and exited after "
          f"{min(exits.values()):.1f}-{max(exits.values()):.1f} s "
          f"(check-in window {CHECKIN_S} s): {lines[0]}")
    return runs


def test_rank_killed_in_grad_reduce_is_named_by_every_survivor(tmp_path):
    kill_and_watch(tmp_path, victim=6, phase="grad_reduce")


@pytest.mark.slow
@pytest.mark.parametrize("victim, phase", [
    (3, "forward_gather"),
    (5, "step_reduce"),
    (2, "step_gather"),
])
def test_rank_killed_in_each_phase(tmp_path, victim, phase):
    kill_and_watch(tmp_path, victim, phase)


@pytest.mark.slow
def test_store_host_killed(tmp_path):
    """Rank 0 hosts the rendezvous store: with it gone, the survivors say so and name rank 0."""
    runs = launch(train_tiny, (3, ARGS), WORLD, tmp_path,
                  env={faults.INJECT_ENV: "rank=0,phase=forward_gather,iteration=2"},
                  rank_env=rank_location_env(4), deadline_s=DEADLINE_S)
    assert runs[0].exitcode == -9
    for r in runs[1:]:
        assert r.exitcode not in (0, None), f"rank {r.rank}: exit {r.exitcode}\n{r.output[-2000:]}"
        assert f"[megatron-lbp] rank {r.rank} lost rank(s) [0] during " in r.output
        assert "rendezvous store rank 0 hosts no longer answers" in r.output


def test_injection_spec_is_checked():
    assert faults.parse_injection("rank=3,phase=grad_reduce,iteration=2") == {
        "rank": 3, "phase": "grad_reduce", "iteration": 2, "action": "kill"}
    assert faults.parse_injection("rank=1,phase=grad_reduce,iteration=2,action=nan")["action"] \
        == "nan"
    for bad in ("rank=3,phase=grad_reduce", "rank=3,phase=x,iteration=2,action=explode",
                "rank=3,phase=x,iteration=2,when=now",
                "rank=3,phase=forward_gather,iteration=2,action=nan"):
        with pytest.raises(ValueError, match=faults.INJECT_ENV):
            faults.parse_injection(bad)


@pytest.mark.slow
def test_rank_killed_under_the_training_entry(tmp_path, demo_dataset):
    """python -m megatron_lbp.pretrain_gpt per rank (as srun starts tasks), rank 6 killed in
    grad_reduce at Megatron's iteration 3: the survivors leave megatron.training with the line."""
    argv = TINY + ["--data-path", demo_dataset, "--train-iters", "6", "--global-batch-size", "16",
                   "--hier-partition", "--hier-gpus-per-node", "4",
                   "--hier-fault-checkin-s", str(CHECKIN_S),
                   "--hier-collective-timeout-s", str(COLLECTIVE_TIMEOUT_S)]
    runs = launch_pretrain(argv, WORLD, tmp_path,
                           env={faults.INJECT_ENV: "rank=6,phase=grad_reduce,iteration=3"},
                           rank_env=rank_location_env(4), deadline_s=240 + COLLECTIVE_TIMEOUT_S)
    assert " iteration        2/" in runs[7].output, runs[7].output[-3000:]
    check_survivors(runs, victim=6, phase="grad_reduce", iteration=3)


@pytest.mark.slow
def test_rank_stuck_alive_fails_the_others_after_the_collective_timeout(tmp_path):
    """Rank 6 hangs (alive) before grad_reduce: its peers give up after
    --hier-collective-timeout-s, everyone checks in, nobody is called lost, and the stuck
    rank itself is ended once the verdict is out."""
    timeout_s = 10
    args = TOPOLOGY_ARGS + ["--hier-fault-checkin-s", str(CHECKIN_S),
                            "--hier-collective-timeout-s", str(timeout_s)]
    runs = launch(train_tiny, (3, args), WORLD, tmp_path,
                  env={faults.INJECT_ENV: "rank=6,phase=grad_reduce,iteration=2,action=hang"},
                  rank_env=rank_location_env(4), deadline_s=DEADLINE_S)
    hung = [r.rank for r in runs if r.exitcode is None]
    assert not hung, (
        f"rank(s) {hung} still running at the deadline:\n{runs[hung[0]].output[-3000:]}")
    for r in runs:
        assert r.exitcode != 0, f"rank {r.rank} exited 0:\n{r.output[-2000:]}"
        lines = [l for l in r.output.splitlines() if l.startswith("[megatron-lbp] rank ")]
        assert "but every rank is alive" in lines[0], (r.rank, lines)
        assert "Timed out" in lines[0] and " in grad_reduce" in lines[0], lines[0]
    assert "still running" in runs[6].output, runs[6].output[-2000:]  # ended by its monitor
    stuck_exit = runs[6].ended_at - min(r.ended_at for r in runs if r.rank != 6)
    print(f"\nstuck rank 6: peers exited at {min(r.ended_at for r in runs):.1f}-"
          f"{max(r.ended_at for r in runs if r.rank != 6):.1f} s after launch, rank 6 "
          f"{stuck_exit:.1f} s after the first of them: {lines[0]}")
