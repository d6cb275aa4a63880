"""The architectures Megatron's flags describe build and train under the hierarchy like stock.

Each named architecture of megatron_lbp.testing.tiny_gpt.ARCHITECTURES (Megatron's
own defaults — learned absolute positions, tied output layer, LayerNorm, GeLU,
biases — and the Llama-style and other combinations users bring) is checked on
8 gloo ranks (2 emulated nodes x 2 packages x 2 GCDs):

1. sharded init (the default) leaves in every primary slice exactly the stock
   build's values for the same seed, and the generators where a plain build
   leaves them;
2. a few steps with lbp train like stock Megatron DDP + distributed optimizer:
   losses, gradient norms and final weights within the fp32 bound the preset
   tests use.

The default suite runs Megatron's defaults and the Llama-style model on the
CPU-init path; the slow suite runs every architecture on both init paths and
with zero3 as well.
"""
import traceback

import pytest

from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import (ARCHITECTURES, TrainSpec, architecture, train_several,
                                           trained)
from tests.engine.test_engine_equivalence import (FP32_REL, PRESETS, WORLD, assert_ranks_hold_the_same_weights,
                                           assert_same_training)
from tests.engine.test_sharded_init import LBP_S2, initial_weights_against_stock

TOPOLOGY = rank_location_env(4)
# Adam's eps 1e-6, not 1e-8: an element whose gradient is ~0 (the key part of a QKV bias
# has an analytically zero one) gets an update of lr x g / (|g| + eps), so with 1e-8 the
# reductions' rounding noise (~1e-10) moves it by ~1e-5 x lr per step and the fp32 weight
# bound measures Adam's amplification of noise, not the engine (seen: 8e-5 on
# gpt2-untied-xavier's QKV bias after 4 steps, losses and gradient norms within 1e-5).
TRAIN = TrainSpec(steps=4, micro_batches=2, bucket_size=20000, adam_eps=1e-6)
LBP = PRESETS["lbp-P2-G4-O8"]
FAST = ("megatron-defaults", "llama")
INIT_PATHS = ("cpu-init", "device-init")


def matrix_on_rank(cases, train, presets):
    """Per case "arch/init": the sharded-init check and {stock, presets...} trainings."""
    out = {}
    for name, init in cases:
        spec = architecture(name, use_cpu_initialization=init == "cpu-init")
        label = f"{name}/{init}"
        try:
            out[label] = {"init": initial_weights_against_stock(spec, LBP_S2, train.bucket_size)}
        except Exception:  # noqa: BLE001 - reported as this case's failure
            out[label] = {"init": f"{label} raised:\n{traceback.format_exc()}"}
        out[label]["runs"] = train_several(spec, train, {"stock": None, **presets})
    return out


def run_matrix(cases, presets):
    return run_on_ranks(matrix_on_rank, WORLD, cases, TRAIN, presets, rank_env=TOPOLOGY,
                        timeout=1200)


def check_case(ranks, label, presets):
    for r, res in enumerate(ranks):
        init = res[label]["init"]
        assert not isinstance(init, str), init
        assert init["materialized"] == 1, f"{label}: rank {r}: the sharded construction did not run"
        assert init["checked"] > 0 and not init["mismatches"], (
            f"{label}: rank {r}: sharded init differs from the stock build: {init['mismatches'][:3]}")
        assert init["rng_equal"], (f"{label}: rank {r}: the generators after the sharded build "
                                   "differ from a plain build's")
    stock = trained(ranks[0][label]["runs"], "stock")
    assert stock.losses[-1] < stock.losses[0], f"{label}: the loss did not fall: {stock.losses}"
    for preset in presets:
        per_rank = [trained(res[label]["runs"], preset) for res in ranks]
        assert_ranks_hold_the_same_weights(per_rank, f"{label} {preset}")
        assert_same_training(per_rank[0], stock, FP32_REL, f"{label} {preset}")


@pytest.fixture(scope="module")
def fast_matrix():
    return run_matrix([(name, "cpu-init") for name in FAST], {"lbp": LBP})


@pytest.mark.parametrize("name", FAST)
def test_architecture_builds_and_trains_like_stock(name, fast_matrix):
    check_case(fast_matrix, f"{name}/cpu-init", {"lbp": LBP})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_architecture_on_both_init_paths(name):
    """One launch per architecture: every setup makes new gloo groups, whose threads stay."""
    presets = {"lbp": LBP, "zero3": PRESETS["zero3"]}
    cases = [(name, init) for init in INIT_PATHS]
    ranks = run_matrix(cases, presets)
    failures = []
    for _, init in cases:
        try:
            check_case(ranks, f"{name}/{init}", presets)
        except AssertionError as e:
            failures.append(str(e)[:3000])
    assert not failures, "\n".join(failures)


def test_the_matrix_covers_what_megatron_flags_describe():
    """Every option the issue names appears in some architecture (and Megatron's defaults are one)."""
    specs = {name: architecture(name) for name in ARCHITECTURES}
    seen = lambda field: {getattr(s, field) for s in specs.values()}  # noqa: E731
    assert seen("position_embedding_type") == {"rope", "learned_absolute", "none"}
    assert seen("tied_output") == {True, False}
    assert seen("normalization") == {"LayerNorm", "RMSNorm"}
    assert seen("swiglu") == {True, False}
    assert seen("add_bias_linear") == {True, False}
    assert seen("xavier_init") == {True, False}
    assert len(seen("init_method_std")) > 1
    assert any(s.num_query_groups and s.num_query_groups < s.num_attention_heads
               for s in specs.values()), "no grouped-query attention"
    defaults = specs["megatron-defaults"]
    assert (defaults.position_embedding_type, defaults.tied_output, defaults.normalization,
            defaults.swiglu, defaults.add_bias_linear) == ("learned_absolute", True, "LayerNorm",
                                                           False, True)
