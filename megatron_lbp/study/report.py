"""``python -m megatron_lbp.study report DIR``: one Markdown table and PNGs from a study's result files.

Reads every ``*.json`` result (megatron_lbp/integration/study_result.py) under DIR, writes
DIR/report.md and DIR/*.png. Nothing is recomputed from logs: each figure in the
table is a field of a result file (or a ratio of two, named in the header).
"""
from __future__ import annotations

import json
import os
import re
import statistics
from collections import defaultdict
from typing import Any

from megatron_lbp.integration.study_result import SCHEMA

BASE = "lbp"
DISAGREE = 0.15       # projection vs measurement, relative, before the report names it
LOSS_WINDOW = 0.5     # loss gaps: mean over the last half of the iterations


class ReportError(ValueError):
    """Bad input to the report; one line."""


def load_results(directory: str) -> list[dict]:
    """Every result file under ``directory`` (recursively), each with its path as ``_path``."""
    if not os.path.isdir(directory):
        raise ReportError(f"{directory}: not a directory")
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d != "checkpoint")  # a run's weights, not its result
        for name in sorted(files):
            if not name.endswith(".json"):
                continue
            p = os.path.join(root, name)
            try:
                with open(p) as f:
                    data = json.load(f)
            except (OSError, ValueError) as err:
                raise ReportError(f"{p}: not a readable JSON result ({err.__class__.__name__})") from None
            if not isinstance(data, dict) or data.get("schema") != SCHEMA or "status" not in data:
                continue  # not a result file (a study plan, another tool's output)
            data["_path"] = os.path.relpath(p, directory)
            out.append(data)
    if not out:
        raise ReportError(f"{directory}: no result files (JSON with schema {SCHEMA}) found")
    return out


def _get(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def _key(r: dict) -> tuple:
    return (r.get("scheme") or "?", r.get("gcds") or 0)


def _fmt(v, spec="{:.3g}") -> str:
    return "—" if v is None else spec.format(v)


def _gib(v) -> str:
    return "—" if v is None else f"{v / 2**30:.3f}"


def _warm(its) -> str:
    if not its:
        return "no warm-up excluded"
    return f"its {its[0]}-{its[-1]} excluded" if its == list(range(its[0], its[-1] + 1)) else f"its {its} excluded"


def loss_mean(r: dict, window: float = LOSS_WINDOW) -> float | None:
    """Mean loss over the last ``window`` of the run's iterations."""
    loss = {int(k): v for k, v in (r.get("loss") or {}).items()}
    if not loss:
        return None
    its = sorted(loss)
    tail = its[int(len(its) * (1 - window)):] or its[-1:]
    return statistics.fmean(loss[i] for i in tail)


def summarize(results: list[dict]) -> dict:
    """The figures the table and plots show, by (scheme, gcds); seeds averaged where several."""
    ok = [r for r in results if r.get("status") == "ok"]
    by = defaultdict(list)
    for r in ok:
        by[_key(r)].append(r)
    rows = {}
    for key, runs in by.items():
        first = runs[0]
        tf = [x for x in (_get(r, "throughput", "tflops_per_gcd") for r in runs) if x is not None]
        losses = [x for x in (loss_mean(r) for r in runs) if x is not None]
        rows[key] = {
            "scheme": key[0], "gcds": key[1], "nodes": first.get("nodes"), "runs": len(runs),
            "seeds": sorted({r.get("seed") for r in runs}, key=str),
            "step_median_s": statistics.median([_get(r, "step_time", "median_s") for r in runs
                                                if _get(r, "step_time", "median_s") is not None] or [0]) or None,
            "step_spread_s": (lambda r: None if _get(r, "step_time", "max_s") is None else
                              _get(r, "step_time", "max_s") - _get(r, "step_time", "min_s"))(first),
            "warmup": _get(first, "step_time", "warmup_iterations_excluded"),
            "tokens_per_s": statistics.fmean([x for x in (_get(r, "throughput", "tokens_per_s") for r in runs)
                                              if x is not None] or [0]) or None,
            "tflops_per_gcd": statistics.fmean(tf) if tf else None,
            "mem_alloc": max((_get(r, "peak_memory_per_gcd", "allocated_bytes") or 0 for r in runs), default=0) or None,
            "mem_reserved": max((_get(r, "peak_memory_per_gcd", "reserved_bytes") or 0 for r in runs), default=0) or None,
            "mem_source": _get(first, "peak_memory_per_gcd", "source"),
            "ledger_network": _get(first, "ledger_bytes_per_step", "network"),
            "iface_tx_per_step": _get(first, "interface_bytes", "tx_bytes_per_step"),
            "iface_source": _get(first, "interface_bytes", "source"),
            "loss_mean": statistics.fmean(losses) if losses else None,
            "loss_seed_spread": (max(losses) - min(losses)) if len(losses) > 1 else None,
            "runs_detail": runs,
        }
    smallest = {}
    for (scheme, gcds), row in rows.items():
        if row["tflops_per_gcd"] and (scheme not in smallest or gcds < smallest[scheme][0]):
            smallest[scheme] = (gcds, row["tflops_per_gcd"])
    for (scheme, gcds), row in rows.items():
        base = rows.get((BASE, gcds))
        row["efficiency"] = (row["tflops_per_gcd"] / smallest[scheme][1]
                             if row["tflops_per_gcd"] and scheme in smallest else None)
        row["ratio_to_lbp"] = (row["tflops_per_gcd"] / base["tflops_per_gcd"]
                               if base and base["tflops_per_gcd"] and row["tflops_per_gcd"] else None)
        row["loss_gap"] = (row["loss_mean"] - base["loss_mean"]
                           if base and base["loss_mean"] is not None and row["loss_mean"] is not None else None)
    # The noise floor: the widest seed spread of any scheme at any scale (one seed: none).
    spreads = [r["loss_seed_spread"] for r in rows.values() if r["loss_seed_spread"] is not None]
    failed = [r for r in results if r.get("status") != "ok"]
    return {"rows": rows, "failed": failed, "noise_floor": max(spreads) if spreads else None}


HEALTH_LINE = re.compile(r"\b(package|node|network): [^\n]*?median ([0-9.eE+-]+) GB/s, slowest")


def measured_links(directory: str) -> dict[str, float]:
    """GB/s per GCD of each link class the launcher's health check measured (megatron_lbp/launch/
    health.py's ``median`` lines in the runs' ``log`` files under DIR), the median over runs."""
    found: dict[str, list[float]] = defaultdict(list)
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if d != "checkpoint"]
        if "log" in files:
            with open(os.path.join(root, "log"), errors="replace") as f:
                for cls, gbps in HEALTH_LINE.findall(f.read()):
                    found[cls].append(float(gbps))
    return {cls: statistics.median(v) for cls, v in found.items()}


def projections(rows: dict, links_gbps: dict[str, float] | None = None) -> dict:
    """(scheme, gcds) -> the cost model's TFLOPS/GCD at the run's settings, or a reason it has none;
    ``links_gbps``: measured GB/s per GCD replacing the model's default for those classes."""
    from megatron_lbp.projection import project

    links = (project.LinkModel.from_measured({c: v * 1e9 for c, v in links_gbps.items()})
             if links_gbps else project.LinkModel())
    out = {}
    for (scheme, gcds), row in rows.items():
        r = row["runs_detail"][0]
        model = dict(r.get("model") or {})
        if scheme not in project.SCHEMES:
            out[(scheme, gcds)] = f"no projection: the cost model has no scheme {scheme!r}"
            continue
        if not model.get("vocab_size"):
            out[(scheme, gcds)] = "no projection: the result has no vocabulary size"
            continue
        try:
            per_node = r.get("gcds_per_node") or gcds
            plan = project.plan_for(model, gcds, scheme, r.get("micro_batches") or 1,
                                    gpus_per_node=per_node, gcds_per_package=2 if per_node % 2 == 0 else 1)
            compute = project.ComputeModel(seq_length=r["seq_length"], micro_batch_size=r["micro_batch_size"])
            out[(scheme, gcds)] = project.step_time(plan, model, links, compute)["tflops_per_gcd"]
        except Exception as err:  # a size the plan tool refuses: say it, keep the report
            out[(scheme, gcds)] = f"no projection: {' '.join(str(err).split())[:200]}"
    return out


def _projection_note(links_gbps: dict[str, float] | None = None) -> str:
    from megatron_lbp.projection import project

    c = project.ComputeModel()
    gbps = {k: v / 1e9 for k, v in project.LinkModel().bandwidth.items()}
    measured = sorted(links_gbps or {})
    gbps.update(links_gbps or {})
    where = (f"the links the launcher's health check measured ({', '.join(measured)}; median over runs) "
             f"and the model's defaults for the rest" if measured else "its default links")
    return (f"The projection is `bench project`'s step model (megatron_lbp/projection/project.py) at each run's "
            f"model, GCD count, node shape, micro-batch size and count, with {where} "
            f"(GB/s per GCD: " + ", ".join(f"{k} {v:.3g}" for k, v in gbps.items())
            + f") and compute (peak {c.peak_flops / 1e12:g} TFLOPS per GCD, MFU {c.mfu:g}: an MI250X GCD). "
            "On CPU ranks or the emulated network those assumptions do not hold, so a disagreement "
            "there measures the assumptions, not the schemes.")


def render(summary: dict, proj: dict | None, mode: str | None,
           links_gbps: dict[str, float] | None = None) -> str:
    rows = summary["rows"]
    lines = ["# Adoption study report", ""]
    if mode:
        lines += [f"Scaling: **{mode}**.", ""]
    lines += ["| scheme | nodes | GCDs | runs | step median s (max-min; warm-up iterations excluded) | tokens/s | "
              "TFLOPS/GCD | ratio to lbp | scaling eff. | peak mem/GCD GiB (alloc / reserved) | "
              "network bytes/step (ledger) | interface tx bytes/step | loss (last half) | gap to lbp |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(rows, key=lambda k: (k[0] != BASE, k[0], k[1])):
        r = rows[key]
        warm = r["warmup"]
        lines.append(
            f"| {r['scheme']} | {r['nodes']} | {r['gcds']} | {r['runs']} | {_fmt(r['step_median_s'])} "
            f"({_fmt(r['step_spread_s'])}; {_warm(warm)}) | {_fmt(r['tokens_per_s'], '{:.1f}')} | "
            f"{_fmt(r['tflops_per_gcd'], '{:.4g}')} | {_fmt(r['ratio_to_lbp'], '{:.3f}')} | "
            f"{_fmt(r['efficiency'], '{:.3f}')} | {_gib(r['mem_alloc'])} / {_gib(r['mem_reserved'])} | "
            f"{_fmt(r['ledger_network'], '{:.4g}')} | "
            f"{_fmt(r['iface_tx_per_step'], '{:.4g}') if r['iface_tx_per_step'] is not None else 'not measured'} | "
            f"{_fmt(r['loss_mean'], '{:.4f}')} | {_fmt(r['loss_gap'], '{:+.4f}')} |")
    lines.append("")
    nf = summary["noise_floor"]
    lines.append("Loss noise floor: " + (
        f"{nf:.4f} (the widest spread of the last-half mean loss between seeds of one scheme at one "
        "scale); a gap to lbp smaller than this is not evidence." if nf is not None else
        "not measured (one seed per scheme and scale): a loss gap here is not evidence; in bf16 runs "
        "that differ only in reduction order separate after ~15 iterations."))
    lines.append("")
    sources = sorted({r["mem_source"] for r in rows.values() if r["mem_source"]})
    lines += ["Peak memory source: " + "; ".join(sources) if sources else "Peak memory: not measured", ""]
    ifs = sorted({r["iface_source"] for r in rows.values() if r["iface_source"]})
    lines += ["Interface counters: " + "; ".join(ifs), ""]
    lines += ["TFLOPS/GCD: Megatron's --log-throughput formula "
              "(megatron.training.training.num_floating_point_operations) over the median step time; "
              "scaling efficiency: TFLOPS/GCD over the same scheme's smallest run; ratio to lbp: "
              "TFLOPS/GCD over lbp's at the same GCD count.", ""]
    if proj is not None:
        lines += ["## Measurement against the cost model's projection", "", _projection_note(links_gbps), "",
                  "| scheme | GCDs | measured TFLOPS/GCD | projected | measured/projected | |",
                  "|---|---|---|---|---|---|"]
        for key in sorted(rows, key=lambda k: (k[0] != BASE, k[0], k[1])):
            p, m = proj.get(key), rows[key]["tflops_per_gcd"]
            if isinstance(p, str) or p is None or m is None:
                lines.append(f"| {key[0]} | {key[1]} | {_fmt(m, '{:.4g}')} | {p or '—'} | — | |")
                continue
            ratio = m / p
            flag = f"disagrees by {abs(ratio - 1):.0%} (> {DISAGREE:.0%})" if abs(ratio - 1) > DISAGREE else "within 15%"
            lines.append(f"| {key[0]} | {key[1]} | {m:.4g} | {p:.4g} | {ratio:.3g} | {flag} |")
        lines.append("")
    if summary["failed"]:
        lines += ["## Failed runs", ""]
        for r in summary["failed"]:
            lines.append(f"- {r['_path']}: {r.get('scheme', '?')} on {r.get('gcds', '?')} GCDs: "
                         f"{r.get('status')}: {r.get('reason')}")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, directory: str) -> list[str]:
    """The PNGs, written into ``directory``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    schemes = sorted({k[0] for k in rows}, key=lambda s: (s != BASE, s))
    written = []

    def series(field):
        for s in schemes:
            pts = sorted((k[1], rows[k][field]) for k in rows if k[0] == s and rows[k][field] is not None)
            if pts:
                yield s, [p[0] for p in pts], [p[1] for p in pts]

    def save(fig, name):
        p = os.path.join(directory, name)
        fig.savefig(p, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(p)

    for field, name, ylabel in (("tflops_per_gcd", "tflops_per_gcd.png", "TFLOPS per GCD"),
                                ("efficiency", "scaling_efficiency.png", "scaling efficiency (vs smallest run)"),
                                ("mem_alloc", "peak_memory.png", "peak memory per GCD (bytes)"),
                                ("ledger_network", "network_bytes.png", "network bytes per step (ledger)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        drawn = False
        for s, xs, ys in series(field):
            ax.plot(xs, ys, marker="o", label=s)
            drawn = True
        if field == "ledger_network":
            for s, xs, ys in series("iface_tx_per_step"):
                ax.plot(xs, ys, marker="x", linestyle="--", label=f"{s} (interfaces)")
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("GCDs")
        ax.set_ylabel(ylabel)
        if drawn:
            ax.legend()
        ax.grid(True, alpha=0.3)
        save(fig, name)
    for nodes in sorted({r["nodes"] for r in rows.values()}, key=str):
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in sorted(rows, key=lambda k: (k[0] != BASE, k[0])):
            if rows[key]["nodes"] != nodes:
                continue
            for r in rows[key]["runs_detail"]:
                loss = sorted((int(i), v) for i, v in (r.get("loss") or {}).items())
                if loss:
                    ax.plot([p[0] for p in loss], [p[1] for p in loss],
                            label=f"{key[0]} seed {r.get('seed')}")
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss")
        ax.set_title(f"{nodes} node(s)")
        ax.legend()
        ax.grid(True, alpha=0.3)
        save(fig, f"loss_{nodes}_nodes.png")
    return written


def report(directory: str, project_too: bool = True, mode: str | None = None) -> tuple[str, list[str]]:
    """Write DIR/report.md and the PNGs; return (Markdown text, PNG paths)."""
    results = load_results(directory)
    summary = summarize(results)
    if mode is None:
        modes = {r.get("scaling") for r in results if r.get("scaling")}
        mode = ", ".join(sorted(modes)) or None
    links = measured_links(directory) if project_too else None
    proj = projections(summary["rows"], links) if project_too else None
    text = render(summary, proj, mode, links)
    pngs = plot(summary, directory)
    with open(os.path.join(directory, "report.md"), "w") as f:
        f.write(text + "\n")
    return text, pngs
