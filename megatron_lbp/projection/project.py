"""Frontier projection: step time and TFLOPS per GCD from a per-link cost model (pure Python).

Replays the planner's exact per-phase bytes (core.plan over core.costs) with each
collective costing bytes / link-class bandwidth + latency * ceil(log2 group),
under the engine's overlap model; :class:`LinkModel` holds the link figures and
``bench network`` fits them (:func:`fit_link`, :func:`calibrate`). Every
assumption is printed with the output; none is tuned to the paper's figures.

    python -m megatron_lbp.projection [--json] [--mfu 0.35] [--micro-batches 1] ...

The overlap model and its assumptions: docs/frontier.md.
"""
from __future__ import annotations
from megatron_lbp.projection import json_out

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Sequence

from megatron_lbp.core.config import (DEFAULT_BUCKET_SIZE, default_grad_reduce_dtype,
                                      default_secondary_dtype)
from megatron_lbp.core.config import hierarchical_grad_reduce
from megatron_lbp.core.costs import LINK_CLASS_ORDER, PHASES, repeats
from megatron_lbp.core.plan import Model, Plan, PlanRequest, make_plan
from megatron_lbp.projection.schemes import ENGINE_SCHEME_SETTINGS, ENGINE_SCHEMES

GB = 1e9
US = 1e-6

MODELS = {
    "10B": {"num_layers": 32, "hidden_size": 5120, "num_attention_heads": 40, "vocab_size": 50304},
    "20B": {"num_layers": 44, "hidden_size": 6144, "num_attention_heads": 64, "vocab_size": 50304},
}
GCDS = (8, 16, 48, 96, 192, 384)
# The engine's schemes (projection/schemes.py: the benchmarks' table), planned with their flags.
SCHEMES = ENGINE_SCHEMES
DEFAULT_SCHEMES = ("lbp", "lbp-int8-S8", "zeropp", "zero3")
PAPER = {
    "source": "Xu et al., arXiv 2501.04266 (published figures, not recomputed here)",
    "lbp_over_zeropp_tflops_20B_384": 1.71,
    "lbp_scaling_efficiency": 0.94,
    "zeropp_over_zero3_tflops": 1.405,
}
# Families each phase's collectives run in (costs.traffic_bytes) without a secondary copy or
# the two-hop qgZ; phase_families resolves them for a plan.
PHASE_FAMILIES = {
    "forward_gather": ("param",),
    "backward_gather": ("param",),
    "grad_reduce": ("grad",),
    "step_reduce": ("inter", "replica"),
    "step_gather": ("inter", "grad_to_param"),
}
PER_MICRO_BATCH = ("forward_gather", "backward_gather", "grad_reduce")


def phase_families(plan: Plan, phase: str) -> tuple[str, ...]:
    """The families whose collectives make up ``phase`` in this plan (PHASE_FAMILIES resolved):
    the backward gathers read the secondary copy where there is one, and with its step scope
    so do the forward gathers after the step's first; ZeRO++'s two-hop qgZ reduces in the
    secondary group (the node), then across the groups ("grad_cross")."""
    cfg, secondary = plan.config, bool(plan.group_sizes.secondary)
    if phase == "backward_gather":
        return ("secondary",) if secondary else ("param",)
    if phase == "forward_gather" and secondary and plan.secondary_scope == "step" \
            and plan.micro_batches > 1:
        return ("param", "secondary")
    if phase == "grad_reduce" and cfg is not None and hierarchical_grad_reduce(cfg):
        return ("secondary", "grad_cross")
    return PHASE_FAMILIES[phase]


def collectives_per_step(plan: Plan, phase: str, family: str) -> int:
    """How many collectives of ``family`` the step issues in ``phase``: one per bucket, per
    micro-batch or per step as costs.repeats counts them."""
    return plan.buckets * repeats(plan.config, phase, family, plan.micro_batches)


NETWORK_MODES = ("per_rank", "shared_uplink")


@dataclass(frozen=True)
class LinkModel:
    """Bandwidth (bytes/s) and per-collective latency of each link class.

    ``network="per_rank"`` (the Frontier projection): every GCD has its own
    share of the network, the bandwidth is per GCD and a collective costs the
    bytes this rank sends. ``network="shared_uplink"`` (the emulated network:
    one shaped uplink per node): the network bandwidth is the node's uplink,
    each way, and a collective costs the bytes crossing it (uplink_bytes).
    """

    bandwidth: Mapping[str, float] = field(default_factory=lambda: {
        "package": 200 * GB, "node": 50 * GB, "network": 12.5 * GB})
    latency: Mapping[str, float] = field(default_factory=lambda: {
        "package": 5 * US, "node": 10 * US, "network": 20 * US})
    network: str = "per_rank"

    def __post_init__(self):
        if self.network not in NETWORK_MODES:
            raise ValueError(f"network={self.network!r}: must be one of {NETWORK_MODES}")

    @classmethod
    def from_measured(cls, bandwidth: Mapping[str, float],
                      latency: Mapping[str, float] | None = None,
                      network: str = "per_rank") -> "LinkModel":
        """A model from measured bandwidths (bytes/s) and latencies (s): calibration."""
        base = cls()
        bw = {c: float(bandwidth.get(c, base.bandwidth[c])) for c in LINK_CLASS_ORDER}
        lat = {c: float((latency or {}).get(c, base.latency[c])) for c in LINK_CLASS_ORDER}
        for c in LINK_CLASS_ORDER:
            if bw[c] <= 0 or lat[c] < 0:
                raise ValueError(f"{c}: bandwidth {bw[c]} must be > 0 and latency {lat[c]} >= 0")
        return cls(bw, lat, network)


def groups_per_node(members_in_node: int, ranks_per_node: int) -> int:
    """How many groups of one family have members in a node (every rank is in one group).

    The families' groups are translates of each other (plan.py's layout), so a
    node whose ranks sit ``members_in_node`` to a group meets
    ranks_per_node / members_in_node of them.
    """
    if members_in_node < 1 or ranks_per_node % members_in_node:
        raise ValueError(f"{members_in_node} members of a group in a node of {ranks_per_node} "
                         f"ranks: groups must split the node evenly")
    return ranks_per_node // members_in_node


def uplink_bytes(bytes_per_rank: float, members_in_node: int, ranks_per_node: int) -> float:
    """Bytes one collective family puts on a node's shared uplink, each way.

    A ring (gloo) over a group whose ranks are sorted, nodes holding contiguous
    rank ranges, leaves each node it spans over exactly one ring edge per
    direction (edges inside a node are loopback); each of the n-1 ring steps
    moves one chunk T/n over that edge, T(n-1)/n in all = the bytes one rank
    sends. Every group of the family runs at once, so the uplink carries that
    times the groups with members in the node: the world group once, the
    one-rank-per-node peer groups ranks_per_node times.
    """
    return bytes_per_rank * groups_per_node(members_in_node, ranks_per_node)


# Phases whose collectives are reduce-scatters: on gloo (the emulated network) the engine
# runs them as an all-to-all exchange (megatron_lbp.engine.comm.exchange_reduce_scatter),
# not a ring.
EXCHANGE_PHASES = {"grad_reduce": ("grad", "grad_cross"), "step_reduce": ("inter",)}


def exchange_uplink_factor(group_size: int, members_in_node: int, ranks_per_node: int) -> float:
    """Uplink bytes per byte one rank sends, for a family of all-to-all exchanges.

    Each rank sends one chunk (its bytes / (n-1)) straight to each other member; the
    m members in a node send n-m chunks each across its uplink, and ranks_per_node / m
    groups of the family run at once: ranks_per_node (n-m)/(n-1). A ring crosses once per
    node instead (uplink_bytes): the same for one member per node (the peer groups), 2.3x
    less for a world group of 8 ranks in nodes of 4 (measured by bench network-choice:
    zeropp's step took 2.2x what the ring rule predicted).
    """
    if group_size < 2:
        return 0.0
    groups_per_node(members_in_node, ranks_per_node)   # the same evenness check
    return ranks_per_node * (group_size - members_in_node) / (group_size - 1)


def _uplink_multiplicity(plan: Plan, phase: str) -> float:
    """Uplink bytes per rank byte of the network family of ``phase``: groups per node for a
    ring, exchange_uplink_factor for the reduce-scatters (an exchange on gloo)."""
    rpn = plan.gpus_per_node
    found = set()
    for fam in phase_families(plan, phase):
        if _family_size(plan, fam) <= 1 or plan.link_classes.get(fam) != "network":
            continue
        # plan.groups[fam] is rank 0's group; rank 0 sits in the first node.
        in_node = sum(1 for r in plan.groups[fam] if r // rpn == 0)
        if fam in EXCHANGE_PHASES.get(phase, ()):
            found.add(exchange_uplink_factor(_family_size(plan, fam), in_node, rpn))
        else:
            found.add(groups_per_node(in_node, rpn))
    if len(found) > 1:
        # The plan adds the families' bytes up per link class: they can't be split again.
        raise ValueError(f"{phase}: network families with different uplink multiplicities "
                         f"{sorted(found)}; the plan's per-class bytes cannot be split")
    return found.pop() if found else 1


@dataclass(frozen=True)
class ComputeModel:
    """How long the FLOPs take: peak bf16 per GCD times an assumed MFU, plus Adam at HBM speed."""

    peak_flops: float = 191.5e12         # MI250X GCD, bf16 dense
    mfu: float = 0.35
    hbm_bytes_per_s: float = 1.6e12
    adam_bytes_per_element: int = 30     # fp32 master, m, v read+write, fp32 grad read, bf16 write
    seq_length: int = 2048
    micro_batch_size: int = 1            # sequences per GCD per micro-batch
    recompute: bool = False              # full activation recomputation (forward again in backward)


def model_flops_per_token(num_params: int, num_layers: int, hidden_size: int,
                          seq_length: int) -> float:
    """fwd+bwd model FLOPs per token: 6*N plus attention scores and values 12*L*h*s."""
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_length


def plan_for(model: Mapping[str, int], gcds: int, scheme: str, micro_batches: int,
             bucket_size: int = DEFAULT_BUCKET_SIZE, gpus_per_node: int = 8,
             gcds_per_package: int = 2) -> Plan:
    """The plan for one (model, GCD count, scheme): bytes by phase and link, bf16 weights, the
    secondary copy and gradient reduction in the preset's defaults (zeropp: ZeRO++ as DeepSpeed
    ships it, the copy in the weights' dtype, bf16 gradients). ``gpus_per_node``/
    ``gcds_per_package`` default to Frontier; the emulated network's calibration passes its own
    node shape."""
    preset, secondary, dtype = ENGINE_SCHEME_SETTINGS[scheme]
    return make_plan(PlanRequest(
        world_size=gcds, model=Model(model["num_layers"], model["hidden_size"],
                                     model["vocab_size"]),
        gpus_per_node=gpus_per_node, gcds_per_package=gcds_per_package, preset=preset,
        secondary_group_size=secondary, secondary_dtype=dtype or default_secondary_dtype(preset),
        grad_dtype=default_grad_reduce_dtype(preset, "bf16"), micro_batches=micro_batches,
        bucket_size=bucket_size))


def _family_size(plan: Plan, family: str) -> int:
    g = plan.group_sizes
    P, G, O, S, R = g.param, g.grad, g.optim, g.secondary or 0, g.replicas
    return {"param": P, "secondary": S, "grad": G, "optim": O, "inter": O // G,
            "grad_to_param": G // P, "replica": R,
            "grad_cross": G // S if S and plan.config is not None
            and hierarchical_grad_reduce(plan.config) else 1}[family]


def _phase_times(plan: Plan, links: LinkModel) -> dict[str, dict[str, float]]:
    """Seconds each phase keeps each link class busy, per optimizer step (k micro-batches)."""
    out: dict[str, dict[str, float]] = {}
    for phase in PHASES:
        times = {c: plan.traffic_by_phase[phase][c] / links.bandwidth[c]
                 for c in LINK_CLASS_ORDER}
        if links.network == "shared_uplink":
            times["network"] *= _uplink_multiplicity(plan, phase)
        for fam in phase_families(plan, phase):
            n = _family_size(plan, fam)
            if n <= 1:
                continue
            cls = plan.link_classes[fam]
            count = collectives_per_step(plan, phase, fam)
            times[cls] += count * links.latency[cls] * math.ceil(math.log2(n))
        out[phase] = times
    return out


def _window(comm: float, compute: float, buckets: int, head: float | None = None) -> float:
    """Exposed seconds of ``comm`` overlapped with ``compute``: ``head`` (default one bucket's
    share) never hides, the rest only where it outlasts the compute."""
    first = comm / buckets if head is None else head
    return first + max(0.0, comm - first - compute)


def step_time(plan: Plan, model: Mapping[str, int], links: LinkModel = LinkModel(),
              compute: ComputeModel = ComputeModel(), overlap: bool = True,
              phase_times: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, float]:
    """Predicted seconds of one optimizer step on one GCD, with its parts, and TFLOPS/GCD.

    With ``overlap`` the optimizer step's collectives are placed where the engine issues
    them (megatron_lbp.engine.step_comm.StepComm): each unit's reduction to the optimizer
    shard starts once the last micro-batch's backward has reduced that unit, so it shares
    that backward's window; the refresh of the updated weights is started after Adam and
    waited for by each unit's first gather of the next step, so it shares the first
    micro-batch's forward window. In those two windows one unit's chain stays exposed: its
    per-micro-batch share and its step hops one after another (the hops run on different
    link classes in sequence, so their shares add up).

    ``phase_times`` (seconds each phase keeps each link class busy, as ``_phase_times``
    gives them) replaces ``links``: the collective model's (projection/collectives.py).
    """
    k, buckets = plan.micro_batches, plan.buckets
    tokens_mb = compute.micro_batch_size * compute.seq_length
    per_token = model_flops_per_token(plan.params, model["num_layers"], model["hidden_size"],
                                      compute.seq_length)
    rate = compute.peak_flops * compute.mfu
    t_mb = per_token * tokens_mb / rate
    t_fwd = t_mb / 3
    t_bwd = 2 * t_mb / 3 + (t_fwd if compute.recompute else 0.0)
    ph = _phase_times(plan, links) if phase_times is None else phase_times
    fwd = {c: ph["forward_gather"][c] / k for c in LINK_CLASS_ORDER}
    bwd = {c: (ph["backward_gather"][c] + ph["grad_reduce"][c]) / k for c in LINK_CLASS_ORDER}
    fwd_comm, bwd_comm = max(fwd.values()), max(bwd.values())
    reduce, refresh = ph["step_reduce"], ph["step_gather"]
    step_comm = sum(reduce[c] + refresh[c] for c in LINK_CLASS_ORDER)
    if overlap:
        plain_fwd = _window(fwd_comm, t_fwd, buckets)
        plain_bwd = _window(bwd_comm, t_bwd, buckets)
        exposed_mb = k * (plain_fwd + plain_bwd)
        first_fwd = _window(max(fwd[c] + refresh[c] for c in LINK_CLASS_ORDER), t_fwd, buckets,
                            (fwd_comm + sum(refresh.values())) / buckets)
        last_bwd = _window(max(bwd[c] + reduce[c] for c in LINK_CLASS_ORDER), t_bwd, buckets,
                           (bwd_comm + sum(reduce.values())) / buckets)
        exposed_step = first_fwd - plain_fwd + last_bwd - plain_bwd
    else:
        exposed_mb = sum(ph[p][c] for p in PER_MICRO_BATCH for c in LINK_CLASS_ORDER)
        exposed_step = step_comm
    optim_elems = plan.padded_params / plan.group_sizes.optim
    t_adam = optim_elems * compute.adam_bytes_per_element / compute.hbm_bytes_per_s
    total = k * (t_fwd + t_bwd) + exposed_mb + exposed_step + t_adam
    useful = per_token * tokens_mb * k
    return {"step_s": total, "compute_s": k * (t_fwd + t_bwd), "exposed_micro_batch_comm_s":
            exposed_mb, "step_comm_s": step_comm, "exposed_step_comm_s": exposed_step,
            "adam_s": t_adam, "tflops_per_gcd": useful / total / 1e12}


def network_time_over_compute(model: str = "20B", gcds: int = 384, scheme: str = "zero3",
                              micro_batches: int = 2, recompute: bool = True,
                              links: LinkModel = LinkModel(),
                              compute: ComputeModel = ComputeModel()) -> dict[str, Any]:
    """A scheme's network link time per step over its compute time, in this cost model.

    Network time: every network-class collective of the step one after
    another (bytes per GCD / bandwidth + latency, as _phase_times charges
    them); compute: the step's forward and backward (and recomputation) at the
    assumed MFU, as step_time counts it. ``bench network --model
    frontier-shaped`` sets its uplink so that zero3's ratio there is this one.
    """
    plan = plan_for(MODELS[model], gcds, scheme, micro_batches)
    net = sum(times["network"] for times in _phase_times(plan, links).values())
    comp = step_time(plan, MODELS[model], links, replace(compute, recompute=recompute))
    return {"model": model, "gcds": gcds, "scheme": scheme, "micro_batches": micro_batches,
            "recompute": recompute, "mfu": compute.mfu,
            "network_GB_per_s_per_gcd": links.bandwidth["network"] / GB,
            "network_bytes_per_gcd": plan.traffic_bytes["network"],
            "network_s": net, "compute_s": comp["compute_s"], "ratio": net / comp["compute_s"]}


def project(models: Sequence[str] = tuple(MODELS), gcds: Sequence[int] = GCDS,
            schemes: Sequence[str] = DEFAULT_SCHEMES, micro_batches: int = 1,
            bucket_size: int = DEFAULT_BUCKET_SIZE, links: LinkModel = LinkModel(),
            compute: ComputeModel = ComputeModel(), overlap: bool = True) -> dict[str, Any]:
    """Every (model, scheme, GCD count): step time, TFLOPS/GCD, scaling efficiency, bytes."""
    results: dict[str, Any] = {}
    for name in models:
        model = MODELS[name]
        results[name] = {}
        for scheme in schemes:
            rows = {}
            for n in gcds:
                plan = plan_for(model, n, scheme, micro_batches, bucket_size)
                row = step_time(plan, model, links, compute, overlap)
                row["traffic_bytes"] = plan.traffic_bytes
                row["persistent_state_gb"] = plan.memory_bytes.total / GB
                row["params"] = plan.params
                rows[str(n)] = row
            base = rows[str(min(gcds))]["tflops_per_gcd"]
            for row in rows.values():
                row["scaling_efficiency"] = row["tflops_per_gcd"] / base
            results[name][scheme] = rows
    return {"assumptions": assumptions(models, micro_batches, bucket_size, links, compute,
                                       overlap),
            "results": results, "ratios": ratios_of(results, gcds), "paper": PAPER}


def tflops_lines(per_scheme: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """TFLOPS per GCD (scaling efficiency), a line per scheme, a column per GCD count."""
    gcds = list(next(iter(per_scheme.values())))
    lines = ["  " + f"{'scheme':<14}" + "".join(f"{g + ' GCDs':>16}" for g in gcds)]
    for scheme, rows in per_scheme.items():
        lines.append("  " + f"{scheme:<14}" + "".join(
            f"{rows[g]['tflops_per_gcd']:>9.1f} ({rows[g]['scaling_efficiency']:.2f})"
            for g in gcds))
    return lines


def ratios_of(results: Mapping[str, Any], gcds: Sequence[int]) -> dict[str, float]:
    """The ratios set beside the paper's: per model, lbp/zeropp and zeropp/zero3 TFLOPS per
    GCD at the largest GCD count, lbp's scaling efficiency from the smallest to it."""
    top, low = str(max(gcds)), min(gcds)
    ratios = {}
    for name, r in results.items():
        if "lbp" in r and "zeropp" in r:
            ratios[f"{name} lbp/zeropp TFLOPS at {top}"] = (
                r["lbp"][top]["tflops_per_gcd"] / r["zeropp"][top]["tflops_per_gcd"])
        if "zeropp" in r and "zero3" in r:
            ratios[f"{name} zeropp/zero3 TFLOPS at {top}"] = (
                r["zeropp"][top]["tflops_per_gcd"] / r["zero3"][top]["tflops_per_gcd"])
        if "lbp" in r:
            ratios[f"{name} lbp scaling efficiency {low}->{top}"] = \
                r["lbp"][top]["scaling_efficiency"]
    return ratios


def assumptions(models, micro_batches, bucket_size, links: LinkModel, compute: ComputeModel,
                overlap: bool) -> dict[str, Any]:
    return {
        "models": {m: MODELS[m] for m in models},
        "model_notes": "megatron-core GPT, tied embeddings, rope (no position table), "
                       "biased linears, ffn 4h; vocab 50257 padded to 50304",
        "placement": "8 GCDs per node, 2 per package (Frontier); consecutive ranks share "
                     "a package, then a node",
        "bandwidth_GB_per_s_per_gcd": {c: links.bandwidth[c] / GB for c in LINK_CLASS_ORDER},
        "bandwidth_notes": "package: MI250X GCD pair 200 GB/s; node: 50 GB/s (lower end of "
                           "50-100 GB/s Infinity Fabric between packages); network: 100 GB/s "
                           "injection per node (4 x 25 GB/s Slingshot) / 8 GCDs; every GCD "
                           "of a node sends at once",
        "latency_us_per_collective_step": {c: links.latency[c] / US for c in LINK_CLASS_ORDER},
        "latency_notes": "latency x ceil(log2(group size)) per collective, one collective per "
                         "bucket per phase and family",
        "compute": asdict(compute) | {"peak_tflops": compute.peak_flops / 1e12},
        "flops": "model FLOPs 6*N + 12*L*h*s per token; recomputation costs time, not counted",
        "micro_batches": micro_batches,
        "bucket_size_elements": bucket_size,
        "bucket_notes": "the model is split into equal buckets of this many elements (the "
                        "engine never splits a parameter: the tied embedding would be one "
                        "larger bucket of its own)",
        "dtypes": "bf16 weights and weight gathers, fp32 gradient reduce-scatters, Adam in fp32",
        "overlap": ("first bucket's gather / last bucket's reduce exposed per micro-batch; "
                    "the rest hides behind fwd (1/3) / bwd (2/3) compute; link classes run "
                    "concurrently; the optimizer step's reductions share the last "
                    "micro-batch's backward window and its refresh the first forward's, one "
                    "unit's chain of hops exposed in each; Adam exposed"
                    if overlap else "none: every collective exposed"),
        "scaling_efficiency": "TFLOPS/GCD at n over the same scheme at the smallest GCD count",
        "not_modelled": "memory limits (persistent state per GCD is listed, activations are "
                        "not), contention between concurrent phases on one link, RCCL "
                        "algorithm choice, stragglers, pipeline/tensor parallelism",
    }


# --------------------------------------------------------------------------- calibration
# Only the link figures and the compute time are fitted to measurements; the
# step model itself (step_time) is the one that projects Frontier, unchanged.


def fit_link(samples: Sequence[tuple[float, int, float]]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of one link class from timed collectives.

    ``samples``: (bytes this rank sent, group size n, seconds). Fits
    ``seconds = bytes / bandwidth + latency * ceil(log2 n)`` (step_time's
    collective cost) by least squares on the relative error, so small and large
    transfers weigh alike; latency is clamped at 0 (then bandwidth is refitted).
    """
    rows = [(b, math.ceil(math.log2(n)) if n > 1 else 0, t) for b, n, t in samples if t > 0]
    if not rows or all(b <= 0 for b, _, _ in rows):
        raise ValueError("fit_link needs timed samples with bytes > 0")
    # Normal equations of sum(((b*x + s*y) / t - 1)^2) in x = 1/bandwidth, y = latency.
    a11 = sum((b / t) ** 2 for b, s, t in rows)
    a12 = sum(b * s / t ** 2 for b, s, t in rows)
    a22 = sum((s / t) ** 2 for b, s, t in rows)
    r1 = sum(b / t for b, s, t in rows)
    r2 = sum(s / t for b, s, t in rows)
    det = a11 * a22 - a12 * a12
    x, y = ((r1 * a22 - r2 * a12) / det, (a11 * r2 - a12 * r1) / det) if det > 0 else (0.0, -1.0)
    if y < 0 or x <= 0:
        x, y = r1 / a11, 0.0
    return 1.0 / x, y


def fit_uplink(samples: Sequence[tuple[float, int, int, float]],
               ranks_per_node: int) -> tuple[float, float]:
    """(uplink bandwidth bytes/s each way, latency s) of a node's shared uplink.

    ``samples``: (bytes one rank sent, group size n, members of its group in
    one node, seconds); fit_link on the uplink bytes (uplink_bytes) instead of
    the per-rank bytes, the rule step_time applies with
    ``LinkModel(network="shared_uplink")``.
    """
    return fit_link([(uplink_bytes(b, m, ranks_per_node), n, t) for b, n, m, t in samples])


def compute_from_measured(model: Mapping[str, int], params: int, seq_length: int,
                          micro_batch_size: int, micro_batch_s: float, adam_s: float,
                          adam_elements: float) -> ComputeModel:
    """A ComputeModel whose micro-batch (fwd+bwd) and Adam times equal measured ones.

    The peak rate is chosen so that step_time's model FLOPs of one micro-batch
    take ``micro_batch_s`` at MFU 1, and the memory rate so that Adam on
    ``adam_elements`` takes ``adam_s``.
    """
    if micro_batch_s <= 0 or adam_s <= 0 or adam_elements <= 0:
        raise ValueError(f"measured times must be > 0 (micro-batch {micro_batch_s}, "
                         f"adam {adam_s}, elements {adam_elements})")
    per_token = model_flops_per_token(params, model["num_layers"], model["hidden_size"],
                                      seq_length)
    base = ComputeModel()
    return ComputeModel(peak_flops=per_token * seq_length * micro_batch_size / micro_batch_s,
                        mfu=1.0, seq_length=seq_length, micro_batch_size=micro_batch_size,
                        hbm_bytes_per_s=adam_elements * base.adam_bytes_per_element / adam_s)


def calibrate(measured_step_s: Mapping[str, float], plans: Mapping[str, Mapping[str, Any]],
              model: Mapping[str, int], links: LinkModel, compute: ComputeModel,
              reference: str = "lbp", tolerance: float = 0.2) -> dict[str, dict[str, Any]]:
    """Per scheme: measured and predicted step time, both as ratios to ``reference``, and the error.

    ``plans[scheme]`` is the plan whose traffic models that scheme's step;
    ``rel_error`` = |predicted ratio - measured ratio| / measured ratio.
    """
    if reference not in measured_step_s:
        raise ValueError(f"the reference scheme {reference!r} was not measured")
    predicted = {s: step_time(plans[s], model, links, compute) for s in measured_step_s}
    ref_meas, ref_pred = measured_step_s[reference], predicted[reference]["step_s"]
    out = {}
    for s, t in measured_step_s.items():
        m, p = t / ref_meas, predicted[s]["step_s"] / ref_pred
        err = abs(p - m) / m
        out[s] = {"measured_s": t, "predicted_s": predicted[s]["step_s"],
                  "predicted_parts_s": {k: v for k, v in predicted[s].items()
                                        if k.endswith("_s") and k != "step_s"},
                  "measured_ratio": m, "predicted_ratio": p, "rel_error": err,
                  "within_20pct": err <= tolerance}
    return out


# --------------------------------------------------------------------------- output


def render(out: Mapping[str, Any]) -> str:
    a = out["assumptions"]
    lines = ["Frontier projection (cost model, not a measurement)", "assumptions:"]
    for key, value in a.items():
        lines.append(f"  {key}: {json.dumps(value) if not isinstance(value, str) else value}")
    for name, per_scheme in out["results"].items():
        first = next(iter(per_scheme.values()))
        gcds = list(first)
        params = first[gcds[0]]["params"]
        lines.append(f"\n{name} ({params / 1e9:.2f} B parameters): TFLOPS/GCD "
                     f"(scaling efficiency)")
        lines += tflops_lines(per_scheme)
        top = gcds[-1]
        lines.append(f"  at {top} GCDs, seconds per step: " + ", ".join(
            f"{s} {rows[top]['step_s']:.2f} (compute {rows[top]['compute_s']:.2f}, exposed "
            f"comm {rows[top]['exposed_micro_batch_comm_s'] + rows[top]['exposed_step_comm_s']:.2f}, "
            f"state {rows[top]['persistent_state_gb']:.1f} GB)"
            for s, rows in per_scheme.items()))
    lines.append("\nratios (model) vs paper:")
    p = out["paper"]
    paper_for = {"lbp/zeropp TFLOPS": p["lbp_over_zeropp_tflops_20B_384"],
                 "zeropp/zero3 TFLOPS": p["zeropp_over_zero3_tflops"],
                 "lbp scaling efficiency": p["lbp_scaling_efficiency"]}
    for key, value in out["ratios"].items():
        ref = next((v for k, v in paper_for.items() if k in key), None)
        lines.append(f"  {key:<44} model {value:.3f}" + (f"   paper {ref}" if ref else ""))
    lines.append(f"  paper: {p['source']}")
    return "\n".join(lines)

