"""Memory and traffic per rank of one hierarchy configuration (pure arithmetic, no torch).

The planning side of docs/design.md §2: from the group sizes (P, S, G, O, R),
bucket sizes and dtypes, the bytes of each kind of state a rank holds and the
bytes it sends per optimizer step over each link class.
Invariants: every figure is bytes per rank, from the padded bucket exactly as
the layout pads it (so the engine's byte counters equal these figures); a
collective is charged to the slowest link class its group spans; a group of
one rank costs 0. The accounting rules and formulas: docs/design.md.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Mapping, Sequence

# The engine's own names for what it does; pure, so the cost model stays torch-free.
from megatron_lbp.core.vocabulary import (DEFAULT_EMBEDDING_BACKWARD_GATHER,
                                          EMBEDDING_BACKWARD_GATHERS, MAX_PENDING_REDUCES,
                                          PHASES, SPLIT_KINDS, UNIT_KINDS)
from megatron_lbp.core.config import hierarchical_grad_reduce
from megatron_lbp.core.layout import plan_bucket
from megatron_lbp.core import program

LINK_CLASS_ORDER = ("package", "node", "network")
MEMORY_STATES = ("primary", "secondary", "grad", "optimizer", "total")
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GRAD_BYTES = {"fp32": 4, "bf16": 2}
SECONDARY_DTYPES = ("int8", "bf16", "param")
DEFAULT_ALIGN = 128
DEFAULT_QUANT_BLOCK = 256
# Families whose link class the traffic formulas read (secondary only when S > 0).
# ("grad_cross" only with the two-hop qgZ.)
TRAFFIC_FAMILIES = ("param", "secondary", "grad_cross", "grad", "inter", "grad_to_param",
                    "replica")


# --- sizes -------------------------------------------------------------------------------


def _sizes(cfg) -> tuple[int, int, int, int, int, int]:
    """(W, P, G, O, S, R) of a HierConfig-like object, checked by the layout's nesting rules."""
    W, P, G, O = (int(cfg.world_size), int(cfg.param_group_size), int(cfg.grad_group_size),
                  int(cfg.optim_group_size))
    S = int(cfg.secondary_group_size or 0)
    plan_bucket(1, W, P, G, O, S)  # raises LayoutError naming the size that breaks a rule
    return W, P, G, O, S, W // O


def padded_numel(numel: int, cfg, align: int = DEFAULT_ALIGN) -> int:
    """Elements a bucket of ``numel`` occupies after padding: exactly what the engine allocates."""
    W, P, G, O, S, _ = _sizes(cfg)
    return plan_bucket(numel, W, P, G, O, S, align).padded_numel


def split_buckets(num_params: int, bucket_size: int | None = None) -> list[int]:
    """Bucket numels for ``num_params`` elements in buckets of ``bucket_size`` (None: one bucket)."""
    if num_params <= 0:
        raise ValueError(f"num_params={num_params}: must be > 0")
    if bucket_size is None or bucket_size >= num_params:
        return [num_params]
    if bucket_size <= 0:
        raise ValueError(f"bucket_size={bucket_size}: must be > 0")
    full, rest = divmod(num_params, bucket_size)
    return [bucket_size] * full + ([rest] if rest else [])


# --- collectives -------------------------------------------------------------------------


# The one byte-charging rule: what one rank sends in a collective over n ranks, ring
# algorithms, ``total`` the full buffer's bytes (an all-gather's output, a reduce-scatter's or
# all-to-all's input, an all-reduce's tensor). The plan (here), the engine's ledger
# (engine/comm.py) and the benchmarks' wrapper of torch.distributed
# (benchmarks/stock_accounting.py) all charge by it.
RING_SENDS = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2}


def ring_sent(op: str, total: int | Fraction, n: int) -> Fraction:
    """Bytes one rank sends in collective ``op`` over ``n`` ranks (RING_SENDS; a group of one
    rank sends nothing); ``"broadcast"``: the root's, total x (n-1)."""
    if n <= 1:
        return Fraction(0)
    if op == "broadcast":
        return Fraction(total) * (n - 1)
    return Fraction(RING_SENDS[op] * Fraction(total) * (n - 1), n)


def allgather_bytes(total: int, n: int) -> int:
    """Bytes one rank sends in a ring all-gather whose full output is ``total`` bytes."""
    if n <= 1:
        return 0
    assert total % n == 0, f"all-gather of {total} bytes over {n} ranks is not even"
    return int(ring_sent("all_gather", total, n))


def reduce_scatter_bytes(total: int, n: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter whose full input is ``total`` bytes."""
    if n <= 1:
        return 0
    assert total % n == 0, f"reduce-scatter of {total} bytes over {n} ranks is not even"
    return int(ring_sent("reduce_scatter", total, n))


def allreduce_bytes(total: int, n: int) -> Fraction:
    """Bytes one rank sends in a ring all-reduce of ``total`` bytes (exact fraction)."""
    return ring_sent("all_reduce", total, n)


def int8_payload_bytes(n_elems: int, quant_block_size: int = DEFAULT_QUANT_BLOCK) -> int:
    """Bytes of ``n_elems`` elements as blockwise int8: one code each plus one fp32 scale per block."""
    return n_elems + 4 * (-(-n_elems // quant_block_size))


def int4_payload_bytes(n_elems: int, quant_block_size: int = DEFAULT_QUANT_BLOCK) -> int:
    """Bytes of ``n_elems`` elements as blockwise int4: two codes a byte plus a fp32 scale per
    block (equal to megatron_lbp.quant.int4.int4_nbytes)."""
    return (n_elems + 1) // 2 + 4 * (-(-n_elems // quant_block_size))


def secondary_slice_bytes(n_elems: int, dtype: str = "int8",
                          quant_block_size: int = DEFAULT_QUANT_BLOCK,
                          weight_bytes: int = 2) -> int:
    """Bytes of one rank's secondary slice of ``n_elems`` elements (``weight_bytes``: the
    weights' element size, for the "param" dtype)."""
    if dtype == "int8":
        return int8_payload_bytes(n_elems, quant_block_size)
    if dtype == "bf16":
        return 2 * n_elems
    if dtype == "param":
        return weight_bytes * n_elems
    raise ValueError(f"secondary dtype {dtype!r}: must be one of {SECONDARY_DTYPES}")


def number(x: Fraction | int) -> int | float:
    """An exact byte count as JSON writes it: an int when whole, else a float."""
    x = Fraction(x)
    return int(x) if x.denominator == 1 else float(x)


def gb_text(nbytes: float, digits: int, *, width: int = 0, unit: bool = True,
            mb_below: float = 0.0, mb_digits: int | None = None) -> str:
    """Bytes as text in GB (1e9) with ``digits`` decimals, right-aligned in ``width``
    characters, followed by " GB" when ``unit``; below ``mb_below`` bytes in MB (1e6)
    with ``mb_digits`` decimals (default ``digits``). The one formatter of the plan
    table, the checkpoint retention lines and the training log's byte report."""
    if nbytes < mb_below:
        return f"{nbytes / 1e6:.{digits if mb_digits is None else mb_digits}f} MB"
    text = format(nbytes / 1e9, f".{digits}f").rjust(width)
    return f"{text} GB" if unit else text


def _dtype_bytes(param_dtype: str, grad_dtype: str) -> tuple[int, int]:
    if param_dtype not in WEIGHT_BYTES:
        raise ValueError(f"param_dtype {param_dtype!r}: must be one of {sorted(WEIGHT_BYTES)}")
    if grad_dtype not in GRAD_BYTES:
        raise ValueError(f"grad_dtype {grad_dtype!r}: must be one of {sorted(GRAD_BYTES)}")
    return WEIGHT_BYTES[param_dtype], GRAD_BYTES[grad_dtype]


def _secondary_dtype(cfg) -> str:
    return str(getattr(cfg, "secondary_dtype", "int8") or "int8")


def _block(cfg, quant_block_size: int | None) -> int:
    """The explicit block size, else the config's, else the default."""
    if quant_block_size is not None:
        return int(quant_block_size)
    return int(getattr(cfg, "quant_block_size", None) or DEFAULT_QUANT_BLOCK)


QGZ_FAMILIES = ("grad", "inter")


def quantized_grad_families(cfg, link_classes: Mapping[str, str | None]) -> tuple[str, ...]:
    """The gradient reduce-scatter families qgZ quantizes: those that cross nodes.

    Empty when qgZ is off. "grad" is the per-micro-batch G-group reduce-scatter
    (it crosses nodes in zero3/zeropp/zero2 beyond one node), "inter" the
    optimizer step's 1/G -> 1/O hop (lbp's network reduce-scatter). A family
    whose groups are single ranks sends nothing and is never listed.
    """
    if not getattr(cfg, "quantize_grad_reduce", False):
        return ()
    sizes = _group_sizes_by_family(cfg)
    return tuple(f for f in QGZ_FAMILIES
                 if sizes[f] > 1 and link_classes.get(f) == "network")


# --- memory ------------------------------------------------------------------------------


def memory_bytes(cfg, bucket_numels: Sequence[int], *, param_dtype: str = "bf16",
                 grad_dtype: str = "fp32", quant_block_size: int | None = None,
                 align: int = DEFAULT_ALIGN) -> dict[str, int]:
    """Persistent bytes per rank by state: {primary, secondary, grad, optimizer, total}.

    ``quant_block_size`` None: the config's (default 256).
    """
    W, P, G, O, S, R = _sizes(cfg)
    wb, gb = _dtype_bytes(param_dtype, grad_dtype)
    sdt = _secondary_dtype(cfg)
    quant_block_size = _block(cfg, quant_block_size)
    opt_per_elem = 8 if param_dtype == "fp32" else 12
    mem = dict.fromkeys(MEMORY_STATES, 0)
    for numel in bucket_numels:
        N = padded_numel(numel, cfg, align)
        mem["primary"] += wb * N // P
        mem["secondary"] += secondary_slice_bytes(N // S, sdt, quant_block_size, wb) if S else 0
        mem["grad"] += gb * N // G
        mem["optimizer"] += opt_per_elem * N // O
    mem["total"] = mem["primary"] + mem["secondary"] + mem["grad"] + mem["optimizer"]
    return mem


def construction_peak_bytes(cfg, bucket_numels: Sequence[int], *, param_dtype: str = "bf16",
                            grad_dtype: str = "fp32", quant_block_size: int | None = None,
                            align: int = DEFAULT_ALIGN) -> int:
    """Peak bytes per rank while the model, the engine and the optimizer are built (sharded init).

    The model is built one module at a time (engine/materialize.py), a
    module's weights at most the largest bucket's (a gather unit's; a
    parameter never spans units), in the weight dtype as Megatron's
    device-init path allocates them. In time order:

    1. the primary slices, plus one module's full weights while it is built;
    2. each bucket's working buffers: its secondary and gradient shards stay,
       its full weight and full gradient buffers are allocated once each and
       freed at once (to lay out the parameter and ``main_grad`` views);
    3. the optimizer's master and Adam slices.

    So the peak is max(primary + w*N_max, primary + secondary + grad +
    max(w, g)*N_max, primary + secondary + grad + optimizer), N_max the
    largest padded bucket. A whole-model build instead holds w*M plus the
    slices. (--use-cpu-initialization keeps the module's fp32 master weight
    and its copies in host memory, not on the device.)
    """
    mem = memory_bytes(cfg, bucket_numels, param_dtype=param_dtype, grad_dtype=grad_dtype,
                       quant_block_size=quant_block_size, align=align)
    wb, gb = _dtype_bytes(param_dtype, grad_dtype)
    n_max = max(padded_numel(n, cfg, align) for n in bucket_numels)
    slices = mem["primary"] + mem["secondary"] + mem["grad"]
    return max(mem["primary"] + wb * n_max, slices + max(wb, gb) * n_max, mem["total"])


# --- traffic -----------------------------------------------------------------------------


def _group_sizes_by_family(cfg) -> dict[str, int]:
    W, P, G, O, S, R = _sizes(cfg)
    return {"param": P, "secondary": S, "grad": G, "optim": O, "inter": O // G,
            "grad_to_param": G // P, "replica": R,
            "grad_cross": G // S if hierarchical_grad_reduce(cfg) else 1}


def traffic_bytes(cfg, bucket_numels: Sequence[int], link_classes: Mapping[str, str], *,
                  param_dtype: str = "bf16", grad_dtype: str = "fp32", micro_batches: int = 1,
                  quant_block_size: int | None = None, align: int = DEFAULT_ALIGN,
                  no_backward_gather: Sequence[int] = (),
                  ) -> tuple[dict[str, int | float], dict[str, dict[str, int | float]]]:
    """Bytes sent per rank per optimizer step: (by link class, by phase -> by link class).

    ``no_backward_gather``: indices of units the backward never gathers (an untied
    embedding with --hier-embedding-backward-gather skip: :func:`backward_gather_skipped`).

    ``link_classes`` maps a family name ("param", "secondary", "grad", "inter",
    "grad_to_param", "replica") to "package" | "node" | "network"; only families
    whose groups have more than one rank are looked up. ``quant_block_size``
    None: the config's (default 256).
    """
    _dtype_bytes(param_dtype, grad_dtype)
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches}: must be >= 1")
    k = int(micro_batches)
    B = _block(cfg, quant_block_size)
    sizes = _group_sizes_by_family(cfg)
    by_phase: dict[str, dict[str, Fraction]] = {
        ph: {c: Fraction(0) for c in LINK_CLASS_ORDER} for ph in PHASES}

    def charge(phase: str, family: str, nbytes) -> None:
        if not nbytes:
            return
        cls = link_classes.get(family)
        if cls not in LINK_CLASS_ORDER:
            raise ValueError(f"link class of family {family!r} (group size "
                             f"{sizes[family]}) is {cls!r}: must be one of {LINK_CLASS_ORDER}")
        by_phase[phase][cls] += nbytes

    skipped = set(no_backward_gather)
    for i, numel in enumerate(bucket_numels):
        for (phase, family), nbytes in unit_collective_bytes(
                cfg, numel, link_classes, param_dtype=param_dtype, grad_dtype=grad_dtype,
                quant_block_size=B, align=align).items():
            if phase == "backward_gather" and i in skipped:
                continue
            charge(phase, family, repeats(cfg, phase, family, k) * nbytes)

    by_class = {c: number(sum(by_phase[ph][c] for ph in PHASES)) for c in LINK_CLASS_ORDER}
    phases = {ph: {c: number(v) for c, v in by_phase[ph].items()} for ph in PHASES}
    return by_class, phases


PER_MICRO_BATCH_PHASES = ("forward_gather", "backward_gather", "grad_reduce")


def repeats(cfg, phase: str, family: str, micro_batches: int) -> int:
    """How often a step issues a unit's (phase, family) collective of
    :func:`unit_collective_bytes`: per micro-batch phases k times, the step's once; with the
    secondary copy's step scope the forward reads the primary slices once (the step's first
    forward) and the secondary copy in the k-1 others."""
    k = int(micro_batches)
    if phase == "forward_gather" and _step_scope(cfg):
        return 1 if family == "param" else k - 1
    return k if phase in PER_MICRO_BATCH_PHASES else 1


def _step_scope(cfg) -> bool:
    return bool(cfg.secondary_group_size) and getattr(cfg, "secondary_scope", "backward") == "step"


def backward_gather_skipped(unit_kinds: Sequence[str], tied_embedding: bool,
                            embedding_backward_gather: str) -> tuple[int, ...]:
    """Units the backward gathers for nobody: with ``embedding_backward_gather="skip"`` the
    embedding unit, unless tied (the output layer's backward then gathers it, once, as
    the default schedule does)."""
    if embedding_backward_gather != "skip" or tied_embedding:
        return ()
    return tuple(i for i, kind in enumerate(unit_kinds) if kind == "embedding")


def unit_collective_bytes(cfg, numel: int, link_classes: Mapping[str, str | None], *,
                          param_dtype: str = "bf16", grad_dtype: str = "fp32",
                          quant_block_size: int | None = None, align: int = DEFAULT_ALIGN,
                          ) -> dict[tuple[str, str], int | Fraction]:
    """Bytes this rank sends in each collective of one unit of ``numel`` elements.

    (phase, family) -> bytes of one collective: the phases of
    PER_MICRO_BATCH_PHASES issue theirs once per micro-batch, the step phases
    once per optimizer step (the formulas of the module docstring; a family
    of one rank sends 0). ``link_classes`` only decides which families qgZ
    quantizes. :func:`traffic_bytes` is the sum of these over the units.
    """
    W, P, G, O, S, R = _sizes(cfg)
    wb, gb = _dtype_bytes(param_dtype, grad_dtype)
    sdt = _secondary_dtype(cfg)
    B = _block(cfg, quant_block_size)
    qwz = bool(getattr(cfg, "quantize_weight_gather", False))
    qgz = quantized_grad_families(cfg, link_classes)
    N = padded_numel(numel, cfg, align)
    weights = (allgather_bytes(P * int8_payload_bytes(N // P, B), P) if qwz
               else allgather_bytes(wb * N, P))
    out: dict[tuple[str, str], int | Fraction] = {("forward_gather", "param"): weights}
    if S:
        # qwZ sends a copy not already int8 as int8 (engine/unit.py _gather_secondary).
        slice_bytes = (int8_payload_bytes(N // S, B) if qwz and sdt != "int8"
                       else secondary_slice_bytes(N // S, sdt, B, wb))
        out[("backward_gather", "secondary")] = allgather_bytes(S * slice_bytes, S)
        if _step_scope(cfg):
            out[("forward_gather", "secondary")] = out[("backward_gather", "secondary")]
    else:
        out[("backward_gather", "param")] = weights
    payload = int4_payload_bytes if _int4(cfg) else int8_payload_bytes
    if "grad" in qgz and hierarchical_grad_reduce(cfg):
        X, c = G // S, N // G
        out[("grad_reduce", "secondary")] = (S - 1) * X * payload(c, B)
        out[("grad_reduce", "grad_cross")] = (X - 1) * payload(c, B)
    else:
        out[("grad_reduce", "grad")] = _grad_reduce_bytes(gb * N, N, G, "grad" in qgz, B,
                                                          payload)
    out[("step_reduce", "inter")] = _grad_reduce_bytes(gb * N // G, N // G, O // G,
                                                       "inter" in qgz, B, payload)
    out[("step_reduce", "replica")] = allreduce_bytes(gb * N // O, R)
    out[("step_gather", "inter")] = allgather_bytes(wb * N // G, O // G)
    out[("step_gather", "grad_to_param")] = allgather_bytes(wb * N // P, G // P)
    return out


CODEC_DIRECTIONS = ("encode", "decode")


def unit_codec_calls(cfg, numel: int, link_classes: Mapping[str, str | None], *,
                     align: int = DEFAULT_ALIGN) -> dict[tuple[str, str], list[tuple]]:
    """The quantizer calls of one unit of ``numel`` elements, by (phase, family) as
    :func:`unit_collective_bytes` keys its collectives: [(codec, direction, calls,
    elements per call)] of one such collective (``("forward_gather", "secondary_build")``:
    the int8 secondary copy's slice, encoded by the forward that builds it).

    As the engine calls them (engine/quantized.py): a quantized gather encodes this rank's
    slice once and decodes every member's, its own included; a quantized reduce-scatter
    encodes and decodes the n - 1 chunks that cross to another rank; the two-hop qgZ does
    that in the S-group for X chunks each, then across the X groups for one.
    """
    W, P, G, O, S, R = _sizes(cfg)
    sdt = _secondary_dtype(cfg)
    qwz = bool(getattr(cfg, "quantize_weight_gather", False))
    qgz = quantized_grad_families(cfg, link_classes)
    N = padded_numel(numel, cfg, align)
    grad_codec = "int4" if _int4(cfg) else "int8"

    def gather(n: int, encode: bool = True) -> list[tuple]:
        return ([("int8", "encode", 1, N // n)] if encode else []) + \
            [("int8", "decode", n, N // n)]

    def reduce(codec: str, calls: int, elems: int) -> list[tuple]:
        return [(codec, d, calls, elems) for d in CODEC_DIRECTIONS] if calls else []

    out: dict[tuple[str, str], list[tuple]] = {}
    if qwz:
        out[("forward_gather", "param")] = gather(P)
    if S and sdt == "int8":
        out[("forward_gather", "secondary_build")] = [("int8", "encode", 1, N // S)]
        out[("backward_gather", "secondary")] = gather(S, encode=False)
    elif S and qwz:
        out[("backward_gather", "secondary")] = gather(S)
    elif qwz:
        out[("backward_gather", "param")] = gather(P)
    if S and _step_scope(cfg) and ("backward_gather", "secondary") in out:
        out[("forward_gather", "secondary")] = out[("backward_gather", "secondary")]
    if "grad" in qgz and hierarchical_grad_reduce(cfg):
        X, c = G // S, N // G
        out[("grad_reduce", "secondary")] = reduce(grad_codec, (S - 1) * X, c)
        out[("grad_reduce", "grad_cross")] = reduce(grad_codec, X - 1, c)
    elif "grad" in qgz:
        out[("grad_reduce", "grad")] = reduce(grad_codec, G - 1, N // G)
    if "inter" in qgz:
        out[("step_reduce", "inter")] = reduce(grad_codec, O // G - 1, N // O)
    return {key: calls for key, calls in out.items() if calls}


def codec_calls(cfg, bucket_numels: Sequence[int], link_classes: Mapping[str, str | None], *,
                micro_batches: int = 1, align: int = DEFAULT_ALIGN,
                no_backward_gather: Sequence[int] = ()) -> dict[str, list[dict[str, Any]]]:
    """The quantizer calls of one optimizer step, by phase: [{codec, direction, elements (per
    call), calls}], from :func:`unit_codec_calls` repeated as the step issues each collective
    (:func:`repeats`; the int8 secondary copy is built by every forward, with the step scope
    by the first only)."""
    k = int(micro_batches)
    skipped = set(no_backward_gather)
    tally: dict[str, dict[tuple[str, str, int], int]] = {ph: {} for ph in PHASES}
    for i, numel in enumerate(bucket_numels):
        for (phase, family), calls in unit_codec_calls(cfg, numel, link_classes,
                                                       align=align).items():
            if phase == "backward_gather" and i in skipped:
                continue
            times = ((1 if _step_scope(cfg) else k) if family == "secondary_build"
                     else repeats(cfg, phase, family, k))
            for codec, direction, n, elems in calls:
                key = (codec, direction, elems)
                tally[phase][key] = tally[phase].get(key, 0) + times * n
    return {ph: [{"codec": c, "direction": d, "elements": e, "calls": n}
                 for (c, d, e), n in sorted(rows.items()) if n]
            for ph, rows in tally.items()}


def _int4(cfg) -> bool:
    return getattr(cfg, "grad_quant_scheme", "int8") == "int4-hier"


def _grad_reduce_bytes(total: int, elems: int, n: int, quantized: bool, block: int,
                       payload=int8_payload_bytes) -> int:
    """A reduce-scatter of ``elems`` elements (``total`` bytes) over n ranks, plain or qgZ
    (``payload``: bytes of one quantized chunk)."""
    if not quantized or n <= 1:
        return reduce_scatter_bytes(total, n)
    assert elems % n == 0, f"qgZ all-to-all of {elems} elements over {n} ranks is not even"
    return (n - 1) * payload(elems // n, block)


def estimate(cfg, bucket_numels: Sequence[int], link_classes: Mapping[str, str], *,
             param_dtype: str = "bf16", grad_dtype: str = "fp32", micro_batches: int = 1,
             quant_block_size: int | None = None,
             align: int = DEFAULT_ALIGN, no_backward_gather: Sequence[int] = ()) -> dict[str, Any]:
    """Everything at once, as plain data.

    Returns {"params": sum of bucket numels, "padded_params": sum of padded numels,
    "bucket_numels", "padded_bucket_numels", "memory_bytes", "traffic_bytes",
    "traffic_by_phase", "codec_calls" (:func:`codec_calls`)}.
    """
    buckets = [int(n) for n in bucket_numels]
    padded = [padded_numel(n, cfg, align) for n in buckets]
    by_class, by_phase = traffic_bytes(
        cfg, buckets, link_classes, param_dtype=param_dtype, grad_dtype=grad_dtype,
        micro_batches=micro_batches, quant_block_size=quant_block_size, align=align,
        no_backward_gather=no_backward_gather)
    return {
        "params": sum(buckets),
        "padded_params": sum(padded),
        "bucket_numels": buckets,
        "padded_bucket_numels": padded,
        "memory_bytes": memory_bytes(cfg, buckets, param_dtype=param_dtype,
                                     grad_dtype=grad_dtype,
                                     quant_block_size=quant_block_size, align=align),
        "traffic_bytes": by_class,
        "traffic_by_phase": by_phase,
        "codec_calls": codec_calls(cfg, buckets, link_classes, micro_batches=micro_batches,
                                   align=align, no_backward_gather=no_backward_gather),
    }


# --- model size --------------------------------------------------------------------------


def gpt_units(num_layers: int, hidden_size: int, vocab_size: int,
              seq_length: int | None = None, ffn_hidden_size: int | None = None,
              tied: bool = True, *, position_embedding_type: str | None = None,
              swiglu: bool = False, num_attention_heads: int | None = None,
              num_query_groups: int | None = None, normalization: str = "LayerNorm",
              add_bias_linear: bool = True, kv_channels: int | None = None,
              add_qkv_bias: bool = False, split_layers: bool = False) -> list[tuple[str, int]]:
    """The engine's gather units of a megatron-core ``GPTModel``: (kind, numel), forward order.

    One unit is what one all-gather brings in (megatron_lbp.integration.megatron_adapter's
    ``gather_units`` declares the same split for a real model). Assumes
    megatron-core defaults: LayerNorm (weight + bias), biased linears
    (``add_bias_linear=True``), multi-head attention (no GQA), a non-gated MLP
    with ``ffn_hidden_size`` (default 4h), a final LayerNorm, no tensor
    parallelism. With L layers, hidden h, ffn f, vocab V (pass Megatron's
    *padded* vocab size), sequence s::

        embedding  = V*h (word embeddings) + s*h if the position embedding is learned_absolute
        layer      = 2h            input LayerNorm            (L of these)
                   + 3h*h + 3h     linear_qkv
                   + h*h + h       linear_proj
                   + 2h            pre-MLP LayerNorm
                   + h*f + f       linear_fc1
                   + f*h + h       linear_fc2
                   = 4h^2 + 2hf + 9h + f          (= 12h^2 + 13h when f = 4h)
        output     = 2h (final LayerNorm) + V*h if not tied (output layer, no bias)

    With tied embeddings the output layer computes with the embedding unit's
    weight, so the output unit holds the final LayerNorm only.

    Megatron's other architecture flags change the layer as follows (n heads of
    d = h/n channels, g query groups; ``normalization`` "RMSNorm" has a weight and
    no bias, so each norm is h; ``add_bias_linear=False`` (--disable-bias-linear)
    drops every linear bias; ``add_qkv_bias`` (--add-qkv-bias, Qwen2) keeps
    linear_qkv's; ``swiglu`` (--swiglu) gates the MLP: linear_fc1 has 2f outputs;
    ``num_query_groups`` (--group-query-attention --num-query-groups g) shrinks
    linear_qkv to n*d + 2*g*d outputs; ``kv_channels`` (--kv-channels) sets d,
    default h/n; both need ``num_attention_heads``)::

        layer = 2*norm + h*(nd + 2gd) [+ nd + 2gd] + nd*h [+ h] + h*f*m [+ f*m] + f*h [+ h]

    with m = 2 for SwiGLU, else 1, and the bracketed terms only with linear biases
    (linear_qkv's also with ``add_qkv_bias``).

    ``split_layers`` (--hier-layer-unit split): each layer is two units, "attention"
    (input norm, linear_qkv, linear_proj) and "mlp" (pre-MLP norm, linear_fc1,
    linear_fc2), whose sum is the layer above.

    ``position_embedding_type``: None means "learned_absolute" when
    ``seq_length`` is given and "rope" (no position table) otherwise;
    "rope"/"none" never count a table; "learned_absolute" needs ``seq_length``.
    """
    L, h, V = int(num_layers), int(hidden_size), int(vocab_size)
    f = 4 * h if ffn_hidden_size is None else int(ffn_hidden_size)
    for name, v in (("num_layers", L), ("hidden_size", h), ("vocab_size", V),
                    ("ffn_hidden_size", f)):
        if v <= 0:
            raise ValueError(f"{name}={v}: must be > 0")
    pe = position_embedding_type or ("learned_absolute" if seq_length else "rope")
    if pe not in ("learned_absolute", "rope", "none"):
        raise ValueError(f"position_embedding_type={pe!r}: must be learned_absolute, rope or none")
    if pe == "learned_absolute" and not seq_length:
        raise ValueError("position_embedding_type=learned_absolute needs seq_length > 0")
    embedding = V * h
    if pe == "learned_absolute":
        if int(seq_length) <= 0:
            raise ValueError(f"seq_length={seq_length}: must be > 0")
        embedding += int(seq_length) * h
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization={normalization!r}: must be LayerNorm or RMSNorm")
    norm = 2 * h if normalization == "LayerNorm" else h
    query, qkv_out = h, 3 * h
    if num_query_groups is not None or kv_channels is not None:
        what = (f"num_query_groups={num_query_groups}" if num_query_groups is not None
                else f"kv_channels={kv_channels}")
        n = int(num_attention_heads or 0)
        if n <= 0 or (kv_channels is None and h % n):
            raise ValueError(f"{what} needs num_attention_heads dividing hidden_size={h}")
        g = n if num_query_groups is None else int(num_query_groups)
        if g <= 0 or n % g:
            raise ValueError(f"num_query_groups={g}: must divide num_attention_heads={n}")
        d = h // n if kv_channels is None else int(kv_channels)
        if d <= 0:
            raise ValueError(f"kv_channels={d}: must be > 0")
        query, qkv_out = n * d, (n + 2 * g) * d
    m = 2 if swiglu else 1
    bias = 1 if add_bias_linear else 0
    attention = (norm + h * qkv_out + query * h
                 + (1 if add_bias_linear or add_qkv_bias else 0) * qkv_out + bias * h)
    mlp = norm + h * f * m + f * h + bias * (f * m + h)
    layer = ([("attention", attention), ("mlp", mlp)] if split_layers
             else [("layer", attention + mlp)])
    output = norm + (0 if tied else V * h)
    return [("embedding", embedding)] + layer * L + [("output", output)]


def gpt_param_count(num_layers: int, hidden_size: int, vocab_size: int,
                    seq_length: int | None = None, ffn_hidden_size: int | None = None,
                    tied: bool = True, *, position_embedding_type: str | None = None,
                    **architecture) -> int:
    """Parameters of a megatron-core ``GPTModel``: the sum of :func:`gpt_units` (see there;
    ``architecture``: its swiglu, num_attention_heads, num_query_groups, normalization,
    add_bias_linear, kv_channels, add_qkv_bias)."""
    return sum(n for _, n in gpt_units(num_layers, hidden_size, vocab_size, seq_length,
                                       ffn_hidden_size, tied,
                                       position_embedding_type=position_embedding_type,
                                       **architecture))


# --- transient memory --------------------------------------------------------------------

# The peaks are maxima over the step's segments, and only the first micro-batch (its forward
# waits for the last step's refresh) and the last (its backward issues the network
# reductions) differ from the others, which allocate alike: walking three micro-batches gives
# every peak of K, at a cost that does not grow with K (a launcher's choice walks hundreds of
# plans of up to ~50 micro-batches). tests/unit/test_transient_knobs.py holds it to the full walk.
WALKED_MICRO_BATCHES = 3

def transient_bytes(cfg, unit_numels: Sequence[int], *, param_dtype: str = "bf16",
                    grad_dtype: str = "fp32", prefetch_units: int = 1,
                    tied_embedding: bool = False, quantized_grad_families: Sequence[str] = (),
                    quant_block_size: int | None = None, micro_batches: int = 1,
                    overlap: bool = True, grad_chunk_ordered: bool = True,
                    max_pending_reduces: int = MAX_PENDING_REDUCES,
                    embedding_backward_gather: str = DEFAULT_EMBEDDING_BACKWARD_GATHER,
                    unit_kinds: Sequence[str] | None = None, linear_biases: bool = True,
                    align: int = DEFAULT_ALIGN) -> dict[str, int]:
    """The engine's peak transient bytes per rank, by part of the step: its schedule replayed.

    Counted as the engine's transient ledger counts them (full weight units and
    their gather buffers, full gradient units and their reduce-scatter buffers,
    the step's 1/O gradients), by walking the buffers of the step's program
    (megatron_lbp.core.program, which the engine's schedule executes) over the
    units (forward order; ``tied_embedding``: unit 0 is the embedding,
    which the last unit's output layer computes with, so it stays gathered
    from the embedding to the output layer and from the output layer's
    backward to the end):

    - forward: a module needs its units (gathered, or waited for when
      prefetched), issues the gathers of the next ``prefetch_units`` = d units
      (each in flight with its receive buffers until its own need), computes,
      and frees its units after their last user;
    - backward (with or without activation recomputation, which needs the units
      the same way): as forward in reverse order, gathering from the secondary
      copy when S > 0; a unit's full gradient exists from its first gradient on;
      at its last one its weights are freed, its reduce-scatter issued (a
      separate send/receive buffer where the reduction needs one: the 1/G
      result on every micro-batch but the step's first, the transposed copy
      where the G-group's communicator is not in chunk order, qgZ's int8
      buffers), and the oldest reduction is completed when more than
      ``max_pending_reduces`` are in flight. A completed reduction frees the full
      gradient; on the step's last micro-batch it then issues the unit's
      network reduction, whose 1/O result stays until the optimizer step.
      ``max_pending_reduces`` (--hier-max-pending-reduces, default
      MAX_PENDING_REDUCES) = r: a backward holds at most r + 1 full gradient
      units with their reduce buffers (the one just issued and r in flight).
      ``embedding_backward_gather="skip"`` (--hier-embedding-backward-gather;
      unit 0 is the embedding): unit 0 is neither gathered nor prefetched for
      its own backward, and, tied, its weights gathered for the output layer are
      freed once the output layer's backward is done, before the output unit's
      gradient (the V·h weights no longer live across every layer's backward).
      ``unit_kinds`` (None: no unit is split): an "attention" unit (--hier-layer-unit
      split) stays gathered in forward until the next unit, its layer's MLP, has been
      needed and its prefetch issued (the layer adds linear_proj's bias after
      self-attention returns; the engine frees it after the pre-MLP norm's forward).
      In backward, with ``linear_biases`` (not --disable-bias-linear), an "attention" or
      "mlp" unit's full gradient exists before its need: the layer's bias-dropout-add
      hands autograd the bias's gradient (linear_proj's, linear_fc2's) first, before the
      half's backward begins, while its gather may still be in flight.

    Reductions are assumed to complete only when the schedule must wait for
    them: the engine also completes those already done at each hook, which
    only frees memory sooner, so the real peak is at most this one and equals
    it when the collectives are slower than a unit's compute. Memory that is
    not the engine's (activations, the tied embedding's output-layer gradient
    autograd holds until the embedding's backward) is not counted here.

    Keys: ``unit_gather`` (the largest unit with its gather buffers, forward or
    backward), ``prefetch`` (d of those), ``forward``, ``backward`` (the peak of
    the step's last micro-batch: every earlier one holds less), ``step`` (the
    optimizer step: every unit's 1/O gradient, widened to fp32 when reduced in
    bf16, plus one network qgZ reduction's buffers) and ``peak`` (the largest).
    ``overlap`` (the engine's --hier-overlap, on by default): off, nothing is prefetched and
    every reduction completes at once; on, ``prefetch_units`` may still be 0.
    """
    W, P, G, O, S, R = _sizes(cfg)
    wb, gb = _dtype_bytes(param_dtype, grad_dtype)
    if prefetch_units < 0:
        raise ValueError(f"prefetch_units={prefetch_units}: must be >= 0")
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches}: must be >= 1")
    if max_pending_reduces < 1:
        raise ValueError(f"max_pending_reduces={max_pending_reduces}: must be >= 1")
    if embedding_backward_gather not in EMBEDDING_BACKWARD_GATHERS:
        raise ValueError(f"embedding_backward_gather={embedding_backward_gather!r}: must be "
                         f"one of {EMBEDDING_BACKWARD_GATHERS}")
    d = int(prefetch_units) if overlap else 0
    B = _block(cfg, quant_block_size)
    qwz = bool(getattr(cfg, "quantize_weight_gather", False))
    sdt = _secondary_dtype(cfg)
    families = set(quantized_grad_families)
    padded = [padded_numel(n, cfg, align) for n in unit_numels]
    n_units = len(padded)
    n_inter = O // G
    tied = bool(tied_embedding) and n_units >= 2
    skip = embedding_backward_gather == "skip"

    def in_flight(N: int, secondary: bool) -> int:
        """Receive (and send) buffers of a gather, alive until the unit's need waits for it."""
        if secondary and S:
            if sdt == "int8":
                return S * int8_payload_bytes(N // S, B) if S > 1 else 0
            if qwz:    # quantized on the way: its send and receive buffers
                return (S + 1) * int8_payload_bytes(N // S, B) if S > 1 else 0
            if sdt == "param":
                return 0
            return 2 * N if wb != 2 else 0    # bf16 copy of wider weights: widened on arrival
        return (P + 1) * int8_payload_bytes(N // P, B) if qwz and P > 1 else 0

    payload = int4_payload_bytes if _int4(cfg) else int8_payload_bytes
    two_hop = "grad" in families and hierarchical_grad_reduce(cfg)
    X = G // S if two_hop else 1

    def reduce_extra(N: int, fresh: bool) -> int:
        transpose = gb * N if (not grad_chunk_ordered and 1 < P < G) else 0
        out = 0 if fresh else gb * N // G
        qgz = 2 * G * payload(N // G, B) if ("grad" in families and G > 1) else 0
        return transpose + out + qgz

    def finish_extra(N: int) -> int:   # qgZ's fp32 sums and part (two hops: hop 2's buffers)
        if two_hop:
            c = N // G
            return 4 * X * c + 2 * 4 * c + 2 * X * payload(c, B)
        return 2 * 4 * (N // G) if ("grad" in families and G > 1) else 0

    def step_network(N: int) -> int:
        return (2 * n_inter * payload(N // O, B) + 2 * 4 * (N // O)
                if "inter" in families and n_inter > 1 else 0)

    def step_grad(N: int) -> int:   # the 1/O result of the network hop (the shard itself if O == G)
        return gb * N // O if n_inter > 1 else 0

    def nbytes(buffer: str, u: int, segment: str, fresh: bool) -> int:
        N = padded[u]
        return {"weights": lambda: wb * N, "gather": lambda: in_flight(N, False),
                "secondary_gather": lambda: in_flight(N, True),
                "grad": lambda: gb * N, "reduce": lambda: reduce_extra(N, fresh),
                "finish": lambda: finish_extra(N), "step_grad": lambda: step_grad(N),
                "step_network": lambda: step_network(N),
                "widened": lambda: 4 * N // O if gb != 4 else 0}[buffer]()

    spec = program.ProgramSpec(
        unit_kinds=tuple(unit_kinds or ("layer",) * n_units), group_sizes=program.group_sizes(cfg),
        tied_embedding=tied, micro_batches=min(micro_batches, WALKED_MICRO_BATCHES),
        prefetch_units=prefetch_units,
        max_pending_reduces=max_pending_reduces, overlap=overlap,
        embedding_backward_gather=embedding_backward_gather, linear_biases=linear_biases,
        quantized_grad_families=tuple(quantized_grad_families),
        secondary_serves_step=_step_scope(cfg))
    walked = program.peaks(program.step_program(spec), nbytes)
    forward, backward = walked["forward"], walked["backward"]
    widen = sum(4 * N // O for N in padded) if (gb != 4) else 0
    step = (sum(step_grad(N) for N in padded) + widen
            + max((step_network(N) for N in padded), default=0))
    gather_max = max((wb * N + max(in_flight(N, False), in_flight(N, bool(S))) for N in padded),
                     default=0)
    return {"prefetch_units": d, "max_pending_reduces": int(max_pending_reduces) if overlap else 0,
            "unit_gather": gather_max, "prefetch": d * gather_max,
            "forward": forward, "backward": backward, "step": step,
            "peak": max(forward, backward, step)}
