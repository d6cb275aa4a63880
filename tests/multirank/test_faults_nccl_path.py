"""The NCCL fault path on CPU: the stall watch names a stuck collective before the backend's timeout.

On NCCL ``work.wait()`` returns at once and a stuck collective is only ended
by ProcessGroupNCCL's watchdog at the group's timeout, so the engine's verdict
comes from its stall watch (megatron_lbp/engine/faults.py, section 6): a
collective not completed half of ``--hier-collective-timeout-s`` after its
issue starts the check-in. ``LBP_FAULT_STALL_WATCH=1`` runs the same watch on
gloo; a hung rank keeps gloo's blocking ``wait()`` from returning until gloo's
own timeout (the stand-in for NCCL's watchdog here), so the verdict has to come
from the watch, and first.
"""
import pytest

from megatron_lbp.engine import faults
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, train_hier
from tests.helpers.fault_fns import launch, train_tiny

WORLD = 4
CHECKIN_S = 3
# gloo's timeout, the watchdog's role: the shortest faults.check_timing accepts with this
# check-in (2 x (3 + 10) s). The ranks exit at about this long after the hung collective's
# issue (gloo's wait returns, or the verdict's exit grace ends), so each second here is one
# of the test's.
TIMEOUT_S = 26
HIER = ["--hier-preset", "lbp", "--hier-param-group-size", "2", "--hier-grad-group-size", "4",
        "--hier-optim-group-size", "4"]
ARGS = HIER + ["--hier-fault-checkin-s", str(CHECKIN_S),
               "--hier-collective-timeout-s", str(TIMEOUT_S)]
WATCH = {faults.STALL_WATCH_ENV: "1"}


# Slow (30 s of waiting for the hung collective): the NCCL path's watch, run on gloo; the fast
# suite keeps its timing refusal and environment below, and the gloo path's fault tests.
@pytest.mark.slow
def test_stuck_rank_named_by_the_stall_watch_before_the_timeout(tmp_path):
    runs = launch(train_tiny, (3, ARGS), WORLD, tmp_path, rank_env=rank_location_env(4),
                  env={**WATCH, faults.INJECT_ENV: "rank=2,phase=grad_reduce,iteration=2,action=hang"},
                  deadline_s=120 + TIMEOUT_S)
    hung = [r.rank for r in runs if r.exitcode is None]
    assert not hung, f"rank(s) {hung} still running at the deadline:\n{runs[hung[0]].output[-3000:]}"
    for r in runs:
        assert r.exitcode != 0, f"rank {r.rank} exited 0:\n{r.output[-2000:]}"
        lines = [l for l in r.output.splitlines() if l.startswith("[megatron-lbp] rank ")]
        assert lines, f"rank {r.rank}: no verdict:\n{r.output[-2000:]}"
        verdict = lines[0]
        assert "but every rank is alive" in verdict and " in grad_reduce" in verdict, verdict
        assert "not completed" in verdict and "stall window" in verdict, (
            f"rank {r.rank}: the verdict did not come from the stall watch: {verdict}")
        # gloo's own timeout error (the watchdog's stand-in) may only come after the verdict.
        gloo_timeout = r.output.find("Timed out waiting")
        assert gloo_timeout == -1 or r.output.find(verdict) < gloo_timeout, (
            f"rank {r.rank}: gloo's timeout came before the verdict:\n{r.output[-3000:]}")
    said = sorted(r.said_at for r in runs)
    print(f"\nstall watch: verdict on every rank {said[0]:.1f}-{said[-1]:.1f} s after launch, "
          f"exits {min(r.ended_at for r in runs):.1f}-{max(r.ended_at for r in runs):.1f} s "
          f"(window {TIMEOUT_S / 2:g} s, check-in {CHECKIN_S} s, timeout {TIMEOUT_S} s): {verdict}")


@pytest.mark.slow
def test_training_through_the_watch_is_unchanged():
    """Every collective issued asynchronously and registered (the NCCL path) trains bit-identically."""
    spec, train = TinyGPTSpec(), TrainSpec(steps=3, micro_batches=2, bucket_size=20000)
    plain = run_on_ranks(train_hier, WORLD, spec, train, HIER, rank_env=rank_location_env(4))
    watched = run_on_ranks(train_hier, WORLD, spec, train, HIER, rank_env=rank_location_env(4),
                           env=WATCH)
    assert watched[0].losses == plain[0].losses, (watched[0].losses, plain[0].losses)
    for name, w in plain[0].params.items():
        assert watched[0].params[name].equal(w), name


def test_timing_that_cannot_put_the_verdict_first_is_refused(monkeypatch):
    faults.check_timing("nccl", 300, 15)
    faults.check_timing("gloo", 20, 15)             # gloo raises in wait(): no watch
    with pytest.raises(ValueError, match="--hier-collective-timeout-s 40 is too short") as err:
        faults.check_timing("nccl", 40, 15)
    assert "at least 50" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setenv(faults.STALL_WATCH_ENV, "1")
    with pytest.raises(ValueError):
        faults.check_timing("gloo", 20, 15)


def test_nccl_environment_is_set_before_any_process_group():
    env = {}
    lines = faults.prepare_backend_environment(["--hier-partition"], env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"} and len(lines) == 1, (env, lines)
    assert faults.prepare_backend_environment(["--hier-partition"], env) == []
    assert faults.prepare_backend_environment(
        ["--hier-partition", "--distributed-backend", "gloo"], {}) == []
    assert faults.prepare_backend_environment([], {}) == []   # stock Megatron: its defaults
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    (warning,) = faults.prepare_backend_environment(["--hier-partition"], mine)
    assert mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "warning" in warning
