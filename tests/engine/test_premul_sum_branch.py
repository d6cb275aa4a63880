"""The branch a GPU takes for the 1/W gradient scaling (NCCL/RCCL's PREMUL_SUM), run on CPU ranks.

On gloo the engine scales each unit's gradient in the pass that also counts this
rank's inf/nan; with PREMUL_SUM the reduce-scatter scales it, and the inf/nan
verdict comes from the optimizer's pass over the reduced gradients alone: a
rank's own count, a read pass of its own, is made only where the rank is to be
named (--check-for-nan-in-loss-and-grad, as stock Megatron's check_grads). Here
the engine's PREMUL_SUM seam is replaced by an exact gloo emulation
(tests/helpers/premul_sum_gloo.py); the rest of the branch runs for real.

6 gloo ranks as 3 nodes x 2 GCDs, lbp P=2 G=2 (the G-group reduce-scatter over
2 ranks), the tiny GPT, all configurations in one launch. W = 6 so that 1/W is
no power of two: scaling rounds, and bit-identity checks that both branches
round the same way (an emulation multiplying in fp64 and rounding once would
differ in about a third of the elements).

- fp32, 2 steps of 2 micro-batches, each branch: bit-identical losses, gradient
  norms and final weights; the fold branch really ran (folds_prescale, every
  reduce-scatter through PREMUL_SUM, no count pass, no scaling pass);
- fp16 with dynamic loss scaling, a nan written into rank 3's gradient at
  iteration 2 (LBP_FAULT_INJECT action=nan), 3 steps of 1 micro-batch: on both
  branches the step is skipped and the scale halves, the same losses, scales
  and weights, and the fold branch made no count pass;
- fp32 with the nan check, the same nan: the fold branch stops naming rank 3 (as
  the gloo branch does: tests/multirank/test_faults_nan.py), one count pass per unit gradient;
- the tests of the tests (tests/helpers/broken_engine.py): a PREMUL_SUM that multiplies
  in fp64 fails the bit-identity check; the fold branch with a verdict that
  ignores the reduced gradients misses the nan.
"""
from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from megatron_lbp.engine import faults
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks

WORLD = 6
POISONED_RANK = 3
LBP = ["--hier-preset", "lbp", "--hier-param-group-size", "2", "--hier-grad-group-size", "2"]
NAN_AT = f"rank={POISONED_RANK},phase=grad_reduce,iteration=2,action=nan"

# name: (fold branch, fp16 with loss scaling, nan check, nan injected, broken engine)
CONFIGS = {
    "gloo": (False, False, False, False, None),
    "fold": (True, False, False, False, None),
    "gloo-fp16-nan": (False, True, False, True, None),
    "fold-fp16-nan": (True, True, False, True, None),
    "fold-check-nan": (True, False, True, True, None),
    # tests of the tests (tests/helpers/broken_engine.py)
    "fold-fp64-product": (True, False, False, False, "premul_sum_rounding_in_fp64"),
    "fold-fp16-nan-blind": (True, True, False, True, "reduced_check_ignores_nonfinite"),
}


def _train(fold, fp16, check_nan, nan, broken):
    from megatron_lbp.engine.optimizer import NonFiniteGradientError
    from megatron_lbp.testing.fp16_training import (FP16_SPEC, LossScaleSpec, run_fp16,
                                                    setup_hier_fp16)
    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, setup_hier
    from tests.helpers import broken_engine
    from tests.helpers.premul_sum_gloo import CALLS, counting_passes, premul_sum_on_gloo

    # One micro-batch per step where a nan is injected: what is checked there is the verdict.
    train = TrainSpec(steps=3 if nan else 2, micro_batches=1 if nan else 2, bucket_size=20000)
    if nan:
        os.environ[faults.INJECT_ENV] = NAN_AT   # read when the engine is built
    faults.TRACKER.iteration = 1                 # each training counts its iterations from 1
    printed = io.StringIO()
    with contextlib.ExitStack() as stack:
        if fold:
            stack.enter_context(premul_sum_on_gloo())
        if broken is not None:
            stack.enter_context(getattr(broken_engine, broken)())
        stack.enter_context(counting_passes())
        if fp16:
            trainer = setup_hier_fp16(FP16_SPEC, train, LossScaleSpec(
                initial_loss_scale=4096.0, hysteresis=1), LBP)
        else:
            trainer = setup_hier(TinyGPTSpec(), train, LBP)
        os.environ.pop(faults.INJECT_ENV, None)
        trainer.optimizer.check_for_nan_in_grad = check_nan
        got = {"folds_prescale": trainer.model.ctx.folds_prescale("grad"),
               "counts_own": trainer.model.ctx.health.counts_own, "error": None}
        try:
            with contextlib.redirect_stdout(printed):
                result = run_fp16(trainer, range(train.steps))
            got.update(losses=result.losses, scales=result.scales, applied=result.applied,
                       grad_norms=result.grad_norms, params=result.params)
        except NonFiniteGradientError as err:
            got.update(error=str(err), ranks=err.ranks)
        got["calls"] = dict(CALLS)
    got["printed"] = printed.getvalue()
    return got


def _all_branches():
    return {name: _train(*flags) for name, flags in CONFIGS.items()}


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_all_branches, WORLD, rank_env=rank_location_env(2), timeout=600)


def assert_same_training(a, b, label):
    """Bit-identical losses, gradient norms, loss scales, skipped steps and final weights."""
    for what in ("losses", "grad_norms", "scales", "applied"):
        assert a[what] == b[what], f"{label}: {what} {a[what]} != {b[what]}"
    assert a["params"].keys() == b["params"].keys() and a["params"], label
    differ = [n for n, w in a["params"].items() if not torch.equal(w, b["params"][n])]
    assert not differ, f"{label}: final weights differ: {differ[:4]}"


def assert_skipped_and_backed_off(got, label):
    """The poisoned step (the second) is skipped and the loss scale halves; the rest apply."""
    assert got["error"] is None, f"{label}: raised {got['error']}"
    assert got["applied"] == [True, False, True], f"{label}: applied per step {got['applied']}"
    first, poisoned, after = got["scales"]
    assert poisoned == first and after == poisoned / 2, (
        f"{label}: loss scale per step {got['scales']}, expected a halving after step 2")
    assert all(torch.isfinite(w).all() for w in got["params"].values()), (
        f"{label}: a non-finite weight after the run")


def test_the_fold_branch_runs_without_a_count_pass_and_trains_bit_identically(ranks):
    for r, got in enumerate(ranks):
        gloo, fold = got["gloo"], got["fold"]
        assert gloo["folds_prescale"] is False and fold["folds_prescale"] is True, (r, gloo, fold)
        # 4 units (embedding, 2 layers, output) x 2 micro-batches x 2 steps, one read each
        assert gloo["calls"] == {"scale_pass": 16}, f"rank {r} gloo: {gloo['calls']}"
        assert fold["calls"] == {"premul_sum": 16}, (
            f"rank {r}: the fold branch made other passes than the collective: {fold['calls']}")
        assert fold["counts_own"] is False, f"rank {r}: counts its own inf/nan with no nan check"
        assert_same_training(fold, gloo, f"rank {r}, PREMUL_SUM vs scaling pass")


def test_an_inf_on_one_rank_skips_the_step_and_backs_off_on_both_branches(ranks):
    for r, got in enumerate(ranks):
        for name in ("gloo-fp16-nan", "fold-fp16-nan"):
            assert_skipped_and_backed_off(got[name], f"rank {r} {name}")
        assert got["fold-fp16-nan"]["calls"].get("count_pass", 0) == 0, got["fold-fp16-nan"]
        assert_same_training(got["fold-fp16-nan"], got["gloo-fp16-nan"],
                             f"rank {r}, fp16 with a nan, PREMUL_SUM vs scaling pass")
    # Rank 0 says what it saw: the gloo branch names the rank, the fold branch cannot.
    gloo, fold = ranks[0]["gloo-fp16-nan"]["printed"], ranks[0]["fold-fp16-nan"]["printed"]
    assert f"inf/nan gradient from rank(s) [{POISONED_RANK}]; step skipped" in gloo, gloo
    said = ("the reduced gradients are inf/nan (naming the rank(s) they came from needs "
            "--check-for-nan-in-loss-and-grad); step skipped, loss scale 4096 -> 2048")
    assert said in fold, fold
    assert "no single rank" not in fold, fold


def test_with_the_nan_check_the_fold_branch_stops_naming_the_rank(ranks):
    """As the gloo branch does (tests/multirank/test_faults_nan.py)."""
    for r, got in enumerate(ranks):
        res = got["fold-check-nan"]
        assert res["ranks"] == [POISONED_RANK], f"rank {r}: {res}"
        assert (f"iteration 2: inf/nan gradient produced by rank(s) [{POISONED_RANK}]"
                in res["error"]), res["error"]
        # The naming costs the fold branch one read of each unit gradient until it stops:
        # 4 units x 1 micro-batch x 2 iterations.
        calls = res["calls"]
        assert calls.get("count_pass") == 8 and "scale_pass" not in calls, calls


def test_identity_check_fails_when_the_collective_rounds_differently(ranks):
    """The test of the test: a PREMUL_SUM multiplying in fp64 (1/6 rounds otherwise)."""
    for r, got in enumerate(ranks):
        assert got["fold-fp64-product"]["calls"]["premul_sum"] == 16, got["fold-fp64-product"]
        with pytest.raises(AssertionError, match="losses|grad_norms|final weights"):
            assert_same_training(got["fold-fp64-product"], got["gloo"], f"rank {r}")


def test_detection_check_fails_when_the_verdict_ignores_the_reduced_gradients(ranks):
    """The test of the test: the fold branch's verdict blind to its reduced-gradient pass."""
    for got in ranks:
        with pytest.raises(AssertionError, match="applied per step"):
            assert_skipped_and_backed_off(got["fold-fp16-nan-blind"], "blind")
