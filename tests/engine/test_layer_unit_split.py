"""--hier-layer-unit split on gloo ranks: each layer's attention and MLP as two gather units.

4 ranks as 2 nodes of one package of 2 GCDs, lbp (P=2, G=2, O=4), one gradient
reduce-scatter in flight, 2 steps of 2 micro-batches, each model once with whole layers and once split. Splitting changes
which collectives carry a layer's weights and gradients, not what is computed, so the
losses and the final weights must be bit for bit those of whole layers. Beside that:
the split run's units are the plan's (costs.gpt_units with split_layers), its ledger
holds the plan's bytes (costs.traffic_bytes), its peak of live transient bytes is
within the plan's figure (costs.transient_bytes with the unit kinds) and below the
whole-layer run's. The measured peak against the plan on a Frontier-shaped model is
tests/engine/test_transient_model.py's.
"""
import pytest
import torch

from megatron_lbp.core import costs
from megatron_lbp.core.config import HierConfig, HierConfigError
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import ARCHITECTURES, TinyGPTSpec, TrainSpec
from tests.helpers.embedding_fns import train_and_watch_gathers

WORLD = 4
TRAIN = TrainSpec(steps=2, micro_batches=2, bucket_size=20000)
# One reduce-scatter in flight: the schedule then waits for each as soon as the next is issued,
# so the peaks compared below do not depend on when gloo finished one.
LBP = ["--hier-preset", "lbp", "--hier-gpus-per-node", "2", "--hier-gcds-per-package", "2",
       "--hier-max-pending-reduces", "1"]


def _runs(architectures):
    runs = {}
    for arch in architectures:
        spec = TinyGPTSpec(**ARCHITECTURES[arch])
        for unit in ("whole", "split"):
            runs[(arch, unit)] = (spec, LBP + ["--hier-layer-unit", unit], None)
    return runs


def _units(spec: TinyGPTSpec) -> list[tuple[str, int]]:
    return costs.gpt_units(spec.num_layers, spec.hidden_size, spec.vocab_size, spec.seq_length,
                           spec.ffn_hidden_size, spec.tied_output,
                           position_embedding_type=spec.position_embedding_type,
                           swiglu=spec.swiglu, num_attention_heads=spec.num_attention_heads,
                           num_query_groups=spec.num_query_groups,
                           normalization=spec.normalization,
                           add_bias_linear=spec.add_bias_linear, split_layers=True)


def problems(split, whole, spec: TinyGPTSpec) -> list[str]:
    """What differs from the knob's promise."""
    out = []
    if split["losses"] != whole["losses"]:
        out.append(f"losses split {split['losses']}, whole {whole['losses']}")
    for name, w in whole["params"].items():
        diff = (split["params"][name] - w).abs().max().item()
        if diff != 0:
            out.append(f"final {name} differs by {diff:.3g}")
    want = _units(spec)
    got = list(zip(split["kinds"], split["numels"]))
    if got != want:
        out.append(f"split units {got}, the plan's {want}")
    kinds = {kind for kind, _ in split["gathers"]}
    if "layer" in kinds or not {"attention", "mlp"} <= kinds:
        out.append(f"split run gathered {split['gathers']}")
    cfg = HierConfig(**split["config"])
    _, traffic = costs.traffic_bytes(cfg, split["numels"], split["links"], param_dtype="fp32",
                                     micro_batches=TRAIN.micro_batches)
    measured = {ph: v for ph, v in split["report"]["traffic_by_phase"].items() if ph != "control"}
    if measured != traffic:
        out.append(f"ledger {measured}\n plan {traffic}")
    plan = costs.transient_bytes(cfg, split["numels"], param_dtype="fp32",
                                 tied_embedding=spec.tied_output,
                                 micro_batches=TRAIN.micro_batches, max_pending_reduces=1,
                                 unit_kinds=split["kinds"], linear_biases=spec.add_bias_linear)
    peak = split["report"]["memory_bytes"]["peak_transient"]
    whole_peak = whole["report"]["memory_bytes"]["peak_transient"]
    if not 0 < peak <= plan["peak"]:
        out.append(f"peak transient {peak} bytes above the plan's {plan}")
    if not peak < whole_peak:
        out.append(f"split peaked at {peak} bytes, whole layers at {whole_peak}")
    return out


def _check(trained, architectures):
    for rank, res in enumerate(trained):
        for arch in architectures:
            found = problems(res[(arch, "split")], res[(arch, "whole")],
                             TinyGPTSpec(**ARCHITECTURES[arch]))
            assert not found, f"{arch} rank {rank}:\n" + "\n".join(found)


def test_split_layers_train_bit_for_bit_like_whole_layers_on_megatrons_default_gpt():
    # Megatron's defaults: learned absolute positions, biased linears (linear_proj's and
    # linear_fc2's biases are added by the layer after their half returns), LayerNorm, tied.
    archs = ["megatron-defaults"]
    _check(run_on_ranks(train_and_watch_gathers, WORLD, _runs(archs), TRAIN,
                        rank_env=rank_location_env(2), timeout=900), archs)


@pytest.mark.slow
def test_split_layers_train_bit_for_bit_like_whole_layers_on_other_architectures():
    archs = ["llama", "gqa-swiglu-bias-learned", "gpt2-untied-xavier"]
    _check(run_on_ranks(train_and_watch_gathers, WORLD, _runs(archs), TRAIN,
                        rank_env=rank_location_env(2), timeout=1800), archs)


def test_split_refuses_a_layer_whose_parameters_its_halves_do_not_hold():
    from megatron_lbp.integration.megatron_adapter import split_layer_units

    class Layer(torch.nn.Module):
        def __init__(self, extra: bool):
            super().__init__()
            for name in ("input_layernorm", "pre_cross_attn_layernorm", "cross_attention",
                         "pre_mlp_layernorm"):
                setattr(self, name, torch.nn.Identity())
            self.self_attention = torch.nn.Linear(4, 4)
            self.mlp = torch.nn.Linear(4, 4)
            if extra:
                self.gate = torch.nn.Parameter(torch.zeros(4))

    specs = split_layer_units(Layer(False), 0)
    assert [(s.kind, s.held_by) for s in specs] == [
        ("attention", (specs[0].held_by[0],)), ("mlp", (specs[1].held_by[0],))]
    with pytest.raises(HierConfigError, match="outside its attention and MLP halves.*gate"):
        split_layer_units(Layer(True), 0)
    bare = Layer(False)
    del bare.mlp
    with pytest.raises(HierConfigError, match="has no mlp"):
        split_layer_units(bare, 0)


def test_split_with_full_recomputation_is_refused_before_any_model():
    from types import SimpleNamespace

    from megatron_lbp.integration.megatron_adapter import check_megatron_args

    args = SimpleNamespace(hier_layer_unit="split", recompute_granularity="full")
    with pytest.raises(ValueError, match="--hier-layer-unit split with --recompute-granularity"):
        check_megatron_args(args)
    check_megatron_args(SimpleNamespace(hier_layer_unit="split",
                                        recompute_granularity="selective"))
    check_megatron_args(SimpleNamespace(hier_layer_unit="whole", recompute_granularity="full"))
