"""BENCHMARKS.md's leading table: lbp, zeropp, ds-zeropp and ds-zero3 at the flagship's settings.

    python -m benchmarks headline [--json] [--steps 5] [--nodes 2] [--ranks-per-node 2]
        [--hidden 64] [--layers 2] [--survey FILE]

1. The settings: the chooser (``python -m megatron_lbp.plan --choose``, the code of
   megatron_lbp/launch/choose.py) for the flagship, 20B on 48 Frontier nodes at a global batch
   of 1536 with 4 GB reserved (docs/planning.md's command); the row it launches gives the
   recomputation, the micro-batch size and the micro-batches per step.
2. The measurement: ``bench network --model frontier-shaped`` (benchmarks/network.py) with
   those settings, the four schemes trained side by side in one multi-rank run, stepped in
   turns, ``--steps`` timed rounds after ``--warmup``; the uplink at Frontier's
   compute-to-network ratio from public figures (benchmarks/network_shape.py). Per scheme: the
   median step, the spread (lowest and highest round), and the step over lbp's of the same
   round, median and spread.
3. The projection beside it: each scheme's chooser row at the same settings, its step-time band
   at 20B on 384 GCDs (projection/collectives.py: public figures, or ``--survey``'s tables),
   as a ratio to lbp's over the same corners. ds-zeropp and ds-zero3 are projected as the
   presets that gather as they do (projection/schemes.MODELLED_AS).

The emulation's model is 20B's proportions scaled down to what the machine runs, so its
absolute step times are not Frontier's; the ratios to lbp are what the two sides share.
Needs root and iproute2 for step 2 (the chooser and the bands alone: ``--no-measure``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from megatron_lbp.projection import json_out

PROG = "python -m benchmarks headline"
SCHEMES = ("lbp", "zeropp", "ds-zeropp", "ds-zero3")
# The flagship as docs/planning.md chooses it: 20B (44 layers, hidden 6144, 64 heads, sequence
# 2048, GPT-2's padded vocabulary) on 48 nodes of 8 GCDs, global batch 1536, 4 GB reserved.
FLAGSHIP = ["--nodes", "48", "--tasks-per-node", "8", "--num-layers", "44", "--hidden-size",
            "6144", "--num-attention-heads", "64", "--seq-length", "2048", "--vocab-size",
            "50304", "--global-batch-size", "1536", "--reserve-gb", "4", "--preset", "auto",
            "--recompute", "auto", "--choose"]
# The chooser's row label of each measured scheme (estimate.SCHEMES): lbp's preset has no
# secondary copy; DeepSpeed's are projected as the presets that gather as they do.
CHOOSER_LABEL = {"lbp": "lbp S=0", "zeropp": "zeropp", "zero3": "zero3"}
# What fits the 2-core machine (about 10 min at load 10-40 for the four schemes).
SIZE = ["--nodes", "2", "--ranks-per-node", "2", "--hidden", "64", "--layers", "2"]


def flagship(survey: str | None = None) -> dict[str, Any]:
    """The chooser's launched row for the flagship and, per scheme, its band at those settings."""
    from megatron_lbp.launch import choose, estimate
    from megatron_lbp.projection import collectives
    from megatron_lbp.projection.schemes import MODELLED_AS

    a = estimate.job_from_args(estimate.build_parser().parse_args(
        FLAGSHIP + (["--survey", survey] if survey else [])))
    row, ranked = choose.choose(a)
    if row is None:
        raise RuntimeError("the chooser fits nothing for the flagship")
    c = row.choice
    same = {}
    for r in ranked:
        if (r.choice.recompute, r.choice.micro_batch_size) == (c.recompute, c.micro_batch_size):
            same.setdefault(r.scheme, r)
    lbp = same[CHOOSER_LABEL["lbp"]].choice
    projected = {}
    for scheme in SCHEMES:
        label = CHOOSER_LABEL[MODELLED_AS.get(scheme, scheme)]
        r = same[label].choice
        lo, hi = collectives.ratio_band(r.band, lbp.band)
        projected[scheme] = {"row": label, "step_s": r.step_s, "band_s": [r.band.low, r.band.high],
                             "ratio_to_lbp": r.step_s / lbp.step_s, "ratio_band": [lo, hi],
                             "fits": r.fits}
    return {"command": "python -m megatron_lbp.launch estimate " + " ".join(FLAGSHIP),
            "chosen": {"scheme": row.scheme, "recompute": c.recompute,
                       "micro_batch_size": c.micro_batch_size, "micro_batches": c.micro_batches},
            "links": a.survey.source if a.survey else collectives.PUBLIC_TEXT,
            "projected": projected}


def network_argv(args, chosen: dict[str, Any]) -> list[str]:
    return ["--model", "frontier-shaped", "--schemes", ",".join(SCHEMES),
            "--nodes", str(args.nodes), "--ranks-per-node", str(args.ranks_per_node),
            "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--micro-batch-size", str(chosen["micro_batch_size"]),
            "--micro-batches", str(chosen["micro_batches"]), "--recompute", chosen["recompute"],
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            # the calibration's link collectives are not part of this table: the least there is
            "--link-sizes-mb", "0.01",
            "--timeout", str(args.timeout)]


def measured(net: dict[str, Any]) -> dict[str, Any]:
    """Per scheme: median and spread of its steps, and of its step over lbp's in the same round."""
    lbp = net["schemes"]["lbp"]["step_s"]
    out = {}
    for s, row in net["schemes"].items():
        ratios = [a / b for a, b in zip(row["step_s"], lbp)]
        out[s] = {"step_s": row["step_s"], "median_s": statistics.median(row["step_s"]),
                  "spread_s": [min(row["step_s"]), max(row["step_s"])],
                  "ratio_to_lbp": statistics.median(ratios),
                  "ratio_spread": [min(ratios), max(ratios)], "ratios": ratios}
    return out


def run(args) -> dict[str, Any]:
    t0 = time.perf_counter()
    out: dict[str, Any] = {"flagship": flagship(args.survey)}
    if args.measure:
        from benchmarks import network

        argv = network_argv(args, out["flagship"]["chosen"])
        out["network_command"] = "python -m benchmarks network " + " ".join(argv)
        net = network.run(network.parse(argv))
        out["network"] = {"config": net["config"], "schemes": {
            s: {k: r[k] for k in ("step_s", "median_s", "compute_s", "link_s", "exposed_s")
                if k in r} for s, r in net["schemes"].items()}}
        out["measured"] = measured(net)
    out["seconds"] = time.perf_counter() - t0
    return out


def _range(lo: float, hi: float, fmt: str = ".2f") -> str:
    return f"{lo:{fmt}}–{hi:{fmt}}"


def table(out: dict[str, Any]) -> list[str]:
    """The markdown table (BENCHMARKS.md's and the command's own)."""
    f, m = out["flagship"], out.get("measured", {})
    rows = ["| scheme | measured step (s), median [lowest–highest] | measured / lbp, median "
            "[lowest–highest round] | projected / lbp at 20B, 384 GCDs [band] | projected as |",
            "|---|---:|---:|---:|---|"]
    for s in SCHEMES:
        p = f["projected"][s]
        meas = m.get(s)
        step = (f"{meas['median_s']:.3f} [{_range(*meas['spread_s'], '.3f')}]" if meas
                else "not measured")
        ratio = (f"{meas['ratio_to_lbp']:.2f} [{_range(*meas['ratio_spread'])}]" if meas
                 else "—")
        rows.append(f"| {s} | {step} | {ratio} | {p['ratio_to_lbp']:.2f} "
                    f"[{_range(*p['ratio_band'])}] | {p['row']} |")
    return rows


def setting_lines(out: dict[str, Any]) -> list[str]:
    f, c = out["flagship"], out["flagship"]["chosen"]
    lines = [f"Settings: the chooser's launched row for 20B on 48 nodes, global batch 1536 "
             f"(`{f['command']}`): {c['scheme']}, recomputation {c['recompute']}, micro-batch "
             f"size {c['micro_batch_size']}, {c['micro_batches']} micro-batches per step; every "
             f"scheme measured and projected at those. Projected with {f['links']}."]
    net = out.get("network")
    if net:
        cfg, mdl = net["config"], net["config"]["model"]
        d = cfg.get("rate_derivation", {})
        lines.append(
            f"Measured: `{out['network_command']}`: {cfg['nodes']} emulated nodes x "
            f"{cfg['ranks_per_node']} ranks, GPT {mdl['num_layers']} layers, hidden "
            f"{mdl['hidden_size']}, sequence {mdl['seq_length']} (20B's proportions), uplink "
            f"{cfg['uplink_rate_mbit']:.2f} Mbit/s each way at Frontier's compute-to-network "
            f"ratio ({d.get('flops_per_byte', float('nan')):.0f} FLOP per byte: "
            f"{d.get('source', '')}); {cfg['timed_steps']} timed rounds after "
            f"{cfg['warmup_steps']} warm-up, the four schemes stepped in turns in one run; "
            f"load average {cfg['loadavg_start'][0]:.0f} at the start, "
            f"{cfg['loadavg_end'][0]:.0f} at the end"
            + (f"; {cfg['load_warning']}" if cfg.get("load_warning") else "") + ".")
    return lines


def render(out: dict[str, Any]) -> str:
    return "\n".join(setting_lines(out) + [""] + table(out)
                     + ["", f"({out['seconds']:.0f} s)"])


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{PROG}: error: {message}\n")


def parse(argv) -> argparse.Namespace:
    p = _Parser(prog=PROG, description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed rounds (the repeats)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=2700.0, help="seconds for the multi-rank run")
    p.add_argument("--survey", default=None, metavar="FILE",
                   help="project with this link survey's tables instead of the public figures")
    p.add_argument("--no-measure", dest="measure", action="store_false",
                   help="the chooser's settings and the projected bands only")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    for flag in ("nodes", "ranks_per_node", "hidden", "layers", "steps"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}={getattr(a, flag)} must be >= 1")
    if a.nodes < 2 or a.warmup < 0:
        p.error(f"--nodes={a.nodes} must be >= 2 and --warmup={a.warmup} >= 0")
    return a


def main(argv=None) -> int:
    from benchmarks import netns

    args = parse(argv)
    return netns.command_main(
        PROG, lambda: run(args),
        lambda out: json_out.emit(out) if args.json else print(render(out)),
        network=args.measure, refusal_hint=" (--no-measure: the projection alone)")


if __name__ == "__main__":
    sys.exit(main())
