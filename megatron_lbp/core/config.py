"""Hierarchy configuration: the group sizes P | G | O | W (and S) of LBP.

Pure Python (no torch), so a launch command can be validated without a GPU.
Sizes count data-parallel ranks: P param (primary weights 1/P, package),
S secondary copy (0 = off), G grad (node), O optim (network), R = W / O replicas.
Invariants: the --hier-gpus-per-node / --hier-gcds-per-package flags count all
ranks, and the caller converts them to data-parallel counts
(``topology.dp_domain_sizes``); every invalid input raises ``HierConfigError``
with one line naming the flag, the value and the rule. See docs/design.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

from megatron_lbp.core.vocabulary import (DEFAULT_EMBEDDING_BACKWARD_GATHER,
                                          DEFAULT_LAYER_UNIT, EMBEDDING_BACKWARD_GATHERS,
                                          LAYER_UNITS, MAX_PENDING_REDUCES)

__all__ = [
    "PRESETS",
    "SECONDARY_DTYPES",
    "SECONDARY_SCOPES",
    "GRAD_QUANT_SCHEMES",
    "hierarchical_grad_reduce",
    "default_grad_reduce_dtype",
    "default_secondary_dtype",
    "DEFAULT_PRESET",
    "DEFAULT_GPUS_PER_NODE",
    "DEFAULT_GCDS_PER_PACKAGE",
    "DEFAULT_SECONDARY_DTYPE",
    "ARGUMENT_GROUP_TITLE",
    "HierConfigError",
    "HierConfig",
    "resolve_hier_config",
    "add_hier_arguments",
    "hier_config_from_args",
    "EngineOptions",
    "engine_options_from_args",
    "prefetch_units_from_args",
    "max_pending_reduces_from_args",
    "EMBEDDING_BACKWARD_GATHERS",
    "DEFAULT_EMBEDDING_BACKWARD_GATHER",
    "LAYER_UNITS",
    "DEFAULT_LAYER_UNIT",
    "DEFAULT_PREFETCH_UNITS",
    "DEFAULT_MAX_PENDING_REDUCES",
    "DEFAULT_QUANT_BLOCK_SIZE",
    "QUANT_KERNEL_ALIGN",
    "check_training_dtypes",
    "check_quantized_grad_families",
]

PRESETS = ("lbp", "zero3", "zeropp", "zero2", "hsdp")
# "param": the weights' own dtype (ZeRO++'s hpZ secondary partition).
SECONDARY_DTYPES = ("int8", "bf16", "param")
# When the secondary copy is built and which gathers read it:
# "backward": rebuilt by every forward, read by the backward of that micro-batch;
# "step": built by the step's first forward gather of each unit, then read by every later
# gather of the step (later micro-batches' forwards, every backward) until the optimizer
# step changes the weights (DeepSpeed's hpZ: ds_secondary_tensor, invalidated after the step).
SECONDARY_SCOPES = ("backward", "step")
# qgZ's payload: "int8" one all-to-all over the reduce-scatter's group; "int4-hier" ZeRO++'s
# int4 all-to-all, in the S-group first and across S-groups second where the S-groups nest in
# the gradient group (DeepSpeed's all_to_all_quant_reduce: in the node, then across nodes).
GRAD_QUANT_SCHEMES = ("int8", "int4-hier")
DEFAULT_PRESET = "lbp"
# Frontier: 8 GCDs per node, 2 GCDs per MI250X package.
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_GCDS_PER_PACKAGE = 2
DEFAULT_SECONDARY_DTYPE = "int8"
ARGUMENT_GROUP_TITLE = "hierarchical partitioning (megatron-lbp)"

# Flag spelling per HierConfig field / resolve_hier_config keyword, so every
# message speaks the user's language rather than Python's.
FLAGS = {
    "world_size": "--hier-world-size",
    "param_group_size": "--hier-param-group-size",
    "grad_group_size": "--hier-grad-group-size",
    "optim_group_size": "--hier-optim-group-size",
    "secondary_group_size": "--hier-secondary-group-size",
    "secondary_dtype": "--hier-secondary-dtype",
    "secondary_scope": "--hier-secondary-scope",
    "grad_quant_scheme": "--hier-grad-quant-scheme",
    "gpus_per_node": "--hier-gpus-per-node",
    "gcds_per_package": "--hier-gcds-per-package",
    "preset": "--hier-preset",
    "bucket_size": "--hier-bucket-size",
    "prefetch_units": "--hier-prefetch-units",
    "max_pending_reduces": "--hier-max-pending-reduces",
    "embedding_backward_gather": "--hier-embedding-backward-gather",
    "layer_unit": "--hier-layer-unit",
    "grad_reduce_dtype": "--hier-grad-reduce-dtype",
    "quant_block_size": "--hier-quant-block-size",
    "quantize_weight_gather": "--hier-quantize-weight-gather",
    "quantize_grad_reduce": "--hier-quantize-grad-reduce",
}

GRAD_REDUCE_DTYPES = ("fp32", "bf16")
# Megatron's own default bucket (40M elements) keeps collectives large enough
# to run near link bandwidth on Frontier; tests pass small sizes for many buckets.
DEFAULT_BUCKET_SIZE = 40_000_000
# Gather units whose all-gather runs ahead of the one being computed (FSDP2's default).
DEFAULT_PREFETCH_UNITS = 1
# Gradient reduce-scatters in flight before the oldest is waited for (the engine's own
# figure, kept in its torch-free vocabulary).
DEFAULT_MAX_PENDING_REDUCES = MAX_PENDING_REDUCES

# Blockwise int8 (megatron_lbp.quant, which needs torch; these mirror its
# DEFAULT_BLOCK_SIZE and KERNEL_ALIGN, and a test keeps them equal): one fp32
# scale per block of this many elements, and blocks in whole 64-lane wavefronts.
DEFAULT_QUANT_BLOCK_SIZE = 256
QUANT_KERNEL_ALIGN = 64

_SIZE_FIELDS = ("param_group_size", "secondary_group_size", "grad_group_size", "optim_group_size")


class HierConfigError(ValueError):
    """An invalid hierarchy configuration; the message is one line."""

    def __init__(self, message: str):
        # A multi-line message would be split by launchers that prefix every
        # line with the rank; keep it grep-able as one line.
        super().__init__(" ".join(str(message).split()))


def _flag(field: str, value: Any) -> str:
    return f"{FLAGS[field]}={value}"


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but --hier-param-group-size=True is a bug.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(field: str, value: Any, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        rule = "an integer >= 1" if minimum == 1 else "an integer >= 0 (0 = off)"
        raise HierConfigError(f"{_flag(field, value)} is invalid: it must be {rule}")
    return int(value)


def _check_choice(field: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise HierConfigError(
            f"{_flag(field, value)} is unknown: choose one of {', '.join(choices)}"
        )
    return value


def _check_machine(world_size: Any, gpus_per_node: Any, gcds_per_package: Any) -> None:
    _check_int("world_size", world_size, 1)
    _check_int("gpus_per_node", gpus_per_node, 1)
    _check_int("gcds_per_package", gcds_per_package, 1)
    if gpus_per_node % gcds_per_package:
        raise HierConfigError(
            f"{_flag('gcds_per_package', gcds_per_package)} must divide "
            f"{_flag('gpus_per_node', gpus_per_node)} (a node holds whole packages)"
        )


def _describe(field: str, value: int, origin: str | None) -> str:
    """`--flag=v`, plus where v came from when the user did not type it."""
    text = _flag(field, value)
    return text if origin is None else f"{text} ({origin})"


def _check_nesting(sizes: dict[str, int], world_size: int, origins: dict[str, str | None]) -> None:
    """P | G | O | W and S | W, naming the inner size first."""
    p, g, o, s = (sizes[k] for k in ("param_group_size", "grad_group_size",
                                     "optim_group_size", "secondary_group_size"))
    d = {k: _describe(k, sizes[k], origins.get(k)) for k in sizes}
    if g % p:
        raise HierConfigError(
            f"{d['param_group_size']} must divide {d['grad_group_size']} "
            "- rule P | G: each gradient shard lies inside one weight shard")
    if o > world_size:
        raise HierConfigError(
            f"{d['optim_group_size']} exceeds the data-parallel world size {world_size} "
            "- rule O <= W")
    if o % g:
        raise HierConfigError(
            f"{d['grad_group_size']} must divide {d['optim_group_size']} "
            "- rule G | O: each optimizer shard lies inside one gradient shard")
    if world_size % o:
        raise HierConfigError(
            f"{d['optim_group_size']} must divide the data-parallel world size {world_size} "
            "- rule O | W: there are W / O optimizer replicas")
    if s and world_size % s:
        raise HierConfigError(
            f"{d['secondary_group_size']} must divide the data-parallel world size "
            f"{world_size} - rule S | W, or S = 0 for no secondary copy")


@dataclass(frozen=True)
class HierConfig:
    """Resolved group sizes; build it with ``resolve_hier_config``.

    Constructing it directly (e.g. ``HierConfig(**d)`` from ``as_dict``)
    re-checks the structural rules, but not the preset's locked values.
    """

    world_size: int
    param_group_size: int
    grad_group_size: int
    optim_group_size: int
    secondary_group_size: int
    secondary_dtype: str
    gpus_per_node: int
    gcds_per_package: int
    preset: str
    # Quantized communication (blockwise, one fp32 scale per block):
    # qwZ: every weight all-gather that feeds compute (from the primary slices, and from a
    # secondary copy not stored as int8) carries int8 + scales instead of the weights;
    # qgZ: every gradient reduce-scatter whose groups cross nodes runs as an all-to-all of
    # quantized chunks (grad_quant_scheme), dequantized and summed in fp32 by the receiver.
    quant_block_size: int = DEFAULT_QUANT_BLOCK_SIZE
    quantize_weight_gather: bool = False
    quantize_grad_reduce: bool = False
    secondary_scope: str = "backward"
    grad_quant_scheme: str = "int8"

    def __post_init__(self) -> None:
        _check_machine(self.world_size, self.gpus_per_node, self.gcds_per_package)
        _check_choice("preset", self.preset, PRESETS)
        _check_choice("secondary_dtype", self.secondary_dtype, SECONDARY_DTYPES)
        _check_choice("secondary_scope", self.secondary_scope, SECONDARY_SCOPES)
        _check_choice("grad_quant_scheme", self.grad_quant_scheme, GRAD_QUANT_SCHEMES)
        sizes = {k: getattr(self, k) for k in _SIZE_FIELDS}
        for field, value in sizes.items():
            _check_int(field, value, 0 if field == "secondary_group_size" else 1)
        _check_nesting(sizes, self.world_size, {})
        _check_quantization(self.quant_block_size, self.quantize_weight_gather,
                            self.quantize_grad_reduce, self.param_group_size, {})
        _check_hierarchical_reduce(self)

    @property
    def replicas(self) -> int:
        """R = W / O: how many copies of the optimizer state exist."""
        return self.world_size // self.optim_group_size

    def as_dict(self) -> dict:
        """The fields only (``HierConfig(**cfg.as_dict())`` round-trips)."""
        return dataclasses.asdict(self)


def _check_quant_block_size(value: Any) -> int:
    if not _is_int(value) or value <= 0 or value % QUANT_KERNEL_ALIGN:
        raise HierConfigError(
            f"{_flag('quant_block_size', value)} is invalid: it must be a positive multiple "
            f"of {QUANT_KERNEL_ALIGN} (a block fills whole 64-lane wavefronts of the "
            f"quantization kernels; default {DEFAULT_QUANT_BLOCK_SIZE})")
    return int(value)


def _check_quantization(block_size: Any, qwz: Any, qgz: Any, param_group_size: int,
                        origins: dict[str, str | None]) -> None:
    _check_quant_block_size(block_size)
    for field, value in (("quantize_weight_gather", qwz), ("quantize_grad_reduce", qgz)):
        if not isinstance(value, bool):
            raise HierConfigError(f"{_flag(field, value)} is invalid: it must be true or false")
    if qwz and param_group_size == 1:
        raise HierConfigError(
            f"{FLAGS['quantize_weight_gather']} needs a weight all-gather to quantize, but "
            f"{_describe('param_group_size', 1, origins.get('param_group_size'))} keeps "
            "every weight on every rank; drop the flag or raise the weight group size")


def hierarchical_grad_reduce(cfg: Any) -> bool:
    """Whether qgZ reduces the gradient group in two hops: int4 all-to-all in the S-group,
    then across S-groups ("grad_cross"); needs 1 < S < G with S | G."""
    S, G = int(getattr(cfg, "secondary_group_size", 0) or 0), int(cfg.grad_group_size)
    return (bool(getattr(cfg, "quantize_grad_reduce", False))
            and getattr(cfg, "grad_quant_scheme", "int8") == "int4-hier"
            and 1 < S < G and G % S == 0)


def _check_hierarchical_reduce(cfg: "HierConfig") -> None:
    p, g = cfg.param_group_size, cfg.grad_group_size
    if hierarchical_grad_reduce(cfg) and 1 < p < g:
        raise HierConfigError(
            f"{_flag('grad_quant_scheme', 'int4-hier')} with {_flag('param_group_size', p)} "
            f"inside {_flag('grad_group_size', g)} is not supported: its two-hop all-to-all "
            "hands out gradient chunks in rank order, which needs P = 1 or P = G; use "
            f"{FLAGS['grad_quant_scheme']} int8")


def default_secondary_dtype(preset: str | None) -> str:
    """--hier-secondary-dtype when not given: the weights' own dtype for zeropp (DeepSpeed's
    hpZ copy), else int8."""
    return "param" if preset == "zeropp" else DEFAULT_SECONDARY_DTYPE


def default_grad_reduce_dtype(preset: str | None, param_dtype: str) -> str:
    """--hier-grad-reduce-dtype when not given: bf16 for zeropp under bf16 training (DeepSpeed
    reduces in its training dtype, ``communication_data_type``), else fp32."""
    return "bf16" if preset == "zeropp" and param_dtype == "bf16" else "fp32"


def check_training_dtypes(cfg: "HierConfig", param_dtype: str) -> None:
    """Refuse quantization settings that make no sense for the weights' dtype.

    ``param_dtype`` is "bf16", "fp16" or "fp32" (the dtype of the trained
    weights). An int8 secondary copy of fp32 weights is refused: it exists to
    halve the backward gather of 16-bit weights, and for fp32 training it would
    quantize weights the user asked to keep in full precision.
    """
    if cfg.secondary_group_size and cfg.secondary_dtype == "int8" and param_dtype == "fp32":
        raise HierConfigError(
            f"{_flag('secondary_dtype', 'int8')} with fp32 weights is refused: the int8 "
            "secondary copy exists to halve the backward gather of bf16/fp16 weights, and "
            f"fp32 training asked for full-precision weights; train in bf16 (--bf16), use "
            f"{FLAGS['secondary_dtype']} bf16, or {FLAGS['secondary_group_size']} 0 "
            f"(secondary group size {cfg.secondary_group_size}, preset {cfg.preset})")


def check_quantized_grad_families(cfg: "HierConfig", families: Any) -> None:
    """Refuse qgZ when no gradient reduce-scatter crosses nodes (nothing to quantize).

    ``families``: what ``costs.quantized_grad_families`` chose for the launch's
    topology (the "grad" and/or "inter" reduce-scatters whose groups cross nodes).
    """
    if cfg.quantize_grad_reduce and not families:
        g, o = cfg.grad_group_size, cfg.optim_group_size
        raise HierConfigError(
            f"{FLAGS['quantize_grad_reduce']} has nothing to quantize: it applies to "
            "gradient reduce-scatters whose groups cross nodes, and neither the "
            f"gradient group ({_flag('grad_group_size', g)}) nor the optimizer step's "
            f"inter-node group (O/G={o // g}) does here; drop the flag")


def _preset_sizes(preset: str, world: int, node: int, pkg: int) -> dict[str, tuple[int, str, bool]]:
    """field -> (value, human description of the value, locked?)."""
    w = (world, f"the world size {world}")
    n = (node, f"the GPUs per node {node}")
    one = (1, "1")
    off = (0, "0, no secondary copy")
    table = {
        "lbp": dict(param_group_size=((pkg, f"the GCDs per package {pkg}"), False),
                    secondary_group_size=(off, False),
                    grad_group_size=(n, False),
                    optim_group_size=(w, False)),
        "zero3": dict(param_group_size=(w, True), secondary_group_size=(off, True),
                      grad_group_size=(w, True), optim_group_size=(w, True)),
        # ZeRO++ as DeepSpeed ships it: zero3 + hpZ (a node-sized secondary) + qwZ + qgZ;
        # its dtype, scope and quantization come from resolve_hier_config.
        "zeropp": dict(param_group_size=(w, True), secondary_group_size=(n, False),
                       grad_group_size=(w, True), optim_group_size=(w, True)),
        "zero2": dict(param_group_size=(one, True), secondary_group_size=(off, True),
                      grad_group_size=(w, True), optim_group_size=(w, True)),
        "hsdp": dict(param_group_size=(n, True), secondary_group_size=(off, True),
                     grad_group_size=(n, True), optim_group_size=(n, True)),
    }[preset]
    return {k: (v[0], v[1], locked) for k, (v, locked) in table.items()}


def resolve_hier_config(
    world_size: int,
    *,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    gcds_per_package: int = DEFAULT_GCDS_PER_PACKAGE,
    preset: str | None = None,
    param_group_size: int | None = None,
    grad_group_size: int | None = None,
    optim_group_size: int | None = None,
    secondary_group_size: int | None = None,
    secondary_dtype: str | None = None,
    quant_block_size: int | None = None,
    quantize_weight_gather: bool | None = None,
    quantize_grad_reduce: bool | None = None,
    secondary_scope: str | None = None,
    grad_quant_scheme: str | None = None,
) -> HierConfig:
    """Apply the preset, then the user's explicit sizes, and validate.

    ``None`` means "not given": the preset's value is used. Explicit values
    are checked (type, range, preset lock) before anything is derived from
    them, so the message always points at what the user typed.

    zeropp is ZeRO++ with DeepSpeed's defaults for what its tutorial turns on:
    the secondary copy (hpZ) in the weights' dtype with the step scope, qwZ on,
    qgZ on as int4-hier wherever the world spans more than one node (one node:
    nothing crosses a node, as DeepSpeed skips qgZ there). Every other preset:
    int8 secondary copy rebuilt every forward (backward scope), qwZ and qgZ off,
    qgZ int8 when asked for. Explicit values win; the block size defaults to 256.
    """
    _check_machine(world_size, gpus_per_node, gcds_per_package)
    preset = DEFAULT_PRESET if preset is None else _check_choice("preset", preset, PRESETS)
    zeropp = preset == "zeropp"
    if secondary_dtype is None:
        secondary_dtype = default_secondary_dtype(preset)
    secondary_dtype = _check_choice("secondary_dtype", secondary_dtype, SECONDARY_DTYPES)
    if secondary_scope is None:
        secondary_scope = "step" if zeropp else "backward"
    secondary_scope = _check_choice("secondary_scope", secondary_scope, SECONDARY_SCOPES)
    if grad_quant_scheme is None:
        grad_quant_scheme = "int4-hier" if zeropp else "int8"
    grad_quant_scheme = _check_choice("grad_quant_scheme", grad_quant_scheme,
                                      GRAD_QUANT_SCHEMES)
    explicit = {
        "param_group_size": param_group_size,
        "secondary_group_size": secondary_group_size,
        "grad_group_size": grad_group_size,
        "optim_group_size": optim_group_size,
    }
    for field, value in explicit.items():
        if value is not None:
            explicit[field] = _check_int(field, value, 0 if field == "secondary_group_size" else 1)

    table = _preset_sizes(preset, world_size,
                          min(gpus_per_node, world_size), min(gcds_per_package, world_size))
    sizes: dict[str, int] = {}
    origins: dict[str, str | None] = {}
    for field, (value, description, locked) in table.items():
        given = explicit[field]
        if given is None:
            sizes[field], origins[field] = value, f"preset {preset} default: {description}"
            continue
        if locked and given != value:
            raise HierConfigError(
                f"{_flag(field, given)} contradicts --hier-preset {preset} "
                f"(which fixes it to {description})")
        sizes[field], origins[field] = given, None

    _check_nesting(sizes, world_size, origins)
    block = DEFAULT_QUANT_BLOCK_SIZE if quant_block_size is None else quant_block_size
    if quantize_weight_gather is None:
        # zeropp = zero3 + hpZ (the secondary) + qwZ; nothing to gather when P = 1.
        quantize_weight_gather = preset == "zeropp" and sizes["param_group_size"] > 1
    if quantize_grad_reduce is None:
        # zeropp's gradient group is the world: it crosses nodes exactly when W > a node.
        quantize_grad_reduce = zeropp and world_size > min(gpus_per_node, world_size)
    _check_quantization(block, quantize_weight_gather, quantize_grad_reduce,
                        sizes["param_group_size"], origins)
    return HierConfig(world_size=world_size, secondary_dtype=secondary_dtype,
                      gpus_per_node=gpus_per_node, gcds_per_package=gcds_per_package,
                      preset=preset, quant_block_size=block,
                      quantize_weight_gather=quantize_weight_gather,
                      quantize_grad_reduce=quantize_grad_reduce,
                      secondary_scope=secondary_scope, grad_quant_scheme=grad_quant_scheme,
                      **sizes)


# --------------------------------------------------------------------------- argparse


def _int_arg(text: str) -> int:
    """argparse type: an integer, range checked later with a better message."""
    try:
        return int(text, 10)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"invalid integer value: {text!r}") from None


def _positive_seconds(text: str) -> float:
    """argparse type: a positive number of seconds."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"invalid number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_hier_arguments(parser: argparse.ArgumentParser, *, include_world: bool = False
                       ) -> argparse.ArgumentParser:
    """Register the --hier-* flags; usable as Megatron's ``extra_args_provider``.

    ``include_world`` adds --hier-world-size for tools that run without a
    launcher (cost model, dry runs); under Megatron the launcher decides W.
    """
    g = parser.add_argument_group(title=ARGUMENT_GROUP_TITLE)
    g.add_argument("--hier-partition", action="store_true",
                   help="Enable megatron-lbp's hierarchical (three-level) partitioning "
                        "of weights, gradients and optimizer state.")
    g.add_argument("--hier-preset", choices=PRESETS, default=None,
                   help="Scheme to start from (default lbp). lbp: P=package, G=node, "
                        "O=world; zero3: P=G=O=world; zeropp: ZeRO++ as DeepSpeed ships it, "
                        "zero3 plus a node-sized secondary copy in the weights' dtype built "
                        "by each step's first forward and read by every later gather (hpZ), "
                        "int8 weight gathers (qwZ) and an int4 gradient all-to-all in the "
                        "node, then across nodes (qgZ); zero2: P=1, G=O=world; hsdp: "
                        "P=G=O=node with world/node replicas. Only lbp's sizes (and "
                        "zeropp's secondary size) may be overridden.")
    g.add_argument("--hier-param-group-size", type=_int_arg, default=None, metavar="P",
                   help="Data-parallel ranks sharing one copy of the bf16 weights "
                        "(default: GCDs per package).")
    g.add_argument("--hier-grad-group-size", type=_int_arg, default=None, metavar="G",
                   help="Data-parallel ranks sharing one fp32 gradient accumulator; a "
                        "multiple of P (default: GPUs per node).")
    g.add_argument("--hier-optim-group-size", type=_int_arg, default=None, metavar="O",
                   help="Data-parallel ranks sharing one optimizer state; a multiple of "
                        "G dividing the data-parallel size (default: all of them).")
    g.add_argument("--hier-secondary-group-size", type=_int_arg, default=None, metavar="S",
                   help="Data-parallel ranks sharing the secondary weight copy; divides "
                        "the data-parallel size, 0 = off (default 0; zeropp: GPUs per node).")
    g.add_argument("--hier-secondary-dtype", choices=SECONDARY_DTYPES, default=None,
                   help="Storage type of the secondary weight copy: int8 (blockwise with "
                        "scales), bf16, or param (the weights' own dtype). Default int8; "
                        "zeropp: param.")
    g.add_argument("--hier-secondary-scope", choices=SECONDARY_SCOPES, default=None,
                   help="Which gathers read the secondary copy: 'backward' (default) rebuilds "
                        "it in every forward for that micro-batch's backward; 'step' (zeropp's "
                        "default, DeepSpeed's hpZ) builds it in the step's first forward and "
                        "serves every later gather of the step from it, forward and backward, "
                        "until the optimizer step changes the weights.")
    g.add_argument("--hier-grad-quant-scheme", choices=GRAD_QUANT_SCHEMES, default=None,
                   help="qgZ's payload: 'int8' (default) one blockwise int8 all-to-all; "
                        "'int4-hier' (zeropp's default, ZeRO++'s qgZ) blockwise int4 codes, "
                        "two per byte, exchanged in the secondary group first and across "
                        "secondary groups second where those nest in the gradient group "
                        "(1 < S < G, S | G), else in one all-to-all.")
    g.add_argument("--hier-quantize-weight-gather", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="qwZ: send every weight all-gather that feeds compute (from the "
                        "primary slices, and from a secondary copy that is not int8 already) "
                        "as blockwise int8 + fp32 scales, dequantized on arrival (default: on "
                        "for zeropp, off otherwise).")
    g.add_argument("--hier-quantize-grad-reduce", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="qgZ: run every gradient reduce-scatter whose groups cross nodes "
                        "as an all-to-all of blockwise quantized codes + fp32 scales "
                        "(--hier-grad-quant-scheme), dequantized and summed in fp32 by the "
                        "receiver (default off; zeropp: on where the world spans nodes).")
    g.add_argument("--hier-quant-block-size", type=_int_arg, default=None, metavar="B",
                   help="Elements per fp32 scale of every int8 payload (secondary copy, "
                        f"qwZ, qgZ); a positive multiple of {QUANT_KERNEL_ALIGN} "
                        f"(default {DEFAULT_QUANT_BLOCK_SIZE}).")
    g.add_argument("--hier-gpus-per-node", type=_int_arg, default=None,
                   help="Ranks (GPUs/GCDs) per node (default: from the launcher's "
                        "environment, else 8). A divisor of the launcher's count emulates "
                        "smaller nodes. With tensor/context parallelism the data-parallel "
                        "ranks per node are derived from it.")
    g.add_argument("--hier-gcds-per-package", type=_int_arg, default=None,
                   help="Ranks per GPU package, e.g. the two GCDs of an MI250X "
                        "(default 2); must divide the ranks per node.")
    g.add_argument("--hier-allow-non-colocated", action="store_true",
                   help="Warn instead of failing when a weight, secondary or gradient "
                        "group spans a slower link than its size requires "
                        "(for experiments).")
    g.add_argument("--hier-bucket-size", type=_int_arg, default=None, metavar="ELEMENTS",
                   help="Parameters per flat bucket for parameters outside the model's "
                        "gather units (a GPT's embedding, layers and output layer are one "
                        f"unit each, whatever their size; default {DEFAULT_BUCKET_SIZE:,}; "
                        "a parameter is never split).")
    g.add_argument("--hier-overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="Prefetch the next units' weights and reduce gradients "
                        "asynchronously (default on; --no-hier-overlap for debugging).")
    g.add_argument("--hier-prefetch-units", type=_int_arg, default=None, metavar="N",
                   help="Gather units whose all-gather is issued ahead of the unit being "
                        "computed, in forward, backward and activation recomputation "
                        f"(default {DEFAULT_PREFETCH_UNITS}; 0 = gather on demand).")
    g.add_argument("--hier-max-pending-reduces", type=_int_arg, default=None, metavar="N",
                   help="Gradient reduce-scatters kept in flight during backward before the "
                        "oldest is waited for; each keeps one full gradient unit alive "
                        f"(default {DEFAULT_MAX_PENDING_REDUCES}; at least 1; 1 saves a unit's "
                        "gradient buffer where a reduce-scatter is shorter than a unit's "
                        "backward).")
    g.add_argument("--hier-embedding-backward-gather", choices=EMBEDDING_BACKWARD_GATHERS,
                   default=DEFAULT_EMBEDDING_BACKWARD_GATHER,
                   help="What the embedding unit's backward gathers: 'gather' (default) "
                        "regathers it like every unit and keeps a tied embedding gathered "
                        "from the output layer's backward to the embedding's; 'skip' gathers "
                        "nothing for the lookup's backward (it reads no weight values) and "
                        "frees a tied embedding right after the output layer's backward.")
    g.add_argument("--hier-layer-unit", choices=LAYER_UNITS, default=DEFAULT_LAYER_UNIT,
                   help="What one transformer layer is to the engine: 'whole' (default) "
                        "gathers and reduces it as one unit; 'split' makes its attention and "
                        "its MLP two units, so its weights and full gradient are in memory "
                        "half at a time, for one collective more per layer and phase. Not "
                        "with --recompute-granularity full, whose recomputed layer needs both "
                        "halves at once.")
    g.add_argument("--hier-sharded-init", action=argparse.BooleanOptionalAction, default=True,
                   help="Build the model one module at a time and keep only this rank's "
                        "slices, so no rank ever holds the whole model (default on; the "
                        "initial weights equal a plain build's for the same seed). "
                        "--no-hier-sharded-init builds the whole model, then buckets it.")
    g.add_argument("--hier-grad-reduce-dtype", choices=GRAD_REDUCE_DTYPES, default=None,
                   help="Dtype of the gradient shard and of every gradient reduction "
                        "(default fp32; zeropp under --bf16: bf16, DeepSpeed's "
                        "communication dtype).")
    g.add_argument("--hier-comm-report", default=None, metavar="PATH",
                   help="Write bytes per link class and phase, and bytes held per state, "
                        "as JSON lines, one per optimizer step.")
    g.add_argument("--hier-trace", default=None, metavar="PATH",
                   help="Write the schedule trace: every collective (issued, waited for, "
                        "done) and every unit's compute interval, one JSON line per "
                        "optimizer step (PATH containing {rank}: one file per rank, else "
                        "rank 0 only; docs/schedule-trace.md).")
    g.add_argument("--hier-collective-timeout-s", type=_positive_seconds, default=300.0,
                   metavar="SECONDS",
                   help="Timeout of every hierarchy collective (default 300): a peer that "
                        "is alive but stuck fails the others after this long.")
    g.add_argument("--hier-fault-checkin-s", type=_positive_seconds, default=15.0,
                   metavar="SECONDS",
                   help="After a collective fails, how long survivors wait for every rank "
                        "to check in; ranks that do not are reported lost (default 15).")
    if include_world:
        g.add_argument("--hier-world-size", type=_int_arg, default=None, metavar="W",
                       help="Data-parallel size, for tools that run without a launcher.")
    return parser


def hier_config_from_args(args: Any, world_size: int | None = None, *,
                          gpus_per_node: int | None = None,
                          gcds_per_package: int | None = None) -> HierConfig:
    """Build the HierConfig from parsed --hier-* flags.

    ``gpus_per_node`` / ``gcds_per_package``, when given, override the flags:
    the caller passes the values it resolved from the launcher (see
    ``topology.resolve_gpus_per_node``) and the parallel layout. Otherwise the
    flags are used, else 8 and 2. ``world_size`` falls back to --hier-world-size.
    Does not look at --hier-partition: whether to use the config is the caller's call.
    """
    if world_size is None:
        world_size = getattr(args, "hier_world_size", None)
        if world_size is None:
            raise HierConfigError(
                "--hier-world-size is missing: the data-parallel world size must be given")

    def pick(override: int | None, attr: str, default: int) -> int:
        if override is not None:
            return override
        value = getattr(args, attr, None)
        return default if value is None else value

    return resolve_hier_config(
        world_size,
        gpus_per_node=pick(gpus_per_node, "hier_gpus_per_node", DEFAULT_GPUS_PER_NODE),
        gcds_per_package=pick(gcds_per_package, "hier_gcds_per_package",
                              DEFAULT_GCDS_PER_PACKAGE),
        preset=getattr(args, "hier_preset", None),
        param_group_size=getattr(args, "hier_param_group_size", None),
        grad_group_size=getattr(args, "hier_grad_group_size", None),
        optim_group_size=getattr(args, "hier_optim_group_size", None),
        secondary_group_size=getattr(args, "hier_secondary_group_size", None),
        secondary_dtype=getattr(args, "hier_secondary_dtype", None),
        quant_block_size=getattr(args, "hier_quant_block_size", None),
        quantize_weight_gather=getattr(args, "hier_quantize_weight_gather", None),
        quantize_grad_reduce=getattr(args, "hier_quantize_grad_reduce", None),
        secondary_scope=getattr(args, "hier_secondary_scope", None),
        grad_quant_scheme=getattr(args, "hier_grad_quant_scheme", None),
    )


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs a HierConfig: bucketing, overlap, reduction dtype, reporting."""

    bucket_size: int = DEFAULT_BUCKET_SIZE
    overlap: bool = True
    # None: default_grad_reduce_dtype of the preset and the weights' dtype (the engine's call).
    grad_reduce_dtype: str | None = "fp32"
    comm_report: str | None = None
    prefetch_units: int = DEFAULT_PREFETCH_UNITS
    max_pending_reduces: int = DEFAULT_MAX_PENDING_REDUCES
    embedding_backward_gather: str = DEFAULT_EMBEDDING_BACKWARD_GATHER
    layer_unit: str = DEFAULT_LAYER_UNIT
    trace: str | None = None
    # Build the model without holding it whole (engine/materialize.py); off: build it
    # whole, then bucket it.
    sharded_init: bool = True

    def __post_init__(self) -> None:
        _check_int("bucket_size", self.bucket_size, 1)
        _check_int("prefetch_units", self.prefetch_units, 0)
        _check_int("max_pending_reduces", self.max_pending_reduces, 1)
        if self.grad_reduce_dtype is not None:
            _check_choice("grad_reduce_dtype", self.grad_reduce_dtype, GRAD_REDUCE_DTYPES)
        _check_choice("embedding_backward_gather", self.embedding_backward_gather,
                      EMBEDDING_BACKWARD_GATHERS)
        _check_choice("layer_unit", self.layer_unit, LAYER_UNITS)


def engine_options_from_args(args: Any) -> EngineOptions:
    bucket = getattr(args, "hier_bucket_size", None)
    return EngineOptions(
        bucket_size=DEFAULT_BUCKET_SIZE if bucket is None else bucket,
        overlap=bool(getattr(args, "hier_overlap", True)),
        grad_reduce_dtype=getattr(args, "hier_grad_reduce_dtype", None),
        comm_report=getattr(args, "hier_comm_report", None),
        prefetch_units=prefetch_units_from_args(args),
        max_pending_reduces=max_pending_reduces_from_args(args),
        embedding_backward_gather=(getattr(args, "hier_embedding_backward_gather", None)
                                   or DEFAULT_EMBEDDING_BACKWARD_GATHER),
        layer_unit=getattr(args, "hier_layer_unit", None) or DEFAULT_LAYER_UNIT,
        trace=getattr(args, "hier_trace", None),
        sharded_init=bool(getattr(args, "hier_sharded_init", True)),
    )


def prefetch_units_from_args(args: Any) -> int:
    """--hier-prefetch-units, checked (the plan tool reads it too)."""
    value = getattr(args, "hier_prefetch_units", None)
    return _check_int("prefetch_units", DEFAULT_PREFETCH_UNITS if value is None else value, 0)


def max_pending_reduces_from_args(args: Any) -> int:
    """--hier-max-pending-reduces, checked (the plan tool reads it too)."""
    value = getattr(args, "hier_max_pending_reduces", None)
    return _check_int("max_pending_reduces",
                      DEFAULT_MAX_PENDING_REDUCES if value is None else value, 1)
