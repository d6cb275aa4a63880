"""python -m megatron_lbp.pretrain_gpt on real gloo ranks: the hierarchy trains like stock Megatron.

Losses are read from Megatron's own iteration log, printed with 7 significant
digits, so "equal" means equal at that precision.
"""
import pytest

from megatron_lbp.testing.optimizer_state import checkpoint_optimizer_state, state_differences
from tests.pretrain_runner import TINY, demo_data, run_pretrain, why
from tests.test_reshard_optimizer_state import AFTER_RESHARD_REL

PRINT_REL = 2e-6   # two units in the 7th significant digit


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return demo_data(tmp_path_factory.mktemp("data"))


def _args(data, iters, *extra, gbs=16):
    return TINY + ["--data-path", data, "--train-iters", str(iters),
                   "--global-batch-size", str(gbs), *extra]


def close(a, b):
    return abs(a - b) <= PRINT_REL * abs(b)


def test_hierarchy_equals_stock_distributed_optimizer_for_20_iterations(data):
    code, log, stock = run_pretrain(8, _args(data, 20, "--use-distributed-optimizer"))
    assert code == 0, why(log)
    code, log, lbp = run_pretrain(8, _args(data, 20, "--hier-partition", "--hier-gpus-per-node", "4"))
    assert code == 0, why(log)
    assert "megatron-lbp hierarchy (lbp): W=8 P=2 S=off G=4 O=8" in log, log[-3000:]
    assert "[megatron-lbp] sharded initialization: the model was built one module" in log
    assert "[megatron-lbp] iteration       20 | bytes sent/step" in log
    assert sorted(lbp) == sorted(stock) == list(range(1, 21)), (sorted(lbp), sorted(stock))
    bad = [(i, lbp[i], stock[i]) for i in stock if not close(lbp[i], stock[i])]
    assert not bad, f"iterations whose loss differs (lbp, stock): {bad}"
    assert stock[20] < stock[1] - 0.5, f"loss did not fall: {stock}"


def test_resume_and_reshard_through_megatrons_checkpointing(data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    lbp = ["--hier-partition", "--hier-gpus-per-node", "4", "--ckpt-format", "torch_dist"]
    code, log, straight = run_pretrain(8, _args(data, 6, *lbp, "--save", ckpt, "--save-interval", "3"))
    assert code == 0, why(log)
    assert "successfully saved checkpoint from iteration       3" in log, log[-3000:]

    code, log, resumed = run_pretrain(8, _args(data, 6, *lbp, "--load", ckpt, "--ckpt-step", "3"))
    assert code == 0, why(log)
    assert sorted(resumed) == [4, 5, 6], resumed
    # Megatron does not reset its loss accumulator after the first iteration of a
    # resumed run, so iteration 5 logs the mean of 4 and 5; 4 and 6 are exact.
    assert resumed[4] == straight[4] and resumed[6] == straight[6], (resumed, straight)
    assert close(resumed[5], (straight[4] + straight[5]) / 2), (resumed, straight)

    # The same checkpoint under zero2 on 4 ranks (same global batch): the three steps after
    # it, and the optimizer state it saves after them, match the uninterrupted run's.
    ckpt4 = str(tmp_path / "ckpt4")
    code, log, on4 = run_pretrain(4, _args(data, 6, "--hier-partition", "--hier-preset", "zero2",
                                           "--ckpt-format", "torch_dist", "--load", ckpt,
                                           "--ckpt-step", "3", "--save", ckpt4,
                                           "--save-interval", "3"))
    assert code == 0, why(log)
    assert sorted(on4) == [4, 5, 6], on4
    assert close(on4[4], straight[4]) and close(on4[6], straight[6]), (on4, straight)
    assert close(on4[5], (straight[4] + straight[5]) / 2), (on4, straight)
    # 3 fp32 steps on another world size: rounding only (see test_reshard_optimizer_state,
    # which also compares the state bit for bit right after each load).
    differences = state_differences(checkpoint_optimizer_state(f"{ckpt4}/iter_0000006"),
                                    checkpoint_optimizer_state(f"{ckpt}/iter_0000006"),
                                    AFTER_RESHARD_REL)
    assert not differences, "\n".join(differences)
