"""The launcher's activation estimate (candidates.activation_bytes) for the MLP's width and SwiGLU.

What a transformer layer holds for its backward is measured on real megatron-core layers
(local spec, bf16, Megatron's default dropouts): every tensor autograd saves in the
forward (torch.autograd.graph.saved_tensors_hooks), counted once per storage, parameters
left out; a layer's figure is the model with two layers minus the model with one. The CPU
build saves more than Korthikanti's count in absolute terms (its unfused kernels), so the
check is on what the architecture flags change: the formula's difference between two
architectures equals the measured one.
"""
from __future__ import annotations


import pytest

from megatron_lbp.launch import candidates
from megatron_lbp.launch.job import Job
from megatron_lbp.testing.multirank import run_single

S, B, H, HEADS, V = 64, 2, 128, 8, 256


def _shape(**over):
    a = dict(seq_length=S, hidden_size=H, num_attention_heads=HEADS, num_layers=1,
             vocab_size=V, ffn_hidden_size=0, swiglu=False, params_dtype="bf16",
             untie_embeddings_and_output_weights=False)
    a.update(over)
    return Job(**a)


def _layer(**over) -> int:
    """The formula's bytes of one layer without recomputation (two layers minus one)."""
    return (candidates.activation_bytes(_shape(num_layers=2, **over), "none", B)
            - candidates.activation_bytes(_shape(num_layers=1, **over), "none", B))


def test_defaults_keep_korthikantis_34sbh_and_the_width_and_swiglu_count():
    sbh = S * B * H
    assert _layer() == 34 * sbh + 5 * HEADS * S * S * B
    # the MLP saves its fc1 output and the activation's output: 2 bytes x f each
    assert _layer() - _layer(ffn_hidden_size=2 * H) == 4 * S * B * (4 * H - 2 * H)
    # SwiGLU's fc1 has 2f outputs (saved by the fused bias-SwiGLU) and the product f
    assert _layer(swiglu=True, ffn_hidden_size=352) - _layer(ffn_hidden_size=352) \
        == 2 * S * B * 352
    swiglu = _shape(nodes=1, tasks_per_node=8, gcds_per_package=2, preset="lbp",
                    position_embedding_type="rope", bucket_size=1000,
                    hier_grad_reduce_dtype="fp32", hier_secondary_group_size=0, swiglu=True)
    assert candidates.plan_request(swiglu, 8).model.swiglu     # the plan counts it too
    assert "--swiglu" in candidates.plan_command(swiglu, 8)


def _saved_per_layer(cases):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_lbp.testing.tiny_gpt import init_megatron_state

    init_megatron_state()

    def saved(c, layers):
        config = TransformerConfig(
            num_layers=layers, hidden_size=H, num_attention_heads=HEADS,
            num_query_groups=c.get("groups"), ffn_hidden_size=c.get("ffn"),
            gated_linear_unit=c.get("swiglu", False),
            activation_func=torch.nn.functional.silu if c.get("swiglu") else
            torch.nn.functional.gelu,
            bias_activation_fusion=c.get("swiglu", False),   # Megatron's --bias-swiglu-fusion
            use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
            hidden_dropout=0.1, attention_dropout=0.1)
        torch.manual_seed(0)
        model = Float16Module(config, GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V,
            max_sequence_length=S, position_embedding_type="rope"))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                storages[st.data_ptr()] = st.nbytes()
            return t

        tokens = torch.randint(0, V, (B, S))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens, torch.arange(S).expand(B, S), attention_mask=None, labels=tokens)
        return sum(storages.values())

    return [saved(c, 2) - saved(c, 1) for c in cases]


@pytest.mark.slow   # ten megatron-core models built and run: about a minute under load
def test_width_swiglu_and_gqa_change_the_estimate_as_they_change_a_real_layer():
    cases = {"default": {}, "ffn 2h": {"ffn": 2 * H}, "swiglu ffn 2h": {"swiglu": True, "ffn": 2 * H},
             "gqa 2 groups": {"groups": 2}, "gqa 1 group": {"groups": 1}}
    measured = dict(zip(cases, run_single(_saved_per_layer, list(cases.values()), timeout=900)))
    formula = {"default": _layer(), "ffn 2h": _layer(ffn_hidden_size=2 * H),
               "swiglu ffn 2h": _layer(ffn_hidden_size=2 * H, swiglu=True),
               "gqa 2 groups": _layer(), "gqa 1 group": _layer()}
    report = {k: (formula[k], measured[k]) for k in cases}
    # the MLP's width and SwiGLU: exactly what the formula says they change
    for a, b in (("default", "ffn 2h"), ("ffn 2h", "swiglu ffn 2h")):
        assert formula[b] - formula[a] == measured[b] - measured[a], \
            f"{a} -> {b}: formula {formula[b] - formula[a]:+d} B, measured " \
            f"{measured[b] - measured[a]:+d} B per layer (formula, measured: {report})"
    # grouped-query attention: K and V are expanded to every head before the core attention
    # saves them, so the layer's figure does not follow the group count (the formula keeps it)
    assert measured["gqa 2 groups"] == measured["gqa 1 group"], report
    assert abs(measured["gqa 2 groups"] - measured["default"]) <= 0.1 * measured["default"], report
