"""An inf/nan gradient on one rank: every rank agrees, names that rank, and reacts as Megatron does.

8 real gloo ranks (2 nodes x 2 packages x 2 GCDs), the tiny GPT through the
engine; a real autograd hook writes inf or nan into one element of one rank's
word-embedding gradient at step 1 (iteration 2), so the poison travels the
engine's own path (bucket, reduce-scatter in the node, cross-node reduce).
"""
import math

from megatron_lbp.engine import faults
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from tests.helpers.fault_fns import TOPOLOGY_ARGS, launch_pretrain, poisoned_step
from tests.helpers.pretrain_runner import TINY

WORLD = 8
TOPOLOGY = rank_location_env(4)


def test_fp16_loss_scaling_skips_the_step_and_backs_off_on_every_rank():
    ranks = run_on_ranks(poisoned_step, WORLD, 3, 1, 3, TOPOLOGY_ARGS, True, False, math.inf,
                         rank_env=TOPOLOGY)
    for r, res in enumerate(ranks):
        assert res["error"] is None, f"rank {r} raised: {res['error']}"
        assert res["steps"] == ranks[0]["steps"], (
            f"rank {r} saw other steps than rank 0:\n {res['steps']}\n {ranks[0]['steps']}")
    s0, s1, s2 = ranks[0]["steps"]
    assert (s0["applied"], s1["applied"], s2["applied"]) == (True, False, True), ranks[0]["steps"]
    assert s1["nonfinite_ranks"] == [3], f"reported {s1['nonfinite_ranks']}, poisoned rank 3"
    assert s0["nonfinite_ranks"] == [] and s2["nonfinite_ranks"] == []
    assert s2["scale_before"] == s1["scale_before"] / 2, (
        f"loss scale {s1['scale_before']} -> {s2['scale_before']}, expected a halving")


def test_check_for_nan_stops_every_rank_naming_the_poisoned_rank():
    ranks = run_on_ranks(poisoned_step, WORLD, 5, 1, 3, TOPOLOGY_ARGS, False, True, math.nan,
                         rank_env=TOPOLOGY)
    for r, res in enumerate(ranks):
        assert res["error"] is not None, f"rank {r} did not stop: {res['steps']}"
        assert res["ranks"] == [5], f"rank {r} blamed {res['ranks']}, poisoned rank 5"
        assert "iteration 2: inf/nan gradient produced by rank(s) [5]" in res["error"], res["error"]
        assert [s["applied"] for s in res["steps"]] == [True], f"rank {r}: {res['steps']}"


def test_without_poison_nothing_is_reported():
    ranks = run_on_ranks(poisoned_step, WORLD, -1, 1, 2, TOPOLOGY_ARGS, False, True, math.nan,
                         rank_env=TOPOLOGY)
    for r, res in enumerate(ranks):
        assert res["error"] is None and all(s["applied"] and not s["nonfinite_ranks"]
                                            for s in res["steps"]), f"rank {r}: {res}"


def test_training_entry_stops_every_rank_naming_the_poisoned_rank(tmp_path, demo_dataset):
    """Through python -m megatron_lbp.pretrain_gpt (one process per rank, as srun starts them),
    Megatron's default --check-for-nan-in-loss-and-grad: rank 3 writes a nan into its own
    gradient at iteration 3 (LBP_FAULT_INJECT action=nan); every rank stops non-zero, naming it."""
    argv = TINY + ["--data-path", demo_dataset, "--train-iters", "6", "--global-batch-size", "8",
                   "--hier-partition", "--hier-gpus-per-node", "2"]
    result_file = tmp_path / "result.json"
    runs = launch_pretrain(argv, 4, tmp_path,
                           env={faults.INJECT_ENV: "rank=3,phase=grad_reduce,iteration=3,action=nan",
                                "LBP_RESULT_FILE": str(result_file)},
                           rank_env=rank_location_env(2), deadline_s=300)
    assert " iteration        2/" in runs[3].output, runs[3].output[-3000:]
    assert "writes a nan into its gradient" in runs[3].output, runs[3].output[-3000:]
    for r in runs:
        assert r.exitcode not in (None, 0), f"rank {r.rank} ended with {r.exitcode}:\n{r.output[-3000:]}"
        assert "iteration 3: inf/nan gradient produced by rank(s) [3]" in r.output, (
            f"rank {r.rank} does not name rank 3 at iteration 3:\n{r.output[-3000:]}")
        assert " iteration        3/" not in r.output, f"rank {r.rank} logged iteration 3"
    # The study's result file (megatron_lbp/integration/study_result.py) records the failed run and why.
    from megatron_lbp.integration.study_result import load

    r = load(str(result_file))
    assert r["status"] == "failed" and "inf/nan gradient produced by rank(s) [3]" in r["reason"], r
    assert sorted(r["loss"]) == ["1", "2"] and r["scheme"] == "lbp" and r["gcds"] == 4, r
