"""DeepSpeed ZeRO-3 / ZeRO++ (megatron_lbp/deepspeed_baseline) trains like stock Megatron and lbp.

The same tiny megatron-core GPT, batches and AdamW maths under
``deepspeed.initialize`` (megatron_lbp.deepspeed_baseline.trainer), beside stock Megatron
DDP + DistributedOptimizer and the engine's presets, in the same gloo ranks.

- fp32, constant LR: ds-zero3 and ds-hpz give the same losses, reported gradient
  norms and final weights as stock Megatron and lbp within test_engine_equivalence's
  bound (1e-5 relative; the only differences are summation orders).
- bf16 on real text with qwZ + qgZ (ds-zeropp): within test_quant_training's int8
  bound of lbp's unquantized run (0.5 % per step after 5 warm-up steps), and
  measurably off it (the quantization is real).
- Tests of the tests: the DeepSpeed runner with a wrong learning rate, or with one
  micro-batch of each step dropped from the gradient, fails the fp32 checks.

The default suite runs the 4-rank fp32 case (one launch); 8 ranks as 2 emulated
nodes (hpZ, qgZ's hierarchical path) are slow-marked. The fast launch JIT-builds
nothing: DeepSpeed's CPU shared-memory comm op, which only its inference all-reduce
uses, is skipped (megatron_lbp/deepspeed_baseline/environment.py; its build was 25-45 s of the
first run in a fresh environment), and the launch runs with an empty
TORCH_EXTENSIONS_DIR to show it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import traceback

import importlib.util

import pytest
import torch
import torch.distributed as dist

from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, train_hier, train_stock_megatron
from tests.engine.test_engine_equivalence import (FP32_REL, assert_ranks_hold_the_same_weights,
                                           assert_same_grad_norms, assert_same_losses,
                                           assert_same_training)
from tests.multirank.test_quant_training import MIN_GAP, REL, WARMUP

# find_spec, not importorskip: importing deepspeed here (the ranks import this module too)
# would let it pick its accelerator before megatron_lbp.deepspeed_baseline.environment sets it up.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is a test dependency: scripts/install.sh --test")

TIMEOUT = 900

WRONG_LR = "ds-zero3, lr x1.5 (broken)"
DROPPED = "ds-zero3, micro-batch 0 of each step dropped (broken)"


@contextlib.contextmanager
def wrong_learning_rate(factor: float = 1.5):
    """The runner's AdamW groups carry lr x ``factor`` (a learning rate wired wrongly)."""
    from megatron_lbp.deepspeed_baseline import trainer

    orig = trainer.megatron_param_groups

    def groups(model, weight_decay):
        return [dict(g, lr=g.get("lr", trainer_lr[0]) * factor) for g in orig(model, weight_decay)]

    trainer_lr = [None]
    orig_setup = trainer.setup_deepspeed

    def setup(spec, train, *a, **kw):
        trainer_lr[0] = train.lr
        return orig_setup(spec, train, *a, **kw)

    trainer.megatron_param_groups, trainer.setup_deepspeed = groups, setup
    try:
        yield
    finally:
        trainer.megatron_param_groups, trainer.setup_deepspeed = orig, orig_setup


@contextlib.contextmanager
def dropped_micro_batch(micro_batches: int, dropped: int = 0):
    """Micro-batch ``dropped`` of every step runs forward and logs its loss but adds no gradient."""
    from megatron_lbp.deepspeed_baseline import trainer

    orig = trainer.tiny_gpt.forward_loss
    calls = [0]

    def forward_loss(model, tokens):
        loss = orig(model, tokens)
        drop = calls[0] % micro_batches == dropped
        calls[0] += 1
        return loss.detach() + 0.0 * loss if drop else loss

    trainer.tiny_gpt.forward_loss = forward_loss
    try:
        yield
    finally:
        trainer.tiny_gpt.forward_loss = orig


def train_runs(spec, train, configs: dict, ranks_per_node: int, faults: dict | None = None,
               steps: dict | None = None):
    """Per configuration, its TrainResult (or the traceback it raised), one after another.

    ``configs``: name -> None (stock Megatron), a list (the engine's --hier-* argv),
    a DeepSpeed scheme name, or (scheme name, zero_optimization overrides).
    ``steps``: name -> steps, for configurations that train fewer than ``train.steps``.
    """
    from megatron_lbp.deepspeed_baseline.trainer import train_deepspeed

    out = {}
    for name, what in configs.items():
        own = dataclasses.replace(train, steps=(steps or {}).get(name, train.steps))
        fault = (faults or {}).get(name)
        try:
            with fault() if fault else contextlib.nullcontext():
                if what is None:
                    out[name] = train_stock_megatron(spec, own)
                elif isinstance(what, list):
                    out[name] = train_hier(spec, own, what)
                else:
                    scheme, overrides = (what, None) if isinstance(what, str) else what
                    out[name] = train_deepspeed(spec, own, scheme, ranks_per_node=ranks_per_node,
                                                zero_overrides=overrides)
        except Exception:  # noqa: BLE001 - reported as this configuration's result
            out[name] = f"{name} raised on rank {dist.get_rank()}:\n{traceback.format_exc()}"
    return out


def trained(result, name):
    value = result[name]
    assert not isinstance(value, str), value
    return value


# -- fast: 4 ranks as 2 nodes of 2, fp32 ------------------------------------------------

FAST_WORLD, FAST_NODE = 4, 2
FAST_TRAIN = TrainSpec(steps=4, micro_batches=2, bucket_size=20000)
FAST_LBP = ["--hier-preset", "lbp"]
# The broken runners train 2 steps: a wrong learning rate shows in step 2's loss (step 1's
# update), a dropped micro-batch in step 1's gradient norm; each step of DeepSpeed costs ~1 s
# of the fast suite's slowest set-up.
BROKEN_STEPS = 2


def first_steps(result, n: int):
    """``result`` as if it had trained ``n`` steps (its losses and gradient norms; no weights)."""
    return dataclasses.replace(result, losses=result.losses[:n], grad_norms=result.grad_norms[:n],
                               params={})


def _dropped_fault():
    return dropped_micro_batch(FAST_TRAIN.micro_batches)


@pytest.fixture(scope="module")
def extensions(tmp_path_factory):
    """An empty TORCH_EXTENSIONS_DIR for the fast launch: what DeepSpeed JIT-builds there."""
    return tmp_path_factory.mktemp("torch-extensions")


@pytest.fixture(scope="module")
def fast_runs(extensions):
    configs = {"stock": None, "lbp": FAST_LBP, "ds-zero3": "ds-zero3",
               WRONG_LR: "ds-zero3", DROPPED: "ds-zero3"}
    return run_on_ranks(train_runs, FAST_WORLD, TinyGPTSpec(), FAST_TRAIN, configs, FAST_NODE,
                        {WRONG_LR: wrong_learning_rate, DROPPED: _dropped_fault},
                        {WRONG_LR: BROKEN_STEPS, DROPPED: BROKEN_STEPS},
                        rank_env=rank_location_env(FAST_NODE), timeout=TIMEOUT,
                        env={"TORCH_EXTENSIONS_DIR": str(extensions)})


def test_ds_zero3_trains_like_stock_megatron_and_lbp_fp32(fast_runs):
    ranks = [trained(r, "ds-zero3") for r in fast_runs]
    assert_ranks_hold_the_same_weights(ranks, "ds-zero3")
    stock, lbp = trained(fast_runs[0], "stock"), trained(fast_runs[0], "lbp")
    assert_same_training(ranks[0], stock, FP32_REL, "ds-zero3 vs stock")
    assert_same_training(ranks[0], lbp, FP32_REL, "ds-zero3 vs lbp")
    assert stock.losses[-1] < stock.losses[0] - 0.1, f"the loss barely moved: {stock.losses}"


def test_ds_zero3_on_cpu_ranks_jit_builds_nothing(fast_runs, extensions):
    """DeepSpeed's CPU shared-memory comm op serves only inference_all_reduce; its JIT build
    (25-45 s in a fresh environment) is skipped (megatron_lbp/deepspeed_baseline/environment.py)."""
    built = sorted(p.name for p in extensions.iterdir())
    assert not built, f"DeepSpeed JIT-built {built} for ZeRO-3 training on CPU ranks"


def test_equivalence_check_fails_on_a_wrong_learning_rate(fast_runs):
    """The test of the test: the same runner with lr x1.5 differs from stock."""
    stock, bad = trained(fast_runs[0], "stock"), trained(fast_runs[0], WRONG_LR)
    assert len(bad.losses) == BROKEN_STEPS, bad.losses
    with pytest.raises(AssertionError, match="losses differ"):
        assert_same_losses(bad, first_steps(stock, BROKEN_STEPS), FP32_REL, WRONG_LR)


def test_equivalence_check_fails_on_a_dropped_micro_batch(fast_runs):
    """The test of the test: one micro-batch's gradient missing from each step."""
    stock, bad = trained(fast_runs[0], "stock"), trained(fast_runs[0], DROPPED)
    assert len(bad.grad_norms) == BROKEN_STEPS, bad.grad_norms
    # its logged losses start equal (the dropped micro-batch still runs forward) ...
    assert abs(bad.losses[0] - stock.losses[0]) <= FP32_REL * stock.losses[0]
    # ... and the reported gradient norm shows the missing half
    with pytest.raises(AssertionError, match="grad norms differ"):
        assert_same_grad_norms(bad, first_steps(stock, BROKEN_STEPS), FP32_REL, DROPPED)


# -- slow: 8 ranks as 2 nodes of 4 (hpZ's node-sized partition, qgZ's two levels) ----------

WORLD, NODE = 8, 4
FP32_TRAIN = TrainSpec(steps=10, micro_batches=2, bucket_size=20000)
LBP8 = ["--hier-param-group-size", "2", "--hier-grad-group-size", "4",
        "--hier-optim-group-size", "8"]


@pytest.mark.slow
def test_ds_zero3_and_hpz_train_like_stock_lbp_and_zero3_on_two_nodes_fp32():
    configs = {"stock": None, "lbp": LBP8, "zero3": ["--hier-preset", "zero3"],
               "ds-zero3": "ds-zero3", "ds-hpz": "ds-hpz"}
    runs = run_on_ranks(train_runs, WORLD, TinyGPTSpec(), FP32_TRAIN, configs, NODE,
                        rank_env=rank_location_env(NODE), timeout=TIMEOUT)
    for scheme in ("ds-zero3", "ds-hpz"):
        ranks = [trained(r, scheme) for r in runs]
        assert_ranks_hold_the_same_weights(ranks, scheme)
        for ref in ("stock", "lbp", "zero3"):
            assert_same_training(ranks[0], trained(runs[0], ref), FP32_REL,
                                 f"{scheme} vs {ref}")


BF16_SPEC = TinyGPTSpec(params_dtype=torch.bfloat16, vocab_size=4096)
BF16_TRAIN = TrainSpec(steps=25, micro_batches=1, bucket_size=50000, text=True)
QWZ = "ds-zeropp without qgZ (hpZ + qwZ)"
# DeepSpeed's qgZ sends gradients in int4 (the ZeRO++ paper's choice), 16x coarser steps than
# the project's int8 paths that REL bounds; measured 1.03 % at worst over these 25 steps
# (tests/bench/test_deepspeed_baseline.py -s prints it). Not the int8 bound: its own, with the
# measured value stated beside it.
INT4_GRAD_REL = 0.015


def _gaps(losses, ref):
    return [abs(a - b) / b for a, b in zip(losses, ref)]


@pytest.mark.slow
def test_ds_zeropp_against_lbp_unquantized_bf16():
    """bf16 on real text: ds-zero3 and hpZ + qwZ (int8 weights) within the int8 bound of lbp
    without quantization; the full ds-zeropp (+ qgZ, int4 gradients) within INT4_GRAD_REL."""
    configs = {"reference": LBP8, "ds-zero3": "ds-zero3",
               QWZ: ("ds-zeropp", {"zero_quantized_gradients": False}),
               "ds-zeropp": "ds-zeropp"}
    runs = run_on_ranks(train_runs, WORLD, BF16_SPEC, BF16_TRAIN, configs, NODE,
                        rank_env=rank_location_env(NODE), timeout=TIMEOUT)
    names = ("ds-zero3", QWZ, "ds-zeropp")
    for name in names:
        assert_ranks_hold_the_same_weights([trained(r, name) for r in runs], name)
    ref = trained(runs[0], "reference").losses
    assert ref[-1] < ref[0] - 1.0, f"the reference barely learnt: {ref}"
    bounds = {"ds-zero3": REL, QWZ: REL, "ds-zeropp": INT4_GRAD_REL}
    worst = {}
    for name in names:
        losses = trained(runs[0], name).losses
        g = _gaps(losses, ref)
        worst[name] = max(g[WARMUP:])
        print(f"{name}: worst gap {worst[name]:.3%} from step {WARMUP}, last {g[-1]:.3%}")
        assert worst[name] <= bounds[name], (
            f"{name}: losses up to {worst[name]:.2%} from lbp unquantized (> {bounds[name]:.1%}):"
            f"\n {name} {losses}\n lbp {ref}")
    for name in (QWZ, "ds-zeropp"):
        assert worst[name] >= MIN_GAP, (
            f"{name} within {worst[name]:.2e} of lbp unquantized (< {MIN_GAP:g}): nothing was "
            f"quantized")
