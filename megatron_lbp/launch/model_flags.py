"""Megatron's model flags the planner counts, spelt and read as Megatron reads them, in one
table: the estimate's command line takes them (:func:`add_arguments`) and the launcher reads
them from the training command (:func:`read`), so both count the same model."""
from __future__ import annotations

from typing import Callable, Mapping

from megatron_lbp.launch.candidates import EstimateError
from megatron_lbp.launch.job_values import integer, one_of

POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
REQUIRED = object()
# flag: (what it takes: int, its choices, or None for a switch; the estimate's default; help)
FLAGS = {
    "--num-layers": (int, REQUIRED, None),
    "--hidden-size": (int, REQUIRED, None),
    "--num-attention-heads": (int, REQUIRED, None),
    "--ffn-hidden-size": (int, 0, None),
    "--position-embedding-type": (POSITION_EMBEDDINGS, "rope", None),
    "--max-position-embeddings": (int, 0, "rows of the learned position table (default "
                                          "--seq-length)"),
    "--untie-embeddings-and-output-weights": (None, False, None),
    "--swiglu": (None, False, "gated MLP (Megatron's --swiglu): its parameters and activations"),
    "--group-query-attention": (None, False, "grouped-query attention with --num-query-groups "
                                             "key/value heads (default 1, as Megatron's)"),
    "--num-query-groups": (int, None, "key/value heads; as in Megatron, only with "
                                      "--group-query-attention"),
    "--kv-channels": (int, None, "channels per attention head (default hidden/heads)"),
    "--normalization": (NORMALIZATIONS, "LayerNorm", None),
    "--disable-bias-linear": (None, False, "no linear biases"),
    "--add-qkv-bias": (None, False, "linear_qkv keeps its bias under --disable-bias-linear "
                                    "(Qwen2)"),
}
# Model flags the planner does not count (the launcher warns).
UNCOUNTED = ("--num-experts", "--qk-layernorm", "--multi-latent-attention", "--squared-relu",
             "--quick-geglu")


def field(flag: str) -> str:
    """The Job field of a flag (Megatron's name)."""
    return flag[2:].replace("-", "_")


def add_arguments(ap) -> None:
    """The model flags on an argparse parser (the estimate's command line)."""
    for flag, (kind, default, text) in FLAGS.items():
        if kind is None:
            ap.add_argument(flag, action="store_true", help=text)
        elif default is REQUIRED:
            ap.add_argument(flag, type=kind, required=True, help=text)
        elif kind is int:
            ap.add_argument(flag, type=int, default=default, help=text)
        else:
            ap.add_argument(flag, choices=kind, default=default, help=text)


def value(name: str, flag: str, text: str):
    """A value flag's text read as the flag takes it; ``name`` says where it came from."""
    kind = FLAGS[flag][0]
    return integer(name, text) if kind is int else one_of(name, text, kind)


def read(given: Mapping[str, tuple[str, str]], words: list[str],
         say: Callable[[str], None]) -> dict[str, object]:
    """The Job's model fields from a training command's words, over ``given`` ({flag: (the
    variable it came from, text)}, an empty text: not given): the last of a flag wins, as in
    Megatron's argparse, and --num-query-groups counts only with --group-query-attention.
    ``say`` takes the warning for a flag not counted. EstimateError names the variable or flag."""
    texts = {f: (name, text) for f, (name, text) in given.items() if text}
    on = set()
    for i, f in enumerate(words):
        x = words[i + 1] if i + 1 < len(words) else ""
        if f.startswith("--") and "=" in f:
            f, x = f.split("=", 1)
        if f in FLAGS and FLAGS[f][0] is not None:
            texts[f] = (f, x)
        elif f in FLAGS:
            on.add(f)
        elif f in UNCOUNTED:
            say(f"warning: {f}: the estimate does not count it (parameters, memory and step time "
                "are for the model without it)")
    if "--group-query-attention" not in on:
        texts.pop("--num-query-groups", None)
    out: dict[str, object] = {field(f): True for f in on}
    for f, (name, text) in texts.items():
        if not text:
            raise EstimateError(f"{f} needs a value (the training command gives none)")
        out[field(f)] = value(name, f, text)
    return out
