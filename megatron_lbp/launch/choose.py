"""The configuration to launch, chosen by projected step time under memory.

Every candidate (scheme x recomputation x micro-batch size, each with the first
transient knob setting that fits) gets its memory per GCD from the one memory model
(``candidates.choices``) and its projected step time: the committed schedule trace
replayed at this shape (projection/project_replay.py) where one matches, the
idealised cost model otherwise (every row says which).
The choice is the fastest fitting row among those the user left open (an explicit
--preset, --micro-batch-size or --recompute restricts it). See docs/planning.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

from megatron_lbp.core.plan import Plan, PlanError
from megatron_lbp.launch import candidates
from megatron_lbp.launch.job import Job

# (label, preset, secondary: "node", "package" or 0) — the schemes every ranking covers.
SCHEMES = candidates.SCHEMES
# label -> the scheme name of the committed traces (megatron_lbp/projection/traces/index.json).
# (zeropp, ZeRO++, is timed by the idealised model: its committed traces are not yet held
# to the idealised step the way lbp's are, tests/launch/test_launch_choose.py.)
TRACED = {"lbp S=node": "lbp-int8-S8", "lbp S=0": "lbp", "zero3": "zero3"}


@dataclass(frozen=True)
class Row:
    scheme: str
    preset: str
    secondary: int
    choice: candidates.Choice
    source: str          # "replay" (a committed trace at this shape) or "idealised"


def secondary_size(a, sec) -> int:
    return {"node": a.tasks_per_node, "package": a.gcds_per_package}.get(sec, sec or 0)


def scheme_label(a, preset: str, secondary: int) -> str:
    if preset != "lbp":
        return preset
    return "lbp S=" + ("node" if secondary == a.tasks_per_node else
                       "package" if secondary == a.gcds_per_package else str(secondary))


def _schemes(a) -> list[tuple[str, str, int]]:
    out = [(label, preset, secondary_size(a, sec)) for label, preset, sec in SCHEMES]
    if a.preset != "auto" and (a.preset, a.hier_secondary_group_size) not in \
            {(p, s) for _, p, s in out}:
        out.append((scheme_label(a, a.preset, a.hier_secondary_group_size), a.preset,
                    a.hier_secondary_group_size))
    return out


# --------------------------------------------------------------------------- the replay


@functools.lru_cache(maxsize=16)
def _records(path: str) -> tuple:
    """Rank 0's records of a committed trace, by step (projection/trace_records.py: torch-free)."""
    from megatron_lbp.projection import project_replay as pr

    return tuple(pr.load(path, rank=0))


@functools.lru_cache(maxsize=1)
def _committed() -> dict[str, dict[int, Any]]:
    from megatron_lbp.projection import project_replay as pr

    try:
        return pr.default_traces()
    except pr.ReplayError:
        return {}


def trace_for(a, label: str, c: candidates.Choice) -> str | None:
    """The committed trace whose replay times this row, or None (then: the idealised model)."""
    if (label not in TRACED or c.recompute != "full" or a.tasks_per_node != 8
            or c.embedding_backward_gather != "gather"   # the traces gather it (and whole layers)
            or a.gcds_per_package != 2 or not a.gpt2_architecture()
            or a.ffn_hidden_size not in (0, 4 * a.hidden_size) or a.params_dtype != "bf16"
            or a.hier_grad_reduce_dtype not in (None, "fp32")
            or a.position_embedding_type != "rope"
            or (label == "lbp S=node" and a.hier_secondary_dtype not in (None, "int8"))):
        return None
    path = _committed().get(TRACED[label], {}).get(a.num_layers)
    if path is None:
        return None
    from megatron_lbp.projection import project_replay as pr

    try:
        records = _records(str(path))
    except (pr.ReplayError, KeyError, ValueError):
        return None
    return str(path) if records and records[-1]["micro_batches"] == c.micro_batches else None


def replayed_step_s(a: Job, p: Plan, path: str, c: candidates.Choice) -> float | None:
    """The trace at ``path`` replayed with ``p``'s bytes and link classes at this model's
    compute (None when the replay refuses it: the idealised model then)."""
    from megatron_lbp.projection import project_replay as pr

    compute = candidates.compute_model(a, c.micro_batch_size, True)
    try:
        out = pr.replay_one(list(_records(path)), p, candidates._model(a),
                            candidates.link_model(a), compute)
    except (pr.ReplayError, KeyError, ValueError):
        return None
    return out["step_s"] if out.get("bytes_match_plan") else None


# --------------------------------------------------------------------------- ranking


def rank(a) -> list[Row]:
    """Every candidate at the user's global batch, fastest first (fitting or not)."""
    rows = []
    world = a.nodes * a.tasks_per_node
    for label, preset, secondary in _schemes(a):
        b = replace(a, preset=preset, hier_secondary_group_size=secondary, recompute="auto",
                    micro_batch_size="auto")
        try:
            options, _ = candidates.choices(b)
        except PlanError:
            continue   # the scheme cannot be built on this machine shape
        for c in options:
            source = "survey" if a.survey else "idealised"
            # With a survey the collective model times the step (its tables and overlap),
            # which the committed traces' replay (on the cost model's link figures) does not.
            path = None if a.step_seconds or source == "survey" else trace_for(b, label, c)
            if path:
                t = replayed_step_s(b, candidates.plan_of(b, world, c.micro_batches, c.knobs),
                                    path, c)
                if t is not None:
                    # The band moves with the point (the replay refines the same schedule).
                    c, source = replace(c, step_s=t + c.knob_cost_s, band=c.band and c.band.shifted(
                        t + c.knob_cost_s - c.step_s)), "replay"
            rows.append(Row(label, preset, secondary, c, source))
    # Ties (--step-seconds: one figure for all) keep the old rule: the least recomputation,
    # the largest micro-batch, the schemes in their listed order. A projected tie otherwise
    # (a secondary copy whose backward gathers hide either way) goes to the smaller total:
    # the same speed with more memory left and no int8 copy the step does not need.
    return sorted(rows, key=lambda r: (r.choice.step_s,
                                       candidates.RECOMPUTE_ORDER.index(r.choice.recompute),
                                       -r.choice.micro_batch_size,
                                       0 if a.step_seconds else r.choice.total_bytes))


def allowed(a, r: Row) -> bool:
    """Whether the user's explicit settings leave this row open."""
    return ((a.preset == "auto" or (r.preset == a.preset
                                     and r.secondary == a.hier_secondary_group_size))
            and a.micro_batch_size in ("auto", r.choice.micro_batch_size)
            and a.recompute in ("auto", r.choice.recompute))


def headroom(a, r: Row) -> float:
    """Bytes per GCD this row leaves free (its total or its construction peak, the larger)."""
    return a.gcd_memory_gb * candidates.GB - max(r.choice.total_bytes, r.choice.construction_bytes)


def tied(a, rows: list[Row]) -> list[Row]:
    """The schemes tied with the fastest: each scheme's fastest fitting row the user's settings
    allow whose step-time band ties with the fastest row's (projection/collectives.ties: at
    some corner of what is not known, within its resolution of it or faster), fastest first;
    just the fastest when there are no bands. Within a scheme the fastest row stands: its
    recomputation and micro-batch are the scheme's best guess, not a scheme to weigh."""
    open_ = [r for r in rows if r.choice.fits and allowed(a, r)]
    if not open_ or open_[0].choice.band is None:
        return open_[:1]
    from megatron_lbp.projection import collectives

    best: dict[str, Row] = {}
    for r in open_:
        best.setdefault(r.scheme, r)
    return [r for r in best.values() if collectives.ties(r.choice.band, open_[0].choice.band)]


def choose(a) -> tuple[Row | None, list[Row]]:
    """(the row to launch, or None; the whole ranking): among the fitting rows the user's settings
    allow whose bands tie with the fastest's, the one with the most memory headroom (the
    fastest itself where nothing ties)."""
    rows = rank(a)
    ties = tied(a, rows)
    if not ties:
        return None, rows
    return max(ties, key=lambda r: (headroom(a, r), -ties.index(r))), rows


def row_text(r: Row, chosen) -> str:
    """``chosen``: the chosen row (its band gives the ratio's band) or its seconds."""
    c = r.choice
    t = chosen.choice.step_s if isinstance(chosen, Row) else chosen
    band = ratio = ""
    if c.band is not None:
        band = f" [{c.band.low:.4g}, {c.band.high:.4g}]"
        if isinstance(chosen, Row) and chosen.choice.band is not None:
            from megatron_lbp.projection import collectives

            lo, hi = collectives.ratio_band(c.band, chosen.choice.band)
            ratio = f" [{lo:.3f}, {hi:.3f}]"
    return (f"{r.scheme:<14} RECOMPUTE={c.recompute:<9} MICRO_BATCH_SIZE={c.micro_batch_size:<2}"
            f" ({c.micro_batches} per step){c.knob_text()}: step {c.step_s:.4g} s{band} "
            f"({r.source}), {c.step_s / t:.3f}x{ratio} the chosen's, total "
            f"{candidates.gb(c.total_bytes)}{'' if c.fits else ' DOES NOT FIT'}")


def tie_line(a, rows: list[Row], chosen: Row) -> str | None:
    """One line when bands tie: which rows, and that the chosen has the most headroom."""
    ties = tied(a, rows)
    if len(ties) < 2:
        return None
    fastest = ties[0]
    others = [r for r in ties if r is not chosen]
    from megatron_lbp.projection.collectives import TIE

    return (f"tie: {len(ties)} schemes within {TIE:.0%} of the fastest's step time somewhere in "
            f"what is not known ({fastest.scheme} "
            f"RECOMPUTE={fastest.choice.recompute} MICRO_BATCH_SIZE="
            f"{fastest.choice.micro_batch_size}, {fastest.choice.band.text()}); chosen: "
            f"{chosen.scheme} RECOMPUTE={chosen.choice.recompute} MICRO_BATCH_SIZE="
            f"{chosen.choice.micro_batch_size}, the most memory headroom "
            f"({candidates.gb(headroom(a, chosen))} per GCD free, against "
            f"{candidates.gb(max(headroom(a, r) for r in others))} at most for the others)")


def ranking_lines(a, rows: list[Row], chosen: Row, top: int = 5) -> list[str]:
    """The top fitting rows, the best zeropp and zero3 rows at the same global batch with their
    ratios to the chosen, and one line when a scheme other than the chosen's is faster."""
    t = chosen.choice.step_s
    fitting = [r for r in rows if r.choice.fits]
    sources = sorted({r.source for r in fitting})
    cm = candidates.collective_model(a)
    lines = [f"ranking at GLOBAL_BATCH_SIZE={a.global_batch_size} on {a.nodes} node(s) by "
             f"projected step time ({' or '.join(sources) or 'none'}: replay = the engine's "
             f"committed trace replayed, idealised = the cost model, survey = the link "
             f"survey's tables; MFU {a.mfu:g}; {len(fitting)} of {len(rows)} candidates fit):"]
    if chosen.choice.band is not None:
        lines.append("  [bands]: over rates " + ("the survey's fastest to slowest repetitions"
                     if a.survey else "the public figures' fast to slow ends")
                     + " and overlap perfect to " + ("the survey's least hidden"
                     if a.survey else "none (no survey measured it)")
                     + f"; collective times from {cm.source}")
    lines += ["  " + row_text(r, chosen) + ("  <- chosen" if r == chosen else "")
              for r in fitting[:top]]
    if chosen not in fitting[:top]:   # the explicit settings kept it out of the top rows
        lines.append(f"  ... (#{fitting.index(chosen) + 1}) " + row_text(chosen, chosen)
                     + "  <- chosen")
    for name in ("zeropp", "zero3"):
        best = next((r for r in fitting if r.scheme == name), None)
        ratio = ""
        if best and best.choice.band is not None and chosen.choice.band is not None:
            from megatron_lbp.projection import collectives

            ratio = " [{:.3f}, {:.3f}]".format(*collectives.ratio_band(chosen.choice.band,
                                                                       best.choice.band))
        lines.append(f"best {name}: " + (row_text(best, chosen) + f"; chosen/{name} step-time "
                                         f"ratio {t / best.choice.step_s:.3f}{ratio}"
                                         if best else "none fits"))
    tie = tie_line(a, rows, chosen)
    if tie:
        lines.append(tie)
    if cm.fallbacks:
        lines.append("survey gaps (read elsewhere): " + "; ".join(sorted(cm.fallbacks)))
    faster = next((r for r in fitting if r.scheme != chosen.scheme and r.choice.step_s < t), None)
    if faster:
        c = faster.choice
        lines.append(f"projected faster: HIER_PRESET={faster.preset} HIER_SECONDARY_GROUP_SIZE="
                     f"{faster.secondary} RECOMPUTE={c.recompute} MICRO_BATCH_SIZE="
                     f"{c.micro_batch_size}{c.knob_text()}, {c.step_s:.4g} s per step ({faster.source}) against "
                     f"{t:.4g} s for the chosen {chosen.scheme} ("
                     + ("tied within the bands: the most headroom wins" if faster in
                        tied(a, rows) else "your explicit settings win") + ")")
    return lines
