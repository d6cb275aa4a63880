"""What a Hugging Face ``config.json`` says about the model, and the Megatron flags that build it.

Only what megatron-core's GPTModel (local layers) computes exactly is accepted:
the GPT-2 family (LayerNorm, learned positions, GELU-tanh, biases, tied output)
and the Llama family (RMSNorm, RoPE, SwiGLU, grouped-query attention, tied or
untied output; Mistral without a sliding window; Qwen2's q/k/v biases). Any
other config is refused in one line naming the field, before a tensor is read.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass


class UnsupportedModel(ValueError):
    """A config megatron-core's GPTModel cannot reproduce exactly."""


LLAMA_TYPES = ("llama", "mistral", "qwen2")
FAMILIES = ("gpt2",) + LLAMA_TYPES


@dataclass(frozen=True)
class Arch:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_positions: int
    norm_eps: float
    tied: bool
    qkv_bias: bool
    rope_theta: float = 10000.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    @property
    def gpt2(self) -> bool:
        return self.model_type == "gpt2"


def read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise UnsupportedModel(f"{model_dir} has no config.json (not a Hugging Face model directory)")
    with open(path) as f:
        return json.load(f)


def _refuse(cfg: dict, field: str, why: str) -> None:
    raise UnsupportedModel(f"{cfg.get('model_type')} config: {field}={cfg.get(field)!r}: {why}")


def arch_from_config(cfg: dict) -> Arch:
    """The Arch of ``cfg``, or UnsupportedModel naming the first field Megatron cannot express."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        raise UnsupportedModel(f"model_type {mt!r} is not supported (supported: {', '.join(FAMILIES)})")
    for moe in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"):
        if cfg.get(moe):
            _refuse(cfg, moe, "mixture-of-experts models are not supported")
    if mt == "gpt2":
        return _gpt2(cfg)
    return _llama(cfg)


def _gpt2(cfg: dict) -> Arch:
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        _refuse(cfg, "activation_function", "only the tanh GELU (Megatron's --openai-gelu) is supported")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if cfg.get(flag):
            _refuse(cfg, flag, "Megatron's attention has no such option")
    if cfg.get("scale_attn_weights") is False:
        _refuse(cfg, "scale_attn_weights", "Megatron always scales attention by 1/sqrt(head_dim)")
    if not cfg.get("tie_word_embeddings", True):
        _refuse(cfg, "tie_word_embeddings", "GPT2LMHeadModel always ties its output layer")
    h, heads = cfg["n_embd"], cfg["n_head"]
    return Arch(model_type="gpt2", num_layers=cfg["n_layer"], hidden_size=h, num_heads=heads,
                num_query_groups=heads, head_dim=h // heads,
                ffn_hidden_size=cfg.get("n_inner") or 4 * h, vocab_size=cfg["vocab_size"],
                max_positions=cfg["n_positions"], norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
                tied=True, qkv_bias=True, hidden_dropout=cfg.get("resid_pdrop", 0.1),
                attention_dropout=cfg.get("attn_pdrop", 0.1))


def _llama(cfg: dict) -> Arch:
    mt = cfg["model_type"]
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse(cfg, "hidden_act", "only SwiGLU (silu) MLPs are supported")
    if cfg.get("sliding_window") is not None and (mt != "qwen2" or cfg.get("use_sliding_window")):
        _refuse(cfg, "sliding_window", "sliding-window attention is not supported")
    # transformers >= 5 writes RoPE settings as rope_parameters; older configs as rope_theta/rope_scaling.
    rope = cfg.get("rope_parameters") or {}
    if cfg.get("rope_scaling") and (cfg["rope_scaling"].get("rope_type") or cfg["rope_scaling"].get("type")) != "default":
        _refuse(cfg, "rope_scaling", "RoPE scaling is not supported yet")
    if rope.get("rope_type", "default") != "default":
        _refuse(cfg, "rope_parameters", "RoPE scaling is not supported yet")
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse(cfg, "partial_rotary_factor", "only full rotary embeddings are supported")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        field = "attention_bias" if cfg.get("attention_bias") else "mlp_bias"
        _refuse(cfg, field, "biases on the output/MLP projections are not supported")
    if cfg.get("pretraining_tp", 1) != 1:
        _refuse(cfg, "pretraining_tp", "only 1 is supported")
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if theta != int(theta):
        _refuse(cfg, "rope_theta", "Megatron's --rotary-base is an integer")
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    if heads % groups:
        _refuse(cfg, "num_key_value_heads", f"must divide num_attention_heads={heads}")
    return Arch(model_type=mt, num_layers=cfg["num_hidden_layers"], hidden_size=h, num_heads=heads,
                num_query_groups=groups, head_dim=cfg.get("head_dim") or h // heads,
                ffn_hidden_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                max_positions=cfg.get("max_position_embeddings", 2048),
                norm_eps=cfg.get("rms_norm_eps", 1e-6), tied=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=(mt == "qwen2"), rope_theta=theta,
                attention_dropout=float(cfg.get("attention_dropout", 0.0)))


def megatron_flags(arch: Arch) -> list[str]:
    """megatron.training flags that build exactly this model (TP = 1).

    ``--make-vocab-size-divisible-by <vocab>`` makes Megatron's padded
    vocabulary equal the checkpoint's rows for any tokenizer no larger than it.
    """
    f = ["--num-layers", str(arch.num_layers), "--hidden-size", str(arch.hidden_size),
         "--num-attention-heads", str(arch.num_heads), "--ffn-hidden-size", str(arch.ffn_hidden_size),
         "--max-position-embeddings", str(arch.max_positions),
         "--make-vocab-size-divisible-by", str(arch.vocab_size),
         "--norm-epsilon", repr(arch.norm_eps),
         "--hidden-dropout", repr(arch.hidden_dropout), "--attention-dropout", repr(arch.attention_dropout)]
    if arch.head_dim != arch.hidden_size // arch.num_heads:
        f += ["--kv-channels", str(arch.head_dim)]
    if arch.gpt2:
        f += ["--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm",
              "--openai-gelu"]
        return f
    f += ["--position-embedding-type", "rope", "--rotary-base", str(int(arch.rope_theta)),
          "--rotary-percent", "1.0", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]
    if arch.num_query_groups != arch.num_heads:
        f += ["--group-query-attention", "--num-query-groups", str(arch.num_query_groups)]
    if arch.qkv_bias:
        f += ["--add-qkv-bias"]
    if not arch.tied:
        f += ["--untie-embeddings-and-output-weights"]
    return f
