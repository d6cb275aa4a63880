"""BENCHMARKS.md from the report's saved record (results.json): nothing is measured here.

Every table cell is formatted from the record by the functions below, so
``tests/bench/test_bench_report.py`` can read the tables back and compare them with
the JSON.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from benchmarks import cpu_share
from megatron_lbp.projection.project_replay import settings_text
from benchmarks.report_goals import calibration_rows, fmt_ratio, result, traffic_bytes
from megatron_lbp.core.costs import LINK_CLASS_ORDER

NOT_RUN = "not run: "
# The one line that regenerates the leading table (docs/benchmarks.md, "The headline table").
HEADLINE_COMMAND = "python -m benchmarks report --only headline"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def _rel(path: Path, out: Path) -> str:
    """A link from the report to ``path``: relative when both live in one tree (the repository)."""
    rel = os.path.relpath(path, out.parent)
    return str(path) if rel.startswith("../..") else rel


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _provenance(run: dict[str, Any]) -> str:
    if run.get("status") == "skipped":
        return ""
    note = f"`{run.get('command', '?')}`"
    if run.get("reused"):
        note += (f" (reused from the run started {run.get('started_utc', '?')} at commit "
                 f"{run.get('git', {}).get('commit', '?')[:12]})")
    return note


def _not_run(runs, *keys) -> str | None:
    for key in keys:
        r = runs.get(key, {"status": "failed", "reason": "not run"})
        if r["status"] != "ok":
            return f"{NOT_RUN}{r.get('reason', 'unknown')}"
    return None


def flagship_table(report) -> list[str]:
    """The leading table: the four schemes at the flagship's chosen settings, measured side by
    side with repeats, the projected band beside each (benchmarks/headline.py)."""
    from benchmarks import headline as hl

    runs = report["runs"]
    if "headline" not in runs:
        return []
    lines = ["## At the flagship's settings", "",
             f"One command: `{HEADLINE_COMMAND}` (this table alone, every other section "
             f"reused). Command of this run: {_provenance(runs['headline'])}", ""]
    missing = _not_run(runs, "headline")
    if missing:
        return lines + [missing, ""]
    out = result(runs, "headline")
    lines += hl.setting_lines(out) + [""] + hl.table(out)
    return lines + ["", "Measured / lbp: each round's step over lbp's step of the same round "
                        "(the schemes stepped in turns); projected: the chooser's row of each "
                        "scheme at the same settings, its band over the public figures' fast "
                        "and slow rates and overlap from none to perfect (docs/planning.md).", ""]


def headline(report) -> list[str]:
    lines = ["## Headline", ""]
    lines += [f"- {h['text']}" for h in report["headline"]] or ["- nothing was measured"]
    return lines + [""]


def goals_table(report) -> list[str]:
    lines = ["## Goals", "", "Targets from the issue; measured values from the runs below.", "",
             "| Goal | Measured | Status | Reason (misses, comparisons) |", "|---|---|---|---|"]
    for g in report["goals"]:
        lines.append(f"| {_cell(g['goal'])} | {_cell(g['measured'])} | **{g['status']}** | "
                     f"{_cell(g['reason'])} |")
    return lines + [""]


def traffic_section(report, out: Path, plots: Path) -> list[str]:
    runs = report["runs"]
    lines = ["## Link traffic (`python -m benchmarks traffic`)", "",
             "Bytes sent per rank per optimizer step on the slowest link class each collective "
             "spans; the second of two steps counted; engine rows by the engine's ledger, "
             "stock rows by the torch.distributed wrapper (see docs/benchmarks.md).", ""]
    for k in (1, 4):
        key = f"traffic_k{k}"
        lines += [f"### K = {k} micro-batch(es)", ""]
        missing = _not_run(runs, key)
        if missing:
            lines += [missing, ""]
            continue
        lines += [f"Command: {_provenance(runs[key])}", "",
                  "| scheme | package | node | network | lbp network / scheme network |",
                  "|---|---:|---:|---:|---:|"]
        data = traffic_bytes(runs, k)
        lbp = data.get("lbp", {}).get("network")
        for scheme, row in data.items():
            ratio = fmt_ratio(lbp / row["network"]) if lbp and row["network"] else "—"
            lines.append(f"| {scheme} | " + " | ".join(f"{row[c]:,}" for c in LINK_CLASS_ORDER)
                         + f" | {ratio} |")
        for scheme, row in result(runs, key).items():
            if "unavailable" in row:
                lines.append(f"| {scheme} | unavailable: {_cell(row['unavailable'])} | | | |")
        lines.append("")
    if "traffic.png" in report["plots"]:
        lines += [f"![bytes per link class]({_rel(plots / 'traffic.png', out)})", ""]
    return lines


def network_section(report, out: Path, plots: Path) -> list[str]:
    runs = report["runs"]
    lines = ["## Emulated network (`python -m benchmarks network`)", ""]
    missing = _not_run(runs, "network")
    if missing:
        return lines + [missing, ""] + frontier_section(report, out, plots)
    net = result(runs, "network")
    lines += [f"Command: {_provenance(runs['network'])}", ""]
    if net.get("config", {}).get("load_warning"):
        lines += [f"**Warning from the command:** {net['config']['load_warning']}", ""]
    lines += ["Setup:", "", "```json",
              json.dumps(net.get("config", {}), indent=1, sort_keys=True), "```", "",
              "| scheme | median step (s) | ratio to lbp | compute alone (s) | link alone (s) "
              "| exposed (s) | exposed / link | step times (s) |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for scheme, row in net["schemes"].items():
        times = ", ".join(f"{t:.3f}" for t in row.get("step_s", []))
        lines.append(f"| {scheme} | {row['median_s']:.3f} | {row['ratio_to_lbp']:.2f} | "
                     + " | ".join(exposure_cells(row)) + f" | {times} |")
    lines.append("")
    cal = calibration_rows(net)
    if cal:
        lines += ["Calibration (the Frontier cost model with link figures fitted on this "
                  "emulated network, predicting each scheme's step time ratio to lbp)."
                  + predicted_by(runs["network"], net), "",
                  "| scheme | measured ratio | predicted ratio | relative error | within 20% |",
                  "|---|---:|---:|---:|---|"]
        for scheme, c in cal.items():
            within = "reference" if scheme == "lbp" else "yes" if c["within_20pct"] else "no"
            lines.append(f"| {scheme} | {c['measured_ratio']:.2f} | {c['predicted_ratio']:.2f} "
                         f"| {c['rel_error']:+.1%} | {within} |")
        fitted = {k: v for k, v in net["calibration"].items() if k not in cal}
        if fitted:
            lines += ["", "Fitted figures (long sample lists only in the results file):", "",
                      "```json", json.dumps(_short(fitted), indent=1), "```"]
        lines.append("")
    if "network.png" in report["plots"]:
        lines += [f"![step time on the emulated network]({_rel(plots / 'network.png', out)})", ""]
    return lines + frontier_section(report, out, plots)


def predicted_by(run, net) -> str:
    """Which cost model made the calibration's predictions (report.rederive_predictions)."""
    if run.get("not_rederived"):
        return f" **Predictions not re-derived:** {run['not_rederived']}."
    made = ((net.get("calibration") or {}).get("fit") or {}).get("predicted_with")
    return f" Predicted by {made}." if made else ""


def exposure_cells(row) -> list[str]:
    """compute alone, link alone, exposed, exposed / link: '—' for a run from before them."""
    if "exposed_share" not in row:
        return ["—"] * 4
    return [f"{row['compute_s']:.3f}", f"{row['link_s']:.3f}", f"{row['exposed_s']:.3f}",
            f"{row['exposed_share']:.0%}"]


def frontier_section(report, out: Path, plots: Path) -> list[str]:
    from benchmarks.network_shape import derivation_lines

    runs = report["runs"]
    if "network_frontier" not in runs:
        return []
    lines = ["### Frontier-shaped (`--model frontier-shaped`)", ""]
    missing = _not_run(runs, "network_frontier")
    if missing:
        return lines + [missing, ""]
    net = result(runs, "network_frontier")
    c, m = net["config"], net["config"]["model"]
    lines += [f"Command: {_provenance(runs['network_frontier'])}", ""]
    if c.get("load_warning"):
        lines += [f"**Warning from the command:** {c['load_warning']}", ""]
    lines += [f"GPT {m['num_layers']} layers, hidden {m['hidden_size']}, sequence "
              f"{m['seq_length']}, vocabulary {m['vocab_size']} ({m['params']:,} parameters; "
              f"20B's proportions), recomputation {m['recompute']}, {c['micro_batches']} "
              f"micro-batches of {c['micro_batch_size']}; {c['nodes']} nodes x "
              f"{c['ranks_per_node']} ranks, uplink {c['uplink_rate_mbit']:.1f} Mbit/s; load "
              f"average {c['loadavg_start'][0]:.1f} at the start, {c['loadavg_end'][0]:.1f} at "
              f"the end{cpu_share.clause(c.get('other_cpu'))}.", ""]
    if c.get("rate_derivation"):
        d = c["rate_derivation"]
        lines += ["```", *derivation_lines(d),
                  *([f"  in the run: zero3's collectives alone / compute alone = "
                     f"{d['achieved_ratio']:.3f}"] if "achieved_ratio" in d else []),
                  "```", ""]
    lines += [f"Compute alone: {c.get('compute_alone', '')}. Link alone: the scheme's own step "
              f"collectives issued again back to back. Trace waits: the time the engine's "
              f"schedule trace has the rank waiting on collectives; below, per phase, waited "
              f"for *at once* (no compute since its issue: synchronous, or nothing to hide "
              f"behind) or *issued ahead* of compute shorter than its link time.", "",
              "| scheme | median step (s) | ratio to lbp | compute alone (s) | link alone (s) "
              "| exposed (s) | exposed / link | trace waits (s) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for scheme, row in net["schemes"].items():
        waits = row.get("trace", {}).get("exposed_s")
        lines.append(f"| {scheme} | {row['median_s']:.3f} | {row['ratio_to_lbp']:.2f} | "
                     + " | ".join(exposure_cells(row))
                     + f" | {'—' if waits is None else f'{waits:.3f}'} |")
    lines += ["", "Where the exposed time is (from the schedule traces):", ""]
    lines += [f"- {_cell(line)}" for line in net.get("explained", [])] + [""]
    if "network_frontier.png" in report["plots"]:
        lines += [f"![Frontier-shaped emulation: compute, exposed and link time]"
                  f"({_rel(plots / 'network_frontier.png', out)})", ""]
    return lines


def _short(value: Any, limit: int = 8) -> Any:
    """``value`` with lists longer than ``limit`` replaced by their length."""
    if isinstance(value, dict):
        return {k: _short(v, limit) for k, v in value.items()}
    if isinstance(value, list) and len(value) > limit:
        return f"({len(value)} entries)"
    return value


def overhead_section(report) -> list[str]:
    runs = report["runs"]
    lines = ["## Overhead on one unshaped node (`python -m benchmarks overhead`)", ""]
    missing = _not_run(runs, "overhead")
    if missing:
        return lines + [missing, ""]
    ov = result(runs, "overhead")
    m = ov["model"]
    buckets = ov.get("buckets", {})
    lines += [f"Command: {_provenance(runs['overhead'])}", "",
              f"{ov['ranks']} gloo ranks on this machine ({ov['machine']['cpus']} usable cores), "
              f"GPT {m['layers']} layers, hidden {m['hidden']}, sequence {m['seq']}, vocabulary "
              f"{m['vocab']}; {ov['runs']} run(s) x {ov['steps_timed_per_run']} timed round(s), "
              f"every scheme stepped in turn in each round"
              + (f"; bucket size {ov['bucket_size']:,} elements for every scheme, "
                 f"{ov['micro_batches']} micro-batch(es) per step" if "bucket_size" in ov else "")
              + (f"; load average {ov['loadavg_start'][0]:.1f} at the start, "
                 f"{ov['loadavg_end'][0]:.1f} at the end" if "loadavg_start" in ov else "")
              + cpu_share.clause(ov.get("other_cpu"))
              + "; medians.", "",
              *([f"WARNING: {ov['load_warning']}", ""] if ov.get("load_warning") else []),
              "| scheme | median step (s) | run medians (s) | buckets |", "|---|---:|---|---:|"]
    for scheme, t in ov["median_step_s"].items():
        runs_s = ", ".join(f"{x:.3f}" for x in ov["run_medians_s"][scheme])
        lines.append(f"| {scheme} | {t:.3f} | {runs_s} | {buckets.get(scheme, '—')} |")
    if ov.get("pairs"):
        lines += ["", "| pair (A / B) | A / B median step | median of same-round A / B | "
                  "largest loss difference | measures |", "|---|---:|---:|---:|---|"]
        for key, p in ov["pairs"].items():
            lines.append(f"| {key} | **{p['ratio']:.3f}** | {p['median_paired_ratio']:.3f} | "
                         f"{p['max_loss_difference']:.1e} | {p['measures']} |")
    lines += ["", f"Ratio lbp / stock: **{ov['ratio_lbp_over_stock']:.3f}**", ""]
    if ov.get("profiles"):
        from benchmarks.overhead_profile import CATEGORIES

        schemes = list(ov["profiles"])
        lines += ["Where a step's time goes (cProfile of rank 0 in a run of its own, seconds per "
                  "step; profiled steps run slower than the timed ones):", "",
                  "| | " + " | ".join(schemes) + " |", "|---|" + "---:|" * len(schemes)]
        for c in (*CATEGORIES, "total"):
            lines.append(f"| {c} | " + " | ".join(
                f"{ov['profiles'][s]['breakdown_s_per_step'][c]:.4f}" for s in schemes) + " |")
        lines.append("")
    plan = runs.get("overhead_plan", {})
    if plan.get("status") == "ok":
        lines += [f"Where the time goes is read from the plan for the same configuration: "
                  f"{_provenance(plan)}", ""]
    return lines


def tflops_table(per_scheme) -> list[str]:
    """TFLOPS per GCD (scaling efficiency), a row per scheme, a column per GCD count."""
    gcds = sorted({int(g) for rows in per_scheme.values() for g in rows})
    lines = ["| scheme | " + " | ".join(f"{g} GCDs" for g in gcds) + " |",
             "|---|" + "---:|" * len(gcds)]
    for scheme, rows in per_scheme.items():
        lines.append(f"| {scheme} | " + " | ".join(
            f"{rows[str(g)]['tflops_per_gcd']:.1f} ({rows[str(g)]['scaling_efficiency']:.2f})"
            for g in gcds) + " |")
    return lines


def project_section(report, out: Path, plots: Path) -> list[str]:
    runs = report["runs"]
    lines = ["## Frontier projection (`python -m benchmarks project`)", ""]
    missing = _not_run(runs, "project")
    if missing:
        return lines + [missing, ""]
    proj = result(runs, "project")
    lines += [f"Command: {_provenance(runs['project'])}", "",
              "A cost model, not a measurement: model TFLOPS per GCD (scaling efficiency against "
              "the same scheme at the smallest GCD count).", ""]
    for name, per_scheme in proj["results"].items():
        params = next(iter(next(iter(per_scheme.values())).values()))["params"]
        lines += [f"### {name} ({params / 1e9:.2f} B parameters)", "",
                  *tflops_table(per_scheme), ""]
    paper = proj["paper"]
    refs = {"lbp/zeropp TFLOPS": paper["lbp_over_zeropp_tflops_20B_384"],
            "zeropp/zero3 TFLOPS": paper["zeropp_over_zero3_tflops"],
            "lbp scaling efficiency": paper["lbp_scaling_efficiency"]}
    lines += ["| ratio | model | paper |", "|---|---:|---:|"]
    for key, value in proj["ratios"].items():
        ref = next((v for k, v in refs.items() if k in key), None)
        lines.append(f"| {key} | {value:.3f} | {ref if ref is not None else '—'} |")
    lines += ["", f"Paper: {paper['source']}.", "", "Assumptions (printed by the command):", "",
              "```json", json.dumps(proj["assumptions"], indent=1), "```", ""]
    if "projection.png" in report["plots"]:
        lines += [f"![projected TFLOPS per GCD]({_rel(plots / 'projection.png', out)})", ""]
    return lines + replay_section(proj, refs)


def replay_section(proj, refs) -> list[str]:
    rep = proj.get("replay")
    if not rep:
        return []
    a = rep["assumptions"]
    lines = ["### Replayed schedule", "",
             f"The engine's own program order, from schedule traces "
             f"({a['micro_batches']} micro-batch(es), "
             f"{'full recomputation' if a['recompute'] else 'no recomputation'}, prefetch "
             f"{a['prefetch_units']} unit(s) ahead), replayed with the link and compute figures "
             f"above at the real shape: {a['rules']}. Traces: " + ", ".join(
                 f"`{t['path']}`" for by_model in rep["traces"].values()
                 for t in by_model.values()) + ".", ""]
    if rep.get("stale"):
        lines += [f"**Warning:** {rep['stale']}", ""]
    for name, per_scheme in rep["results"].items():
        if not per_scheme:
            continue
        gcds = sorted({int(g) for rows in per_scheme.values() for g in rows})
        lines += [f"#### {name}, replayed", "", *tflops_table(per_scheme)]
        top = str(gcds[-1])
        lines.append("")
        for scheme, rows in per_scheme.items():
            r = rows[top]
            lines.append(f"- {scheme} at {top} GCDs: step {r['step_s']:.2f} s = compute "
                         f"{r['compute_s']:.2f} + exposed {r['exposed_s']:.2f} (link time "
                         f"{r['link_s']:.2f}); " + _cell("; ".join(r["explain"]) or "nothing "
                                                          "exposed"))
        lines.append("")
    ideal, above = rep["idealised"]["ratios"], proj.get("ratios", {})
    lines += [f"| ratio | replayed | idealised, same settings | idealised as above "
              f"({settings_text(proj['assumptions'])}) | paper |", "|---|---:|---:|---:|---:|"]
    for key, value in rep["ratios"].items():
        ref = next((v for k, v in refs.items() if k in key), None)
        lines.append(f"| {key} | {value:.3f} | "
                     + (f"{ideal[key]:.3f}" if key in ideal else "—") + " | "
                     + (f"{above[key]:.3f}" if key in above else "—")
                     + f" | {ref if ref is not None else '—'} |")
    return lines + [""]


def provenance_section(report) -> list[str]:
    mc, v, g = report["machine"], report["versions"], report["git"]
    load = ", ".join(f"{x:.2f}" for x in mc["loadavg_at_start"])
    lines = ["## Machine, versions, commands", "",
             f"- Machine: {mc['cpu_model']}, {mc['cpus_usable']} usable of {mc['cpus_online']} "
             f"CPUs, {mc['kernel']} ({mc['host_arch']}); load average at start {load} "
             f"(other jobs share this machine, so times are noisy; byte counts are not)",
             "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
             f"- Git: {g['commit']}" + (" (dirty working tree" + (
                 f"; uncommitted code: {', '.join(g['dirty_code_paths'])}"
                 if g["dirty_code_paths"] else "; no uncommitted code") + ")" if g["dirty"]
                 else " (clean)"),
             f"- Report: `{report['command']}`, {report['started_utc']} to "
             f"{report['finished_utc']}", "",
             "| run | command | status | wall (s) | load at start | started |",
             "|---|---|---|---:|---|---|"]
    for key, r in report["runs"].items():
        status = r["status"] + (" (reused)" if r.get("reused") else "")
        if r["status"] != "ok":
            status += f": {r.get('reason', '')}"
        wall = f"{r['wall_s']:.0f}" if "wall_s" in r else ""
        load = ", ".join(f"{x:.1f}" for x in r.get("loadavg_at_start", []))
        cmd = f"`{r['command']}`" if "command" in r else ""
        lines.append(f"| {key} | {cmd} | {_cell(status)} | {wall} | {load} | "
                     f"{r.get('started_utc', '')} |")
    return lines + [""]


def markdown(report: dict[str, Any], out: Path, results_path: Path) -> str:
    plots = results_path.parent
    kind = "reduced (--quick) " if report["quick"] else ""
    lines = ["# Benchmarks", "",
             f"Generated by `{report['command']}` from {kind}fresh runs of the benchmark "
             f"commands (their `--json` output), {report['finished_utc']}. Do not edit: rerun "
             f"the command. Every figure below is in "
             f"[{_rel(results_path, out)}]({_rel(results_path, out)}), with each command, its "
             f"exit status and wall time; how each command counts and what it assumes is in "
             f"[docs/benchmarks.md]({_rel(DOCS, out)}). The leading table alone: "
             f"`{HEADLINE_COMMAND}`.",
             ""]
    lines += flagship_table(report)
    lines += headline(report)
    lines += goals_table(report)
    lines += traffic_section(report, out, plots)
    lines += network_section(report, out, plots)
    lines += overhead_section(report)
    lines += project_section(report, out, plots)
    lines += provenance_section(report)
    return "\n".join(lines)
