"""costs.gpt_units against real megatron-core GPTModels built at small shapes.

Each architecture flag Megatron's GPT takes (SwiGLU with its own --ffn-hidden-size,
grouped-query attention, its own head width (--kv-channels), an untied output layer,
RMSNorm, no linear biases or only q/k/v's (--add-qkv-bias), RoPE or learned positions) changes the parameter count; the plan's formula must give the
model's own count for every combination, and its units the model's units.
"""
import itertools

import pytest

from megatron_lbp.core import costs
from megatron_lbp.launch import plan
from megatron_lbp.testing.multirank import run_single

L, H, HEADS, V, S = 2, 64, 8, 96, 16


def _count_models(cases):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_lbp.testing.tiny_gpt import init_megatron_state

    init_megatron_state()
    out = []
    for c in cases:
        config = TransformerConfig(
            num_layers=L, hidden_size=H, num_attention_heads=HEADS,
            num_query_groups=c["num_query_groups"], ffn_hidden_size=c["ffn_hidden_size"],
            gated_linear_unit=c["swiglu"],
            activation_func=torch.nn.functional.silu if c["swiglu"] else torch.nn.functional.gelu,
            normalization=c["normalization"], add_bias_linear=c["add_bias_linear"],
            kv_channels=c.get("kv_channels"), add_qkv_bias=c.get("add_qkv_bias", False),
            use_cpu_initialization=True)
        model = GPTModel(config=config,
                         transformer_layer_spec=get_gpt_layer_local_spec(
                             normalization=c["normalization"]),
                         vocab_size=V, max_sequence_length=S,
                         position_embedding_type=c["position_embedding_type"],
                         share_embeddings_and_output_weights=c["tied"])
        out.append(sum(p.numel() for p in model.parameters()))
    return out


CASES = [dict(swiglu=sw, ffn_hidden_size=ffn, num_query_groups=g, tied=tied,
              normalization=norm, add_bias_linear=bias, position_embedding_type=pe)
         for (sw, ffn), g, tied, norm, bias, pe in itertools.product(
             [(False, None), (True, 176)], [None, 2], [True, False], ["LayerNorm", "RMSNorm"],
             [True, False], ["rope", "learned_absolute"])]


DEFAULT = CASES[0]
# every flag away from its default, with a head width other than H/HEADS and q/k/v biases
FLIPPED = {**CASES[-1], "kv_channels": 16, "add_qkv_bias": True}
# The defaults and every flag at once in the default suite (building models costs seconds
# on a shared machine); the whole product (64 models) runs with the slow tests.
SOME = [DEFAULT, FLIPPED]


def _check(cases):
    counts = run_single(_count_models, cases, timeout=600)
    wrong = []
    for c, got in zip(cases, counts):
        want = costs.gpt_param_count(
            L, H, V, S, c["ffn_hidden_size"], c["tied"],
            position_embedding_type=c["position_embedding_type"], swiglu=c["swiglu"],
            num_attention_heads=HEADS, num_query_groups=c["num_query_groups"],
            normalization=c["normalization"], add_bias_linear=c["add_bias_linear"],
            kv_channels=c.get("kv_channels"), add_qkv_bias=c.get("add_qkv_bias", False))
        argv = ["--world-size", "8", "--num-layers", str(L), "--hidden-size", str(H),
                "--vocab-size", str(V), "--seq-length", str(S), "--num-attention-heads",
                str(HEADS), "--normalization", c["normalization"],
                "--position-embedding-type", c["position_embedding_type"]]
        argv += ["--swiglu"] * c["swiglu"] + ["--disable-bias-linear"] * (not c["add_bias_linear"])
        argv += ["--untie-embeddings-and-output-weights"] * (not c["tied"])
        if c["ffn_hidden_size"]:
            argv += ["--ffn-hidden-size", str(c["ffn_hidden_size"])]
        if c["num_query_groups"]:
            argv += ["--group-query-attention", "--num-query-groups", str(c["num_query_groups"])]
        if c.get("kv_channels"):
            argv += ["--kv-channels", str(c["kv_channels"])]
        argv += ["--add-qkv-bias"] * c.get("add_qkv_bias", False)
        planned = plan.plan_json(argv)["params"]
        if not want == planned == got:
            wrong.append((c, f"costs {want}, plan {planned}, megatron-core {got}"))
    assert not wrong, f"{len(wrong)} of {len(cases)} architectures miscounted: {wrong[:3]}"


def test_gpt_units_count_the_defaults_and_every_flag_at_once():
    _check(SOME)


@pytest.mark.slow
def test_gpt_units_count_every_combination_of_the_flags():
    _check(CASES + [FLIPPED, {**DEFAULT, "kv_channels": 16}, {**DEFAULT, "add_qkv_bias": True}])


def test_bad_architecture_values_are_one_line_errors():
    with pytest.raises(ValueError, match="num_query_groups=3: must divide"):
        costs.gpt_units(2, 64, 96, num_attention_heads=8, num_query_groups=3)
    with pytest.raises(ValueError, match="normalization='BatchNorm'"):
        costs.gpt_units(2, 64, 96, normalization="BatchNorm")
    with pytest.raises(ValueError, match="kv_channels=16 needs num_attention_heads"):
        costs.gpt_units(2, 64, 96, kv_channels=16)
    # Megatron reads --num-query-groups only with --group-query-attention (default 1 group)
    with pytest.raises(plan.UsageError, match="without --group-query-attention"):
        plan.plan_json(["--world-size", "8", "--num-layers", "2", "--hidden-size", "64",
                        "--vocab-size", "96", "--num-attention-heads", "8",
                        "--num-query-groups", "2"])
    one = ["--world-size", "8", "--num-layers", "2", "--hidden-size", "64", "--vocab-size", "96",
           "--num-attention-heads", "8", "--group-query-attention"]
    assert plan.plan_json(one)["params"] == costs.gpt_param_count(
        2, 64, 96, num_attention_heads=8, num_query_groups=1)
    # the learned position table has --max-position-embeddings rows, as Megatron's
    table = ["--world-size", "8", "--num-layers", "2", "--hidden-size", "64", "--vocab-size",
             "96", "--seq-length", "16", "--position-embedding-type", "learned_absolute"]
    assert plan.plan_json(table + ["--max-position-embeddings", "32"])["params"] \
        == plan.plan_json(table)["params"] + 16 * 64
