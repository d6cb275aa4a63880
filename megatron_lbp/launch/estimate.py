"""A job shape's memory per GCD, step time, save interval and checkpoint size (pure arithmetic).

    python -m megatron_lbp.launch estimate --nodes N --tasks-per-node T --num-layers L \\
        --hidden-size H --num-attention-heads A --seq-length S --vocab-size V \\
        --global-batch-size B [--micro-batch-size auto|b] [--recompute auto|full|selective|none]

Memory per GCD is the plan's persistent state + its transient peak + activations
+ the allocator margin (--reserve-gb); ``auto`` takes the least recomputation and
largest micro-batch that fit, and the fastest transient knobs that fit.
Exit status: 0, 3 (does not fit; the message names what would), 2 (bad input).
``--resolved FILE`` writes the resolved values as KEY=VALUE lines. See docs/planning.md.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, replace

from megatron_lbp.core.config import DEFAULT_BUCKET_SIZE, GRAD_REDUCE_DTYPES
from megatron_lbp.core.plan import PlanError
from megatron_lbp.launch import choose, model_flags
from megatron_lbp.launch._cli import PROG, Parser, write_resolved
from megatron_lbp.launch.candidates import (GB, MARGIN_TEXT, MICRO_BATCH_CANDIDATES, MOST_RANKS,
                                            Choice, EstimateError, SchemeRow, checkpoint_bytes,
                                            choices, gb, model_line, nice_interval, pick,
                                            plan_command, save_seconds, scheme_rows,
                                            smallest_fitting_nodes, units)
from megatron_lbp.launch.job import Job
from megatron_lbp.launch.job_values import (EMBEDDING_GATHERS, LAYER_UNIT_SETTINGS, NETWORK_MODELS,
                                            PARAMS_DTYPES, RECOMPUTES, auto_or_int, checked,
                                            one_of)


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


@dataclass(frozen=True)
class Decision:
    """What the planner decides for a job: the job as it will run (its scheme resolved), the
    chosen candidate (None: nothing fits, ``refusal`` says why), the step time and saving, and
    the summary and full estimate as printed."""
    job: Job
    choice: Choice | None
    summary: list[str]
    lines: list[str]
    refusal: str | None = None
    scheme_chosen: bool = False       # the scheme was chosen here (HIER_PRESET=auto)
    step_s: float = 0.0
    save_interval: int = 0
    checkpoint_bytes: int = 0
    save_s: float = 0.0
    params: int = 0

    def resolved(self) -> dict[str, object]:
        """The launcher's KEY=VALUE settings (empty when nothing fits)."""
        c, a = self.choice, self.job
        if c is None or self.refusal:
            return {}
        out = {"MICRO_BATCH_SIZE": c.micro_batch_size, "RECOMPUTE": c.recompute,
               "HIER_PREFETCH_UNITS": c.prefetch_units,
               "HIER_MAX_PENDING_REDUCES": c.max_pending_reduces,
               "HIER_LAYER_UNIT": c.layer_unit,
               "HIER_EMBEDDING_BACKWARD_GATHER": c.embedding_backward_gather,
               "SAVE_INTERVAL": self.save_interval, "LBP_STEP_S": f"{self.step_s:.6g}",
               "LBP_CKPT_BYTES": self.checkpoint_bytes, "LBP_SAVE_S": f"{self.save_s:.6g}",
               "LBP_PARAMS": self.params}
        if self.scheme_chosen:
            out.update(HIER_PRESET=a.preset, HIER_SECONDARY_GROUP_SIZE=a.hier_secondary_group_size)
        return out


def report(a: Job) -> tuple[list[str], dict, str | None]:
    """(the full estimate's lines, resolved values, refusal line or None)."""
    d = decide(a)
    return d.lines, d.resolved(), d.refusal


SUMMARY_HEAD = "summary (the full estimate and ranking: LBP_VERBOSE=1, estimate --verbose):"


def decide(a: Job) -> Decision:
    """Plan and choose for this job: the one entry a launcher calls (after job_from_args or
    job_env.job_from_env). The summary: the model, the hierarchy, the choice and why (its
    band, a tie), memory per GCD, step time, saving; what the job would refuse.
    Raises PlanError, EstimateError."""
    asked, ranked, row = a, None, None
    if a.choose or a.preset == "auto":
        row, ranked = choose.choose(a)
        # Nothing fits: the refusal speaks of the launcher's default scheme (lbp, the node's copy).
        preset, sec = (row.preset, row.secondary) if row else (
            (a.preset, a.hier_secondary_group_size) if a.preset != "auto" else
            ("lbp", a.tasks_per_node))
        a = replace(a, preset=preset, hier_secondary_group_size=sec)
    params = sum(n for _, n in units(a))
    options, base = choices(a)
    if not options:
        raise EstimateError(
            f"no micro-batch size in {list(MICRO_BATCH_CANDIDATES)} divides GLOBAL_BATCH_SIZE="
            f"{a.global_batch_size} over {a.nodes * a.tasks_per_node} ranks: set "
            "MICRO_BATCH_SIZE or GLOBAL_BATCH_SIZE")
    m, g = base.memory_bytes, base.group_sizes
    size = f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"
    lines = [
        model_line(a, params),
        f"parameters: {params:,} ({size}), padded vocabulary {a.vocab_size}",
        f"hierarchy: W={base.world_size} ranks, P={g.param} G={g.grad} O={g.optim} "
        f"S={g.secondary} ({base.secondary_dtype if g.secondary else 'no secondary'}), "
        f"R={g.replicas}",
        "plan: " + plan_command(a, base.world_size),
        f"memory per GCD (plan): primary {gb(m.primary)}, secondary {gb(m.secondary)}, "
        f"grad {gb(m.grad)}, optimizer {gb(m.optimizer)} = {gb(m.total)}",
        f"construction peak per GCD (plan: the model built module by module into its slices, "
        f"--hier-sharded-init): {gb(base.construction_peak_bytes)} + margin "
        f"{a.reserve_gb:g} GB = {gb(base.construction_peak_bytes + a.reserve_gb * GB)}",
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
    for w in base.warnings:
        lines.append(f"plan warning: {w}")
    scheme = row.scheme if row else choose.scheme_label(a, a.preset, a.hier_secondary_group_size)
    summary = [SUMMARY_HEAD, "  " + lines[0],
               f"  hierarchy: {a.nodes} node(s) x {a.tasks_per_node} ranks, {scheme}: "
               + lines[2].split(": ", 1)[1],
               f"  choice: {scheme} RECOMPUTE={shown.recompute} MICRO_BATCH_SIZE="
               f"{shown.micro_batch_size} ({shown.micro_batches} per step){shown.knob_text()}: "
               + how.replace(", the ranking below", ""),
               "  " + lines[-1 - len(base.warnings)]]   # memory per GCD total
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
        return Decision(a, None, summary + ["  would refuse: " + refusal.split("error: ", 1)[1]],
                        lines, refusal)

    step = chosen.step_s if row is None else row.choice.step_s
    band = chosen.band if row is None else row.choice.band
    source = "--step-seconds" if a.step_seconds else (
        f"{'replayed trace' if row and row.source == 'replay' else 'cost model'}, "
        f"MFU {a.mfu:g}" + (", measured links" if a.links else "")
        + (", collectives from the link survey" + survey_shape(a) if a.survey else ""))
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
           + ("the survey's rates and overlap" if a.survey else
              "the public link figures and overlap none to perfect") if band else ""),
        f"save interval: {interval} iterations = {interval * step / 60:.1f} min of training ({how})",
        f"checkpoint: {gb(ckpt)} per save ({per} B/param); save estimate {save_s:.0f} s "
        f"(2 x bytes at {a.write_gbps_per_node:g} GB/s per node x {a.nodes} node(s) + "
        f"{a.save_fixed_s:g} s)",
    ]
    summary += ["  " + line for line in lines[-3:]]   # step time, save interval, checkpoint
    if row is not None:
        ranking = choose.ranking_lines(asked, ranked, row)
        summary += ["  " + line for line in ranking
                    if line.startswith(("tie:", "projected faster:"))]
        lines += ranking
    elif a.compare:
        lines += comparison_lines(a, chosen)
    return Decision(a, chosen, summary, lines, None, asked.preset == "auto", step, interval,
                    ckpt, save_s, params)


def survey_shape(a: Job) -> str:
    """' of 2 node(s) x 4 ranks, scaled to this job's groups' when the survey was taken on
    another machine shape than the job's ('' when on the same)."""
    from megatron_lbp.projection import collectives

    m = a.survey.survey["machine"]
    if (m["nodes"], m["tasks_per_node"]) == (a.nodes, a.tasks_per_node):
        return ""
    return f" of {collectives.shape_text(a.survey.survey)}, scaled to this job's groups"


def _flag(check, name: str, *rule):
    """An argparse type from a job_values rule: its refusal, after argparse's prefix."""
    def parse(text: str):
        try:
            return check(name, text, *rule)
        except EstimateError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def build_parser(machine: bool = True) -> argparse.ArgumentParser:
    """The estimate's flags; ``machine=False`` leaves out --nodes and --tasks-per-node (plan
    --choose spells the machine its own way)."""
    ap = Parser(prog="python -m megatron_lbp.launch estimate", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    if machine:
        for flag in ("nodes", "tasks-per-node"):
            ap.add_argument(f"--{flag}", type=int, required=True)
    for flag in ("seq-length", "vocab-size", "global-batch-size"):
        ap.add_argument(f"--{flag}", type=int, required=True)
    model_flags.add_arguments(ap)
    ap.add_argument("--micro-batch-size", type=_flag(auto_or_int, "MICRO_BATCH_SIZE"),
                    default="auto")
    ap.add_argument("--recompute", type=_flag(one_of, "RECOMPUTE", RECOMPUTES), default="full")
    ap.add_argument("--gcds-per-package", type=int, default=2)
    ap.add_argument("--preset", default="lbp",
                    help="a preset, or auto: chosen by projected step time (needs --choose)")
    ap.add_argument("--hier-secondary-group-size", type=int, default=0)
    ap.add_argument("--hier-secondary-dtype", default=None,
                    help="the secondary copy's dtype (default: the preset's; int8 for lbp)")
    ap.add_argument("--params-dtype", default="bf16", choices=PARAMS_DTYPES)
    ap.add_argument("--hier-grad-reduce-dtype", default=None, choices=GRAD_REDUCE_DTYPES,
                    help="default: the preset's (bf16 for zeropp under bf16, else fp32)")
    ap.add_argument("--hier-prefetch-units", type=_flag(auto_or_int, "HIER_PREFETCH_UNITS", 0),
                    default="auto", help="auto (default): the first of the choice's settings "
                    "that fits, else this many units gathered ahead")
    ap.add_argument("--hier-max-pending-reduces",
                    type=_flag(auto_or_int, "HIER_MAX_PENDING_REDUCES"), default="auto",
                    help="auto (default): the first of the choice's settings that fits, else "
                    "this many gradient reduce-scatters in flight (>= 1)")
    ap.add_argument("--hier-embedding-backward-gather",
                    type=_flag(one_of, "HIER_EMBEDDING_BACKWARD_GATHER", EMBEDDING_GATHERS),
                    default="auto", help="auto (default): gather, else skip where gather does "
                    "not fit; or that setting (HIER_EMBEDDING_BACKWARD_GATHER): "
                    "skip frees a tied embedding after the output layer's backward")
    ap.add_argument("--hier-layer-unit", type=_flag(one_of, "HIER_LAYER_UNIT", LAYER_UNIT_SETTINGS),
                    default="auto", help="auto (default): whole layers, else, where they do "
                    "not fit and the recomputation is not full, each layer's attention and MLP "
                    "as two gather units (split); or that setting (HIER_LAYER_UNIT)")
    ap.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE)
    ap.add_argument("--gcd-memory-gb", type=float, default=64.0)
    ap.add_argument("--reserve-gb", type=float, default=0.0)
    ap.add_argument("--train-iters", type=int, default=150000)
    ap.add_argument("--save-interval", type=_flag(auto_or_int, "SAVE_INTERVAL"),
                    default="auto")
    ap.add_argument("--save-minutes", type=float, default=45.0)
    ap.add_argument("--milestone-every", type=int, default=0)
    ap.add_argument("--step-seconds", type=float, default=0.0)
    ap.add_argument("--mfu", type=float, default=0.35)
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="peak TFLOPS per GCD the MFU applies to (default: MI250X bf16, 191.5); "
                         "a measured rate with --mfu 1 (CPU ranks: docs/testing.md)")
    ap.add_argument("--network-model", choices=NETWORK_MODELS,
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
    ap.add_argument("--verbose", action="store_true",
                    help="print the full estimate after the summary: every candidate's memory, "
                         "the ranking, the plan's figures (LBP_VERBOSE=1)")
    return ap


def job_from_args(ns: argparse.Namespace) -> Job:
    """The job of the estimate's parsed flags, checked by the rules every edge obeys
    (job_values.checked), its link files read. EstimateError (exit 2) names the setting."""
    job = Job.fields_of(argparse.Namespace(**{**vars(ns), "links": None, "survey": None}))
    return checked(job, ns.links, ns.survey)


def error_text(job: Job, exc: PlanError | EstimateError) -> str:
    """The one-line refusal for a job the planner cannot plan (exit 2)."""
    if isinstance(exc, PlanError):
        return (f"{PROG}: error: the hierarchy does not fit {job.nodes} node(s) x "
                f"{job.tasks_per_node} tasks: {exc}")
    return f"{PROG}: error: {exc}"


def shown(d: Decision, verbose: bool) -> list[str]:
    """The estimate's lines as printed: the summary, then, ``verbose``, the full estimate."""
    return d.summary + (d.lines if verbose else [])


def run(job: Job, resolved_path: str | None = None) -> int:
    """Print the job's estimate (:func:`shown`) and write the resolved values. The exit status
    (3: nothing fits, 2: bad input)."""
    try:
        d = decide(job)
    except (PlanError, EstimateError) as exc:
        print(error_text(job, exc), file=sys.stderr)
        return 2
    lines = shown(d, job.verbose)
    if lines:
        print("\n".join(lines), flush=True)
    if d.refusal:
        print(d.refusal, file=sys.stderr)
        return 3
    write_resolved(resolved_path, d.resolved())
    return 0


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        job = job_from_args(ns)
    except EstimateError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return run(job, ns.resolved)


def choose_main(argv) -> int:
    """``python -m megatron_lbp.plan --choose``: the estimate's ranking and choice for W ranks.

    Takes the estimate's flags (``python -m megatron_lbp.launch estimate --help``) with the
    plan's spellings of the machine (``--world-size W --gpus-per-node N``, N default 8);
    ``--preset`` and ``--recompute`` default to auto here."""
    ap = build_parser(machine=False)
    ap.add_argument("--world-size", type=int)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.set_defaults(preset="auto", recompute="auto", choose=True)
    ns = ap.parse_args(argv)
    if ns.world_size is None or ns.world_size < 1 or ns.gpus_per_node < 1 or \
            ns.world_size % ns.gpus_per_node:
        print("python -m megatron_lbp.plan: error: --choose needs --world-size W, a multiple "
              "of --gpus-per-node N (default 8)", file=sys.stderr)
        return 2
    ns.nodes, ns.tasks_per_node = ns.world_size // ns.gpus_per_node, ns.gpus_per_node
    try:
        job = job_from_args(ns)
    except EstimateError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return run(job, ns.resolved)
