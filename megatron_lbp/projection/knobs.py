"""What the engine's transient knobs cost in exposed time: its schedule, unit by unit (pure Python).

The knobs (--hier-prefetch-units d, --hier-max-pending-reduces r,
--hier-embedding-backward-gather) trade transient memory for overlap. This
module walks the step's program (megatron_lbp.core.program) over the model's
gather units for one micro-batch, each collective timed by the cost model
(``project.LinkModel``) and each unit's compute by ``ComputeModel``.
Exposed seconds = the pass's end minus its compute; a knob's cost is the
difference to the default's (d = 1, r = 2) times the micro-batches per step.
See docs/design.md, "Transient memory and its knobs".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from megatron_lbp.core.plan import Plan
from megatron_lbp.core.config import (DEFAULT_EMBEDDING_BACKWARD_GATHER,
                                      DEFAULT_MAX_PENDING_REDUCES, DEFAULT_PREFETCH_UNITS)
from megatron_lbp.core.program import BACKWARD, FORWARD, Op, ProgramSpec, step_program
from megatron_lbp.core.vocabulary import UNIT_KINDS
from megatron_lbp.projection.project import ComputeModel, LinkModel

DEFAULT = (DEFAULT_PREFETCH_UNITS, DEFAULT_MAX_PENDING_REDUCES)
# The settings the launcher's choice tries, the default first (launch/estimate.py):
# one reduce-scatter less in flight, then no prefetch as well.
CHOICE_SETTINGS = (DEFAULT, (DEFAULT_PREFETCH_UNITS, 1), (0, 1))
# The settings the plan's table shows beside the one asked for (prefetch, pending).
TABLE_SETTINGS = ((DEFAULT_PREFETCH_UNITS, 1), (0, DEFAULT_MAX_PENDING_REDUCES), (0, 1),
                  (2, DEFAULT_MAX_PENDING_REDUCES))

_PHASE_FAMILY = {"forward_gather": "param", "backward_gather": None, "grad_reduce": "grad"}


@dataclass(frozen=True)
class Knobs:
    prefetch_units: int = DEFAULT_PREFETCH_UNITS
    max_pending_reduces: int = DEFAULT_MAX_PENDING_REDUCES
    embedding_backward_gather: str = DEFAULT_EMBEDDING_BACKWARD_GATHER


def _family(plan: Plan, phase: str) -> str:
    fam = _PHASE_FAMILY[phase]
    if fam is None:
        fam = "secondary" if plan.group_sizes.secondary else "param"
    return fam


def _group_size(plan: Plan, family: str) -> int:
    g = plan.group_sizes
    return {"param": g.param, "secondary": g.secondary or 0, "grad": g.grad}[family]


def unit_comm_s(plan: Plan, numels: Sequence[int], phase: str,
                links: LinkModel) -> tuple[str | None, list[float]]:
    """(link class, seconds per unit) of one per-micro-batch phase's collectives."""
    fam = _family(plan, phase)
    cls = plan.link_classes.get(fam)
    n = _group_size(plan, fam)
    if cls is None or n <= 1:
        return None, [0.0] * len(numels)
    k = plan.micro_batches
    per_mb = sum(plan.traffic_by_phase[phase][c] / links.bandwidth[c]
                 for c in plan.traffic_by_phase[phase]) / k
    total = sum(numels)
    lat = links.latency[cls] * math.ceil(math.log2(n))
    return cls, [per_mb * x / total + lat for x in numels]


def unit_compute_s(units: Sequence[tuple[str, int]], model: Mapping[str, int],
                   compute: ComputeModel, tied: bool) -> list[float]:
    """Seconds of fwd+bwd model FLOPs per unit and micro-batch (the module docstring's rule)."""
    tokens = compute.micro_batch_size * compute.seq_length
    rate = compute.peak_flops * compute.mfu
    attention = 12.0 * model["hidden_size"] * compute.seq_length
    embedding = next((n for kind, n in units if kind == "embedding"), 0)
    out = []
    for kind, n in units:
        if kind == "embedding":
            flops = 0.0
        elif kind in ("layer", "attention"):   # a split layer's attention computes its scores
            flops = 6.0 * n + attention
        elif kind == "output" and tied:
            flops = 6.0 * (n + embedding)
        else:
            flops = 6.0 * n
        out.append(flops * tokens / rate)
    return out


def _walk(ops: Sequence[Op], seconds: Mapping[str, tuple[str | None, Sequence[float]]],
          compute: Sequence[float]) -> float:
    """Exposed seconds of one pass of the step's program (megatron_lbp.core.program):
    ``seconds``: phase -> (link class, seconds per unit) of the collectives timed (the
    others are left out); collectives on one class run one after another in issue order."""
    free: dict[str, float] = {}
    end: dict[int, float] = {}
    t = busy = 0.0
    for op in ops:
        if op.action == "issue" and op.phase in seconds:
            cls, per_unit = seconds[op.phase]
            start = max(t, free.get(cls, 0.0)) if cls is not None else t
            end[op.index] = start + per_unit[op.unit]
            if cls is not None:
                free[cls] = end[op.index]
        elif op.action == "wait" and op.waits[0] in end:
            t = max(t, end[op.waits[0]])
        elif op.action == "compute":
            t += compute[op.unit]
            busy += compute[op.unit]
    return t - busy


def exposed_s(plan: Plan, units: Sequence[tuple[str, int]],
              model: Mapping[str, int], knobs: Knobs, *, links: LinkModel = LinkModel(),
              compute: ComputeModel = ComputeModel(), tied: bool = True) -> dict[str, float]:
    """Exposed seconds of the per-micro-batch collectives: {forward, backward, micro_batch, step}
    (``step``: k micro-batches)."""
    if knobs.prefetch_units < 0 or knobs.max_pending_reduces < 1:
        raise ValueError(f"{knobs}: prefetch_units must be >= 0, max_pending_reduces >= 1")
    numels = [n for _, n in units]
    n = len(numels)
    tied = tied and n >= 2 and units[0][0] == "embedding"
    work = unit_compute_s(units, model, compute, tied)
    fwd = [w / 3 for w in work]
    bwd = [w * 2 / 3 + (w / 3 if compute.recompute else 0.0) for w in work]
    seconds = {phase: unit_comm_s(plan, numels, phase, links)
               for phase in ("forward_gather", "backward_gather", "grad_reduce")}
    g = plan.group_sizes
    # The embedding skip applies to unit 0 (the program's rule): only where it is the embedding.
    skip = knobs.embedding_backward_gather == "skip" and bool(units) and units[0][0] == "embedding"
    spec = ProgramSpec(
        unit_kinds=tuple(kind if kind in UNIT_KINDS else "other" for kind, _ in units),
        group_sizes={"param": g.param, "secondary": g.secondary or 0, "grad": g.grad},
        tied_embedding=tied, prefetch_units=knobs.prefetch_units,
        max_pending_reduces=knobs.max_pending_reduces,
        embedding_backward_gather="skip" if skip else "gather")
    passes = {segment: ops for segment, _, ops in step_program(spec).segments()}
    forward = _walk(passes[FORWARD], seconds, fwd)
    backward = _walk(passes[BACKWARD], seconds, bwd)
    k = plan.micro_batches
    return {"forward": forward, "backward": backward, "micro_batch": forward + backward,
            "step": k * (forward + backward)}


def cost_s(plan: Plan, units: Sequence[tuple[str, int]], model: Mapping[str, int],
           knobs: Knobs, default_units: Sequence[tuple[str, int]] | None = None,
           **kw) -> float:
    """Seconds per optimizer step a knob setting adds to the default's exposed communication.

    ``default_units``: the units the default runs with, where the setting's differ (split
    layers against whole ones, --hier-layer-unit; the per-phase bytes are the same but for
    padding); None: ``units``. Negative where smaller units pipeline closer."""
    default_units = units if default_units is None else default_units
    if knobs == Knobs(*DEFAULT) and default_units == units:
        return 0.0
    return (exposed_s(plan, units, model, knobs, **kw)["step"]
            - exposed_s(plan, default_units, model, Knobs(*DEFAULT), **kw)["step"])
