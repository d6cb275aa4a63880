"""The emulated-network benchmark: real namespaces, real tbf shaping, real training, real cleanup.

Everything but the flag checks and the fit arithmetic needs root and iproute2;
those tests skip with the reason the command itself would print.
"""
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

from benchmarks import netns, network_shape
from megatron_lbp.projection import collectives
from megatron_lbp.projection import project as pj

CMD = [sys.executable, "-m", "benchmarks", "network"]
REQUIREMENT = netns.missing_requirements()
needs_root = pytest.mark.skipif(REQUIREMENT is not None, reason=f"emulated network: {REQUIREMENT}")
RATE_MBIT = 200
REDUCED = ["--nodes", "2", "--ranks-per-node", "2", "--steps", "2", "--warmup", "1", "--runs", "1",
           "--hidden", "128", "--layers", "2", "--seq", "32", "--link-sizes-mb", "0.5,4",
           "--rate-mbit", str(RATE_MBIT)]
FRONTIER_REDUCED = ["--model", "frontier-shaped", "--nodes", "2", "--ranks-per-node", "2",
                    "--steps", "2", "--warmup", "1", "--runs", "1", "--hidden", "64",
                    "--layers", "2", "--link-sizes-mb", "0.5,4"]


def _ours(pid: int) -> list[str]:
    return [ns for ns in netns.namespaces() if ns.startswith(f"{netns.PREFIX}{pid}-")]


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait_for_ranks(proc, ranks_per_node=2, timeout=180.0) -> list[int]:
    """Pids of the rank processes in the command's first node, once all of them are in it.

    Python processes only: while the network is built, ``ip netns exec ... tc``
    runs briefly inside the namespaces too.
    """
    deadline = time.monotonic() + timeout
    ns = f"{netns.PREFIX}{proc.pid}-n0"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"command ended early: {proc.communicate()[1][-2000:]}"
        pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                               text=True).stdout.split()]
        ranks = [p for p in pids if "python" in _cmdline(p)]
        if len(ranks) >= ranks_per_node:
            return ranks
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the ranks did not appear in {ns} within {timeout} s")


@pytest.fixture
def launch():
    """Start the command; whatever happens in the test, it does not outlive it.

    SIGTERM first (the command removes its namespaces), SIGKILL if that hangs;
    namespaces a SIGKILLed command leaves are swept.
    """
    procs = []

    def start(args, **kw):
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        proc = subprocess.Popen(CMD + args, text=True, **kw)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    if any(_ours(p.pid) for p in procs):
        subprocess.run(CMD + ["--sweep"], capture_output=True, timeout=120)


def _gone_within(pids, seconds=10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(pids)


@pytest.mark.slow  # ~40 s emulated run; CI keeps the cleanup-after-signal/crash/kill cases
@needs_root
def test_reduced_run_json_shaping_and_cleanup(launch):
    """The frontier-shaped form reduced: its uplink derived from a probe, then the run."""
    proc = launch(FRONTIER_REDUCED + ["--schemes", "lbp,zero3", "--json"])
    stdout, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, stderr[-3000:]
    assert "compute-to-network ratio" in stderr and "rate = " in stderr, stderr[-3000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert _ours(proc.pid) == [], f"namespaces left behind: {_ours(proc.pid)}"

    c = out["config"]
    assert (c["nodes"], c["ranks_per_node"], c["world_size"]) == (2, 2, 4)
    assert c["schemes"] == ["lbp", "zero3"]
    assert {"torch", "megatron_core", "python", "kernel"} <= set(c["versions"])
    m = c["model"]
    # 20B's proportions at hidden 64: sequence 64*2048/6144, vocabulary 64*50304/6144 -> 512.
    assert (m["hidden_size"], m["seq_length"], m["vocab_size"], m["recompute"]) == \
        (64, 21, 512, "full")
    assert (c["micro_batches"], c["model_name"]) == (2, "frontier-shaped")
    d = c["rate_derivation"]
    # The rate is the stated Frontier ratio applied to the compute measured here, nothing else.
    assert d["flops_per_byte"] == pytest.approx(collectives.frontier_flops_per_network_byte())
    assert d["compute_alone_s"] == pytest.approx(statistics.median(d["probe"]["compute_s"]))
    params = pj.plan_for({"num_layers": 2, "hidden_size": 64, "vocab_size": 512}, 4, "lbp", 2,
                         gpus_per_node=2)["params"]
    flops = pj.model_flops_per_token(params, 2, 64, 21) * 21 * 4 * 2
    assert d["flops_per_step_per_rank"] == pytest.approx(flops)
    bal = network_shape.balance({"num_layers": 2, "hidden_size": 64, "vocab_size": 512}, 21)
    assert d["balance"]["factor"] == pytest.approx(bal["factor"])
    assert d["rate_mbit"] == pytest.approx(
        2 * flops / d["compute_alone_s"] / d["flops_per_byte"] * bal["factor"] * 8 / 1e6)
    rate_mbit = c["uplink_rate_mbit"]
    assert rate_mbit == d["rate_mbit"]
    shaped = [float(x) * {"K": 1e-3, "M": 1, "G": 1e3}[unit]
              for q in c["qdiscs"].values()
              for x, unit in re.findall(r"tbf .*?rate (\d+(?:\.\d+)?)([KMG])bit", q)]
    assert len(shaped) == 4 and all(r == pytest.approx(rate_mbit, rel=0.01) for r in shaped), (
        f"expected tbf at {rate_mbit:.1f} Mbit/s on both ends of 2 uplinks: {c['qdiscs']}")
    fwd_bwd = out["calibration"]["fit"]["compute_measured"]["fwd_bwd_s"]
    assert d["achieved_ratio"] == pytest.approx(out["schemes"]["zero3"]["link_s"] / fwd_bwd)

    assert set(out["schemes"]) == {"lbp", "zero3"}
    for scheme, row in out["schemes"].items():
        assert len(row["step_s"]) == 2 and all(t > 0 for t in row["step_s"]), (scheme, row)
        assert row["median_s"] == pytest.approx(sorted(row["step_s"])[0] / 2
                                                + sorted(row["step_s"])[1] / 2)
        assert row["ratio_to_lbp"] == pytest.approx(
            row["median_s"] / out["schemes"]["lbp"]["median_s"])
        assert all(math.isfinite(x) for x in row["losses"]), row["losses"]
    assert out["schemes"]["lbp"]["ratio_to_lbp"] == 1.0
    _check_exposure(out)

    cal = out["calibration"]
    for scheme in ("lbp", "zero3"):
        k = cal[scheme]
        assert k["measured_ratio"] == pytest.approx(out["schemes"][scheme]["ratio_to_lbp"])
        assert k["predicted_ratio"] > 0
        assert k["rel_error"] == pytest.approx(
            abs(k["predicted_ratio"] - k["measured_ratio"]) / k["measured_ratio"])
        assert k["within_20pct"] is (k["rel_error"] <= 0.2)
    links = cal["fit"]["links"]
    assert links["network"]["bandwidth_MB_per_s"] > 0
    assert links["loopback"]["bandwidth_MB_per_s"] > 0

    # Shaping is real: through a node's uplink the largest peer all-gather
    # (every rank of the node sending across at once; 4 MB, so the tbf's 64 kB
    # burst is noise) never beats the tbf rate and gets within a factor 6 of it;
    # loopback in the same run is far faster.
    rate = rate_mbit * 1e6 / 8
    samples = cal["fit"]["link_samples"]
    peers = [s for s in samples if s["pattern"] == "peers" and s["op"] == "all_gather"]
    big = max(peers, key=lambda s: s["bytes"])
    through_uplink = c["ranks_per_node"] * big["bytes"] / big["s"]
    assert rate / 6 < through_uplink < 1.1 * rate, (
        f"{through_uplink / 1e6:.1f} MB/s through a {rate / 1e6:.1f} MB/s uplink: {big}")
    node = max(s["bytes"] / s["s"] for s in samples if s["pattern"] == "node")
    assert node > 3 * big["bytes"] / big["s"], (
        f"loopback {node / 1e6:.1f} vs uplink {big['bytes'] / big['s'] / 1e6:.1f} MB/s per rank")


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT,
                                 pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_mid_run_removes_everything(sig, launch):
    # SIGINT arrives even if this test runs as a background job (SIGINT ignored).
    proc = launch(REDUCED + ["--schemes", "lbp", "--steps", "500"])
    ranks = _wait_for_ranks(proc)
    assert len(_ours(proc.pid)) == 3, netns.namespaces()  # two nodes and the switch
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted; emulated network removed" in stderr
    assert _ours(proc.pid) == [], f"namespaces left after {sig!r}: {_ours(proc.pid)}"
    assert _gone_within(ranks) == [], "rank processes outlived the command"


@pytest.mark.slow
@needs_root
def test_crashed_rank_fails_the_run_and_removes_everything(launch):
    """A rank SIGKILLed mid-run: the run fails naming it, still removes everything (~25-100 s)."""
    proc = launch(REDUCED + ["--schemes", "lbp", "--steps", "500"])
    ranks = _wait_for_ranks(proc)
    os.kill(ranks[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 1, stderr[-2000:]
    assert "a rank failed; emulated network removed" in stderr, stderr[-2000:]
    assert _ours(proc.pid) == [], f"namespaces left after a crash: {_ours(proc.pid)}"
    assert _gone_within(ranks) == []


@needs_root
def test_killed_command_leaves_state_that_the_next_run_sweeps(launch):
    proc = launch(REDUCED + ["--schemes", "lbp", "--steps", "500"],
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = _wait_for_ranks(proc)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait(timeout=30)
    stale = _ours(proc.pid)
    assert len(stale) == 3, f"expected the killed run's namespaces to remain: {netns.namespaces()}"
    sweep = subprocess.run(CMD + ["--sweep"], capture_output=True, text=True, timeout=60)
    assert sweep.returncode == 0, sweep.stderr
    assert all(ns in sweep.stdout for ns in stale), sweep.stdout
    assert _ours(proc.pid) == []
    assert _gone_within(ranks) == [], "the sweep left the dead run's rank processes"


def test_model_presets_fill_the_shape():
    """default: the shape and rate the bench always ran; frontier-shaped: 20B's proportions."""
    from benchmarks.network import SCHEMES, parse

    a = parse([])
    assert (a.layers, a.hidden, a.heads, a.vocab, a.seq, a.micro_batch_size, a.micro_batches,
            a.recompute, a.rate_mbit) == (4, 256, 4, 1024, 64, 1, 1, False, 400.0)
    assert a.schemes == list(SCHEMES)
    f = parse(["--model", "frontier-shaped"])
    assert (f.layers, f.hidden, f.seq, f.vocab, f.micro_batches, f.recompute, f.rate_mbit) == \
        (4, 256, 85, 2048, 2, True, None)
    assert f.schemes == list(network_shape.FRONTIER_SCHEMES)
    g = parse(["--model", "frontier-shaped", "--hidden", "384", "--seq", "100",
               "--rate-mbit", "50"])
    assert (g.seq, g.vocab, g.rate_mbit) == (100, 3200, 50.0)


@pytest.mark.parametrize("flags,says", [
    (["--nodes", "1"], "--nodes=1 must be >= 2"),
    (["--ranks-per-node", "3"], "--ranks-per-node=3 must be a multiple of 2"),
    (["--rate-mbit", "0"], "--rate-mbit=0.0 must be > 0"),
    (["--schemes", "lbp,zero9"], "--schemes: zero9 not in"),
    (["--hidden", "100", "--heads", "3"], "--hidden=100 must be a multiple of --heads=3"),
    (["--steps", "0"], "--steps=0 must be >= 1"),
    (["--link-sizes-mb", "1,-2"], "--link-sizes-mb='1,-2'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--model", "20B"], "--model: invalid choice: '20B'"),
    (["--model", "frontier-shaped", "--hidden", "100", "--heads", "3"],
     "--hidden=100 must be a multiple of --heads=3"),
])
def test_bad_flags_are_one_line_errors(flags, says):
    done = subprocess.run(CMD + flags, capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("python -m benchmarks network: error:"), lines[0]
    assert says in lines[0], lines[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_refuses_without_root_in_one_line():
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + CMD
                          + ["--schemes", "lbp"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": "/tmp"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines[-1] == ("python -m benchmarks network: error: needs root (network "
                         "namespaces, veth and tc); run as root"), done.stderr[-2000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="as non-root the root check answers first")
def test_refuses_without_iproute2_in_one_line(tmp_path):
    done = subprocess.run(CMD + ["--schemes", "lbp"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": str(tmp_path)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines[-1] == ("python -m benchmarks network: error: 'ip' not found on PATH "
                         "(iproute2 is needed)"), done.stderr[-2000:]


def test_fit_link_recovers_bandwidth_and_latency():
    bw, lat = 25e6, 300e-6
    samples = [(b, n, b / bw + lat * math.ceil(math.log2(n)))
               for b in (2e5, 1e6, 4e6) for n in (2, 4, 8)]
    got_bw, got_lat = pj.fit_link(samples)
    assert got_bw == pytest.approx(bw, rel=1e-9) and got_lat == pytest.approx(lat, rel=1e-6)
    # Negative latency would be unphysical: clamped to 0 and the bandwidth refitted.
    fast_small = [(1e6, 2, 0.01), (4e6, 2, 0.05)]
    got_bw, got_lat = pj.fit_link(fast_small)
    assert got_lat == 0.0 and 1e6 / 0.01 > got_bw > 4e6 / 0.05


def test_uplink_fit_recovers_the_uplink_from_world_and_peer_collectives():
    """Samples timed by the shared-uplink rule: one uplink rate fits both patterns."""
    from benchmarks.network import _fit_links

    uplink, lat, rpn = 30e6, 2e-3, 4
    samples = []
    for pattern, n, in_node in (("world", 8, rpn), ("peers", 2, 1)):
        for op, b in (("all_gather", 4e5), ("all_gather", 1.6e6), ("reduce_scatter", 8e5),
                      ("reduce_scatter", 3.2e6)):
            t = pj.uplink_bytes(b, in_node, rpn) / uplink + lat * math.ceil(math.log2(n))
            samples.append((pattern, op, n, b, t))
    for mb in (1e6, 4e6):  # the node loopback, per rank
        samples.append(("node", "all_gather", 4, mb, mb / 2e8 + 1e-4 * 2))
    got_bw, got_lat = pj.fit_uplink([(b, n, rpn if p == "world" else 1, t)
                                     for p, _, n, b, t in samples if p != "node"], rpn)
    assert got_bw == pytest.approx(uplink, rel=1e-9) and got_lat == pytest.approx(lat, rel=1e-6)
    fit = _fit_links(samples, rpn)
    net = fit["network"]
    assert net["bandwidth_MB_per_s"] == pytest.approx(30.0, rel=1e-9), net
    for p in ("world", "peers"):
        assert net[f"{p}_only"]["bandwidth_MB_per_s"] == pytest.approx(30.0, rel=1e-9), net
    # Per rank the two patterns disagree by the peers' multiplicity (the old model's miss).
    assert net["peers_only"]["per_rank_bandwidth_MB_per_s"] == pytest.approx(30.0 / rpn), net
    assert fit["loopback"]["bandwidth_MB_per_s"] == pytest.approx(200.0, rel=1e-9), fit


def test_calibrate_reports_ratios_to_lbp_and_the_error():
    model = pj.MODELS["10B"]
    plans = {s: pj.plan_for(model, 16, s, 1) for s in ("lbp", "zero3")}
    compute = pj.ComputeModel()
    predicted = {s: pj.step_time(plans[s], model, pj.LinkModel(), compute)["step_s"]
                 for s in plans}
    measured = {"lbp": 2.0, "zero3": 2.0 * predicted["zero3"] / predicted["lbp"] * 1.5}
    out = pj.calibrate(measured, plans, model, pj.LinkModel(), compute)
    assert out["lbp"]["measured_ratio"] == 1.0 and out["lbp"]["rel_error"] == 0.0
    z = out["zero3"]
    assert z["predicted_ratio"] == pytest.approx(predicted["zero3"] / predicted["lbp"])
    assert z["rel_error"] == pytest.approx(1 / 3) and z["within_20pct"] is False
    with pytest.raises(ValueError, match="reference scheme 'lbp' was not measured"):
        pj.calibrate({"zero3": 1.0}, plans, model, pj.LinkModel(), compute)


def test_compute_from_measured_reproduces_the_timed_compute():
    model = {"num_layers": 4, "hidden_size": 256, "vocab_size": 1024}
    plan = pj.plan_for(model, 8, "lbp", 2, gpus_per_node=4)
    compute = pj.compute_from_measured(model, plan.params, 64, 1, micro_batch_s=0.08,
                                       adam_s=0.01, adam_elements=plan.padded_params / 8)
    ideal = pj.LinkModel.from_measured({c: 1e30 for c in ("package", "node", "network")},
                                       {c: 0.0 for c in ("package", "node", "network")})
    t = pj.step_time(plan, model, ideal, compute)
    assert t["compute_s"] == pytest.approx(2 * 0.08) and t["adam_s"] == pytest.approx(0.01)


@pytest.mark.slow
@needs_root
def test_package_tier(launch):
    """--package-rate-mbit: packages as namespaces behind shaped links; three link classes fitted."""
    proc = launch(["--nodes", "2", "--ranks-per-node", "4", "--steps", "2", "--warmup", "1",
                   "--hidden", "128", "--layers", "2", "--seq", "32", "--link-sizes-mb", "4",
                   "--rate-mbit", "100", "--package-rate-mbit", "300", "--schemes", "lbp,zero3",
                   "--json"])
    stdout, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert _ours(proc.pid) == []
    qdiscs = list(out["config"]["qdiscs"].values())
    # 2 uplinks and 4 package links, each shaped at both ends.
    assert sum("100Mbit" in q for q in qdiscs) == 4 and sum("300Mbit" in q for q in qdiscs) == 8
    links = out["calibration"]["fit"]["links"]
    assert {"network", "node", "package"} <= set(links) and "loopback" not in links
    per_rank = {}
    for s in out["calibration"]["fit"]["link_samples"]:
        if s["op"] == "all_gather":
            per_rank[s["pattern"]] = s["bytes"] / s["s"]
    # Loopback inside a package > 300 Mbit/s package links > 100 Mbit/s uplinks.
    assert per_rank["package"] > per_rank["node"] > per_rank["peers"], per_rank


def _check_exposure(out):
    """compute alone, link alone, exposed and its share, and the engine schemes' traces."""
    c = out["config"]
    world = c["world_size"]
    model = {k: c["model"][k] for k in ("num_layers", "hidden_size", "vocab_size")}
    compute = c.get("compute_alone", "")
    assert "no collective" in compute and ("recomputation" in compute) is (
        c["model"]["recompute"] == "full"), compute
    fit = out["calibration"]["fit"]["compute_measured"]
    for scheme, row in out["schemes"].items():
        assert row["compute_s"] == pytest.approx(fit["fwd_bwd_s"] + fit["adam_s"]), scheme
        assert len(row["link_replay_s"]) == c["timed_steps"] * c["runs"]
        assert row["link_s"] == pytest.approx(statistics.median(row["link_replay_s"]))
        assert row["replayed_collectives"] > 0 and row["link_s"] > 0, (scheme, row)
        assert row["exposed_s"] == pytest.approx(row["median_s"] - row["compute_s"])
        assert row["exposed_share"] == pytest.approx(row["exposed_s"] / row["link_s"])
        if scheme in ("megatron-fsdp", "megatron-distopt"):
            assert "trace" not in row
            continue
        # The trace is the engine's: its bytes per phase are the plan's for this topology.
        plan = pj.plan_for(model, world, scheme, c["micro_batches"],
                           gpus_per_node=c["ranks_per_node"], gcds_per_package=2)
        tr = row["trace"]
        for phase, by_class in plan.traffic_by_phase.items():
            assert tr["phases"][phase]["bytes"] == pytest.approx(sum(by_class.values())), (
                scheme, phase)
        assert 0 <= tr["exposed_s"] <= tr["step_s"]
        for phase, p in tr["phases"].items():
            assert p["at_once_s"] + p["ahead_s"] == pytest.approx(p["exposed_s"]), (scheme, phase)
    assert len(out["explained"]) == len(out["schemes"])
    assert all(line.split(":")[0] in out["schemes"] for line in out["explained"])


@pytest.mark.slow
@needs_root
def test_full_default_run():
    """The documented default run (2 nodes x 4 ranks, every scheme): a few minutes."""
    done = subprocess.run(CMD + ["--json"], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    from benchmarks.network import SCHEMES

    assert list(out["schemes"]) == list(SCHEMES)
    assert set(SCHEMES) <= set(out["calibration"])
    _check_exposure(out)


@pytest.mark.slow
@needs_root
def test_full_frontier_shaped_run():
    """The documented frontier-shaped run (2 nodes x 4 ranks, 4 schemes): several minutes."""
    done = subprocess.run(CMD + ["--model", "frontier-shaped", "--json"], capture_output=True,
                          text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(out["schemes"]) == list(network_shape.FRONTIER_SCHEMES)
    assert out["config"]["rate_derivation"]["rate_mbit"] == out["config"]["uplink_rate_mbit"]
    _check_exposure(out)
