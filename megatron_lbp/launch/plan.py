"""Plan a hierarchy before launching it: ``python -m megatron_lbp.plan``.

Resolves the --hier-* flags as training does, places W ranks on emulated
nodes and packages, and prints the memory per rank by state and the bytes each
rank sends per optimizer step per link class (megatron_lbp.core.costs);
``--choose`` ranks the configurations by projected step time under memory.
A user error exits with status 2 and one line naming the flag, value and rule
(``main(argv)`` returns it). Flags and the ``--json`` fields: docs/planning.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import decimal
import functools
import json
import sys
from typing import Any, Sequence

from megatron_lbp.core import costs
from megatron_lbp.core.config import (PRESETS, HierConfigError, add_hier_arguments,
                                      default_grad_reduce_dtype, max_pending_reduces_from_args,
                                      prefetch_units_from_args)
from megatron_lbp.core.plan import (Model, Plan, PlanError, PlanRequest, make_plan, query_groups,
                                    transient)
from megatron_lbp.core.topology import LINK_CLASSES
from megatron_lbp.core.vocabulary import SPLIT_WITH_FULL_RECOMPUTE
from megatron_lbp.projection import knobs
from megatron_lbp.projection.project import ComputeModel

PROG = "python -m megatron_lbp.plan"
FAMILY_LABELS = {
    "param": "param (P)", "secondary": "secondary (S)", "grad": "grad (G)",
    "optim": "optim (O)", "inter": "inter (O/G)", "grad_to_param": "grad_to_param (G/P)",
    "replica": "replica (R)",
}
GB = 1e9


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        raise UsageError(message)


# --------------------------------------------------------------------------- arguments


def _number(flag: str, text: str, *, minimum: int = 1) -> int:
    """A whole number written as 20e9, 2.5e9 or 20000000000 (exact, no float rounding)."""
    try:
        value = decimal.Decimal(text.strip())
    except (decimal.InvalidOperation, AttributeError):
        raise UsageError(f"{flag}={text}: not a number") from None
    if not value.is_finite():
        raise UsageError(f"{flag}={text}: must be a finite number")
    if value != value.to_integral_value():
        raise UsageError(f"{flag}={text}: must be a whole number")
    if value < minimum:
        raise UsageError(f"{flag}={text}: must be >= {minimum}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, allow_abbrev=False, description=(
        "Memory per rank and bytes sent per link class for a hierarchical "
        "(P, S, G, O) partitioning, before launching it."))
    p.add_argument("--world-size", required=True, metavar="W",
                   help="data-parallel ranks W (required)")
    p.add_argument("--gpus-per-node", metavar="N", default=None,
                   help="data-parallel ranks per node (default 8); same as --hier-gpus-per-node")
    p.add_argument("--gcds-per-package", metavar="N", default=None,
                   help="data-parallel ranks per package (default 2); "
                        "same as --hier-gcds-per-package")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="same as --hier-preset (default lbp)")
    m = p.add_argument_group("model size (give --params or a GPT shape)")
    m.add_argument("--params", metavar="M", default=None,
                   help="parameter count, e.g. 20e9")
    m.add_argument("--num-layers", metavar="L", default=None)
    m.add_argument("--hidden-size", metavar="H", default=None)
    m.add_argument("--vocab-size", metavar="V", default=None,
                   help="(padded) vocabulary size")
    m.add_argument("--ffn-hidden-size", metavar="F", default=None, help="default 4*hidden")
    m.add_argument("--seq-length", metavar="S", default=None,
                   help="sequence length (counts a position table with "
                        "--position-embedding-type learned_absolute)")
    m.add_argument("--max-position-embeddings", metavar="P", default=None,
                   help="rows of the learned position table (default --seq-length), as "
                        "Megatron's flag")
    m.add_argument("--position-embedding-type", choices=("rope", "learned_absolute", "none"),
                   default="rope", help="default rope (no position table)")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer (V*h more parameters)")
    m.add_argument("--swiglu", action="store_true", help="gated MLP (linear_fc1 has 2*F outputs)")
    m.add_argument("--num-attention-heads", metavar="N", default=None,
                   help="attention heads (needed with --group-query-attention, --kv-channels)")
    m.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads "
                        "(default 1, as Megatron's)")
    m.add_argument("--num-query-groups", metavar="G", default=None,
                   help="key/value heads; as in Megatron, only with --group-query-attention")
    m.add_argument("--kv-channels", metavar="D", default=None,
                   help="channels per attention head (default hidden/heads)")
    m.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    m.add_argument("--disable-bias-linear", action="store_true", help="no linear biases")
    m.add_argument("--add-qkv-bias", action="store_true",
                   help="linear_qkv keeps its bias under --disable-bias-linear (Qwen2)")
    s = p.add_argument_group("training step")
    s.add_argument("--params-dtype", choices=tuple(costs.WEIGHT_BYTES), default="bf16",
                   help="weight dtype (default bf16)")
    s.add_argument("--grad-dtype", choices=tuple(costs.GRAD_BYTES), default=None,
                   help="gradient shard / reduction dtype (default fp32); same as "
                        "--hier-grad-reduce-dtype")
    s.add_argument("--micro-batches", metavar="K", default="1",
                   help="micro-batches per optimizer step (default 1)")
    s.add_argument("--bucket-size", metavar="ELEMS", default=None,
                   help="bucket size in elements for a model sized by --params (default: the "
                        "whole model as one bucket); a GPT shape is cut into the engine's "
                        "gather units instead (embedding, each layer, output layer)")
    s.add_argument("--micro-batch-size", metavar="B", default="1",
                   help="sequences per micro-batch, for the transient knobs' exposed time "
                        "(default 1)")
    s.add_argument("--recompute", choices=("full", "selective", "none"), default="full",
                   help="activation recomputation, for the transient knobs' exposed time "
                        "(default full, the launcher's)")
    s.add_argument("--mfu", metavar="F", default="0.35",
                   help="model FLOPs utilisation of the compute the knobs' collectives hide "
                        "behind (default 0.35, the projection's)")
    s.add_argument("--quant-block-size", metavar="B", default=None,
                   help="elements per fp32 scale of every int8 payload (default 256); "
                        "same as --hier-quant-block-size")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_hier_arguments(p)
    # One setting, two spellings: "not given" must be told from the default (_pick_alias).
    p.set_defaults(hier_grad_reduce_dtype=None)
    return p


def _pick_alias(args, short: str, long: str, default):
    """Value of a flag that has two spellings; error if both are given and differ.

    Integer flags are compared as integers (the short spelling is parsed here,
    the --hier-* one by config's argparse type).
    """
    values = {}
    for flag in (short, long):
        v = getattr(args, flag.lstrip("-").replace("-", "_"))
        if v is not None and not isinstance(default, str) and default is not None:
            v = _number(flag, str(v))
        if v is not None:
            values[flag] = v
    if len(values) == 2 and values[short] != values[long]:
        raise UsageError(f"{short}={values[short]} and {long}={values[long]} disagree: "
                         "give one of them (they are the same setting)")
    return next(iter(values.values()), default)


def model_from_args(args) -> Model:
    """The model of the plan's flags: a GPT shape, or --params; UsageError naming the flag."""
    shape_flags = ("--num-layers", "--hidden-size", "--vocab-size")
    extra_flags = ("--ffn-hidden-size", "--seq-length", "--max-position-embeddings")
    given = {f: getattr(args, f[2:].replace("-", "_")) for f in shape_flags + extra_flags}
    if args.params is not None:
        both = [f for f, v in given.items() if v is not None]
        if both:
            raise UsageError(f"--params={args.params} and {both[0]}={given[both[0]]} both "
                             "given: give --params or a model shape, not both")
        return Model(params=_number("--params", args.params))
    missing = [f for f in shape_flags if given[f] is None]
    if len(missing) == len(shape_flags):
        extras = [f for f in extra_flags if given[f] is not None]
        hint = f" ({extras[0]} alone does not size a model)" if extras else ""
        raise UsageError("--params is missing: give --params M or --num-layers, "
                         f"--hidden-size and --vocab-size{hint}")
    if missing:
        raise UsageError(f"{missing[0]} is missing: a model shape needs --num-layers, "
                         "--hidden-size and --vocab-size")
    num = {f: _number(f, given[f]) for f in shape_flags}
    ffn = None if given["--ffn-hidden-size"] is None else \
        _number("--ffn-hidden-size", given["--ffn-hidden-size"])
    seq = None if given["--seq-length"] is None else _number("--seq-length", given["--seq-length"])
    if given["--max-position-embeddings"] is not None:   # Megatron's table has these rows
        seq = _number("--max-position-embeddings", given["--max-position-embeddings"])
    pe = args.position_embedding_type
    if pe == "learned_absolute" and seq is None:
        raise UsageError("--position-embedding-type=learned_absolute needs --seq-length or "
                         "--max-position-embeddings (the position table's rows)")
    return Model(num["--num-layers"], num["--hidden-size"], num["--vocab-size"],
                 ffn_hidden_size=ffn, table_rows=seq, position_embedding_type=pe,
                 tied=not args.untie_embeddings_and_output_weights, swiglu=args.swiglu,
                 num_attention_heads=_int_or_none("--num-attention-heads",
                                                  args.num_attention_heads),
                 num_query_groups=query_groups(args.group_query_attention,
                                               _int_or_none("--num-query-groups",
                                                            args.num_query_groups)),
                 kv_channels=_int_or_none("--kv-channels", args.kv_channels),
                 normalization=args.normalization, add_bias_linear=not args.disable_bias_linear,
                 add_qkv_bias=args.add_qkv_bias)


def _int_or_none(flag: str, value) -> int | None:
    return None if value is None else _number(flag, str(value))


# --------------------------------------------------------------------------- planning


def plan_json(argv: Sequence[str] | None = None, *, knob_table: bool = True) -> dict[str, Any]:
    """``python -m megatron_lbp.plan ARGV --json`` in process: the command's JSON object;
    raises UsageError. The package plans through core.plan.make_plan with a request."""
    return plan_from_args(build_parser().parse_args(argv), knob_table=knob_table).as_dict()


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    """The plan's flags resolved once into a request (the command's edge); UsageError."""
    world = _number("--world-size", args.world_size)
    gpn = _pick_alias(args, "--gpus-per-node", "--hier-gpus-per-node", 8)
    gpp = _pick_alias(args, "--gcds-per-package", "--hier-gcds-per-package", 2)
    preset = _pick_alias(args, "--preset", "--hier-preset", None)
    k = _number("--micro-batches", args.micro_batches)
    # not given: bf16 for zeropp under bf16 (DeepSpeed's communication dtype), else fp32
    args.grad_dtype = (_pick_alias(args, "--grad-dtype", "--hier-grad-reduce-dtype", None)
                       or default_grad_reduce_dtype(preset, args.params_dtype))
    block = _pick_alias(args, "--quant-block-size", "--hier-quant-block-size",
                        costs.DEFAULT_QUANT_BLOCK)
    bucket = _int_or_none("--bucket-size", args.bucket_size)
    if args.hier_layer_unit == "split" and args.recompute == "full":
        raise UsageError(f"--hier-layer-unit split with --recompute full: "
                         f"{SPLIT_WITH_FULL_RECOMPUTE} (the engine refuses it); plan "
                         "--recompute selective or none")
    model = model_from_args(args)
    try:
        depth = prefetch_units_from_args(args)
        pending = max_pending_reduces_from_args(args)
    except HierConfigError as exc:
        raise UsageError(_spoken(args, str(exc))) from None
    return PlanRequest(
        world_size=world, model=model, gpus_per_node=gpn, gcds_per_package=gpp, preset=preset,
        param_group_size=args.hier_param_group_size, grad_group_size=args.hier_grad_group_size,
        optim_group_size=args.hier_optim_group_size,
        secondary_group_size=args.hier_secondary_group_size,
        secondary_dtype=args.hier_secondary_dtype, quant_block_size=block,
        quantize_weight_gather=args.hier_quantize_weight_gather,
        quantize_grad_reduce=args.hier_quantize_grad_reduce,
        allow_non_colocated=bool(args.hier_allow_non_colocated), overlap=bool(args.hier_overlap),
        params_dtype=args.params_dtype, grad_dtype=args.grad_dtype, micro_batches=k,
        bucket_size=bucket, prefetch_units=depth, max_pending_reduces=pending,
        embedding_backward_gather=args.hier_embedding_backward_gather,
        layer_unit=args.hier_layer_unit)


def _spoken(args, msg: str) -> str:
    """A config error in the spelling the user typed."""
    if args.gpus_per_node is not None:
        msg = msg.replace("--hier-gpus-per-node", "--gpus-per-node")
    if args.gcds_per_package is not None:
        msg = msg.replace("--hier-gcds-per-package", "--gcds-per-package")
    if args.preset is not None:
        msg = msg.replace("--hier-preset", "--preset")
    msg = msg.replace("train in bf16 (--bf16)", "plan bf16 weights (--params-dtype bf16)")
    if args.quant_block_size is not None:
        msg = msg.replace("--hier-quant-block-size", "--quant-block-size")
    if getattr(args, "hier_grad_reduce_dtype", None) is None:
        msg = msg.replace("--hier-grad-reduce-dtype", "--grad-dtype")
    return msg.replace("--hier-world-size", "--world-size")


def plan_from_args(args: argparse.Namespace, *, knob_table: bool = True) -> Plan:
    """The plan for parsed arguments (see build_parser), with the knob table unless
    ``knob_table=False``; raises UsageError."""
    try:
        req = request_from_args(args)
        p = make_plan(req)
        if not (args.hier_overlap and knob_table):
            return p
        return dataclasses.replace(p, transient_knobs=tuple(_knob_rows(args, req, p)))
    except PlanError as exc:
        raise UsageError(_spoken(args, str(exc))) from None


def _knob_rows(args, req: PlanRequest, plan: Plan) -> list[dict[str, Any]]:
    """The transient knobs: per setting, its transient peak, what it saves against the setting
    asked for, and what it costs in exposed seconds per step (projection/knobs.py; None where
    the model has no GPT shape and --seq-length to time its compute by)."""
    timed = args.params is None and args.seq_length is not None
    model = {"hidden_size": req.model.hidden_size} if timed else None
    mfu = _fraction("--mfu", args.mfu)
    compute = ComputeModel(mfu=mfu, seq_length=_number("--seq-length", args.seq_length)
                           if timed else 2048,
                           micro_batch_size=_number("--micro-batch-size", args.micro_batch_size),
                           recompute=args.recompute == "full")
    cfg, classes, units = plan.config, plan.link_classes, list(plan.unit_list)
    qgz = tuple(plan.quantize_grad_reduce)
    tied = units[0][0] == "embedding" and req.model.tied
    depth, pending, gdt0 = req.prefetch_units, req.max_pending_reduces, req.grad_dtype

    def exposed(grad_dtype: str, d: int, r: int, emb: str, layers) -> float | None:
        if not timed:
            return None
        # Every unit's backward gather, priced per unit (knobs.exposed_s leaves out the ones
        # the setting skips).
        _, by_phase = costs.traffic_bytes(cfg, [n for _, n in layers], classes,
                                          param_dtype=req.params_dtype, grad_dtype=grad_dtype,
                                          micro_batches=req.micro_batches)
        p = dataclasses.replace(plan, traffic_by_phase=by_phase)
        return knobs.exposed_s(p, layers, model, knobs.Knobs(d, r, emb), compute=compute,
                               tied=tied)["step"]

    emb, lu = req.embedding_backward_gather, req.layer_unit
    settings = [(depth, pending, gdt0, emb, lu, "as given")]
    settings += [(d, r, gdt0, emb, lu, "") for d, r in knobs.TABLE_SETTINGS
                 if (d, r) != (depth, pending)]
    other = "bf16" if gdt0 == "fp32" else "fp32"
    settings.append((depth, pending, other, emb, lu, f"--hier-grad-reduce-dtype {other}: also "
                     "the gradient shard; a numerics choice, never made for you"))
    if units[0][0] == "embedding":
        flip = "skip" if emb == "gather" else "gather"
        settings.append((depth, pending, gdt0, flip, lu,
                         f"--hier-embedding-backward-gather {flip}"))
        # Splitting the largest units, where the engine can: not under full recomputation.
        if args.recompute != "full" or lu == "split":
            other_lu = "whole" if lu == "split" else "split"
            settings.append((depth, pending, gdt0, emb, other_lu,
                             f"--hier-layer-unit {other_lu}"))
    layers_of = {lu: units}
    rows = []
    for d, r, gdt, e, layer_unit, note in settings:
        if layer_unit not in layers_of:
            layers_of[layer_unit] = req.model.units(layer_unit)
        layers = layers_of[layer_unit]
        t = transient(req, cfg, qgz, layers, d, r, gdt, e)
        rows.append({"prefetch_units": d, "max_pending_reduces": r, "grad_reduce_dtype": gdt,
                     "embedding_backward_gather": e, "layer_unit": layer_unit,
                     "transient_peak": t["peak"], "transient_backward": t["backward"],
                     "exposed_s": exposed(gdt, d, r, e, layers), "note": note})
    first = rows[0]
    for row in rows:
        row["saves_bytes"] = first["transient_peak"] - row["transient_peak"]
        row["cost_s"] = (None if row["exposed_s"] is None
                         else row["exposed_s"] - first["exposed_s"])
    return rows


def _fraction(flag: str, text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UsageError(f"{flag}={text}: not a number") from None
    if not 0 < value <= 1:
        raise UsageError(f"{flag}={text}: must be in (0, 1]")
    return value


# --------------------------------------------------------------------------- output


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if len(ranks) <= 6:
        return ",".join(map(str, ranks))
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        if step == 1:
            return f"{ranks[0]}-{ranks[-1]}"
        return f"{ranks[0]},{ranks[1]},{ranks[2]},...,{ranks[-1]} (step {step})"
    return ",".join(map(str, ranks[:5])) + f",... ({len(ranks)} ranks)"


_gb = functools.partial(costs.gb_text, digits=3, width=10, unit=False)  # the table's GB column


def _bytes(x) -> str:
    return f"{x:,.0f}" if isinstance(x, float) and not float(x).is_integer() else f"{int(x):,}"


def _units_text(counts: dict[str, int]) -> str:
    names = {"embedding": "embedding", "layer": "layer", "attention": "attention half",
             "mlp": "MLP half", "output": "output", "other": "bucket"}
    plural = {"layer": "layers", "attention": "attention halves", "mlp": "MLP halves",
              "other": "buckets"}
    return ", ".join(f"{n} {plural[k] if n > 1 and k in plural else names[k]}"
                     for k, n in counts.items() if n)


def _uses_int8(plan: Plan) -> bool:
    return bool((plan.group_sizes.secondary and plan.secondary_dtype == "int8")
                or plan.quantize_weight_gather or plan.quantize_grad_reduce)


def render(plan: Plan) -> str:
    """Human-readable report of a plan dict."""
    gs = plan.group_sizes
    W = plan.world_size
    nodes = -(-W // plan.gpus_per_node)
    lines = [
        f"megatron-lbp plan: W={W} data-parallel ranks on {nodes} node(s) of "
        f"{plan.gpus_per_node} ranks, {plan.gcds_per_package} ranks per package; "
        f"preset {plan.preset}",
        f"group sizes: P={gs.param}  S={gs.secondary or 0}"
        f"{' (' + plan.secondary_dtype + ')' if gs.secondary else ' (off)'}"
        f"  G={gs.grad}  O={gs.optim}  R={gs.replicas} replica(s)",
        f"model: {plan.params:,} parameters in {plan.buckets} gather unit(s)"
        f" ({_units_text(plan.units)}), padded to "
        f"{plan.padded_params:,} (+{plan.padding:,} padding elements, "
        f"{100 * plan.padding / plan.params:.4f}%)",
        f"step: weights {plan.params_dtype}, gradients {plan.grad_dtype}, "
        f"{plan.micro_batches} micro-batch(es) per optimizer step"
        + (f", int8 scale block {plan.quant_block_size}"
           if _uses_int8(plan) else "")
        + (", int8 weight gathers (qwZ)" if plan.quantize_weight_gather else "")
        + (f", int8 gradient all-to-all (qgZ) in {'+'.join(plan.quantize_grad_reduce)}"
           if plan.quantize_grad_reduce else ""),
        "",
        "groups (rank 0's)        size  link     ranks",
    ]
    for fam, ranks in plan.groups.items():
        cls = plan.link_classes[fam] or "-"
        lines.append(f"  {FAMILY_LABELS.get(fam, fam):<22}{len(ranks):>5}  {cls:<8} "
                     f"{_ranks_text(ranks)}")
    lines += ["", "memory per rank (GB = 1e9 bytes)     GB             bytes"]
    for state in costs.MEMORY_STATES:
        v = getattr(plan.memory_bytes, state)
        if state == "total":
            lines.append("  " + "-" * 52)
        lines.append(f"  {state:<28}{_gb(v)}  {_bytes(v):>18}")
    v = plan.construction_peak_bytes
    lines.append(f"  {'construction peak':<28}{_gb(v)}  {_bytes(v):>18}"
                 "  (model built module by module)")
    t = plan.transient_bytes
    lines += ["", f"transient per rank, at most (GB; prefetch {plan.prefetch_units} unit(s) ahead)",
              f"  {'largest unit gathered':<28}{_gb(t.unit_gather)}",
              f"  {'prefetch':<28}{_gb(t.prefetch)}",
              f"  {'forward / backward / step':<28}{_gb(t.forward)} {_gb(t.backward)} "
              f"{_gb(t.step)}",
              f"  ({plan.max_pending_reduces} gradient reduce-scatter(s) in flight at most)"]
    lines += _knob_lines(plan)
    lines += ["", "bytes sent per rank per optimizer step (GB)",
              f"  {'phase':<20}" + "".join(f"{c:>12}" for c in LINK_CLASSES)]
    for ph, by_cls in plan.traffic_by_phase.items():
        lines.append(f"  {ph:<20}" + "".join(f"{by_cls[c] / GB:12.3f}" for c in LINK_CLASSES))
    lines.append("  " + "-" * 56)
    lines.append(f"  {'total':<20}" + "".join(f"{plan.traffic_bytes[c] / GB:12.3f}"
                                              for c in LINK_CLASSES))
    for c in LINK_CLASSES:
        lines.append(f"  {c + ' bytes':<20}{_bytes(plan.traffic_bytes[c]):>36}")
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _knob_lines(plan: Plan) -> list[str]:
    rows = plan.transient_knobs
    if not rows:
        return []
    lines = ["", "transient knobs (peak GB; saves: against the first row; exposed: seconds of "
             "per-micro-batch communication not hidden per step, projection/knobs.py, "
             "Frontier links)",
             f"  {'prefetch  pending  grads  embedding  layers':<47}{'peak':>10} {'saves':>10} "
             f"{'exposed s':>10} {'costs s':>10}"]
    for r in rows:
        exp = "-" if r["exposed_s"] is None else f"{r['exposed_s']:.3f}"
        cost = "-" if r["cost_s"] is None else f"{r['cost_s']:+.3f}"
        lines.append(f"  {r['prefetch_units']:>8}  {r['max_pending_reduces']:>7}  "
                     f"{r['grad_reduce_dtype']:<5}  {r['embedding_backward_gather']:<9}  "
                     f"{r['layer_unit']:<6}  "
                     f"{_gb(r['transient_peak'])} "
                     f"{_gb(r['saves_bytes'])} {exp:>10} {cost:>10}"
                     + (f"  {r['note']}" if r["note"] else ""))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 for any user error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--choose" in argv:   # the configuration by projected step time (launch/choose.py)
        from megatron_lbp.launch import estimate

        return estimate.choose_main(argv)
    try:
        args = build_parser().parse_args(argv)
        plan = plan_from_args(args)
    except (UsageError, PlanError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    print(json.dumps(plan.as_dict()) if args.json else render(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
