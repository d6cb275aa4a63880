"""--hier-embedding-backward-gather skip on gloo ranks: the same training, no embedding regather.

8 ranks as 2 nodes x 2 packages x 2 GCDs, lbp P=2 G=4 O=8, the tiny megatron-core GPT
tied and untied, with learned absolute positions (a second lookup table in the
embedding unit) and with RoPE, 3 steps of 2 micro-batches (fp32, or bf16 with the int8
secondary copy), each once with the default and once with skip. An embedding lookup's
backward reads the indices and the table's shape only, so skip must leave every loss,
gradient norm and final weight bit for bit as it was; the engine must issue no
backward gather for the embedding unit (untied: none at all; tied: the output layer's,
once, as by default) and hold no embedding weights when a layer's backward ends, its ledger must hold the plan's bytes for the setting
(costs.traffic_bytes with costs.backward_gather_skipped), and its peak of live transient
bytes must stay within the plan's figure for the setting (costs.transient_bytes). The
checks run once more on an engine that ignores the knob (tests/helpers/broken_engine.py)
and must fail there. The measured peak against the plan at scale is
tests/engine/test_transient_model.py's.
"""
import pytest
import torch

from megatron_lbp.core import costs
from megatron_lbp.core.config import HierConfig, HierConfigError
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec
from tests.helpers.embedding_fns import train_and_watch_gathers

WORLD = 8
TRAIN = TrainSpec(steps=3, micro_batches=2, bucket_size=20000)
LBP = ["--hier-preset", "lbp", "--hier-param-group-size", "2", "--hier-grad-group-size", "4",
       "--hier-optim-group-size", "8"]
# (tied, positions, S): both tables and both position kinds, with and without the
# secondary copy the backward gathers from (S = 2: bf16 weights, the int8 copy's dtype).
MODELS = [(True, "learned_absolute", 2), (False, "rope", 0),
          (True, "rope", 0), (False, "learned_absolute", 2)]
BROKEN = "embedding_skip_ignored"


def _runs():
    runs = {}
    for tied, pos, s in MODELS:
        spec = TinyGPTSpec(tied_output=tied, position_embedding_type=pos,
                           params_dtype=torch.bfloat16 if s else torch.float32)
        argv = LBP + ["--hier-secondary-group-size", str(s), "--hier-embedding-backward-gather"]
        for setting in ("gather", "skip"):
            runs[(tied, pos, setting)] = (spec, argv + [setting], None)
        if (tied, pos, s) in MODELS[:2]:
            runs[(tied, pos, BROKEN)] = (spec, argv + ["skip"], BROKEN)
    return runs


@pytest.fixture(scope="module")
def trained():
    return run_on_ranks(train_and_watch_gathers, WORLD, _runs(), TRAIN,
                        rank_env=rank_location_env(4), timeout=1800)


def problems(on, off, model) -> list[str]:
    """What differs from the knob's promise, ``on`` (skip) against ``off`` (gather)."""
    tied, _, s = model
    dtype = "bf16" if s else "fp32"
    out = []
    for what in ("losses", "grad_norms"):
        if on[what] != off[what]:
            out.append(f"{what} with skip {on[what]}, with gather {off[what]}")
    for name, w in off["params"].items():
        diff = (on["params"][name] - w).abs().max().item()
        if diff != 0:
            out.append(f"final {name} differs by {diff:.3g}")
    # The default regathers the embedding for its backward (untied) or keeps the output
    # layer's (tied); skip never gathers it for the embedding's own backward.
    if ("embedding", "backward_gather") not in off["gathers"]:
        out.append(f"the default gathered {off['gathers']}: no embedding backward gather")
    fewer = off["backward_gathers"] - on["backward_gathers"]
    if tied and (fewer != 0 or ("embedding", "backward_gather") not in on["gathers"]):
        out.append(f"skip gathered {on['gathers']} ({fewer} backward gathers fewer): the "
                   "output layer's backward must still gather the embedding, once")
    if not tied and (("embedding", "backward_gather") in on["gathers"] or fewer != 2):
        out.append(f"skip gathered {on['gathers']} ({fewer} backward gathers fewer than the "
                   "default, want 2: one per micro-batch)")
    # Freed after the output layer's backward: never held while a layer's backward ends.
    if on["embedding_held_at_layer_reduces"]:
        out.append(f"skip: the embedding's weights were gathered at "
                   f"{on['embedding_held_at_layer_reduces']} layer reduce-scatters of the step")
    if tied and not off["embedding_held_at_layer_reduces"]:
        out.append("the default never held the tied embedding at a layer's reduce-scatter")
    cfg = HierConfig(**on["config"])
    for setting, got in (("skip", on), ("gather", off)):
        skipped = costs.backward_gather_skipped(got["kinds"], tied, setting)
        _, want = costs.traffic_bytes(cfg, got["numels"], got["links"], param_dtype=dtype,
                                      micro_batches=TRAIN.micro_batches,
                                      no_backward_gather=skipped)
        measured = {ph: v for ph, v in got["report"]["traffic_by_phase"].items()
                    if ph != "control"}
        if measured != want:
            out.append(f"{setting}: ledger {measured}\n plan {want}")
        plan = costs.transient_bytes(cfg, got["numels"], param_dtype=dtype, tied_embedding=tied,
                                     micro_batches=TRAIN.micro_batches,
                                     embedding_backward_gather=setting)
        peak = got["report"]["memory_bytes"]["peak_transient"]
        if not 0 < peak <= plan["peak"]:
            out.append(f"{setting}: peak transient {peak} bytes above the plan's {plan}")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"tied={m[0]}-{m[1]}-S{m[2]}")
def test_skip_trains_bit_for_bit_like_gather_without_an_embedding_regather(trained, model):
    tied, pos, _ = model
    for rank, res in enumerate(trained):
        found = problems(res[(tied, pos, "skip")], res[(tied, pos, "gather")], model)
        assert not found, f"tied={tied} {pos} rank {rank}:\n" + "\n".join(found)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS[:2], ids=lambda m: f"tied={m[0]}-{m[1]}-S{m[2]}")
def test_the_checks_fail_on_an_engine_that_ignores_skip(trained, model):
    tied, pos, _ = model
    found = problems(trained[0][(tied, pos, BROKEN)], trained[0][(tied, pos, "gather")], model)
    assert found, f"tied={tied} {pos}: an engine ignoring skip passed every check"


def test_skip_is_refused_for_an_embedding_unit_that_is_not_only_lookup_tables():
    from megatron_lbp.engine.grouping import UnitSpec
    from megatron_lbp.integration.megatron_adapter import check_lookup_only_embeddings

    normed = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.LayerNorm(4))
    with pytest.raises(HierConfigError, match="LayerNorm.*not a plain lookup"):
        check_lookup_only_embeddings([UnitSpec("embedding", (normed,))])
    check_lookup_only_embeddings([UnitSpec("embedding", (torch.nn.Embedding(8, 4),)),
                                  UnitSpec("layer", (torch.nn.Linear(4, 4),), 0)])
