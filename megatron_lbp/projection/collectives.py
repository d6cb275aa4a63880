"""Collective time from the link survey's tables, or from stated public figures; step-time bands.

A collective over n ranks of a shape in which one rank sends s bytes takes
(n - 1) * alpha + s / beta: :data:`PUBLIC` figures without a survey, else the
survey's table for (op, dtype, shape) read at s (``fallbacks`` says when another
table stood in). A quantizer call takes the survey's codec probe's time, or HBM speed without
one. ``step_band`` is project.step_time at four corners (rates fast or slow x overlap perfect
or pessimistic), the coding added where not hidden, widened to hold the point estimate.
See docs/planning.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from megatron_lbp.core.plan import Plan
from megatron_lbp.projection import survey_file as sf

GB = 1e9
US = 1e-6
RATES = ("fast", "mid", "slow")

# (beta bytes/s per GCD one way, alpha s per ring step) at the fast and slow ends, per shape.
# Sources: AMD's MI250X figures, 400 GB/s between the two GCDs of a package counting both
# directions (200 each way: the fast end; half that at the slow end, what a collective achieves
# of it not being published); OLCF's Frontier User Guide, 50-100 GB/s per direction between
# GCDs on different packages (the two ends), and four 25 GB/s Slingshot-11 NICs per node, 12.5
# GB/s per GCD with all 8 sending (the cross-node groups' fast end; half that at the slow end:
# RCCL's achieved share at scale is not public, and PCCL, Singh et al., arXiv 2504.18658,
# reports RCCL's ring far below it on Frontier). A world ring laid out node by node crosses the
# NICs once per node: its fast end is the in-node lower end, its slow end the per-GCD NIC
# share. Per-step latencies are assumptions (not published): 2.5-5 us in a package, 5-10 us in
# a node, 5-20 us across nodes.
PUBLIC = {
    "package": {"fast": (200 * GB, 2.5 * US), "slow": (100 * GB, 5 * US)},
    "node": {"fast": (100 * GB, 5 * US), "slow": (50 * GB, 10 * US)},
    "cross_node": {"fast": (12.5 * GB, 5 * US), "slow": (6.25 * GB, 20 * US)},
    "world": {"fast": (50 * GB, 5 * US), "slow": (12.5 * GB, 20 * US)},
}
PUBLIC_TEXT = ("public Frontier figures (AMD MI250X: 200 GB/s each way in a package; OLCF "
               "Frontier User Guide: 50-100 GB/s between packages, 4 x 25 GB/s Slingshot-11 "
               "per node; per-step latency assumed; projection/collectives.py)")
# A Frontier node's compute against its network, for what emulates it (benchmarks/network_shape.py
# sets an emulated uplink from these, never from this model's step times). Sources: AMD's MI250X
# figures, 383 TFLOP/s bf16 dense per module of 2 GCDs; OLCF's Frontier User Guide, 8 GCDs and
# four 25 GB/s Slingshot-11 NICs per node; Dash et al., "Optimizing Distributed Training on
# Frontier for Large Language Models" (arXiv 2312.12705), 38.38% of peak achieved for a 22B GPT
# on Frontier, the published figure nearest the 20B flagship.
FRONTIER_NODE = {"gcds": 8, "peak_flops_per_gcd": 191.5e12, "nic_bytes_per_s": 4 * 25 * GB,
                 "achieved_share_of_peak": 0.3838}
FRONTIER_NODE_TEXT = ("Frontier node: 8 GCDs x 191.5 TFLOP/s bf16 (AMD MI250X), 38.38% of peak "
                      "achieved (Dash et al., arXiv 2312.12705, 22B GPT), 4 x 25 GB/s "
                      "Slingshot-11 NICs (OLCF Frontier User Guide)")


def frontier_flops_per_network_byte() -> float:
    """A Frontier node's achieved model FLOP/s over its NICs' bytes/s each way (FRONTIER_NODE)."""
    f = FRONTIER_NODE
    return f["gcds"] * f["peak_flops_per_gcd"] * f["achieved_share_of_peak"] / f["nic_bytes_per_s"]


# Coding on a GCD without a survey (the quantizers of qwZ, qgZ and the int8 secondary copy): each
# element read and written once at HBM speed, bf16 in and int8 (1 byte) or int4 (half) out to
# encode, the codes in and fp32 sums out to decode. Sources: AMD's MI250X figures, 3.2 TB/s HBM2e
# per module of 2 GCDs (1.6 per GCD: the fast end; half that at the slow end, what the
# quantizer's kernels achieve of it not being published).
HBM_BYTES_PER_S = {"fast": 1.6e12, "slow": 0.8e12}
CODEC_BYTES_PER_ELEMENT = {("int8", "encode"): 3.0, ("int8", "decode"): 5.0,
                           ("int4", "encode"): 2.5, ("int4", "decode"): 4.5}
# Without a survey the pessimistic overlap is none: nothing measured says more is hidden.
NO_OVERLAP = {"hidden_fraction": 0.0, "slowdown": 1.0}
# Ties: a row is tied with the fastest where at some corner it is within this of it (the step
# model's resolution: its idealised and replayed steps differ by up to 1%).
TIE = 0.01


def _mid(a: float, b: float) -> float:
    return math.sqrt(a * b)


def shape_text(survey: Mapping[str, Any]) -> str:
    """'2 node(s) x 4 ranks, gloo on cpu': the machine a survey was taken on."""
    m = survey["machine"]
    where = " on ".join(str(m[k]) for k in ("backend", "device") if m.get(k))
    return f"{m['nodes']} node(s) x {m['tasks_per_node']} ranks" + (f", {where}" if where else "")


class CollectiveModel:
    """Seconds of one collective by (op, dtype, shape, bytes sent per rank, group size, rate)."""

    def __init__(self, survey: Mapping[str, Any] | None = None, source: str = ""):
        self.survey = survey
        self.source = source or (PUBLIC_TEXT if survey is None else "link survey")
        self.tables = sf.table_index(survey) if survey else {}
        self.fallbacks: set[str] = set()
        self._fit: dict[tuple, tuple[float, float]] = {}
        # The codec probe (absent: public figures), and each codec's hidden fraction in [0, 1].
        self.codecs = (survey or {}).get("codecs") or {}
        self._codec_hidden = {name: min(1.0, max(0.0, c["hidden_fraction"]))
                              for name, c in self.codecs.get("by_codec", {}).items()}

    @classmethod
    def public(cls) -> "CollectiveModel":
        return cls(None)

    @classmethod
    def from_file(cls, path: str) -> "CollectiveModel":
        survey = sf.read(path)
        return cls(survey, f"link survey {path} ({shape_text(survey)}; a group size other "
                           "than the surveyed one adds its fitted per-step latency per ring step)")

    # ------------------------------------------------------------------ tables

    def table(self, op: str, dtype: str, shape: str) -> Mapping[str, Any] | None:
        for key in [(op, dtype, shape)] + [(op, d, shape) for d in sf.DTYPES] + \
                [(o, d, shape) for o in sf.OPS for d in sf.DTYPES]:
            if key in self.tables:
                if key != (op, dtype, shape):
                    self.fallbacks.add(f"{op} {dtype} {shape} read from {' '.join(key[:2])}")
                return self.tables[key]
        if self.tables:
            self.fallbacks.add(f"{shape}: not surveyed, public figures")
        return None

    def alpha(self, t: Mapping[str, Any], column: str) -> float:
        """Seconds per ring step: the least-squares intercept of seconds on bytes sent (>= 0)
        over the table's sizes (their :meth:`monotone` times), / (m - 1)."""
        key = (t["op"], t["dtype"], t["shape"], column)
        if key not in self._fit:
            xs, ys = t["sent_bytes"], self.monotone(t[column])
            if len(xs) < 2:
                a = 0.0
            else:
                mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
                sxx = sum((x - mx) ** 2 for x in xs)
                slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
                a = max(0.0, my - slope * mx)
            self._fit[key] = (a / (t["group_size"] - 1), a)
        return self._fit[key][0]

    @staticmethod
    def monotone(ys: Sequence[float]) -> list[float]:
        """Each size's time as at most every larger size's (the running minimum from the
        largest): on one group a collective of fewer bytes takes no longer than one of more,
        so a table time above a larger size's is that run's stall (a loaded host's), and the
        larger size's time is what the smaller one is read as. Left as they are when they
        already grow with size."""
        out = list(ys)
        for i in range(len(out) - 2, -1, -1):
            out[i] = min(out[i], out[i + 1])
        return out

    @classmethod
    def interpolate(cls, xs: Sequence[float], ys: Sequence[float], x: float) -> float:
        """Piecewise linear through (xs, :meth:`monotone` ys), the end segments extended; one
        point: through 0. Never decreasing with x: below the smallest size it reads no more
        than that size's time, and no less than that time scaled down by size (a smaller
        message moves no faster per byte; the first segment's line alone can reach 0 there
        where its fitted intercept is below 0, and the engine's many small collectives would
        then cost nothing)."""
        ys = cls.monotone(ys)
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        i = 1
        while i < len(xs) - 1 and x > xs[i]:
            i += 1
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        line = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        if x < x0:
            return max(line, y0 * max(x, 0.0) / x0)
        return max(0.0, line)

    # ------------------------------------------------------------------ the model

    def seconds(self, op: str, dtype: str, shape: str, sent: float, n: int,
                rate: str = "mid") -> float:
        if n < 2 or sent <= 0:
            return 0.0
        t = self.table(op, dtype, shape) if self.tables else None
        if t is None:
            ends = PUBLIC[shape]
            if rate == "mid":
                beta = _mid(ends["fast"][0], ends["slow"][0])
                alpha = _mid(ends["fast"][1], ends["slow"][1])
            else:
                beta, alpha = ends[rate]
            return (n - 1) * alpha + sent / beta
        column = {"fast": "seconds_min", "mid": "seconds", "slow": "seconds_max"}[rate]
        base = self.interpolate(t["sent_bytes"], t[column], sent)
        return max(base + (n - t["group_size"]) * self.alpha(t, column), 0.0)

    def overlap(self, pessimistic: bool) -> dict[str, float]:
        """{hidden_fraction, slowdown}: the survey's least hidden / largest slowdown
        (``pessimistic``) or its medians; without a probe: none hidden (pessimistic) or
        :data:`NO_OVERLAP` as well (there is no measured middle)."""
        by_op = ((self.survey or {}).get("overlap") or {}).get("by_op") or {}
        if not by_op:
            return dict(NO_OVERLAP)
        h = sorted(min(1.0, max(0.0, o["hidden_fraction"])) for o in by_op.values())
        d = sorted(max(1.0, o["slowdown"]) for o in by_op.values())
        if pessimistic:
            return {"hidden_fraction": h[0], "slowdown": d[-1]}
        return {"hidden_fraction": h[len(h) // 2], "slowdown": d[len(d) // 2]}

    # ------------------------------------------------------------------ coding

    def codec_call_seconds(self, codec: str, direction: str, elements: int,
                           rate: str = "mid") -> float:
        """Seconds of one quantizer call: the survey's codec probe read at ``elements``
        (:meth:`interpolate` over its sizes: a call's fixed cost and its cost per element),
        else :data:`CODEC_BYTES_PER_ELEMENT` at :data:`HBM_BYTES_PER_S`."""
        if codec in self._codec_hidden:
            column = {"fast": "seconds_min", "mid": "seconds", "slow": "seconds_max"}[rate]
            return self.interpolate(self.codecs["elements"],
                                    self.codecs["by_codec"][codec][direction][column], elements)
        if self.survey is not None:
            self.fallbacks.add(f"{codec} coding: not surveyed, public figures")
        hbm = (_mid(HBM_BYTES_PER_S["fast"], HBM_BYTES_PER_S["slow"]) if rate == "mid"
               else HBM_BYTES_PER_S[rate])
        return elements * CODEC_BYTES_PER_ELEMENT[(codec, direction)] / hbm

    def codec_seconds(self, plan: Plan, rate: str, exposed: str | None = None) -> float:
        """Seconds a step's quantizer calls take on one device (the plan's codec_calls); with
        ``exposed`` ("point" or "pessimistic") only what compute does not hide
        (:meth:`codec_hidden`)."""
        total = 0.0
        for rows in plan.codec_calls.values():
            for row in rows:
                hidden = (self.codec_hidden(row["codec"], exposed == "pessimistic") if exposed
                          else 0.0)
                total += (1 - hidden) * row["calls"] * self.codec_call_seconds(
                    row["codec"], row["direction"], row["elements"], rate)
        return total

    def codec_hidden(self, codec: str, pessimistic: bool) -> float:
        """The fraction of ``codec``'s coding hidden behind compute: the codec probe's for it, or
        (``pessimistic``) the least of any codec's; without a probe, none (nothing measured
        says more)."""
        h = self._codec_hidden
        if codec not in h:
            return 0.0
        return min(h.values()) if pessimistic else h[codec]

    # ------------------------------------------------------------------ a plan's phases

    def phase_times(self, plan: Plan, rate: str) -> dict[str, dict[str, float]]:
        """Seconds each phase keeps each link class busy per optimizer step (project._phase_times'
        shape), every collective of a bucket timed by :meth:`seconds`."""
        from megatron_lbp.core.costs import LINK_CLASS_ORDER, PHASES
        from megatron_lbp.projection.project import (_family_size, collectives_per_step,
                                                     phase_families)

        out: dict[str, dict[str, float]] = {}
        for phase in PHASES:
            times = {c: 0.0 for c in LINK_CLASS_ORDER}
            charged = set()
            for fam in phase_families(plan, phase):
                n, cls = _family_size(plan, fam), plan.link_classes.get(fam)
                total = plan.traffic_by_phase[phase].get(cls, 0) if cls else 0
                # The plan adds a phase's families up per link class: the first family of a
                # class carries its bytes (the families of a phase cross different classes).
                if n <= 1 or cls in charged or total <= 0:
                    continue
                charged.add(cls)
                count = collectives_per_step(plan, phase, fam)
                op, dtype = phase_op(plan, phase, fam)
                shape = shape_of(plan, fam, cls)
                times[cls] += count * self.seconds(op, dtype, shape, total / count, n, rate)
            out[phase] = times
        return out


def phase_op(plan: Plan, phase: str, family: str) -> tuple[str, str]:
    """(op, dtype) of a phase's collective as the engine issues it (engine/unit.py)."""
    qgz = plan.quantize_grad_reduce
    codec = "int4" if plan.grad_quant_scheme == "int4-hier" else "int8"
    weights = "int8" if plan.quantize_weight_gather else plan.params_dtype
    if phase == "step_gather":
        return "all_gather", plan.params_dtype
    if phase in ("forward_gather", "backward_gather"):
        if family != "secondary":
            return "all_gather", weights
        # an int8 copy travels as int8; qwZ sends any other copy as int8 too (zeropp's hpZ
        # copy, in the weights' dtype, included)
        dtype = plan.secondary_dtype
        if dtype == "int8" or plan.quantize_weight_gather:
            return "all_gather", "int8"
        return "all_gather", plan.params_dtype if dtype == "param" else dtype
    if phase == "grad_reduce":
        return ("all_to_all", codec) if "grad" in qgz else ("reduce_scatter", plan.grad_dtype)
    if family == "inter" and "inter" in qgz:
        return "all_to_all", codec
    return ("all_reduce" if family == "replica" else "reduce_scatter"), plan.grad_dtype


def shape_of(plan: Plan, family: str, cls: str) -> str:
    """The survey shape a family's groups have: by link class, and for the network whether each
    node holds one member (the cross-node hop, every such group at once) or several (a world-like
    ring)."""
    if cls != "network":
        return cls
    rpn = plan.gpus_per_node
    in_node = sum(1 for r in plan.groups[family] if r // rpn == 0)
    return "cross_node" if in_node <= 1 else "world"


# --------------------------------------------------------------------------- bands


@dataclass(frozen=True)
class Band:
    """A step time (s): the point and the range over the four corners (rates x overlap)."""

    point: float
    low: float
    high: float
    corners: Mapping[str, float] = field(default_factory=dict)

    def shifted(self, extra: float) -> "Band":
        return Band(self.point + extra, self.low + extra, self.high + extra,
                    {k: v + extra for k, v in self.corners.items()})

    def text(self) -> str:
        return f"{self.point:.4g} s [{self.low:.4g}, {self.high:.4g}]"


def partial_overlap(perfect: Mapping[str, float], none: Mapping[str, float],
                    hidden: float, slowdown: float) -> float:
    hideable = max(0.0, none["step_s"] - perfect["step_s"])
    return (perfect["step_s"] + (1 - hidden) * hideable
            + (slowdown - 1) * min(perfect["compute_s"], hidden * hideable))


def step_band(plan: Plan, model: Mapping[str, int], compute, cm: CollectiveModel,
              point: float | None = None) -> Band:
    """The step's band (see the module's doc); ``point`` (no survey: the cost model's own figure)
    replaces the survey's own point. The quantizers' time (:meth:`CollectiveModel.codec_seconds`)
    is hidden behind compute at the perfect-overlap corners, and exposed but for the codec
    probe's hidden fraction at the others and the survey's point."""
    from megatron_lbp.projection.project import step_time

    pess, mid = cm.overlap(True), cm.overlap(False)
    corners, mid_s = {}, None
    for rate in ("fast", "slow", "mid"):
        ph = cm.phase_times(plan, rate)
        perfect = step_time(plan, model, compute=compute, overlap=True, phase_times=ph)
        none = step_time(plan, model, compute=compute, overlap=False, phase_times=ph)
        if rate == "mid":
            mid_s = (partial_overlap(perfect, none, mid["hidden_fraction"], mid["slowdown"])
                     + cm.codec_seconds(plan, rate, exposed="point"))
            continue
        corners[f"{rate}, perfect overlap"] = perfect["step_s"]
        corners[f"{rate}, {'measured' if cm.survey else 'no'} overlap"] = partial_overlap(
            perfect, none, pess["hidden_fraction"], pess["slowdown"]) + cm.codec_seconds(
            plan, rate, exposed="pessimistic")
    p = mid_s if point is None else point
    return Band(p, min(p, *corners.values()), max(p, *corners.values()), corners)


def ratio_band(a: Band, b: Band) -> tuple[float, float]:
    """(lowest, highest) of a / b over the corners both have (the same machine for both)."""
    r = [a.corners[k] / b.corners[k] for k in a.corners if k in b.corners and b.corners[k] > 0]
    r.append(a.point / b.point)
    return min(r), max(r)


def ties(a: Band, fastest: Band) -> bool:
    """Whether ``a`` is tied with ``fastest``: at some corner within TIE of it or faster."""
    return ratio_band(a, fastest)[0] <= 1 + TIE
