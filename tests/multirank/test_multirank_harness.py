"""The harness must turn every way ranks go wrong into a fast, clear test failure."""
import subprocess
import sys
import tempfile

import pytest

from megatron_lbp.testing.multirank import MultiRankError, rank_location_env, run_on_ranks
from tests.helpers import ranks_fns


def test_collects_every_rank_result_in_rank_order(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = run_on_ranks(ranks_fns.rank_and_sum, 4, env={"LBP_TEST_TAG": "x"}, timeout=60)
    assert out == [(r, 4, 10.0, "x") for r in range(4)], f"per-rank results were {out}"
    with pytest.raises(MultiRankError):
        run_on_ranks(ranks_fns.exit_hard_on_rank, 2, 1, timeout=60)
    # the per-run directory of stack files goes with the run, failed or not
    assert list(tmp_path.glob("lbp-ranks-*")) == [], list(tmp_path.iterdir())


def test_ranks_start_from_the_preloaded_forkserver():
    # Every rank of the session forks from one server; cold, each would import megatron
    # itself (seconds per rank, on every run of the suite).
    assert run_on_ranks(ranks_fns.started_warm, 2, timeout=120) == [True, True], \
        "ranks started without megatron imported: the forkserver runs without its preload"


def test_a_forkserver_started_without_the_preload_is_refused():
    code = ("import multiprocessing as mp, os\n"
            "p = mp.get_context('forkserver').Process(target=os.getpid); p.start(); p.join()\n"
            "from megatron_lbp.testing.multirank import forkserver_context\n"
            "forkserver_context()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "ranks would start cold" in out.stderr, \
        (out.returncode, out.stderr[-1500:])


def test_exception_carries_rank_and_traceback_and_peers_are_killed():
    with pytest.raises(MultiRankError) as err:
        run_on_ranks(ranks_fns.fail_on_rank, 3, 1, timeout=120, error_grace_s=2)
    msg = str(err.value)
    assert "rank 1 traceback" in msg and "deliberate failure on rank 1" in msg, msg
    assert "ValueError" in msg, msg
    # The peers sat in a barrier; they must be killed after the grace period, not at the timeout
    # (the harness says which ended them: no wall clock asked here).
    assert "rank(s) [0, 2] killed 2 s after another rank failed (the grace period)" in msg, msg


@pytest.mark.slow
def test_hang_becomes_timeout_failure_with_stacks():
    with pytest.raises(MultiRankError) as err:
        run_on_ranks(ranks_fns.hang_forever_in_sleep, 2, timeout=12)
    msg = str(err.value)
    assert "did not finish within 12 s" in msg, msg
    assert "hang_forever_in_sleep" in msg, f"no stack of the hanging function in:\n{msg}"


def test_rank_dying_without_exception_is_reported():
    with pytest.raises(MultiRankError) as err:
        run_on_ranks(ranks_fns.exit_hard_on_rank, 2, 0, timeout=60)
    assert "exited with code 3" in str(err.value), str(err.value)


def test_rank_crashing_in_native_code_shows_where_it_was():
    with pytest.raises(MultiRankError) as err:
        run_on_ranks(ranks_fns.abort_in_native_code_on_rank, 2, 1, timeout=60)
    msg = str(err.value)
    assert "exited with code -6" in msg, msg
    assert "rank 1 stacks when it crashed" in msg and "abort_in_native_code_on_rank" in msg, (
        f"the aborting rank's Python stack is not in the failure:\n{msg}")


def test_rank_location_env_places_consecutive_nodes():
    env = rank_location_env(4)
    assert [env(r)["GROUP_RANK"] for r in range(8)] == ["0"] * 4 + ["1"] * 4
    assert [env(r)["LOCAL_RANK"] for r in range(8)] == ["0", "1", "2", "3"] * 2
