"""Tensor names and layouts between Hugging Face checkpoints and megatron-core's GPTModel.

One layer at a time (Megatron stacks each layer kind along a leading axis); both
directions are pure functions of the tensors handed in, so each output costs at most its
own inputs in memory. Handled here: Megatron's ``linear_qkv`` rows go group by group
(the group's query heads, its key head, its value head) where Hugging Face keeps three
matrices (Llama) or one [Q; K; V] (GPT-2); GPT-2's Conv1D weights are transposed;
SwiGLU's ``linear_fc1`` is [gate; up]. transformers' Llama RoPE rotates halves, as
Megatron does without ``--rotary-interleaved``, so q and k need no permutation.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_lbp.hf.arch import Arch

Get = Callable[[str], torch.Tensor]


def _qkv_to_megatron(arch: Arch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = arch.num_query_groups, arch.head_dim
    per = arch.num_heads // g
    tail = q.shape[1:]
    parts = [q.reshape(g, per * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)]
    return torch.cat(parts, dim=1).reshape(-1, *tail).contiguous()


def _qkv_from_megatron(arch: Arch, qkv: torch.Tensor):
    g, d = arch.num_query_groups, arch.head_dim
    per = arch.num_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *tail)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def hf_prefix(arch: Arch) -> str:
    return "transformer." if arch.gpt2 else "model."


def global_names(arch: Arch) -> dict[str, list[str]]:
    """Megatron key of each non-layer tensor -> the HF names it is made of."""
    p = hf_prefix(arch)
    if arch.gpt2:
        out = {"embedding.word_embeddings.weight": [p + "wte.weight"],
               "embedding.position_embeddings.weight": [p + "wpe.weight"],
               "decoder.final_layernorm.weight": [p + "ln_f.weight"],
               "decoder.final_layernorm.bias": [p + "ln_f.bias"]}
    else:
        out = {"embedding.word_embeddings.weight": [p + "embed_tokens.weight"],
               "decoder.final_layernorm.weight": [p + "norm.weight"]}
    if not arch.tied:
        out["output_layer.weight"] = ["lm_head.weight"]
    return out


def layer_to_megatron(arch: Arch, i: int) -> dict[str, tuple[list[str], Callable[..., torch.Tensor]]]:
    """Megatron layer suffix -> (HF names of layer i it needs, function of those tensors)."""
    ident = lambda t: t  # noqa: E731
    if arch.gpt2:
        h = f"{hf_prefix(arch)}h.{i}."
        T = lambda t: t.t().contiguous()  # noqa: E731  (Conv1D stores (in, out))

        def qkv_w(w):
            q, k, v = w.t().chunk(3, dim=0)
            return _qkv_to_megatron(arch, q, k, v)

        def qkv_b(b):
            return _qkv_to_megatron(arch, *b.chunk(3, dim=0))

        return {
            "input_layernorm.weight": ([h + "ln_1.weight"], ident),
            "input_layernorm.bias": ([h + "ln_1.bias"], ident),
            "self_attention.linear_qkv.weight": ([h + "attn.c_attn.weight"], qkv_w),
            "self_attention.linear_qkv.bias": ([h + "attn.c_attn.bias"], qkv_b),
            "self_attention.linear_proj.weight": ([h + "attn.c_proj.weight"], T),
            "self_attention.linear_proj.bias": ([h + "attn.c_proj.bias"], ident),
            "pre_mlp_layernorm.weight": ([h + "ln_2.weight"], ident),
            "pre_mlp_layernorm.bias": ([h + "ln_2.bias"], ident),
            "mlp.linear_fc1.weight": ([h + "mlp.c_fc.weight"], T),
            "mlp.linear_fc1.bias": ([h + "mlp.c_fc.bias"], ident),
            "mlp.linear_fc2.weight": ([h + "mlp.c_proj.weight"], T),
            "mlp.linear_fc2.bias": ([h + "mlp.c_proj.bias"], ident),
        }
    h = f"model.layers.{i}."
    a = h + "self_attn."
    out = {
        "input_layernorm.weight": ([h + "input_layernorm.weight"], ident),
        "self_attention.linear_qkv.weight": ([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                                             lambda q, k, v: _qkv_to_megatron(arch, q, k, v)),
        "self_attention.linear_proj.weight": ([a + "o_proj.weight"], ident),
        "pre_mlp_layernorm.weight": ([h + "post_attention_layernorm.weight"], ident),
        "mlp.linear_fc1.weight": ([h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"],
                                  lambda g, u: torch.cat([g, u], dim=0)),
        "mlp.linear_fc2.weight": ([h + "mlp.down_proj.weight"], ident),
    }
    if arch.qkv_bias:
        out["self_attention.linear_qkv.bias"] = (
            [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
            lambda q, k, v: _qkv_to_megatron(arch, q, k, v))
    return out


def layer_to_hf(arch: Arch, i: int) -> dict[str, Callable[[torch.Tensor], dict[str, torch.Tensor]]]:
    """Megatron layer suffix -> function of its layer-i tensor giving the HF tensors of layer i."""
    out = {}
    for suffix, (names, _) in layer_to_megatron(arch, i).items():
        out[suffix] = _inverse(arch, suffix, names)
    return out


def _inverse(arch: Arch, suffix: str, names: list[str]) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    if suffix.endswith("linear_qkv.weight") or suffix.endswith("linear_qkv.bias"):
        def qkv(t):
            q, k, v = _qkv_from_megatron(arch, t)
            if arch.gpt2:
                joined = torch.cat([q, k, v], dim=0)
                return {names[0]: joined.t().contiguous() if joined.dim() == 2 else joined}
            return dict(zip(names, (q, k, v)))
        return qkv
    if suffix == "mlp.linear_fc1.weight" and not arch.gpt2:
        return lambda t: dict(zip(names, (c.contiguous() for c in t.chunk(2, dim=0))))
    if arch.gpt2 and suffix.endswith(".weight") and t_is_conv1d(suffix):
        return lambda t: {names[0]: t.t().contiguous()}
    return lambda t: {names[0]: t.contiguous()}


def t_is_conv1d(suffix: str) -> bool:
    return suffix.split(".")[-2] in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def layer_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    """Shape of one layer's tensor of each Megatron suffix (what layer_to_megatron produces)."""
    h, d = arch.hidden_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_query_groups) * d
    fc1 = arch.ffn_hidden_size * (1 if arch.gpt2 else 2)
    shapes = {"input_layernorm.weight": (h,), "self_attention.linear_qkv.weight": (qkv, h),
              "self_attention.linear_proj.weight": (h, arch.num_heads * d),
              "pre_mlp_layernorm.weight": (h,), "mlp.linear_fc1.weight": (fc1, h),
              "mlp.linear_fc2.weight": (h, arch.ffn_hidden_size)}
    if arch.qkv_bias:
        shapes["self_attention.linear_qkv.bias"] = (qkv,)
    if arch.gpt2:
        shapes.update({"input_layernorm.bias": (h,), "self_attention.linear_proj.bias": (h,),
                       "pre_mlp_layernorm.bias": (h,), "mlp.linear_fc1.bias": (fc1,),
                       "mlp.linear_fc2.bias": (h,)})
    return shapes


def global_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    h = arch.hidden_size
    shapes = {"embedding.word_embeddings.weight": (arch.vocab_size, h),
              "decoder.final_layernorm.weight": (h,)}
    if arch.gpt2:
        shapes["embedding.position_embeddings.weight"] = (arch.max_positions, h)
        shapes["decoder.final_layernorm.bias"] = (h,)
    if not arch.tied:
        shapes["output_layer.weight"] = (arch.vocab_size, h)
    return shapes


# megatron-core's local layer spec saves its norms under Transformer Engine's
# names (sharded_state_dict_keys_map of get_gpt_layer_local_spec), so that
# either implementation loads the other's checkpoints.
_CKPT_RENAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                 "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def layer_key(suffix: str) -> str:
    """The checkpoint key of a layer tensor (all layers stacked on its leading axis)."""
    for old, new in _CKPT_RENAMES.items():
        if suffix.startswith(old):
            return "decoder.layers." + new + suffix[len(old):]
    return "decoder.layers." + suffix


LINEAR_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def extra_states(arch: Arch) -> dict[str, None]:
    """The linear layers' ``_extra_state`` objects megatron-core saves per layer (None without fp8),
    by ShardedObject unique key; a load fails on a missing one."""
    L = arch.num_layers
    return {f"decoder.layers.{m}._extra_state/shard_{i}_{L}": None
            for i in range(L) for m in LINEAR_MODULES}
