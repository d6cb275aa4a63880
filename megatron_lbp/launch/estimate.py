"""A job shape's memory per GCD, step time, save interval and checkpoint size (pure arithmetic).

    python -m megatron_lbp.launch estimate --nodes N --tasks-per-node T --num-layers L \\
        --hidden-size H --num-attention-heads A --seq-length S --vocab-size V \\
        --global-batch-size B [--micro-batch-size auto|b] [--recompute auto|full|selective|none]

Memory, one model (the plan's): per GCD, the plan's persistent state (``megatron_lbp.plan``:
primary, secondary, gradient and optimizer shards, buckets padded as the engine pads them)
+ the plan's transient peak for the choice's micro-batches per step (``transient_bytes``:
the engine's schedule replayed over the model's gather units; the backward's, where the
activations also peak) + :func:`activation_bytes` for the recomputation choice and
micro-batch size + the allocator margin (``--reserve-gb``, :data:`MARGIN_TEXT`). This
module keeps no model of the engine's buffers of its own. A choice fits when that total,
and the plan's construction peak (``construction_peak_bytes``: what a rank holds while
the model is built sharded) plus the margin, are at most the GCD's memory.

Choice (``auto``): the least recomputation that fits (none, then selective, then full),
and with it the largest micro-batch that fits and divides the global batch over the
ranks. An explicit value is kept and refused (exit 3) when it does not fit.

Transient knobs (``--hier-prefetch-units``, ``--hier-max-pending-reduces``,
``--hier-layer-unit``, ``--hier-embedding-backward-gather``; ``auto`` by default): each
(recomputation, micro-batch) tries the settings of :func:`knob_trials` — the engine's
default (prefetch 1, 2 reduce-scatters in flight), 1 in flight, no prefetch as well
(``projection.knobs.CHOICE_SETTINGS``), each with whole layers and, where the
recomputation is not full and the engine runs the scheme, with a layer's attention and
MLP as two gather units (``split``), each with the embedding's backward gather and
without it (``skip``) — and takes the fastest that fits (one tried later only where it is
projected ``KNOB_GAIN`` faster), its step time with what the setting adds in exposed
communication (``projection.knobs``; negative where smaller units pipeline closer); none
fitting, the last tried. A value keeps that setting.

Step time: the Frontier cost model (``megatron_lbp.projection.project.step_time``, MI250X
bf16 peak at an assumed MFU, the link bandwidths it assumes, the engine's overlap) for
the chosen micro-batch count; selective recomputation adds the core attention's forward
FLOPs (4*L*h*s per token) to it. ``--step-seconds`` replaces it (a measured figure, or a
machine the model does not describe, e.g. CPU ranks).

Save interval (``auto``): about ``--save-minutes`` of training in iterations, rounded to a
divisor of ``--milestone-every`` when that is set (so that milestones land on saves) or to
two significant digits, at most ``--train-iters``.

Checkpoint: 14 bytes per parameter with bf16 weights (the weights, and the fp32 master
weights, Adam m and v), 12 with fp32 weights (the master is the weight); a save is
assumed to take ``2 x bytes / (nodes x --write-gbps-per-node) + --save-fixed-s``.

Exit status: 0, 3 (does not fit; the message names what would), 2 (bad input).
``--resolved FILE`` writes the resolved values as KEY=VALUE lines for the launcher.
"""
from __future__ import annotations

import argparse
import functools
import math
import shlex
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_lbp.core import costs
from megatron_lbp.launch import plan
from megatron_lbp.core.config import (DEFAULT_BUCKET_SIZE, DEFAULT_EMBEDDING_BACKWARD_GATHER,
                                      DEFAULT_LAYER_UNIT, DEFAULT_MAX_PENDING_REDUCES,
                                      DEFAULT_PREFETCH_UNITS, EMBEDDING_BACKWARD_GATHERS,
                                      LAYER_UNITS, PRESETS)
from megatron_lbp.launch._cli import PROG, Parser, write_resolved
from megatron_lbp.core.vocabulary import SPLIT_WITH_FULL_RECOMPUTE

GB = 1e9
RECOMPUTE_ORDER = ("none", "selective", "full")   # least recomputation first
# How much faster a transient-knob setting tried later must be projected to be chosen over an
# earlier one that fits (:func:`choices`): smaller gains are within what the step model
# resolves (its idealised and replayed steps differ by up to 1% at 20B).
KNOB_GAIN = 0.01
MICRO_BATCH_CANDIDATES = (1, 2, 4, 8, 16)


# What --reserve-gb (LBP_MEMORY_RESERVE_GB; 4 GB on GPUs) is kept for: memory the plan and
# the activation formula cannot see. The caching allocator rounds blocks up and fragments
# (PyTorch's documented behaviour: reserved exceeds allocated), RCCL/NCCL allocate
# buffers per communicator and channel (NCCL_BUFFSIZE, 4 MiB by default, times channels
# and peers, for each of the engine's group families), and hipBLAS/rocBLAS keep a
# workspace per stream; none of it is a tensor the engine allocates.
MARGIN_TEXT = ("allocator margin for fragmentation, RCCL/NCCL communicator buffers and "
               "BLAS workspaces (LBP_MEMORY_RESERVE_GB)")


class EstimateError(ValueError):
    """Bad input; the message is one line."""


@dataclass(frozen=True)
class Choice:
    recompute: str
    micro_batch_size: int
    micro_batches: int
    state_bytes: int
    activation_bytes: int
    total_bytes: int
    fits: bool
    step_s: float
    transient_bytes: int = 0      # the plan's transient peak at this many micro-batches
    margin_bytes: int = 0         # the allocator margin (--reserve-gb)
    construction_bytes: int = 0   # the plan's construction peak + the margin
    prefetch_units: int = DEFAULT_PREFETCH_UNITS              # the transient knobs it runs with
    max_pending_reduces: int = DEFAULT_MAX_PENDING_REDUCES
    knob_cost_s: float = 0.0      # exposed seconds per step the knobs add (in step_s)
    layer_unit: str = DEFAULT_LAYER_UNIT   # --hier-layer-unit it runs with
    embedding_backward_gather: str = DEFAULT_EMBEDDING_BACKWARD_GATHER   # and that one
    # step_s's band over what is not known (projection/collectives.Band; None with
    # --step-seconds)
    band: Any = field(default=None, compare=False)

    @property
    def knobs(self) -> tuple[int, int]:
        return (self.prefetch_units, self.max_pending_reduces)

    def knob_text(self) -> str:
        """The knobs as launcher settings, empty for the engine's defaults."""
        text = ("" if self.knobs == (DEFAULT_PREFETCH_UNITS, DEFAULT_MAX_PENDING_REDUCES) else
                f" HIER_PREFETCH_UNITS={self.prefetch_units} "
                f"HIER_MAX_PENDING_REDUCES={self.max_pending_reduces}")
        if self.layer_unit != DEFAULT_LAYER_UNIT:
            text += f" HIER_LAYER_UNIT={self.layer_unit}"
        if self.embedding_backward_gather != DEFAULT_EMBEDDING_BACKWARD_GATHER:
            text += f" HIER_EMBEDDING_BACKWARD_GATHER={self.embedding_backward_gather}"
        return text


def gb(x: float) -> str:
    return f"{x / GB:.2f} GB" if x >= 0.1 * GB else f"{x / 1e6:.2f} MB"


def plan_argv(a, world_size: int, micro_batches: int = 1,
              knobs: tuple[int, int] = (DEFAULT_PREFETCH_UNITS, DEFAULT_MAX_PENDING_REDUCES),
              layer_unit: str | None = None, embedding: str | None = None) -> list[str]:
    """The plan's argv for this job; ``knobs`` (prefetch units, reduce-scatters in flight)
    appear only when they are not the engine's defaults, ``layer_unit`` (None: the one
    given, whole for auto) only when split, ``embedding`` (the embedding's backward gather;
    None: the one given, gather for auto) only when skip."""
    argv = ["--world-size", str(world_size), "--gpus-per-node", str(a.tasks_per_node),
            "--gcds-per-package", str(a.gcds_per_package), "--preset", a.preset,
            "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--vocab-size", str(a.vocab_size), "--seq-length", str(a.seq_length),
            "--position-embedding-type", a.position_embedding_type,
            "--params-dtype", a.params_dtype, "--bucket-size", str(a.bucket_size),
            "--micro-batches", str(micro_batches),
            "--hier-secondary-group-size", str(a.hier_secondary_group_size)]
    # Not given: the preset's (zeropp: bf16 gradients under bf16, its secondary copy in the
    # weights' dtype; config.resolve_hier_config).
    if a.hier_grad_reduce_dtype:
        argv += ["--hier-grad-reduce-dtype", a.hier_grad_reduce_dtype]
    if a.hier_secondary_group_size and a.hier_secondary_dtype:
        argv += ["--hier-secondary-dtype", a.hier_secondary_dtype]
    if a.ffn_hidden_size:
        argv += ["--ffn-hidden-size", str(a.ffn_hidden_size)]
    argv += architecture_argv(a)
    if knobs[0] != DEFAULT_PREFETCH_UNITS:
        argv += ["--hier-prefetch-units", str(knobs[0])]
    if knobs[1] != DEFAULT_MAX_PENDING_REDUCES:
        argv += ["--hier-max-pending-reduces", str(knobs[1])]
    embedding = embedding or given_setting(a, "hier_embedding_backward_gather",
                                           DEFAULT_EMBEDDING_BACKWARD_GATHER)
    if embedding != DEFAULT_EMBEDDING_BACKWARD_GATHER:
        argv += ["--hier-embedding-backward-gather", embedding]
    if (layer_unit or given_layer_unit(a)) == "split":
        # The plan refuses split layers with its default --recompute full; its --recompute
        # prices only the knob table, which the estimate does not ask for, and
        # :func:`choices` never runs split layers with full recomputation.
        argv += ["--hier-layer-unit", "split", "--recompute", "selective"]
    return argv


def given_setting(a, name: str, default: str) -> str:
    """A knob as given, its default for auto (a namespace built in code may leave it out)."""
    value = getattr(a, name, default)
    return default if value == "auto" else value


def given_layer_unit(a) -> str:
    """HIER_LAYER_UNIT as given, whole for auto."""
    return given_setting(a, "hier_layer_unit", DEFAULT_LAYER_UNIT)


def _settings_to_try(a, name: str, default: str, options: tuple[str, ...],
                     may_vary: bool) -> list[str]:
    """A knob's settings a candidate may run with: the one given, else (auto) its default,
    then the other options where ``may_vary``."""
    given = getattr(a, name, default)
    if given != "auto":
        return [given]
    return [default] + ([o for o in options if o != default] if may_vary else [])


def embedding_settings(a) -> list[str]:
    """The embedding's backward gather a candidate may run with: the one given, else (auto)
    gather, then skip where the engine runs the scheme (skip trains bit for bit like gather
    and only removes a collective: tried wherever gather does not fit)."""
    return _settings_to_try(a, "hier_embedding_backward_gather",
                            DEFAULT_EMBEDDING_BACKWARD_GATHER, EMBEDDING_BACKWARD_GATHERS,
                            a.preset in PRESETS)   # PRESETS: the engine's schemes


def layer_units(a, recompute: str) -> list[str]:
    """The layer units a candidate may run with: the one given, else (auto) whole, then split
    where the engine runs the scheme and the recomputation is not full (the recomputed layer
    needs both halves at once)."""
    return _settings_to_try(a, "hier_layer_unit", DEFAULT_LAYER_UNIT, LAYER_UNITS,
                            recompute != "full" and a.preset in PRESETS)


# Megatron's architecture flags this estimate reads (the model its parameter count, state,
# transient and step time are for), with Megatron's defaults; a namespace built in code
# (choose.py, benchmarks) may leave them out.
ARCHITECTURE = {"untie_embeddings_and_output_weights": False, "swiglu": False,
                "group_query_attention": False, "num_query_groups": None, "kv_channels": None,
                "normalization": "LayerNorm", "disable_bias_linear": False,
                "add_qkv_bias": False, "max_position_embeddings": 0}


def _arch(a, name: str):
    return getattr(a, name, ARCHITECTURE[name])


def architecture(a) -> dict:
    """The architecture as costs.gpt_units' keyword arguments (the one parameter count), read
    as Megatron reads its flags: --num-query-groups counts only with --group-query-attention."""
    return dict(tied=not _arch(a, "untie_embeddings_and_output_weights"),
                position_embedding_type=a.position_embedding_type,
                swiglu=_arch(a, "swiglu"), num_attention_heads=a.num_attention_heads,
                num_query_groups=plan.query_groups(_arch(a, "group_query_attention"),
                                                   _arch(a, "num_query_groups")),
                kv_channels=_arch(a, "kv_channels"), normalization=_arch(a, "normalization"),
                add_bias_linear=not _arch(a, "disable_bias_linear"),
                add_qkv_bias=_arch(a, "add_qkv_bias"))


def architecture_argv(a) -> list[str]:
    """The plan's flags for the architecture; the defaults go unsaid."""
    argv = []
    for flag in ("untie_embeddings_and_output_weights", "swiglu", "group_query_attention",
                 "disable_bias_linear", "add_qkv_bias"):
        if _arch(a, flag):
            argv.append("--" + flag.replace("_", "-"))
    if _arch(a, "group_query_attention") or _arch(a, "kv_channels"):
        argv += ["--num-attention-heads", str(a.num_attention_heads)]
    for flag in ("num_query_groups", "kv_channels"):
        if _arch(a, flag):
            argv += ["--" + flag.replace("_", "-"), str(_arch(a, flag))]
    if _arch(a, "normalization") != "LayerNorm":
        argv += ["--normalization", _arch(a, "normalization")]
    if _arch(a, "max_position_embeddings") not in (0, a.seq_length):
        argv += ["--max-position-embeddings", str(_arch(a, "max_position_embeddings"))]
    return argv


def units(a, layer_unit: str | None = None) -> list[tuple[str, int]]:
    """The model's gather units (costs.gpt_units): the one count of its parameters.
    ``layer_unit``: None for the one given (whole for auto)."""
    return costs.gpt_units(a.num_layers, a.hidden_size, a.vocab_size,
                           seq_length=_arch(a, "max_position_embeddings") or a.seq_length,
                           ffn_hidden_size=a.ffn_hidden_size or None,
                           split_layers=(layer_unit or given_layer_unit(a)) == "split",
                           **architecture(a))


def model_line(a, params: int) -> str:
    """The model this estimate is for, in one line (the dry run prints it); ``params``: the
    sum of units(a)."""
    groups = architecture(a)["num_query_groups"]
    return (f"model: {a.num_layers} layers, hidden {a.hidden_size}, ffn "
            f"{a.ffn_hidden_size or 4 * a.hidden_size}, heads {a.num_attention_heads}/"
            f"{groups or a.num_attention_heads} query groups"
            + (f", kv-channels {_arch(a, 'kv_channels')}" if _arch(a, "kv_channels") else "")
            + f", {'swiglu' if _arch(a, 'swiglu') else 'gelu'}, {_arch(a, 'normalization')}, "
            f"{'no linear biases' if _arch(a, 'disable_bias_linear') else 'linear biases'}"
            + (" (qkv bias)" if _arch(a, "add_qkv_bias") else "")
            + f", {'untied' if _arch(a, 'untie_embeddings_and_output_weights') else 'tied'} "
            f"output, {a.position_embedding_type} positions"
            + (f" ({_arch(a, 'max_position_embeddings') or a.seq_length} rows)"
               if a.position_embedding_type == "learned_absolute" else "")
            + f": {params:,} parameters")


@functools.lru_cache(maxsize=256)
def _plan(argv: tuple[str, ...]) -> dict:
    return plan.make_plan(list(argv), knob_table=False)


def cached_plan(argv: list[str]) -> dict:
    """plan.make_plan, once per argv (a ranking asks each scheme's plan at several micro-batch
    counts, and the report asks again); the dict is shared: read it, never change it."""
    return _plan(tuple(argv))


def load_links(path: str) -> dict[str, float]:
    """{class: bytes/s per GCD, one direction} from the health check's --links-out file."""
    from megatron_lbp.launch.health import read_links

    return read_links(path)


def link_model(a):
    """The link figures the step time uses: measured ones (``--links FILE``, the health
    check's) when given, else the cost model's Frontier figures (project.LinkModel)."""
    from megatron_lbp.projection import project

    links = getattr(a, "links", None)
    if getattr(a, "network_model", "per_rank") == "shared_uplink":
        # One shaped uplink per node (the emulated network, benchmarks/netns.py): a collective
        # costs the bytes crossing it (project.uplink_bytes). The health check's network
        # figure is per GCD with every local rank sending across at once, so the uplink
        # carries tasks_per_node times it.
        links = {**links, "network": links["network"] * a.tasks_per_node}
        return project.LinkModel.from_measured(links, network="shared_uplink")
    return project.LinkModel.from_measured(links) if links else project.LinkModel()


def compute_model(a, micro_batch_size: int, recompute: bool):
    """The compute rate the step time uses: ``--peak-tflops`` (default: the cost model's
    MI250X bf16 peak) x ``--mfu``; a measured rate (CPU ranks) is ``--peak-tflops R --mfu 1``."""
    from megatron_lbp.projection import project

    peak = getattr(a, "peak_tflops", None)
    base = project.ComputeModel() if peak is None else project.ComputeModel(
        peak_flops=peak * 1e12)
    return replace(base, mfu=a.mfu, seq_length=a.seq_length,
                   micro_batch_size=micro_batch_size, recompute=recompute)


def activation_bytes(a, recompute: str, micro_batch_size: int) -> int:
    """Activations per GCD (estimate, bytes): what the backward holds besides the engine's buffers.

    Korthikanti et al. (2022), 16-bit activations, no tensor parallelism, micro-batch b,
    sequence s, hidden h, heads n, layers L (unfused attention, as Megatron's local layers),
    with the MLP's width f (--ffn-hidden-size, default 4h) kept as a variable as Megatron's
    own estimator does (megatron/training/theoretical_memory_usage.py: 18 + 4f/h per sbh):
    one layer's linear part is 18sbh + 4sbf (the MLP saves its fc1 output and the
    activation's output, 2 bytes x f each); --swiglu's fc1 has 2f outputs, saved by the
    fused bias-SwiGLU (Megatron's default) with the f-wide product: 18sbh + 6sbf.
    Grouped-query attention changes nothing here: the core attention expands K and V to
    every head before it saves them. RMSNorm and --disable-bias-linear are counted as the
    default layer (the formula's terms are tensors of the layer's widths, which neither
    changes). --kv-channels
    other than h/n is taken as h/n (its q/k/v and projection input are n*d wide, not h).
    Per layer:
      full:      2sbh per layer (each layer's input) + one layer rebuilt in backward:
                 linear + 5ns^2b;
      selective: linear per layer (the core attention is recomputed) + one layer's
                 attention scores 5ns^2b while it is rebuilt;
      none:      (linear + 5ns^2b) per layer.
    Plus the logits (16-bit) and their fp32 softmax/gradient (~10 bytes * s*b*V), and, with
    tied embeddings, the output layer's gradient of the shared weight (V*h in the weight
    dtype), which autograd holds until the embedding's backward adds its own to it. The
    engine's gathered weights and gradient buffers are the plan's transient figure, not
    counted here. tests/launch/test_activation_estimate.py checks the f and SwiGLU terms against
    what a real megatron-core layer saves for its backward.
    """
    s, b, h, n, L, V = (a.seq_length, micro_batch_size, a.hidden_size,
                        a.num_attention_heads, a.num_layers, a.vocab_size)
    f = a.ffn_hidden_size or 4 * h
    linear = 18 * s * b * h + (6 if getattr(a, "swiglu", False) else 4) * s * b * f
    scores = 5 * n * s * s * b
    acts = {"full": 2 * s * b * h * L + linear + scores,
            "selective": linear * L + scores,
            "none": (linear + scores) * L}[recompute]
    logits = 10 * s * b * V
    tied = 0 if a.untie_embeddings_and_output_weights else \
        V * h * {"bf16": 2, "fp16": 2, "fp32": 4}[a.params_dtype]
    return acts + logits + tied


def checkpoint_bytes(params: int, params_dtype: str) -> int:
    """Bytes one torch_dist save writes: weights + fp32 master (16-bit weights only) + Adam m, v."""
    per_param = {"bf16": 2 + 4 + 8, "fp16": 2 + 4 + 8, "fp32": 4 + 8}[params_dtype]
    return params * per_param


def save_seconds(nbytes: float, nodes: int, write_gbps_per_node: float, fixed_s: float) -> float:
    """Assumed seconds of one save: twice the bytes at the nodes' write rate, plus a fixed part."""
    return 2.0 * nbytes / (nodes * write_gbps_per_node * GB) + fixed_s


def nice_interval(target: float, train_iters: int, milestone_every: int = 0) -> int:
    """Iterations near ``target``: a divisor of ``milestone_every`` if set, else 2 significant digits."""
    target = max(1.0, target)
    if milestone_every > 0:
        divisors = [d for d in range(1, milestone_every + 1) if milestone_every % d == 0]
        best = min(divisors, key=lambda d: (abs(math.log(d / target)), -d))
    else:
        digits = 10 ** max(0, int(math.floor(math.log10(target))) - 1)
        best = max(1, int(round(target / digits)) * digits)
    return max(1, min(best, train_iters))


def _model(a) -> dict:
    return {"num_layers": a.num_layers, "hidden_size": a.hidden_size,
            "num_attention_heads": a.num_attention_heads, "vocab_size": a.vocab_size}


def collective_model(a):
    """The collective-time model the bands use: the link survey's (``--survey``) or the public
    figures' (projection/collectives.py)."""
    from megatron_lbp.projection import collectives

    return getattr(a, "survey", None) or collectives.CollectiveModel.public()


def step_estimate(a, p: dict, recompute: str, micro_batch_size: int):
    """(seconds per iteration, its band or None) for one choice: --step-seconds (no band); with
    a survey, the band's point (its median rates and overlap); else the cost model's figure
    (project.step_time on project.LinkModel), inside a band over the public figures; with
    --links or --network-model shared_uplink (and no survey) that figure alone."""
    if a.step_seconds:
        return a.step_seconds, None
    from megatron_lbp.projection import collectives, project

    compute = compute_model(a, micro_batch_size, recompute == "full")
    extra = 0.0
    if recompute == "selective":
        tokens = p["micro_batches"] * micro_batch_size * a.seq_length
        extra = tokens * 4 * a.num_layers * a.hidden_size * a.seq_length / (
            compute.peak_flops * compute.mfu)
    point = None if getattr(a, "survey", None) else project.step_time(
        p, _model(a), links=link_model(a), compute=compute)["step_s"]
    if point is not None and (getattr(a, "links", None)
                              or getattr(a, "network_model", "per_rank") != "per_rank"):
        # Measured link figures (--links) or another machine's network model: the public
        # Frontier figures would not describe it, so no band (and no tie) around its point.
        return point + extra, None
    band = collectives.step_band(p, _model(a), compute, collective_model(a), point=point)
    band = band.shifted(extra)
    return band.point, band


def step_seconds(a, p: dict, recompute: str, micro_batch_size: int) -> float:
    """The cost model's seconds per iteration (or --step-seconds) for one choice."""
    return step_estimate(a, p, recompute, micro_batch_size)[0]


def knob_settings(a) -> list[tuple[int, int]]:
    """(prefetch units, reduce-scatters in flight) to try, cheapest first: the user's, where
    given, else projection.knobs.CHOICE_SETTINGS."""
    from megatron_lbp.projection import knobs

    d = getattr(a, "hier_prefetch_units", "auto")
    r = getattr(a, "hier_max_pending_reduces", "auto")
    out = []
    for sd, sr in knobs.CHOICE_SETTINGS:
        setting = (sd if d == "auto" else int(d), sr if r == "auto" else int(r))
        if setting not in out:
            out.append(setting)
    return out


def knob_cost_s(a, p: dict, recompute: str, micro_batch_size: int,
                setting: tuple[int, int], layer_unit: str = DEFAULT_LAYER_UNIT,
                embedding: str = DEFAULT_EMBEDDING_BACKWARD_GATHER) -> float:
    """Exposed seconds per step ``setting`` and ``layer_unit`` add to the engine's defaults
    (projection/knobs.py; 0 with --step-seconds, a measured figure the knobs' model cannot
    amend). Negative where smaller units pipeline closer than whole layers."""
    from megatron_lbp.projection import knobs, project

    chosen = knobs.Knobs(*setting, embedding)
    if a.step_seconds or (chosen == knobs.Knobs() and layer_unit == DEFAULT_LAYER_UNIT):
        return 0.0
    compute = project.ComputeModel(mfu=a.mfu, seq_length=a.seq_length,
                                   micro_batch_size=micro_batch_size,
                                   recompute=recompute == "full")
    return knobs.cost_s(p, units(a, layer_unit), _model(a), chosen,
                        default_units=units(a, DEFAULT_LAYER_UNIT), links=link_model(a),
                        compute=compute, tied=not a.untie_embeddings_and_output_weights)


def knob_trials(a, recompute: str) -> list[tuple[int, int, str, str]]:
    """(prefetch units, reduce-scatters in flight, layer unit, embedding's backward gather) in
    the order a candidate tries them: :func:`knob_settings` with each of :func:`layer_units`,
    whole layers first, and the settings without prefetch (every gather exposed) last; each
    with gather, then skip (:func:`embedding_settings`)."""
    settings, lus, embs = knob_settings(a), layer_units(a, recompute), embedding_settings(a)
    ahead = [s for s in settings if s[0] > 0]
    return [(d, r, lu, e) for group in (ahead, [s for s in settings if s[0] == 0])
            for lu in lus for d, r in group for e in embs]


def _micro_batch_sizes(a, world: int) -> list[int]:
    if a.micro_batch_size != "auto":
        return [int(a.micro_batch_size)]
    return [b for b in MICRO_BATCH_CANDIDATES if a.global_batch_size % (b * world) == 0]


def choices(a) -> tuple[list[Choice], dict]:
    """Every (recompute, micro-batch) this job could run with, each with the first transient
    knob setting that fits (:func:`knob_settings`; the last tried when none does), and the
    plan at micro-batch count 1."""
    world = a.nodes * a.tasks_per_node
    base = cached_plan(plan_argv(a, world, 1))
    limit = a.gcd_memory_gb * GB
    reserve = a.reserve_gb * GB
    out = []
    # Per micro-batch count and knobs: the traffic (so the step time) and the transient
    # depend on them; the state does not.
    for rc in RECOMPUTE_ORDER:
        if rc == "full" and given_layer_unit(a) == "split":
            continue   # the engine refuses it: the recomputed layer needs both halves at once
        for b in _micro_batch_sizes(a, world):
            k = a.global_batch_size // (b * world)
            if k < 1:
                continue
            act = activation_bytes(a, rc, b)
            trials = knob_trials(a, rc)
            # No knob fits a row whose state and activations alone do not (most rows without
            # recomputation): it is reported with the last setting, the least transient,
            # without planning every setting before it (each is a plan at this size).
            state_floor = min(cached_plan(plan_argv(a, world, 1, layer_unit=lu))
                              ["memory_bytes"]["total"] for lu in {t[2] for t in trials})
            if state_floor + act + reserve > limit:
                trials = trials[-1:]
            fitting, fallback = [], None
            for d, r, lu, emb in trials:
                p = cached_plan(plan_argv(a, world, k, (d, r), lu, emb))
                # The state and the construction peak are the base plan's but for split
                # layers' padding and their smaller largest unit.
                state = p["memory_bytes"]["total"]
                construction = p["construction_peak_bytes"] + int(reserve)
                transient = p["transient_bytes"]["peak"]
                total = state + transient + act + int(reserve)
                fits = total <= limit and construction <= limit
                if fits or (d, r, lu, emb) == trials[-1]:
                    cost = knob_cost_s(a, p, rc, b, (d, r), lu, emb)
                    t, band = step_estimate(a, p, rc, b)
                    c = Choice(rc, b, k, state, act, total, fits, t + cost, transient,
                               int(reserve), construction, d, r, cost, lu, emb,
                               band and band.shifted(cost))
                    if fits:
                        fitting.append(c)
                    else:
                        fallback = c   # none fits: the last tried, the least transient
            # The fastest setting that fits, but a setting tried later (further from the
            # engine's defaults and the recorded traces) only where it is projected
            # KNOB_GAIN faster.
            if fitting:
                best = min(c.step_s for c in fitting)
                out.append(next(c for c in fitting if c.step_s <= best * (1 + KNOB_GAIN)))
            else:
                out.append(fallback)
    return out, base


def pick(options: list[Choice], recompute: str = "auto") -> Choice | None:
    """Among ``recompute`` (or every kind for auto): the least recomputation that fits, then the
    largest micro-batch (None if none fits)."""
    fitting = [c for c in options if c.fits and recompute in ("auto", c.recompute)]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (RECOMPUTE_ORDER.index(c.recompute), -c.micro_batch_size))


# The largest job the node-count hint considers (planning a much larger one takes seconds).
MOST_RANKS = 1024


def smallest_fitting_nodes(a, choice: Choice, base: dict) -> int | None:
    """Smallest node count at which ``choice``'s micro-batch fits, when the optimizer shard and the
    step's 1/O gradients shrink with more nodes (O = all ranks, one replica, as lbp) and the rest
    is fixed per GCD. None if none fits (up to :data:`MOST_RANKS` ranks, or this job's)."""
    g = base["group_sizes"]
    if g["optim"] != base["world_size"] or g["replicas"] != 1:
        return None
    limit = a.gcd_memory_gb * GB
    opt = base["memory_bytes"]["optimizer"]
    fixed = choice.state_bytes - opt + choice.activation_bytes + choice.margin_bytes
    if fixed >= limit:
        return None
    # The transient shrinks with more ranks (the step's 1/O gradients) and fewer micro-batches:
    # its value at the largest job with one micro-batch is a floor.
    most = max(MOST_RANKS // a.tasks_per_node, a.nodes)
    floor = cached_plan(plan_argv(a, most * a.tasks_per_node, 1, choice.knobs,
                                  choice.layer_unit, choice.embedding_backward_gather)
                        )["transient_bytes"]["peak"]
    if fixed + floor > limit:
        return None
    n = a.nodes + 1
    while fixed + floor + opt * a.nodes / n > limit:   # a lower bound
        n += 1
    # Confirm with the plan itself (padding, the transient at that node count's micro-batches).
    for n in range(n, min(most, n + 64) + 1):
        world = n * a.tasks_per_node
        k = max(1, a.global_batch_size // (choice.micro_batch_size * world))
        p = cached_plan(plan_argv(a, world, k, choice.knobs, choice.layer_unit,
                                  choice.embedding_backward_gather))
        total = (p["memory_bytes"]["total"] + p["transient_bytes"]["peak"]
                 + choice.activation_bytes + choice.margin_bytes)
        if total <= limit and p["construction_peak_bytes"] + choice.margin_bytes <= limit:
            return n
    return None


# The schemes the comparison ranks: (label, preset, secondary group size: "node", "package" or 0).
SCHEMES = (("lbp S=node", "lbp", "node"), ("lbp S=package", "lbp", "package"),
           ("lbp S=0", "lbp", 0), ("zeropp", "zeropp", "node"), ("zero3", "zero3", 0),
           ("zero2", "zero2", 0))


@dataclass(frozen=True)
class SchemeRow:
    scheme: str
    preset: str
    secondary: int
    choice: Choice


def scheme_rows(a) -> list[SchemeRow]:
    """Every scheme x recomputation x micro-batch size at the user's global batch that fits, by
    projected step time (fastest first; the idealised cost model of megatron_lbp.projection.project)."""
    from argparse import Namespace

    rows = []
    for label, preset, sec in SCHEMES:
        s = {"node": a.tasks_per_node, "package": a.gcds_per_package, 0: 0}[sec]
        b = Namespace(**{**vars(a), "preset": preset, "hier_secondary_group_size": s,
                         "recompute": "auto", "micro_batch_size": "auto"})
        try:
            options, _ = choices(b)
        except plan.UsageError:
            continue   # the scheme cannot be built on this machine shape
        rows += [SchemeRow(label, preset, s, c) for c in options if c.fits]
    return sorted(rows, key=lambda r: r.choice.step_s)


def comparison_lines(a, chosen: Choice, top: int = 5) -> list[str]:
    """The ranking's top rows, the best zeropp and zero3 rows at the same global batch with their
    ratios to the chosen configuration, and one line when another scheme is projected faster."""
    rows = scheme_rows(a)
    label = {"lbp": "lbp S=" + ("node" if a.hier_secondary_group_size == a.tasks_per_node else
                                "package" if a.hier_secondary_group_size == a.gcds_per_package
                                else "0" if not a.hier_secondary_group_size else
                                str(a.hier_secondary_group_size))}.get(a.preset, a.preset)

    def row_text(r: SchemeRow) -> str:
        c = r.choice
        return (f"  {r.scheme:<14} RECOMPUTE={c.recompute:<9} MICRO_BATCH_SIZE={c.micro_batch_size:<2}"
                f" ({c.micro_batches} per step): step {c.step_s:.3g} s, "
                f"{c.step_s / chosen.step_s:.3f}x the chosen's, total {gb(c.total_bytes)}")

    lines = [f"schemes at GLOBAL_BATCH_SIZE={a.global_batch_size} by projected step time "
             f"(idealised cost model, MFU {a.mfu:g}; only rows that fit):"]
    lines += [row_text(r) for r in rows[:top]]
    for name in ("zeropp", "zero3"):
        best = next((r for r in rows if r.scheme == name), None)
        lines.append(f"best {name}: " + (row_text(best).strip() if best else "none fits"))
    if rows and rows[0].choice.step_s < chosen.step_s and rows[0].scheme != label:
        r = rows[0]
        lines.append(f"projected faster: HIER_PRESET={r.preset} HIER_SECONDARY_GROUP_SIZE="
                     f"{r.secondary} RECOMPUTE={r.choice.recompute} MICRO_BATCH_SIZE="
                     f"{r.choice.micro_batch_size}, {r.choice.step_s:.3g} s per step against "
                     f"{chosen.step_s:.3g} s for the chosen {label}")
    return lines


RC_TEXT = {"full": "full recomputation", "selective": "selective recomputation",
           "none": "no recomputation"}


def report(a) -> tuple[list[str], dict, str | None]:
    """(stdout lines, resolved values, refusal line or None)."""
    asked, ranked, row = a, None, None
    if getattr(a, "choose", False) or a.preset == "auto":
        from megatron_lbp.launch import choose

        row, ranked = choose.choose(a)
        # Nothing fits: the refusal speaks of the launcher's default scheme (lbp, the node's copy).
        preset, sec = (row.preset, row.secondary) if row else (
            (a.preset, a.hier_secondary_group_size) if a.preset != "auto" else
            ("lbp", a.tasks_per_node))
        a = argparse.Namespace(**{**vars(a), "preset": preset, "hier_secondary_group_size": sec})
    params = sum(n for _, n in units(a))
    options, base = choices(a)
    if not options:
        raise EstimateError(
            f"no micro-batch size in {list(MICRO_BATCH_CANDIDATES)} divides GLOBAL_BATCH_SIZE="
            f"{a.global_batch_size} over {a.nodes * a.tasks_per_node} ranks: set "
            "MICRO_BATCH_SIZE or GLOBAL_BATCH_SIZE")
    m, g = base["memory_bytes"], base["group_sizes"]
    size = f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"
    lines = [
        model_line(a, params),
        f"parameters: {params:,} ({size}), padded vocabulary {a.vocab_size}",
        f"hierarchy: W={base['world_size']} ranks, P={g['param']} G={g['grad']} O={g['optim']} "
        f"S={g['secondary']} ({base['secondary_dtype'] if g['secondary'] else 'no secondary'}), "
        f"R={g['replicas']}",
        "plan: python -m megatron_lbp.plan " + shlex.join(plan_argv(a, base["world_size"])),
        f"memory per GCD (plan): primary {gb(m['primary'])}, secondary {gb(m['secondary'])}, "
        f"grad {gb(m['grad'])}, optimizer {gb(m['optimizer'])} = {gb(m['total'])}",
        f"construction peak per GCD (plan: the model built module by module into its slices, "
        f"--hier-sharded-init): {gb(base['construction_peak_bytes'])} + margin "
        f"{a.reserve_gb:g} GB = {gb(base['construction_peak_bytes'] + a.reserve_gb * GB)}",
        f"margin per GCD: {a.reserve_gb:g} GB, {MARGIN_TEXT}",
        f"memory per GCD by choice (plan state + plan transient at its micro-batches per step + "
        f"activations estimate + margin; step time: "
        + ("--step-seconds" if a.step_seconds else f"cost model, MFU {a.mfu:g}") + "):",
    ]
    chosen = pick(options, a.recompute) if row is None else next(
        c for c in options if (c.recompute, c.micro_batch_size)
        == (row.choice.recompute, row.choice.micro_batch_size))
    for c in options:
        mark = "  <- chosen" if c is chosen else ""
        knob = (f" with{c.knob_text()} ({c.knob_cost_s:+.3g} s exposed)" if c.knob_text()
                else "")
        lines.append(f"  RECOMPUTE={c.recompute:<9} MICRO_BATCH_SIZE={c.micro_batch_size:<2} "
                     f"({c.micro_batches} per step){knob}: transient {gb(c.transient_bytes)}, "
                     f"activations {gb(c.activation_bytes)}, "
                     f"total {gb(c.total_bytes)}, step {c.step_s:.3g} s "
                     f"{'fits' if c.fits else 'DOES NOT FIT'}{mark}")
    explicit = a.recompute != "auto" and a.micro_batch_size != "auto"
    allowed = [c for c in options if a.recompute in ("auto", c.recompute)]
    shown = chosen or min(allowed, key=lambda c: c.total_bytes)
    if row is not None:
        how = ("the fastest fitting by projected step time among the candidates "
               + ("the explicit settings leave open" if asked.preset != "auto" or explicit
                  else "of every scheme") + ", the ranking below")
    elif explicit:
        how = "as given"
    elif a.recompute == "auto":
        how = "auto: the least recomputation that fits, then the largest micro-batch"
    else:
        how = f"MICRO_BATCH_SIZE=auto: the largest that fits with RECOMPUTE={a.recompute}"
    lines += [
        f"choice: RECOMPUTE={shown.recompute} MICRO_BATCH_SIZE={shown.micro_batch_size} ({how})",
        f"memory per GCD (activations, {RC_TEXT[shown.recompute]}, micro-batch "
        f"{shown.micro_batch_size}, estimate): {gb(shown.activation_bytes)}",
        f"transient knobs: HIER_PREFETCH_UNITS={shown.prefetch_units} "
        f"HIER_MAX_PENDING_REDUCES={shown.max_pending_reduces} "
        f"HIER_LAYER_UNIT={shown.layer_unit} "
        f"HIER_EMBEDDING_BACKWARD_GATHER={shown.embedding_backward_gather} ("
        + ("the engine's defaults" if not shown.knob_text() else
           ("" if shown.fits else "none fits; the least transient tried, ")
           + f"{shown.knob_cost_s:+.3g} s exposed per step against the defaults, "
           "projection/knobs.py") + ")",
        f"memory per GCD total: state {gb(shown.state_bytes)} + transient "
        f"{gb(shown.transient_bytes)} ({shown.micro_batches} micro-batch(es) per step) + "
        f"activations {gb(shown.activation_bytes)} + margin {gb(shown.margin_bytes)} = "
        f"{gb(shown.total_bytes)} of {a.gcd_memory_gb:g} GB "
        f"({'fits' if shown.fits else 'DOES NOT FIT'})",
    ]
    for w in base.get("warnings", []):
        lines.append(f"plan warning: {w}")
    if chosen is None:
        need = smallest_fitting_nodes(a, shown, base)
        hint = (f"use at least NNODES={need} (sbatch -N {need})" if need else
                f"no node count up to {max(MOST_RANKS // a.tasks_per_node, a.nodes)} fits "
                "these settings")
        if shown.micro_batch_size > 1:
            hint += f", or lower MICRO_BATCH_SIZE={shown.micro_batch_size}"
        if a.hier_secondary_group_size and a.hier_secondary_group_size < a.tasks_per_node:
            hint += (f", or set HIER_SECONDARY_GROUP_SIZE={a.tasks_per_node} (a smaller "
                     "secondary copy)")
        if shown.recompute != "full":
            hint += ", or set RECOMPUTE=full"
        worst = max(shown.total_bytes, shown.construction_bytes)
        refusal = (f"{PROG}: error: refusing to launch: {worst / GB:.2f} GB per GCD "
                   f"exceeds the GCD's {a.gcd_memory_gb:g} GB on {a.nodes} node(s) "
                   f"(GCD_MEMORY_GB, RECOMPUTE={shown.recompute}, MICRO_BATCH_SIZE="
                   f"{shown.micro_batch_size}); {hint}")
        return lines, {}, refusal

    step = chosen.step_s if row is None else row.choice.step_s
    band = chosen.band if row is None else row.choice.band
    source = "--step-seconds" if a.step_seconds else (
        f"{'replayed trace' if row and row.source == 'replay' else 'cost model'}, "
        f"MFU {a.mfu:g}" + (", measured links" if getattr(a, "links", None) else "")
        + (", collectives from the link survey" if getattr(a, "survey", None) else ""))
    if a.save_interval == "auto":
        interval = nice_interval(a.save_minutes * 60 / step, a.train_iters, a.milestone_every)
        how = (f"SAVE_INTERVAL=auto: about every {a.save_minutes:g} min"
               + (f", a divisor of the milestone interval {a.milestone_every}"
                  if a.milestone_every else ""))
    else:
        interval, how = int(a.save_interval), "as given"
    ckpt = checkpoint_bytes(params, a.params_dtype)
    save_s = save_seconds(ckpt, a.nodes, a.write_gbps_per_node, a.save_fixed_s)
    per = {"bf16": 14, "fp16": 14, "fp32": 12}[a.params_dtype]
    lines += [
        f"step time: {step:.3g} s per iteration ({source})"
        + (f", band [{band.low:.3g}, {band.high:.3g}] s over "
           + ("the survey's rates and overlap" if getattr(a, "survey", None) else
              "the public link figures and overlap none to perfect") if band else ""),
        f"save interval: {interval} iterations = {interval * step / 60:.1f} min of training ({how})",
        f"checkpoint: {gb(ckpt)} per save ({per} B/param); save estimate {save_s:.0f} s "
        f"(2 x bytes at {a.write_gbps_per_node:g} GB/s per node x {a.nodes} node(s) + "
        f"{a.save_fixed_s:g} s)",
    ]
    if row is not None:
        lines += choose.ranking_lines(asked, ranked, row)
    elif a.compare:
        lines += comparison_lines(a, chosen)
    resolved = {"MICRO_BATCH_SIZE": chosen.micro_batch_size, "RECOMPUTE": chosen.recompute,
                "HIER_PREFETCH_UNITS": chosen.prefetch_units,
                "HIER_MAX_PENDING_REDUCES": chosen.max_pending_reduces,
                "HIER_LAYER_UNIT": chosen.layer_unit,
                "HIER_EMBEDDING_BACKWARD_GATHER": chosen.embedding_backward_gather,
                "SAVE_INTERVAL": interval, "LBP_STEP_S": f"{step:.6g}",
                "LBP_CKPT_BYTES": ckpt, "LBP_SAVE_S": f"{save_s:.6g}", "LBP_PARAMS": params}
    if asked.preset == "auto":
        resolved.update(HIER_PRESET=a.preset, HIER_SECONDARY_GROUP_SIZE=a.hier_secondary_group_size)
    return lines, resolved, None


def _choice(name: str, allowed: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"{name}={text}: use one of {', '.join(allowed)}")
        return text
    return parse


def _auto_or_int(name: str, minimum: int = 1):
    def parse(text: str):
        if text == "auto":
            return text
        if not text.isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(
                f"{name}={text}: use auto or an integer >= {minimum}")
        return int(text)
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m megatron_lbp.launch estimate", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("nodes", "tasks-per-node", "num-layers", "hidden-size", "num-attention-heads",
                 "seq-length", "vocab-size", "global-batch-size"):
        ap.add_argument(f"--{flag}", type=int, required=True)
    ap.add_argument("--micro-batch-size", type=_auto_or_int("MICRO_BATCH_SIZE"), default="auto")
    ap.add_argument("--recompute", type=_choice("RECOMPUTE", ("auto",) + RECOMPUTE_ORDER),
                    default="full")
    ap.add_argument("--ffn-hidden-size", type=int, default=0)
    ap.add_argument("--gcds-per-package", type=int, default=2)
    ap.add_argument("--preset", default="lbp",
                    help="a preset, or auto: chosen by projected step time (needs --choose)")
    ap.add_argument("--hier-secondary-group-size", type=int, default=0)
    ap.add_argument("--hier-secondary-dtype", default=None,
                    help="the secondary copy's dtype (default: the preset's; int8 for lbp)")
    ap.add_argument("--position-embedding-type", choices=("rope", "learned_absolute", "none"),
                    default="rope")
    ap.add_argument("--max-position-embeddings", type=int, default=0,
                    help="rows of the learned position table (default --seq-length)")
    ap.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    # Megatron's architecture flags, spelt and read as Megatron does (the plan's too).
    ap.add_argument("--swiglu", action="store_true",
                    help="gated MLP (Megatron's --swiglu): its parameters and activations")
    ap.add_argument("--group-query-attention", action="store_true",
                    help="grouped-query attention with --num-query-groups key/value heads "
                         "(default 1, as Megatron's)")
    ap.add_argument("--num-query-groups", type=int, default=None,
                    help="key/value heads; as in Megatron, only with --group-query-attention")
    ap.add_argument("--kv-channels", type=int, default=None,
                    help="channels per attention head (default hidden/heads)")
    ap.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    ap.add_argument("--disable-bias-linear", action="store_true", help="no linear biases")
    ap.add_argument("--add-qkv-bias", action="store_true",
                    help="linear_qkv keeps its bias under --disable-bias-linear (Qwen2)")
    ap.add_argument("--params-dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--hier-grad-reduce-dtype", default=None, choices=("fp32", "bf16"),
                    help="default: the preset's (bf16 for zeropp under bf16, else fp32)")
    ap.add_argument("--hier-prefetch-units", type=_auto_or_int("HIER_PREFETCH_UNITS", 0),
                    default="auto", help="auto (default): the first of the choice's settings "
                    "that fits, else this many units gathered ahead")
    ap.add_argument("--hier-max-pending-reduces",
                    type=_auto_or_int("HIER_MAX_PENDING_REDUCES"), default="auto",
                    help="auto (default): the first of the choice's settings that fits, else "
                    "this many gradient reduce-scatters in flight (>= 1)")
    ap.add_argument("--hier-embedding-backward-gather",
                    type=_choice("HIER_EMBEDDING_BACKWARD_GATHER",
                                 ("auto",) + EMBEDDING_BACKWARD_GATHERS),
                    default="auto", help="auto (default): gather, else skip where gather does "
                    "not fit; or that setting (HIER_EMBEDDING_BACKWARD_GATHER): "
                    "skip frees a tied embedding after the output layer's backward")
    ap.add_argument("--hier-layer-unit", type=_choice("HIER_LAYER_UNIT", ("auto",) + LAYER_UNITS),
                    default="auto", help="auto (default): whole layers, else, where they do "
                    "not fit and the recomputation is not full, each layer's attention and MLP "
                    "as two gather units (split); or that setting (HIER_LAYER_UNIT)")
    ap.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE)
    ap.add_argument("--gcd-memory-gb", type=float, default=64.0)
    ap.add_argument("--reserve-gb", type=float, default=0.0)
    ap.add_argument("--train-iters", type=int, default=150000)
    ap.add_argument("--save-interval", type=_auto_or_int("SAVE_INTERVAL"), default="auto")
    ap.add_argument("--save-minutes", type=float, default=45.0)
    ap.add_argument("--milestone-every", type=int, default=0)
    ap.add_argument("--step-seconds", type=float, default=0.0)
    ap.add_argument("--mfu", type=float, default=0.35)
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="peak TFLOPS per GCD the MFU applies to (default: MI250X bf16, 191.5); "
                         "a measured rate with --mfu 1 (CPU ranks: docs/testing.md)")
    ap.add_argument("--network-model", choices=("per_rank", "shared_uplink"),
                    default="per_rank",
                    help="per_rank (Frontier: every GCD its share of the network) or "
                         "shared_uplink (one uplink per node, as the emulated network: a "
                         "collective costs the bytes crossing it); shared_uplink needs --links")
    ap.add_argument("--write-gbps-per-node", type=float, default=1.0)
    ap.add_argument("--save-fixed-s", type=float, default=60.0)
    ap.add_argument("--compare", action="store_true",
                    help="rank every scheme (lbp with each secondary copy, zeropp, zero3, zero2) "
                         "x recomputation x micro-batch size at this global batch by projected "
                         "step time, and say when another is projected faster")
    ap.add_argument("--choose", action="store_true",
                    help="choose the scheme (with --preset auto), recomputation and micro-batch "
                         "size left auto by projected step time among those that fit "
                         "(megatron_lbp.launch.choose), and print the ranking")
    ap.add_argument("--links", default=None, metavar="FILE",
                    help="measured link bandwidths (the health check's --links-out file) for "
                         "the step time, instead of the cost model's Frontier figures")
    ap.add_argument("--survey", default=None, metavar="FILE",
                    help="a link survey (python -m megatron_lbp.launch survey, or the health "
                         "check's --survey-out): step times and their bands from its tables "
                         "and measured overlap instead of the public figures")
    ap.add_argument("--resolved", default=None, help="write KEY=VALUE lines here")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    checks = {"NNODES": a.nodes, "TASKS_PER_NODE": a.tasks_per_node,
              "GLOBAL_BATCH_SIZE": a.global_batch_size, "TRAIN_ITERS": a.train_iters}
    bad = [f"{k}={v}" for k, v in checks.items() if v < 1]
    if bad:
        print(f"{PROG}: error: {bad[0]} must be >= 1", file=sys.stderr)
        return 2
    for name, value in (("LBP_WRITE_GBPS", a.write_gbps_per_node), ("LBP_SAVE_MINUTES", a.save_minutes)):
        if not value > 0:
            print(f"{PROG}: error: {name}={value:g} must be > 0", file=sys.stderr)
            return 2
    if not 0 < a.mfu <= 1:
        print(f"{PROG}: error: --mfu={a.mfu:g} must be in (0, 1]", file=sys.stderr)
        return 2
    if a.peak_tflops is not None and not a.peak_tflops > 0:
        print(f"{PROG}: error: --peak-tflops={a.peak_tflops:g} must be > 0", file=sys.stderr)
        return 2
    if given_layer_unit(a) == "split" and a.recompute == "full":
        print(f"{PROG}: error: HIER_LAYER_UNIT=split with RECOMPUTE=full: "
              f"{SPLIT_WITH_FULL_RECOMPUTE} (the engine refuses it); use "
              "RECOMPUTE=selective, none or auto", file=sys.stderr)
        return 2
    try:   # the architecture, before any plan is made (groups dividing the heads, ...)
        units(a)
    except (plan.UsageError, ValueError) as exc:
        print(f"{PROG}: error: the model: {exc}", file=sys.stderr)
        return 2
    if a.network_model == "shared_uplink" and not a.links:
        print(f"{PROG}: error: --network-model shared_uplink needs --links FILE (the measured "
              "per-GCD network figure gives the uplink)", file=sys.stderr)
        return 2
    try:
        a.links = load_links(a.links) if a.links else None
    except (OSError, ValueError) as exc:
        print(f"{PROG}: error: --links {a.links}: {exc}", file=sys.stderr)
        return 2
    try:
        from megatron_lbp.projection import collectives, survey_file

        a.survey = collectives.CollectiveModel.from_file(a.survey) if a.survey else None
    except survey_file.SurveyError as exc:
        print(f"{PROG}: error: --survey {exc}", file=sys.stderr)
        return 2
    if a.preset == "auto" and not a.choose:
        a.choose = True
    try:
        lines, resolved, refusal = report(a)
    except (plan.UsageError, EstimateError) as exc:
        print(f"{PROG}: error: the hierarchy does not fit {a.nodes} node(s) x {a.tasks_per_node} "
              f"tasks: {exc}" if isinstance(exc, plan.UsageError) else f"{PROG}: error: {exc}",
              file=sys.stderr)
        return 2
    print("\n".join(lines), flush=True)
    if refusal:
        print(refusal, file=sys.stderr)
        return 3
    write_resolved(a.resolved, resolved)
    return 0
