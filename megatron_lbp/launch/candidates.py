"""Each configuration a job could run with: its memory per GCD and its step time.

A candidate is (recomputation, micro-batch size, transient knobs). Memory is the
planner's one model: plan state + plan transient peak + :func:`activation_bytes`
+ the allocator margin (:data:`MARGIN_TEXT`); it fits when that, and the
construction peak plus the margin, are at most the GCD's memory. Time: the cost
model in a band (projection/collectives.py) plus what non-default knobs expose.
:func:`knob_trials` lists the knob settings tried; the fastest that fits wins.
See docs/planning.md.
"""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_lbp.core.config import (DEFAULT_EMBEDDING_BACKWARD_GATHER, DEFAULT_LAYER_UNIT,
                                      DEFAULT_MAX_PENDING_REDUCES, DEFAULT_PREFETCH_UNITS,
                                      EMBEDDING_BACKWARD_GATHERS, LAYER_UNITS, PRESETS,
                                      default_grad_reduce_dtype)
from megatron_lbp.core.plan import Plan, PlanError, PlanRequest, make_plan
from megatron_lbp.launch.job import Job

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


def plan_request(a: Job, world_size: int, micro_batches: int = 1,
                 knobs: tuple[int, int] = (DEFAULT_PREFETCH_UNITS, DEFAULT_MAX_PENDING_REDUCES),
                 layer_unit: str | None = None, embedding: str | None = None) -> PlanRequest:
    """The planner's request for this job at ``world_size`` ranks; ``layer_unit`` and
    ``embedding`` (the embedding's backward gather) None: the one given, the engine's
    default for auto."""
    return PlanRequest(
        world_size=world_size, model=a.model(), gpus_per_node=a.tasks_per_node,
        gcds_per_package=a.gcds_per_package, preset=a.preset,
        secondary_group_size=a.hier_secondary_group_size,
        secondary_dtype=a.hier_secondary_dtype if a.hier_secondary_group_size else None,
        params_dtype=a.params_dtype,
        grad_dtype=a.hier_grad_reduce_dtype or default_grad_reduce_dtype(a.preset, a.params_dtype),
        micro_batches=micro_batches, bucket_size=a.bucket_size,
        prefetch_units=knobs[0], max_pending_reduces=knobs[1],
        embedding_backward_gather=embedding or given_setting(
            a, "hier_embedding_backward_gather", DEFAULT_EMBEDDING_BACKWARD_GATHER),
        layer_unit=layer_unit or given_layer_unit(a))


def plan_of(a: Job, world_size: int, micro_batches: int = 1,
            knobs: tuple[int, int] = (DEFAULT_PREFETCH_UNITS, DEFAULT_MAX_PENDING_REDUCES),
            layer_unit: str | None = None, embedding: str | None = None) -> Plan:
    """The plan of :func:`plan_request` (core.plan caches it: read it, never change it)."""
    return make_plan(plan_request(a, world_size, micro_batches, knobs, layer_unit, embedding))


def plan_command(a: Job, world_size: int) -> str:
    """The plan command a user runs to see this job's plan (the dry run prints it): the
    flags of :func:`plan_request` at one micro-batch, the defaults unsaid."""
    return "python -m megatron_lbp.plan " + shlex.join(_plan_flags(a, world_size))


def _plan_flags(a: Job, world_size: int, micro_batches: int = 1,
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
    argv += _architecture_flags(a)
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


def _architecture_flags(a: Job) -> list[str]:
    """The plan's flags for the architecture; the defaults go unsaid."""
    argv = []
    for flag in ("untie_embeddings_and_output_weights", "swiglu", "group_query_attention",
                 "disable_bias_linear", "add_qkv_bias"):
        if getattr(a, flag):
            argv.append("--" + flag.replace("_", "-"))
    if a.group_query_attention or a.kv_channels:
        argv += ["--num-attention-heads", str(a.num_attention_heads)]
    for flag in ("num_query_groups", "kv_channels"):
        if getattr(a, flag):
            argv += ["--" + flag.replace("_", "-"), str(getattr(a, flag))]
    if a.normalization != "LayerNorm":
        argv += ["--normalization", a.normalization]
    if a.max_position_embeddings not in (0, a.seq_length):
        argv += ["--max-position-embeddings", str(a.max_position_embeddings)]
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


def units(a: Job, layer_unit: str | None = None) -> list[tuple[str, int]]:
    """The model's gather units (costs.gpt_units): the one count of its parameters.
    ``layer_unit``: None for the one given (whole for auto)."""
    return a.model().units(layer_unit or given_layer_unit(a))


def model_line(a, params: int) -> str:
    """The model this estimate is for, in one line (the dry run prints it); ``params``: the
    sum of units(a)."""
    groups = a.model().num_query_groups
    return (f"model: {a.num_layers} layers, hidden {a.hidden_size}, ffn "
            f"{a.ffn_hidden_size or 4 * a.hidden_size}, heads {a.num_attention_heads}/"
            f"{groups or a.num_attention_heads} query groups"
            + (f", kv-channels {a.kv_channels}" if a.kv_channels else "")
            + f", {'swiglu' if a.swiglu else 'gelu'}, {a.normalization}, "
            f"{'no linear biases' if a.disable_bias_linear else 'linear biases'}"
            + (" (qkv bias)" if a.add_qkv_bias else "")
            + f", {'untied' if a.untie_embeddings_and_output_weights else 'tied'} "
            f"output, {a.position_embedding_type} positions"
            + (f" ({a.max_position_embeddings or a.seq_length} rows)"
               if a.position_embedding_type == "learned_absolute" else "")
            + f": {params:,} parameters")


def load_links(path: str) -> dict[str, float]:
    """{class: bytes/s per GCD, one direction} from the health check's --links-out file."""
    from megatron_lbp.launch.health import read_links

    return read_links(path)


def link_model(a):
    """The link figures the step time uses: measured ones (``--links FILE``, the health
    check's) when given, else the cost model's Frontier figures (project.LinkModel)."""
    from megatron_lbp.projection import project

    links = a.links
    if a.network_model == "shared_uplink":
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

    peak = a.peak_tflops
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
    linear = 18 * s * b * h + (6 if a.swiglu else 4) * s * b * f
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

    return a.survey or collectives.CollectiveModel.public()


def step_estimate(a, p: Plan, recompute: str, micro_batch_size: int):
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
        tokens = p.micro_batches * micro_batch_size * a.seq_length
        extra = tokens * 4 * a.num_layers * a.hidden_size * a.seq_length / (
            compute.peak_flops * compute.mfu)
    point = None if a.survey else project.step_time(
        p, _model(a), links=link_model(a), compute=compute)["step_s"]
    if point is not None and (a.links
                              or a.network_model != "per_rank"):
        # Measured link figures (--links) or another machine's network model: the public
        # Frontier figures would not describe it, so no band (and no tie) around its point.
        return point + extra, None
    band = collectives.step_band(p, _model(a), compute, collective_model(a), point=point)
    band = band.shifted(extra)
    return band.point, band


def step_seconds(a, p: Plan, recompute: str, micro_batch_size: int) -> float:
    """The cost model's seconds per iteration (or --step-seconds) for one choice."""
    return step_estimate(a, p, recompute, micro_batch_size)[0]


def knob_settings(a) -> list[tuple[int, int]]:
    """(prefetch units, reduce-scatters in flight) to try, cheapest first: the user's, where
    given, else projection.knobs.CHOICE_SETTINGS."""
    from megatron_lbp.projection import knobs

    d = a.hier_prefetch_units
    r = a.hier_max_pending_reduces
    out = []
    for sd, sr in knobs.CHOICE_SETTINGS:
        setting = (sd if d == "auto" else int(d), sr if r == "auto" else int(r))
        if setting not in out:
            out.append(setting)
    return out


def knob_cost_s(a, p: Plan, recompute: str, micro_batch_size: int,
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


def choices(a) -> tuple[list[Choice], Plan]:
    """Every (recompute, micro-batch) this job could run with, each with the first transient
    knob setting that fits (:func:`knob_settings`; the last tried when none does), and the
    plan at micro-batch count 1."""
    world = a.nodes * a.tasks_per_node
    base = plan_of(a, world, 1)
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
            state_floor = min(plan_of(a, world, 1, layer_unit=lu).memory_bytes.total for lu in {t[2] for t in trials})
            if state_floor + act + reserve > limit:
                trials = trials[-1:]
            fitting, fallback = [], None
            for d, r, lu, emb in trials:
                p = plan_of(a, world, k, (d, r), lu, emb)
                # The state and the construction peak are the base plan's but for split
                # layers' padding and their smaller largest unit.
                state = p.memory_bytes.total
                construction = p.construction_peak_bytes + int(reserve)
                transient = p.transient_bytes.peak
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


def smallest_fitting_nodes(a, choice: Choice, base: Plan) -> int | None:
    """Smallest node count at which ``choice``'s micro-batch fits, when the optimizer shard and the
    step's 1/O gradients shrink with more nodes (O = all ranks, one replica, as lbp) and the rest
    is fixed per GCD. None if none fits (up to :data:`MOST_RANKS` ranks, or this job's)."""
    g = base.group_sizes
    if g.optim != base.world_size or g.replicas != 1:
        return None
    limit = a.gcd_memory_gb * GB
    opt = base.memory_bytes.optimizer
    fixed = choice.state_bytes - opt + choice.activation_bytes + choice.margin_bytes
    if fixed >= limit:
        return None
    # The transient shrinks with more ranks (the step's 1/O gradients) and fewer micro-batches:
    # its value at the largest job with one micro-batch is a floor.
    most = max(MOST_RANKS // a.tasks_per_node, a.nodes)
    floor = plan_of(a, most * a.tasks_per_node, 1, choice.knobs, choice.layer_unit,
                    choice.embedding_backward_gather).transient_bytes.peak
    if fixed + floor > limit:
        return None
    n = a.nodes + 1
    while fixed + floor + opt * a.nodes / n > limit:   # a lower bound
        n += 1
    # Confirm with the plan itself (padding, the transient at that node count's micro-batches).
    for n in range(n, min(most, n + 64) + 1):
        world = n * a.tasks_per_node
        k = max(1, a.global_batch_size // (choice.micro_batch_size * world))
        p = plan_of(a, world, k, choice.knobs, choice.layer_unit,
                    choice.embedding_backward_gather)
        total = (p.memory_bytes.total + p.transient_bytes.peak
                 + choice.activation_bytes + choice.margin_bytes)
        if total <= limit and p.construction_peak_bytes + choice.margin_bytes <= limit:
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
    rows = []
    for label, preset, sec in SCHEMES:
        s = {"node": a.tasks_per_node, "package": a.gcds_per_package, 0: 0}[sec]
        b = replace(a, preset=preset, hier_secondary_group_size=s, recompute="auto",
                    micro_batch_size="auto")
        try:
            options, _ = choices(b)
        except PlanError:
            continue   # the scheme cannot be built on this machine shape
        rows += [SchemeRow(label, preset, s, c) for c in options if c.fits]
    return sorted(rows, key=lambda r: r.choice.step_s)


