"""python -m megatron_lbp.pretrain_gpt on real gloo ranks: the hierarchy trains like stock Megatron.

Losses are read from Megatron's own iteration log, printed with 7 significant
digits, so "equal" means equal at that precision.

One lbp run serves both tests: its 20 iterations are compared with stock
Megatron's, and the checkpoint it saves at iteration 10 is resumed on the same
hierarchy and resharded onto zero2 on 4 ranks. The resumed runs keep
--train-iters 20 (the learning-rate schedule) and stop with --exit-interval.
"""
import pytest

from megatron_lbp.testing.optimizer_state import checkpoint_optimizer_state, state_differences
from tests.pretrain_runner import TINY, grad_norms, run_pretrain, why
from tests.test_reshard_optimizer_state import AFTER_RESHARD_REL

PRINT_REL = 2e-6   # two units in the 7th significant digit
NORM_PRINT_ABS = 1.0e-3 + 1e-9   # Megatron prints the grad norm with 3 decimals: one unit apart
ITERS, SAVED_AT = 20, 10
LBP8 = ["--hier-partition", "--hier-gpus-per-node", "4", "--ckpt-format", "torch_dist"]


def _args(data, *extra, gbs=16):
    return TINY + ["--data-path", data, "--train-iters", str(ITERS),
                   "--global-batch-size", str(gbs), *extra]


def close(a, b):
    return abs(a - b) <= PRINT_REL * abs(b)


@pytest.fixture(scope="module")
def stock(demo_dataset):
    return run_pretrain(8, _args(demo_dataset, "--use-distributed-optimizer"))


@pytest.fixture(scope="module")
def lbp(demo_dataset, tmp_path_factory):
    """(exit status, log, losses, checkpoint directory) of lbp on 8 ranks, saving every 10 iterations."""
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    return (*run_pretrain(8, _args(demo_dataset, *LBP8, "--save", ckpt,
                                   "--save-interval", str(SAVED_AT))), ckpt)


def test_hierarchy_equals_stock_distributed_optimizer_for_20_iterations(stock, lbp):
    code, log, stock_losses = stock
    assert code == 0, why(log)
    code, log, lbp_losses, _ = lbp
    assert code == 0, why(log)
    assert "megatron-lbp hierarchy (lbp): W=8 P=2 S=off G=4 O=8" in log, log[-3000:]
    assert "[megatron-lbp] sharded initialization: the model was built one module" in log
    assert "[megatron-lbp] iteration       20 | bytes sent/step" in log
    assert sorted(lbp_losses) == sorted(stock_losses) == list(range(1, 21)), (
        sorted(lbp_losses), sorted(stock_losses))
    bad = [(i, lbp_losses[i], stock_losses[i]) for i in stock_losses
           if not close(lbp_losses[i], stock_losses[i])]
    assert not bad, f"iterations whose loss differs (lbp, stock): {bad}"
    # Adam and clipping hide a gradient-scale error from the losses, not from the norm.
    lbp_norms, stock_norms = grad_norms(log), grad_norms(stock[1])
    assert sorted(lbp_norms) == sorted(stock_norms) == list(range(1, 21)), (lbp_norms, stock_norms)
    bad = [(i, lbp_norms[i], stock_norms[i]) for i in stock_norms
           if abs(lbp_norms[i] - stock_norms[i]) > NORM_PRINT_ABS]
    assert not bad, f"iterations whose grad norm differs (lbp, stock): {bad}"
    assert stock_losses[20] < stock_losses[1] - 0.5, f"loss did not fall: {stock_losses}"


def test_resume_and_reshard_through_megatrons_checkpointing(demo_dataset, lbp, tmp_path):
    code, log, straight, ckpt = lbp
    assert code == 0, why(log)
    assert f"successfully saved checkpoint from iteration {SAVED_AT:7d}" in log, log[-3000:]
    first = SAVED_AT + 1

    ckpt_resumed = str(tmp_path / "ckpt_resumed")
    code, log, resumed = run_pretrain(8, _args(demo_dataset, *LBP8, "--load", ckpt, "--ckpt-step",
                                               str(SAVED_AT), "--save", ckpt_resumed, "--save-interval",
                                               str(SAVED_AT + 3), "--exit-interval", str(SAVED_AT + 3)))
    assert code == 0, why(log)
    assert sorted(resumed) == [first, first + 1, first + 2], resumed
    # Megatron does not reset its loss accumulator after the first iteration of a
    # resumed run, so the second logs the mean of the first two; the others are exact.
    assert resumed[first] == straight[first] and resumed[first + 2] == straight[first + 2], (
        resumed, straight)
    assert close(resumed[first + 1], (straight[first] + straight[first + 1]) / 2), (resumed, straight)

    # The same checkpoint under zero2 on 4 ranks (same global batch): the three steps after
    # it, and the optimizer state it saves after them, match the lbp run's. The lbp
    # reference state is the resumed run's save at the same iteration: its losses equal
    # the uninterrupted run's exactly (above), and it needs no extra launch.
    last = first + 2
    ckpt4 = str(tmp_path / "ckpt4")
    code, log, on4 = run_pretrain(4, _args(demo_dataset, "--hier-partition", "--hier-preset", "zero2",
                                           "--ckpt-format", "torch_dist", "--load", ckpt,
                                           "--ckpt-step", str(SAVED_AT), "--save", ckpt4,
                                           "--save-interval", str(last), "--exit-interval", str(last)))
    assert code == 0, why(log)
    assert sorted(on4) == [first, first + 1, last], on4
    assert close(on4[first], straight[first]) and close(on4[last], straight[last]), (on4, straight)
    assert close(on4[first + 1], (straight[first] + straight[first + 1]) / 2), (on4, straight)
    # 3 fp32 steps on another world size: rounding only (see test_reshard_optimizer_state,
    # which also compares the state bit for bit right after each load).
    differences = state_differences(checkpoint_optimizer_state(f"{ckpt4}/iter_{last:07d}"),
                                    checkpoint_optimizer_state(f"{ckpt_resumed}/iter_{last:07d}"),
                                    AFTER_RESHARD_REL)
    assert not differences, "\n".join(differences)
