"""One hierarchy planned before launch: a typed request in, a typed plan out (pure Python).

``make_plan(PlanRequest) -> Plan``: the hierarchy resolved as training resolves it
(core/config.py), W ranks placed on emulated nodes and packages (core/topology.py), and
per rank the persistent state, the construction peak, the engine's transient peak and the
bytes sent per optimizer step by phase and link class (core/costs.py). Every planner
above it (launch/plan.py's command, launch/candidates.py's memory fit, projection/'s
step times) asks this function with a request, never with a command line.

Invariant: a request is hashable and a plan is a function of it alone (callers cache
plans by request). Bad input raises :class:`PlanError` with one line.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from megatron_lbp.core import costs
from megatron_lbp.core.config import (DEFAULT_BUCKET_SIZE, DEFAULT_EMBEDDING_BACKWARD_GATHER,
                                      DEFAULT_LAYER_UNIT, DEFAULT_MAX_PENDING_REDUCES,
                                      DEFAULT_PREFETCH_UNITS,
                                      HierConfigError,
                                      check_quantized_grad_families, check_training_dtypes,
                                      resolve_hier_config)
from megatron_lbp.core.layout import LayoutError
from megatron_lbp.core.topology import (TopologyError, check_colocation, emulated_locations,
                                        family_link_classes, hierarchy_groups)


class PlanError(ValueError):
    """A request that cannot be planned; the message is one line."""


def query_groups(group_query_attention: bool, num_query_groups: int | None) -> int | None:
    """Key/value heads as Megatron reads its flags: --num-query-groups (default 1) counts only
    with --group-query-attention, else the attention is multi-head (None). Given alone it
    is refused: Megatron would silently train multi-head attention."""
    if not group_query_attention:
        if num_query_groups is not None:
            raise PlanError(f"--num-query-groups={num_query_groups} without "
                            "--group-query-attention: Megatron ignores it; give both for "
                            "grouped-query attention")
        return None
    return 1 if num_query_groups is None else num_query_groups


@dataclass(frozen=True)
class Model:
    """A GPT shape (Megatron's flags and defaults) or, with ``params``, a bare parameter count."""
    num_layers: int = 0
    hidden_size: int = 0
    vocab_size: int = 0
    ffn_hidden_size: int | None = None       # default 4 * hidden
    table_rows: int | None = None            # learned position table rows (seq or max positions)
    position_embedding_type: str = "rope"
    tied: bool = True
    swiglu: bool = False
    num_attention_heads: int | None = None
    num_query_groups: int | None = None      # None: multi-head attention
    kv_channels: int | None = None
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    params: int | None = None                # a bare count instead of a shape

    def units(self, layer_unit: str = DEFAULT_LAYER_UNIT,
              bucket_size: int | None = None) -> list[tuple[str, int]]:
        """(kind, numel) of each gather unit: the shape's units, or ``params`` in buckets."""
        if self.params is not None:
            if layer_unit == "split":
                raise PlanError("--hier-layer-unit split needs a GPT shape (--num-layers, "
                                "--hidden-size, --vocab-size): --params has no layers to split")
            return [("other", n) for n in costs.split_buckets(self.params, bucket_size)]
        try:
            return costs.gpt_units(self.num_layers, self.hidden_size, self.vocab_size,
                                   seq_length=self.table_rows, ffn_hidden_size=self.ffn_hidden_size,
                                   tied=self.tied, position_embedding_type=self.position_embedding_type,
                                   swiglu=self.swiglu, num_attention_heads=self.num_attention_heads,
                                   num_query_groups=self.num_query_groups,
                                   normalization=self.normalization,
                                   add_bias_linear=self.add_bias_linear,
                                   kv_channels=self.kv_channels, add_qkv_bias=self.add_qkv_bias,
                                   split_layers=layer_unit == "split")
        except ValueError as exc:
            raise PlanError(str(exc)) from None


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is asked for: the machine, the hierarchy, the model, the step, the knobs."""
    world_size: int
    model: Model
    gpus_per_node: int = 8
    gcds_per_package: int = 2
    preset: str | None = None
    param_group_size: int | None = None
    grad_group_size: int | None = None
    optim_group_size: int | None = None
    secondary_group_size: int | None = None
    secondary_dtype: str | None = None      # None: the preset's (int8; zeropp the weights')
    quant_block_size: int = costs.DEFAULT_QUANT_BLOCK
    quantize_weight_gather: bool | None = None
    quantize_grad_reduce: bool | None = None
    allow_non_colocated: bool = False
    overlap: bool = True
    params_dtype: str = "bf16"
    grad_dtype: str = "fp32"
    micro_batches: int = 1
    bucket_size: int | None = None           # --params only: bucket elements (None: one bucket)
    prefetch_units: int = DEFAULT_PREFETCH_UNITS
    max_pending_reduces: int = DEFAULT_MAX_PENDING_REDUCES
    embedding_backward_gather: str = DEFAULT_EMBEDDING_BACKWARD_GATHER
    layer_unit: str = DEFAULT_LAYER_UNIT


@dataclass(frozen=True)
class GroupSizes:
    param: int
    grad: int
    optim: int
    secondary: int
    replicas: int


@dataclass(frozen=True)
class Memory:
    """Persistent bytes per rank by state (costs.MEMORY_STATES)."""
    primary: int
    secondary: int
    grad: int
    optimizer: int
    total: int


@dataclass(frozen=True)
class Transient:
    """The engine's transient bytes per rank at most, by part of the step."""
    unit_gather: int
    prefetch: int
    forward: int
    backward: int
    step: int
    peak: int


@dataclass(frozen=True)
class Plan:
    """One planned hierarchy. Field order and names are the plan command's JSON (as_dict).
    Tables keyed by link class or phase (costs.LINK_CLASS_ORDER, costs.PHASES) stay mappings."""
    world_size: int
    gpus_per_node: int
    gcds_per_package: int
    preset: str
    group_sizes: GroupSizes
    secondary_dtype: str | None
    params_dtype: str
    grad_dtype: str
    micro_batches: int
    quant_block_size: int
    quantize_weight_gather: bool
    quantize_grad_reduce: list[str]
    secondary_scope: str
    grad_quant_scheme: str
    params: int
    padded_params: int
    padding: int
    buckets: int
    units: dict[str, int]
    largest_unit: int
    prefetch_units: int
    max_pending_reduces: int
    embedding_backward_gather: str
    layer_unit: str
    transient_bytes: Transient
    transient_knobs: tuple = ()              # the plan command's knob table (launch/plan.py)
    memory_bytes: Memory = None
    construction_peak_bytes: int = 0
    traffic_bytes: dict[str, float] = field(default_factory=dict)
    traffic_by_phase: dict[str, dict[str, float]] = field(default_factory=dict)
    # phase -> the quantizer's calls in a step (costs.codec_calls): what a device spends coding
    codec_calls: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    groups: dict[str, list[int]] = field(default_factory=dict)
    link_classes: dict[str, str | None] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # How it was planned (not printed): the resolved config and the model's units.
    config: Any = field(default=None, repr=False, compare=False)
    unit_list: tuple = field(default=(), repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The plan command's JSON object."""
        out = dataclasses.asdict(self)
        del out["config"], out["unit_list"]
        return out


@functools.lru_cache(maxsize=64)
def _topology(world: int, gpn: int, gpp: int, cfg, allow: bool):
    """(groups, colocation warnings, link class per family) of one hierarchy on the emulated
    placement. Cached: it is most of a plan's time at hundreds of ranks, and a ranking plans
    each scheme at several micro-batch counts; callers copy what they hand out."""
    locations = emulated_locations(world, gpn, gpp)
    groups = hierarchy_groups(range(world), cfg)
    warnings = check_colocation(groups, locations, allow=allow)
    return groups, tuple(warnings), family_link_classes(groups, locations)


def resolve(req: PlanRequest):
    """(HierConfig, groups, warnings, link classes, qgZ families) of a request; PlanError."""
    try:
        cfg = resolve_hier_config(
            req.world_size, gpus_per_node=req.gpus_per_node,
            gcds_per_package=req.gcds_per_package, preset=req.preset,
            param_group_size=req.param_group_size, grad_group_size=req.grad_group_size,
            optim_group_size=req.optim_group_size,
            secondary_group_size=req.secondary_group_size,
            secondary_dtype=req.secondary_dtype, quant_block_size=req.quant_block_size,
            quantize_weight_gather=req.quantize_weight_gather,
            quantize_grad_reduce=req.quantize_grad_reduce)
        check_training_dtypes(cfg, req.params_dtype)
        groups, warnings, classes = _topology(req.world_size, req.gpus_per_node,
                                              req.gcds_per_package, cfg,
                                              req.allow_non_colocated)
        classes = dict(classes)
        qgz = costs.quantized_grad_families(cfg, classes)
        check_quantized_grad_families(cfg, qgz)
    except (HierConfigError, TopologyError, LayoutError) as exc:
        raise PlanError(str(exc)) from None
    return cfg, groups, list(warnings), classes, qgz


def transient(req: PlanRequest, cfg, qgz, units: list[tuple[str, int]],
              prefetch_units: int, max_pending_reduces: int, grad_dtype: str,
              embedding: str) -> dict[str, int]:
    """costs.transient_bytes for the request's hierarchy at these knobs and units."""
    tied = units[0][0] == "embedding" and req.model.tied
    return costs.transient_bytes(
        cfg, [n for _, n in units], param_dtype=req.params_dtype, grad_dtype=grad_dtype,
        prefetch_units=prefetch_units if req.overlap else 0, overlap=req.overlap,
        tied_embedding=tied, quantized_grad_families=qgz, micro_batches=req.micro_batches,
        max_pending_reduces=max_pending_reduces,
        embedding_backward_gather=embedding if units[0][0] == "embedding" else "gather",
        unit_kinds=[kind for kind, _ in units], linear_biases=req.model.add_bias_linear)


@functools.lru_cache(maxsize=256)
def make_plan(req: PlanRequest) -> Plan:
    """The plan of ``req`` (cached: a ranking asks each scheme's plan at several micro-batch
    counts; a plan is read, never changed). Raises PlanError."""
    units = req.model.units(req.layer_unit, req.bucket_size)
    numels = [n for _, n in units]
    cfg, groups, warnings, classes, qgz = resolve(req)
    tied = units[0][0] == "embedding" and req.model.tied
    try:
        result = costs.estimate(cfg, numels, classes, param_dtype=req.params_dtype,
                                grad_dtype=req.grad_dtype, micro_batches=req.micro_batches,
                                no_backward_gather=costs.backward_gather_skipped(
                                    [kind for kind, _ in units], tied,
                                    req.embedding_backward_gather))
        # Construction's transient buffers are one unit's: the model's units, or with
        # --params buckets of the engine's size (its default when none is given).
        construction = costs.construction_peak_bytes(
            cfg, numels if req.model.params is None else costs.split_buckets(
                req.model.params, req.bucket_size or DEFAULT_BUCKET_SIZE),
            param_dtype=req.params_dtype, grad_dtype=req.grad_dtype)
        t = transient(req, cfg, qgz, units, req.prefetch_units, req.max_pending_reduces,
                      req.grad_dtype, req.embedding_backward_gather)
    except (HierConfigError, TopologyError, LayoutError) as exc:
        raise PlanError(str(exc)) from None
    g = GroupSizes(cfg.param_group_size, cfg.grad_group_size, cfg.optim_group_size,
                   cfg.secondary_group_size, cfg.replicas)
    return Plan(
        world_size=req.world_size, gpus_per_node=req.gpus_per_node,
        gcds_per_package=req.gcds_per_package, preset=cfg.preset, group_sizes=g,
        secondary_dtype=cfg.secondary_dtype if cfg.secondary_group_size else None,
        params_dtype=req.params_dtype, grad_dtype=req.grad_dtype,
        micro_batches=req.micro_batches, quant_block_size=req.quant_block_size,
        quantize_weight_gather=cfg.quantize_weight_gather, quantize_grad_reduce=list(qgz),
        secondary_scope=cfg.secondary_scope, grad_quant_scheme=cfg.grad_quant_scheme,
        params=result["params"], padded_params=result["padded_params"],
        padding=result["padded_params"] - result["params"],
        buckets=len(result["bucket_numels"]),
        # A split layer's two kinds only when split: the counts keep their keys otherwise.
        units={kind: sum(1 for k_, _ in units if k_ == kind) for kind in costs.UNIT_KINDS
               if kind not in costs.SPLIT_KINDS or req.layer_unit == "split"},
        largest_unit=max(numels), prefetch_units=t["prefetch_units"],
        max_pending_reduces=t["max_pending_reduces"],
        embedding_backward_gather=req.embedding_backward_gather, layer_unit=req.layer_unit,
        transient_bytes=Transient(**{k: v for k, v in t.items()
                                     if k not in ("prefetch_units", "max_pending_reduces")}),
        memory_bytes=Memory(**result["memory_bytes"]),
        construction_peak_bytes=construction,
        traffic_bytes=result["traffic_bytes"], traffic_by_phase=result["traffic_by_phase"],
        codec_calls=result["codec_calls"],
        groups={fam: list(next(gr for gr in gs if 0 in gr)) for fam, gs in groups.items()},
        link_classes=classes, warnings=warnings, config=cfg, unit_list=tuple(units))
