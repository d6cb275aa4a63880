"""The benchmark report: real sub-command runs, every rendered figure equal to the JSON it saved.

The fast form runs ``python -m benchmarks report --quick`` (8-rank
traffic with 3 schemes at K=1 and K=4, a one-step overhead on 4 ranks, the
projection with its replayed schedule; the emulated network, default and
frontier-shaped, only where this machine can run it: root and iproute2) into
a temporary directory and reads the markdown back. The same checks run on the
committed BENCHMARKS.md against its committed results.json, and the README's
quoted headline must be in that file.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report, report_render
from benchmarks.report_goals import calibration_rows, fmt_ratio

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("## At the flagship's settings", "## Headline", "## Goals", "## Link traffic", "## Emulated network",
            "## Overhead on one unshaped node", "## Frontier projection",
            "## Machine, versions, commands")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _network_runnable() -> str:
    """'' when the emulated network can run here, else why not (the report then skips it)."""
    if os.geteuid() != 0:
        return "not root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) missing"
    if not (REPO / "benchmarks" / "network.py").exists():
        return "benchmarks/network.py not in this checkout"
    return ""


def _report(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "benchmarks", "report", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _quick(tmp: Path, *args: str) -> tuple[Path, Path]:
    out = _report("--quick", "--out", str(tmp / "BENCHMARKS.md"), "--plots-dir",
                  str(tmp / "plots"), *args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return tmp / "BENCHMARKS.md", tmp / "plots" / "results.json"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    # The emulated network (~1 min even reduced) is left to the slow form; its
    # section is checked in CI on the committed report's real results.
    return _quick(tmp_path_factory.mktemp("report"), "--skip", "network")


# --------------------------------------------------------------------------- reading back


def section(md: str, heading: str) -> str:
    """The text from ``heading`` up to the next heading of the same or a higher level."""
    start = md.index(heading)
    level = heading.split()[0]
    nxt = re.search(rf"^#{{1,{len(level)}}} ", md[start + len(heading):], re.M)
    return md[start:start + len(heading) + nxt.start()] if nxt else md[start:]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in ``text`` (header and rule rows left out)."""
    rows, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        if i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: ") and lines[i + 1]:
            continue  # header row
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def check_report(md_path: Path, results_path: Path):
    """Every section present; every table figure equal to results.json; plots valid PNGs."""
    md, rec = md_path.read_text(), json.loads(results_path.read_text())
    runs = rec["runs"]
    for heading in SECTIONS:
        assert heading in md, f"{heading!r} missing from {md_path}"
    for key in ("cpu_model", "cpus_usable", "loadavg_at_start", "kernel"):
        assert key in rec["machine"], f"machine lacks {key}"
    assert {"python", "torch", "megatron-core"} <= set(rec["versions"]), rec["versions"]
    assert re.fullmatch(r"[0-9a-f]{40}", rec["git"]["commit"]) and "dirty" in rec["git"]
    assert rec["git"]["commit"] in md and rec["command"] in md

    for k in (1, 4):
        text = section(md, f"### K = {k} micro-batch(es)")
        run = runs[f"traffic_k{k}"]
        if run["status"] != "ok":
            assert f"not run: {run['reason']}" in text, text
            continue
        assert run["command"] in text, f"traffic K={k}: command not recorded"
        rows = {r[0]: r for r in table_rows(text)}
        data = {s: v for s, v in run["result"].items() if "unavailable" not in v}
        assert set(rows) == set(data), (k, set(rows), set(data))
        for scheme, b in data.items():
            got = [int(c.replace(",", "")) for c in rows[scheme][1:4]]
            assert got == [b["package"], b["node"], b["network"]], (k, scheme, got, b)
            assert rows[scheme][4] == fmt_ratio(data["lbp"]["network"] / b["network"]), (
                k, scheme, rows[scheme][4])

    check_flagship(md, runs.get("headline"))

    text = section(md, "## Overhead on one unshaped node")
    ov = runs["overhead"]
    if ov["status"] == "ok":
        rows = {r[0]: r for r in table_rows(text)}
        for scheme, t in ov["result"]["median_step_s"].items():
            assert rows[scheme][1] == f"{t:.3f}", (scheme, rows[scheme], t)
        assert f"**{ov['result']['ratio_lbp_over_stock']:.3f}**" in text
    else:
        assert f"not run: {ov['reason']}" in text

    text = section(md, "## Frontier projection")
    pr = runs["project"]
    if pr["status"] == "ok":
        for name, per_scheme in pr["result"]["results"].items():
            rows = {r[0]: r for r in table_rows(section(text, f"### {name} "))}
            for scheme, by_gcd in per_scheme.items():
                want = [f"{by_gcd[g]['tflops_per_gcd']:.1f} ({by_gcd[g]['scaling_efficiency']:.2f})"
                        for g in sorted(by_gcd, key=int)]
                assert rows[scheme][1:] == want, (name, scheme, rows[scheme], want)
        idealised = text.split("### Replayed schedule")[0]
        ratio_rows = {r[0]: r for r in table_rows(idealised) if r[0] in pr["result"]["ratios"]}
        for key, value in pr["result"]["ratios"].items():
            assert ratio_rows[key][1] == f"{value:.3f}", (key, ratio_rows[key], value)
        check_replay(text, pr["result"])
    else:
        assert f"not run: {pr['reason']}" in text

    text = section(md, "## Emulated network")
    net = runs["network"]
    if net["status"] == "ok":
        warning = net["result"]["config"].get("load_warning")
        assert not warning or warning in text, "the network command's load warning is not shown"
        rows = {r[0]: r for r in table_rows(text.split("Calibration")[0])}
        for scheme, row in net["result"]["schemes"].items():
            assert rows[scheme][1:3] == [f"{row['median_s']:.3f}",
                                         f"{row['ratio_to_lbp']:.2f}"], (scheme, rows[scheme], row)
            if "exposed_share" in row:
                assert rows[scheme][3:7] == exposure_cells(row), (scheme, rows[scheme], row)
        check_calibration(text, net)
    else:
        assert f"not run: {net['reason']}" in text, text
    if "network_frontier" in runs:
        check_frontier(section(md, "### Frontier-shaped"), runs["network_frontier"])

    goal_rows = table_rows(section(md, "## Goals"))
    assert len(goal_rows) == len(rec["goals"])
    for row, goal in zip(goal_rows, rec["goals"]):
        assert row[1] == goal["measured"] and row[2] == f"**{goal['status']}**", (row, goal)
        if goal["status"] in ("missed", "compared", "not measured"):
            assert goal["reason"], f"{goal['id']} {goal['status']} without a reason"
    independent_headline(rec)
    head = section(md, "## Headline")
    for line in rec["headline"]:
        assert f"- {line['text']}" in head, line

    plots = results_path.parent
    drawn = set(rec["plots"])
    expected = {"traffic.png"} if runs["traffic_k1"]["status"] == "ok" else set()
    expected |= {"projection.png"} if pr["status"] == "ok" else set()
    expected |= {"network.png"} if net["status"] == "ok" else set()
    expected |= {"network_frontier.png"} if runs.get("network_frontier", {}).get(
        "status") == "ok" else set()
    assert drawn == expected, (drawn, expected)
    for name in drawn:
        data = (plots / name).read_bytes()
        assert data.startswith(PNG_MAGIC), f"{name} is not a PNG"
        import matplotlib.image

        h, w = matplotlib.image.imread(plots / name).shape[:2]
        assert h > 100 and w > 100, (name, h, w)
        assert f"({os.path.relpath(plots / name, md_path.parent)})" in md \
            or f"({plots / name})" in md, f"{name} not linked"
    return md, rec


def exposure_cells(row):
    return [f"{row['compute_s']:.3f}", f"{row['link_s']:.3f}", f"{row['exposed_s']:.3f}",
            f"{row['exposed_share']:.0%}"]


def check_calibration(text: str, run):
    """The calibration table equals the JSON, and says which cost model predicted it."""
    cal = calibration_rows(run["result"])
    if not cal:
        return
    text = text.split("Calibration (", 1)[1].split("### Frontier-shaped")[0]
    rows = {r[0]: r for r in table_rows(text)}
    for scheme, c in cal.items():
        assert rows[scheme][1:4] == [f"{c['measured_ratio']:.2f}", f"{c['predicted_ratio']:.2f}",
                                     f"{c['rel_error']:+.1%}"], (scheme, rows[scheme], c)
    made = run["result"]["calibration"].get("fit", {}).get("predicted_with")
    assert not made or f"Predicted by {made}." in text, "which model predicted is not said"
    assert not run.get("not_rederived") or run["not_rederived"] in text, run["not_rederived"]


def check_frontier(text: str, run):
    """The frontier-shaped table: every scheme's figures as in its JSON, the trace's account."""
    if run["status"] != "ok":
        assert f"not run: {run['reason']}" in text, text
        return
    net = run["result"]
    assert run["command"] in text
    assert f"{net['config']['uplink_rate_mbit']:.1f} Mbit/s" in text
    if net["config"].get("rate_derivation"):
        from benchmarks.network_shape import derivation_lines

        assert all(line in text for line in derivation_lines(net["config"]["rate_derivation"]))
    rows = {r[0]: r for r in table_rows(text)}
    for scheme, row in net["schemes"].items():
        waits = row.get("trace", {}).get("exposed_s")
        assert rows[scheme][1:] == [f"{row['median_s']:.3f}", f"{row['ratio_to_lbp']:.2f}",
                                    *exposure_cells(row),
                                    "—" if waits is None else f"{waits:.3f}"], (scheme, rows)
    for line in net["explained"]:
        assert line.replace("|", "\\|") in text, line


def check_flagship(md: str, run):
    """The leading table: measured medians and spreads, ratios to lbp and projected bands as the
    headline run's JSON has them, and the one command that reruns it."""
    from benchmarks import headline as hl

    text = section(md, "## At the flagship's settings")
    assert report_render.HEADLINE_COMMAND in text
    if not run or run["status"] != "ok":
        assert "not run: " in text, text
        return
    out = run["result"]
    rows = {r[0]: r for r in table_rows(text)}
    assert list(rows) == list(hl.SCHEMES), rows
    for s in hl.SCHEMES:
        m, p = out["measured"][s], out["flagship"]["projected"][s]
        lo, hi = m["spread_s"]
        assert rows[s][1] == f"{m['median_s']:.3f} [{lo:.3f}–{hi:.3f}]", (s, rows[s], m)
        lo, hi = m["ratio_spread"]
        assert rows[s][2] == f"{m['ratio_to_lbp']:.2f} [{lo:.2f}–{hi:.2f}]", (s, rows[s], m)
        lo, hi = p["ratio_band"]
        assert rows[s][3] == f"{p['ratio_to_lbp']:.2f} [{lo:.2f}–{hi:.2f}]", (s, rows[s], p)
        assert len(m["step_s"]) == out["network"]["config"]["timed_steps"] >= 1


def check_replay(text: str, proj):
    """The replayed projection's tables equal the project run's ``replay`` JSON."""
    rep = proj.get("replay")
    if not rep:
        assert "### Replayed schedule" not in text
        return
    replayed = section(text, "### Replayed schedule")
    for name, per_scheme in rep["results"].items():
        rows = {r[0]: r for r in table_rows(section(replayed, f"#### {name}, replayed"))}
        for scheme, by_gcd in per_scheme.items():
            want = [f"{by_gcd[g]['tflops_per_gcd']:.1f} ({by_gcd[g]['scaling_efficiency']:.2f})"
                    for g in sorted(by_gcd, key=int)]
            assert rows[scheme][1:] == want, (name, scheme, rows[scheme], want)
    ratio_rows = {r[0]: r for r in table_rows(replayed) if r[0] in rep["ratios"]}
    for key, value in rep["ratios"].items():
        ideal = rep["idealised"]["ratios"].get(key)
        # beside it the idealised figure of the tables above (the command's own settings)
        above = proj["ratios"][key]
        assert ratio_rows[key][1:4] == [f"{value:.3f}", f"{ideal:.3f}", f"{above:.3f}"], (
            key, ratio_rows[key])


def independent_headline(rec):
    """The headline ratios recomputed here from the raw sub-command JSON, not by the report."""
    runs, heads = rec["runs"], {h["id"]: h for h in rec["headline"]}
    if runs["traffic_k1"]["status"] == "ok":
        t = runs["traffic_k1"]["result"]
        want = [t["lbp"]["network"] / t["zero3"]["network"],
                t["lbp"]["network"] / t["zeropp"]["network"]]
        assert heads["network_bytes"]["values"] == pytest.approx(want, rel=1e-12)
        assert f"1/{1 / want[0]:.2f}" in heads["network_bytes"]["text"]
    if runs["overhead"]["status"] == "ok":
        m = runs["overhead"]["result"]["median_step_s"]
        assert heads["overhead"]["values"][0] == pytest.approx(m["lbp"] / m["megatron-distopt"])
    if runs["project"]["status"] == "ok":
        p = runs["project"]["result"]["results"]["20B"]
        want = p["lbp"]["384"]["tflops_per_gcd"] / p["zeropp"]["384"]["tflops_per_gcd"]
        assert heads["projection"]["values"][0] == pytest.approx(want, rel=1e-12)
    if runs["network"]["status"] == "ok":
        s = runs["network"]["result"]["schemes"]
        want = [s[x]["ratio_to_lbp"] for x in ("zeropp", "zero3", "megatron-fsdp", "ds-zeropp",
                                                 "ds-zero3") if x in s]
        assert heads["emulated_speedup"]["values"] == pytest.approx(want)
    if runs.get("network_frontier", {}).get("status") == "ok":
        s = runs["network_frontier"]["result"]["schemes"]
        want = [s["lbp"]["exposed_s"] / s["lbp"]["link_s"]] + [
            s[x]["median_s"] / s["lbp"]["median_s"] for x in ("zeropp", "zero3", "megatron-fsdp",
                                                              "ds-zeropp", "ds-zero3") if x in s]
        assert heads["frontier_emulation"]["values"] == pytest.approx(want)
    rep = runs["project"].get("result", {}).get("replay") if runs["project"]["status"] == "ok" \
        else None
    if rep:
        r = rep["results"]["20B"]
        want = [r["lbp"]["384"]["tflops_per_gcd"] / r["zeropp"]["384"]["tflops_per_gcd"]]
        assert heads["replay"]["values"] == pytest.approx(want, rel=1e-12)


# --------------------------------------------------------------------------- tests


@pytest.mark.slow  # ~50 s of every benchmark section at quick size; CI keeps each section's own tests
def test_quick_report_renders_every_section_from_its_json(quick):
    md_path, results_path = quick
    md, rec = check_report(md_path, results_path)
    assert rec["quick"] and all(r["status"] in ("ok", "skipped") for r in rec["runs"].values())
    assert "not run: skipped (--skip)" in section(md, "## Emulated network")


@pytest.mark.slow  # ~50 s of every benchmark section at quick size; CI keeps each section's own tests
def test_reuse_keeps_the_figures_and_their_provenance(quick, tmp_path):
    _, first_path = quick
    first = json.loads(first_path.read_text())
    (tmp_path / "plots").mkdir()
    shutil.copy(first_path, tmp_path / "plots" / "results.json")
    out = _report("--quick", "--out", str(tmp_path / "again.md"), "--plots-dir",
                  str(tmp_path / "plots"), "--reuse", "traffic,project,overhead",
                  "--skip", "network", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    md, rec = check_report(tmp_path / "again.md", tmp_path / "plots" / "results.json")
    for key in ("traffic_k1", "traffic_k4", "project", "overhead", "overhead_plan"):
        assert rec["runs"][key]["reused"], key
        assert rec["runs"][key]["result"] == first["runs"][key]["result"], key
        assert rec["runs"][key]["started_utc"] == first["runs"][key]["started_utc"], key
    assert "reused from the run started" in md


def test_failing_subcommand_is_reported_and_fails_the_command(tmp_path):
    out = _report("--quick", "--out", str(tmp_path / "B.md"), "--skip", "traffic,overhead,network",
                  "--timeout", "0.2", timeout=300)
    assert out.returncode == 1, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    md, rec = check_report(tmp_path / "B.md", tmp_path / "benchmarks" / "results.json")
    assert rec["runs"]["project"]["status"] == "failed"
    assert "not run: timed out after 0.2 s" in section(md, "## Frontier projection")
    assert "not run: skipped (--skip)" in section(md, "## Link traffic")
    skipped = _report("--quick", "--out", str(tmp_path / "C.md"),
                      "--skip", "traffic,overhead,network,project", timeout=120)
    assert skipped.returncode == 0, skipped.stderr[-2000:]


@pytest.mark.slow  # renders the whole committed report again: ~80 s at load ~100
def test_only_runs_the_named_run_and_reuses_every_other(tmp_path):
    """--only overhead_plan: the plan tool runs again for the committed overhead run; every other
    run is the committed one, marked reused, its provenance kept."""
    committed = json.loads((REPO / "docs" / "benchmarks" / "results.json").read_text())
    (tmp_path / "plots").mkdir()
    shutil.copy(REPO / "docs" / "benchmarks" / "results.json", tmp_path / "plots" / "results.json")
    out = _report("--only", "overhead_plan", "--out", str(tmp_path / "B.md"),
                  "--plots-dir", str(tmp_path / "plots"), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rec = json.loads((tmp_path / "plots" / "results.json").read_text())
    assert "reused" not in rec["runs"]["overhead_plan"], rec["runs"]["overhead_plan"]
    assert rec["runs"]["overhead_plan"]["started_utc"] != \
        committed["runs"]["overhead_plan"]["started_utc"]
    assert rec["runs"]["overhead_plan"]["status"] == "ok", rec["runs"]["overhead_plan"]
    assert rec["runs"]["overhead_plan"]["result"]["world_size"] == \
        committed["runs"]["overhead"]["result"]["ranks"]
    for key in set(report.run_keys()) - {"overhead_plan"}:
        assert rec["runs"][key]["reused"], key
        assert rec["runs"][key]["started_utc"] == committed["runs"][key]["started_utc"], key


def test_absent_command_is_a_failed_run_with_its_error():
    run = report.run_command([sys.executable, "-m", "benchmarks", "nosuch", "--json"],
                             timeout=120)
    assert run["status"] == "failed", run
    assert run["reason"].startswith("exit 2:") and "command nosuch is not one of" in run["reason"]


def test_the_frontier_shaped_run_has_its_own_multi_rank_timeout():
    """Six schemes in one multi-rank run outlast the network command's default; the report's own
    per-command limit must still leave that run room to fail by itself (its namespaces removed)."""
    from benchmarks import network

    argv = report.section_commands(False)["network"]["network_frontier"]
    given = float(argv[argv.index("--timeout") + 1])
    default = network.parse(["--model", "frontier-shaped"]).timeout
    assert default < given == report.FRONTIER_RUN_TIMEOUT_S < report.DEFAULT_TIMEOUT_S, (
        default, given, report.DEFAULT_TIMEOUT_S)
    assert "--timeout" not in report.section_commands(True)["network"]["network_frontier"]


def test_bad_flags_are_one_line_errors():
    for args, msg in ((["--skip", "speed"], "--skip: speed not in"),
                      (["--skip", "project", "--reuse", "project"], "both skipped and reused"),
                      (["--timeout", "0"], "--timeout=0 must be > 0"),
                      (["--only", "network_default"], "--only: network_default not in"),
                      (["--only", "project", "--reuse", "traffic"], "not with --skip or --reuse")):
        out = _report(*args, timeout=120)
        assert out.returncode == 2 and msg in out.stderr, (args, out.stderr[-500:])


def test_committed_report_matches_its_results_and_the_readme_quotes_it():
    md_path, results_path = REPO / "BENCHMARKS.md", REPO / "docs" / "benchmarks" / "results.json"
    if not md_path.exists():
        pytest.fail("BENCHMARKS.md is not committed: run python -m benchmarks report")
    md, rec = check_report(md_path, results_path)
    assert not rec["quick"], "the committed report must be the full form"
    readme = (REPO / "README.md").read_text()
    quoted = section(readme, "## Benchmarks")
    # Measured figures are written as in the headline (1/20.00, 1.22x, 1.495);
    # targets as 1/8, 1.5× so that they are not taken for measurements.
    figures = re.findall(r"\d+/\d+\.\d+|\d+\.\d+x|\b\d\.\d{3}\b", quoted)
    assert figures, "README's benchmark section quotes no headline figures"
    head = section(md, "## Headline")
    for fig in figures:
        assert fig in head, f"README quotes {fig}, not in BENCHMARKS.md's headline"


@pytest.mark.slow
def test_quick_report_with_the_emulated_network(tmp_path):
    why = _network_runnable()
    if why:
        pytest.skip(f"emulated network cannot run here: {why}")
    md_path, results_path = _quick(tmp_path)
    md, rec = check_report(md_path, results_path)
    assert rec["runs"]["network"]["status"] == "ok" and "network.png" in rec["plots"]
    assert "| zeropp |" in section(md, "## Emulated network")


@pytest.mark.slow
def test_full_report(tmp_path):
    """The documented command, into a temporary directory (traffic, overhead, network: minutes)."""
    skip = ["--skip", "network"] if _network_runnable() else []
    out = _report("--out", str(tmp_path / "BENCHMARKS.md"), "--plots-dir",
                  str(tmp_path / "benchmarks"), *skip, timeout=7200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    check_report(tmp_path / "BENCHMARKS.md", tmp_path / "benchmarks" / "results.json")
