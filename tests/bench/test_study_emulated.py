"""The adoption study on the emulated network (issue 29 item 4): the committed report in
docs/study-emulated/ is what the report code gives from the committed result files (so the two
cannot drift apart), and the benchmark that records them (python -m benchmarks
study-network) runs real training on namespaces and reads the uplinks' byte counters."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import netns, study_network
from megatron_lbp.study import report
from megatron_lbp.integration import study_result as result

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "study-emulated"


def test_committed_report_is_the_report_of_the_committed_results(tmp_path):
    results = sorted(DOC.rglob("result.json"))
    assert len(results) >= 6, results   # 2 node counts x 3 schemes at least (issue 29)
    for p in results:
        (tmp_path / p.parent.name).mkdir()
        shutil.copy(p, tmp_path / p.parent.name / p.name)
    text, pngs = report.report(str(tmp_path))
    committed = (DOC / "report.md").read_text()
    assert committed.strip() == text.strip(), (
        "docs/study-emulated/report.md is not the report of its result files; regenerate it with "
        "python -m megatron_lbp.study report docs/study-emulated")
    assert sorted(Path(p).name for p in pngs) == sorted(p.name for p in DOC.glob("*.png"))
    # the uplinks were measured on the emulated network, not left "not measured"
    multi = [result.load(str(p)) for p in results]
    multi = [r for r in multi if r["status"] == "ok" and r["nodes"] > 1]
    assert multi and all(r["interface_bytes"].get("tx_bytes_per_step") for r in multi), multi


def test_committed_settings_name_todays_command_and_files():
    # network.json records how the committed study was run: the CLI that runs it today
    # (python -m benchmarks, since the benchmarks left the package) and files that exist.
    settings = json.loads((DOC / "network.json").read_text())
    prog = "python -m benchmarks study-network "
    assert settings["command"].startswith(prog), settings["command"]
    study_network.parse(settings["command"][len(prog):].split())
    cited = re.findall(r"\(([\w/]+\.py)\)", settings["what"])
    assert cited and all((REPO / f).is_file() for f in cited), settings["what"]


def test_study_network_refuses_bad_input_before_any_work(capsys):
    for argv, word in ((["--schemes", "lbp,zero9"], "--schemes"), (["--nodes", "1,x"], "--nodes"),
                       (["--rate-mbit", "0"], "--rate-mbit"), (["--iters", "0"], "--iters")):
        with pytest.raises(SystemExit) as e:
            study_network.parse(["--out", "unused", *argv])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and word in err, (argv, err)


@pytest.mark.slow   # four real runs on namespaces: ~4-6 min on the busy 2-core machine
def test_study_network_runs_and_counts_the_uplinks(tmp_path):
    """1 and 2 emulated nodes x lbp and zero3: every run trains and reads its uplink counters; a
    1-node run sends (almost) nothing over its uplink; lbp's network collectives are between
    node peers, so all their bytes cross the uplinks: the counters carry the ledger's network
    bytes plus TCP/IP headers and the few collectives the engine does not charge (loss, grad
    norm). zero3 puts more on the uplinks than lbp, and less than its ledger's network bytes:
    the ledger charges every byte of a collective that spans nodes to the network, while in
    gloo's ring over two nodes of two ranks only the hops between the nodes cross an uplink."""
    why = netns.missing_requirements()
    if why:
        pytest.skip(why)
    out = subprocess.run([sys.executable, "-m", "benchmarks", "study-network", "--out", str(tmp_path),
                          "--nodes", "1,2", "--schemes", "lbp,zero3", "--iters", "4"],
                         capture_output=True, text=True, cwd=REPO, timeout=1800)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    runs = {p.parent.name: result.load(str(p)) for p in (tmp_path / "runs").rglob("result.json")}
    assert sorted(runs) == ["n001-lbp-s1234", "n001-zero3-s1234", "n002-lbp-s1234", "n002-zero3-s1234"]
    seen = {}
    for name, r in runs.items():
        assert r["status"] == "ok", (name, r.get("reason"))
        seen[name] = (r["ledger_bytes_per_step"]["network"], r["interface_bytes"].get("tx_bytes_per_step"))
    assert all(wire is not None for _, wire in seen.values()), seen
    for name in ("n001-lbp-s1234", "n001-zero3-s1234"):
        assert seen[name][0] == 0 and seen[name][1] < 10_000, seen
    (lbp_ledger, lbp_wire), (z3_ledger, z3_wire) = seen["n002-lbp-s1234"], seen["n002-zero3-s1234"]
    assert lbp_ledger > 0 and 1.0 <= lbp_wire / lbp_ledger <= 1.3, seen
    assert lbp_wire < z3_wire < 1.3 * z3_ledger, seen
    text = (tmp_path / "runs" / "report.md").read_text()
    assert "/sys/class/net/{up0}/statistics" in text, text
    settings = json.loads((tmp_path / "network.json").read_text())
    assert settings["interfaces_counted"] == "up0" and settings["nodes"] == [1, 2], settings
    assert settings["command"].startswith("python -m benchmarks study-network --out "), settings
