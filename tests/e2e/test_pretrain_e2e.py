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
from tests.helpers.pretrain_runner import TINY, grad_norms, run_pretrain, why
from tests.engine.test_reshard_optimizer_state import AFTER_RESHARD_REL

PRINT_REL = 2e-6   # two units in the 7th significant digit
NORM_PRINT_ABS = 1.0e-3 + 1e-9   # Megatron prints the grad norm with 3 decimals: one unit apart
ITERS, SAVED_AT = 20, 10
LBP8 = ["--hier-partition", "--hier-gpus-per-node", "4", "--ckpt-format", "torch_dist"]


# Megatron features that read parameters between steps and that the engine serves, on in both
# module runs (the refused ones: tests/unit/test_capabilities.py).
SERVED_READERS = ["--log-params-norm", "--log-num-zeros-in-grad"]


def _args(data, *extra, gbs=16):
    return TINY + ["--data-path", data, "--train-iters", str(ITERS),
                   "--global-batch-size", str(gbs), *extra]


def close(a, b):
    return abs(a - b) <= PRINT_REL * abs(b)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Where both runs write their study result files (LBP_RESULT_FILE, megatron_lbp/study)."""
    return tmp_path_factory.mktemp("results")


@pytest.fixture(scope="module")
def stock(demo_dataset, results):
    return run_pretrain(8, _args(demo_dataset, "--use-distributed-optimizer", *SERVED_READERS),
                        env={"LBP_RESULT_FILE": str(results / "distopt.json")})


@pytest.fixture(scope="module")
def lbp(demo_dataset, tmp_path_factory, results):
    """(exit status, log, losses, checkpoint directory) of lbp on 8 ranks, saving every 10 iterations."""
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    return (*run_pretrain(8, _args(demo_dataset, *LBP8, *SERVED_READERS, "--save", ckpt,
                                   "--save-interval", str(SAVED_AT),
                                   "--tensorboard-dir", f"{ckpt}/tensorboard"),
                          env={"LBP_RESULT_FILE": str(results / "lbp.json")}), ckpt)


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


def _printed_per_iteration(log: str, name: str) -> dict[int, float]:
    import re

    return {int(i): float(v) for i, v in
            re.findall(rf"iteration\s+(\d+)/\s*\d+ \|.*? {name}: ([\d.]+) \|", log)}


def _assert_readers_equal(lbp_log: str, stock_log: str, iters: int) -> None:
    for name, tolerance in (("params norm", NORM_PRINT_ABS), ("num zeros", 0)):
        mine, theirs = (_printed_per_iteration(lbp_log, name),
                        _printed_per_iteration(stock_log, name))
        assert sorted(mine) == sorted(theirs) == list(range(1, iters + 1)), (name, mine, theirs)
        bad = [(i, mine[i], theirs[i]) for i in theirs if abs(mine[i] - theirs[i]) > tolerance]
        assert not bad, f"iterations whose {name} differs (lbp, stock): {bad}"
    norms = _printed_per_iteration(lbp_log, "params norm")
    assert norms[iters] != norms[1], f"the norm read does not follow the training: {norms}"


def test_params_norm_and_zero_count_equal_stock_megatrons(stock, lbp):
    """--log-params-norm and --log-num-zeros-in-grad read every weight (gradient) between steps,
    where an lbp rank holds only its slices: served from the optimizer's slices, they print
    what stock Megatron prints from its whole weights, every iteration."""
    assert lbp[0] == 0 and stock[0] == 0, why(lbp[1] if lbp[0] else stock[1])
    _assert_readers_equal(lbp[1], stock[1], ITERS)


@pytest.mark.slow
def test_zero_count_and_evaluation_between_steps_equal_stock_megatrons(demo_dataset):
    """Untied input embeddings: the rows of tokens no batch holds have zero gradients (tied ones
    do not: the output layer's softmax reaches every row), so the counts are not all 0. An
    evaluation every 2 iterations and after training reads the weights between steps, through
    the forward's gathers: its validation losses are stock Megatron's."""
    import re

    untied = ["--untie-embeddings-and-output-weights", *SERVED_READERS]
    extra = ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "2"]
    code, stock_log, _ = run_pretrain(8, _args(demo_dataset, "--use-distributed-optimizer",
                                               *untied) + extra)
    assert code == 0, why(stock_log)
    code, lbp_log, _ = run_pretrain(8, _args(demo_dataset, *LBP8, *untied) + extra)
    assert code == 0, why(lbp_log)
    assert min(_printed_per_iteration(stock_log, "num zeros").values()) > 0, stock_log[-2000:]
    _assert_readers_equal(lbp_log, stock_log, 4)
    validation = re.compile(r"validation loss at (iteration \d+[^|]*)\|.*?lm loss value: ([\dE+\-.]+)")
    mine, theirs = validation.findall(lbp_log), validation.findall(stock_log)
    assert len(theirs) == 3 and [w for w, _ in mine] == [w for w, _ in theirs], (mine, theirs)
    bad = [(w, a, b) for (w, a), (_, b) in zip(mine, theirs) if not close(float(a), float(b))]
    assert not bad, f"validation losses that differ (lbp, stock): {bad}"


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


def test_each_run_leaves_a_result_file_that_matches_its_log(stock, lbp, results):
    """The study's result files (megatron_lbp/integration/study_result.py) of the two runs above: what they
    describe, and the loss curve equal to Megatron's log line by line (7 significant digits)."""
    from megatron_lbp.integration.study_result import load

    for name, (code, log, losses, *_) in (("distopt", stock), ("lbp", lbp)):
        assert code == 0, why(log)
        r = load(str(results / f"{name}.json"))
        assert r["status"] == "ok" and r["reason"] is None, r
        assert r["scheme"] == name, (name, r["scheme"])
        assert (r["gcds"], r["nodes"], r["global_batch"], r["micro_batch_size"], r["micro_batches"]) == (
            8, 2 if name == "lbp" else 1, 16, 2, 1), r
        loss = {int(k): v for k, v in r["loss"].items()}
        assert sorted(loss) == sorted(losses) == list(range(1, ITERS + 1)), (sorted(loss), sorted(losses))
        # Megatron's line at iteration 2 prints the mean of iterations 1 and 2 (its interval sum
        # is not reset after the first log); the file keeps each iteration's own value.
        logged = {**{i: loss[i] for i in loss}, 2: (loss[1] + loss[2]) / 2}
        bad = [(i, logged[i], losses[i]) for i in losses if not close(logged[i], losses[i])]
        assert not bad, f"{name}: result-file losses differing from the log (file, log): {bad}"
        st = r["step_time"]
        assert st["warmup_iterations_excluded"] == [1, 2] and st["iterations_measured"] == ITERS - 2, st
        assert 0 < st["min_s"] <= st["median_s"] <= st["max_s"], st
        tp = r["throughput"]
        assert tp["tokens_per_s"] == pytest.approx(16 * 32 / st["median_s"]), tp
        assert tp["tflops_per_gcd"] == pytest.approx(tp["flops_per_step"] / st["median_s"] / 8 / 1e12), tp
        assert r["interface_bytes"]["source"].startswith("not measured"), r["interface_bytes"]
    lbp_r, stock_r = load(str(results / "lbp.json")), load(str(results / "distopt.json"))
    # Same model and batch: Megatron's formula gives both runs the same FLOPs per step.
    assert lbp_r["throughput"]["flops_per_step"] == stock_r["throughput"]["flops_per_step"] > 0
    assert lbp_r["group_sizes"]["param_group_size"] == 2 and lbp_r["group_sizes"]["grad_group_size"] == 4, lbp_r
    assert lbp_r["peak_memory_per_gcd"]["source"].startswith("engine ledger"), lbp_r["peak_memory_per_gcd"]
    assert lbp_r["peak_memory_per_gcd"]["allocated_bytes"] > 0
    assert lbp_r["ledger_bytes_per_step"]["network"] > 0, lbp_r["ledger_bytes_per_step"]
    assert stock_r["peak_memory_per_gcd"]["allocated_bytes"] is None, stock_r["peak_memory_per_gcd"]
    assert stock_r["ledger_bytes_per_step"]["source"].startswith("not measured"), stock_r


def _printed(text: str) -> tuple[float, float]:
    """(value in bytes, half a unit of its last printed digit) of "1.2345 GB" / "1.234 MB"."""
    number, unit = text.split()
    scale = {"GB": 1e9, "MB": 1e6}[unit]
    decimals = len(number.partition(".")[2])
    return float(number) * scale, 0.5 * 10 ** -decimals * scale


def test_tensorboard_has_megatrons_scalars_and_the_interval_lines_figures(lbp):
    """--tensorboard-dir: Megatron's writer holds its own scalars and megatron-lbp's
    (megatron_lbp/integration/tensorboard_scalars.py), equal to the figures of the interval log lines."""
    import re

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    code, log, _, ckpt = lbp
    assert code == 0, why(log)
    events = EventAccumulator(f"{ckpt}/tensorboard", size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "lm loss" in tags, sorted(tags)                       # Megatron's own
    scalars = {t: {e.step: e.value for e in events.Scalars(t)} for t in tags
               if t.startswith("megatron-lbp/")}
    lines = re.findall(r"\[megatron-lbp\] iteration +(\d+) \| bytes sent/step (.*)", log)
    assert len(lines) == ITERS, len(lines)
    fields = {"package": "bytes sent per step/package", "node": "bytes sent per step/node",
              "network": "bytes sent per step/network", "held primary": "held bytes/primary",
              "secondary": "held bytes/secondary", "grad": "held bytes/grad",
              "optimizer": "held bytes/optimizer", "peak transient": "held bytes/peak_transient"}
    for it, rest in lines:
        it = int(it)
        for name, tag in fields.items():
            text = re.search(rf"(?:^|\| |\s){name} ([\d.]+ [GM]B)", rest).group(1)
            value, tolerance = _printed(text)
            got = scalars[f"megatron-lbp/{tag}"][it]
            assert abs(got - value) <= tolerance + 1e-6 * value, (it, name, got, text)
        rate = re.search(r"tokens/s ([\d.]+)", rest)
        if it == 1:
            assert rate is None and it not in scalars["megatron-lbp/tokens per second"]
        else:
            assert scalars["megatron-lbp/tokens per second"][it] == pytest.approx(
                float(rate.group(1)), abs=0.05 + 1e-6 * float(rate.group(1))), (it, rest)
    assert scalars["megatron-lbp/bytes sent per step/node"][ITERS] > 0


@pytest.mark.slow
def test_split_layer_units_through_the_training_entry_train_like_stock(demo_dataset, stock):
    """--hier-layer-unit split through python -m megatron_lbp.pretrain_gpt (Megatron's own
    model and schedule, biased linears, selective recomputation of the core attention): the
    losses and grad norms of stock Megatron's distributed optimizer; with full recomputation
    it is refused in one line before any model exists."""
    code, log, losses = run_pretrain(8, _args(demo_dataset, *LBP8, "--hier-layer-unit", "split",
                                              "--recompute-activations"))
    assert code == 0, why(log)
    assert "megatron-lbp hierarchy (lbp): W=8 P=2 S=off G=4 O=8" in log, log[-3000:]
    _, stock_log, stock_losses = stock
    assert sorted(losses) == sorted(stock_losses) == list(range(1, 21))
    bad = [(i, losses[i], stock_losses[i]) for i in stock_losses
           if not close(losses[i], stock_losses[i])]
    assert not bad, f"iterations whose loss differs (split lbp, stock): {bad}"
    norms, stock_norms = grad_norms(log), grad_norms(stock_log)
    bad = [(i, norms[i], stock_norms[i]) for i in stock_norms
           if abs(norms[i] - stock_norms[i]) > NORM_PRINT_ABS]
    assert not bad, f"iterations whose grad norm differs (split lbp, stock): {bad}"
    # one rank: the refusal is its exit status and its line, not a peer's kill
    code, log, _ = run_pretrain(1, _args(demo_dataset, "--hier-partition", "--hier-layer-unit",
                                         "split", "--recompute-granularity", "full",
                                         "--recompute-method", "uniform", gbs=4))
    assert code == 2 and "--hier-layer-unit split with --recompute-granularity full" in log, \
        log[-2000:]
