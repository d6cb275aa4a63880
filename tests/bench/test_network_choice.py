"""Issue 26 item 3 at the emulated-network scale: the launcher's choice follows measured step times.

``python -m benchmarks network-choice`` (benchmarks/network_choice.py) measures on two
emulated nodes of 4 ranks, uplinks shaped to a stated rate: the links by the launcher's own
health check (the file the choice reads with ``--links``), the CPU ranks' compute rate, and
the real step times of lbp and zeropp at two batches (one micro-batch of 8 sequences per
rank, and 4 micro-batches of 1), interleaved in the same rank processes. The slow test
asserts that at each batch the choice's ranking of the two is the measured one, whichever
scheme is faster, and that the batch where the projection gives the first scheme its better
ratio to the second is the measured one. Needs root and iproute2.
"""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from benchmarks import netns
from benchmarks import network_choice as nc
from megatron_lbp.launch import candidates, estimate
from megatron_lbp.projection import project as pj

REQUIREMENT = netns.missing_requirements()
needs_root = pytest.mark.skipif(REQUIREMENT is not None, reason=f"emulated network: {REQUIREMENT}")
LINKS = {"package": 0.09, "node": 0.09, "network": 0.003}   # GB/s per GCD, as the check writes


def _table(out) -> str:
    return "; ".join(
        f"{name}, global batch {b['global_batch']}: projected " + ", ".join(
            f"{s} {t:.3f} s" for s, t in b["projected_s"].items()) + " / measured " + ", ".join(
            f"{s} {t:.3f} s" for s, t in b["measured_s"].items())
        for name, b in out["batches"].items())


@pytest.mark.slow   # minutes: 8 ranks train 4 configurations for 3 rounds on 2 CPU cores
@needs_root
def test_the_choice_follows_the_measured_step_times_at_two_global_batches():
    """At each batch the scheme the choice projects faster is the one measured faster (whichever
    it is), and the batch where the projection gives the first scheme its better ratio to the
    second is the one where the run measured it better. On this network the projection prefers
    zeropp at both batches
    (test_the_projection_ranks_zeropp_lbp_then_the_rest_at_every_uplink_on_this_network;
    docs/testing.md#the-choice-against-measured-step-times)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks", "network-choice", "--json"],
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(nc.render(out))
    batches = list(out["batches"].values())
    assert len(batches) == 2
    for b in batches:
        for s, losses in b["losses"].items():
            assert losses and all(math.isfinite(x) for x in losses), (s, losses)
    for name, b in out["batches"].items():
        assert b["projected_faster"] == b["measured_faster"], \
            f"at {name} (global batch {b['global_batch']}) the choice prefers {b['projected_faster']} but " \
            f"{b['measured_faster']} was measured faster: {_table(out)}"
    first, second = nc.DEFAULT_SCHEMES

    def lead(b, key):
        return b[key][first] / b[key][second]

    projected = sorted(out["batches"], key=lambda n: lead(out["batches"][n], "projected_s"))
    measured = sorted(out["batches"], key=lambda n: lead(out["batches"][n], "measured_s"))
    assert projected == measured, \
        f"the projection gives {first}/{second} its lowest ratio at {projected[0]}, the run at " \
        f"{measured[0]}: {_table(out)}"


def test_the_shared_uplink_is_the_health_checks_per_gcd_figure_times_the_node(tmp_path):
    """--network-model shared_uplink: the choice's step time is project.step_time with the
    uplink = per-GCD network figure x ranks per node, charged per byte crossing it."""
    from megatron_lbp.launch import health

    path = tmp_path / "links.json"
    path.write_text(json.dumps({"convention": health.LINKS_CONVENTION,
                                "GB_per_s_per_gcd": LINKS}))
    args = nc.parse([])
    a = estimate.job_from_args(estimate.build_parser().parse_args(
        nc.estimate_argv(args, 64, 2, str(path), 0.002, "shared_uplink")))
    links = candidates.link_model(a)
    assert links.network == "shared_uplink"
    assert links.bandwidth["network"] == pytest.approx(LINKS["network"] * 1e9 * 4)
    b = estimate.job_from_args(estimate.build_parser().parse_args(
        estimate_argv := nc.estimate_argv(args, 64, 2, str(path), 0.002, "per_rank")))
    assert candidates.link_model(b).bandwidth["network"] == pytest.approx(LINKS["network"] * 1e9)
    assert "--peak-tflops" in estimate_argv
    a = dataclasses.replace(a, preset="zeropp", hier_secondary_group_size=4)
    p = candidates.plan_of(a, 8, 4)
    compute = pj.ComputeModel(peak_flops=0.002e12, mfu=1.0, seq_length=64,
                              micro_batch_size=2, recompute=False)
    want = pj.step_time(p, candidates._model(a), links, compute)["step_s"]
    assert candidates.step_seconds(a, p, "none", 2) == pytest.approx(want)


@pytest.mark.parametrize("argv, says", [
    (["--network-model", "shared_uplink"], "needs --links"),
    (["--peak-tflops", "0"], "--peak-tflops=0 must be > 0"),
])
def test_the_estimates_new_flags_refuse_bad_input_in_one_line(argv, says, capsys):
    base = ["--nodes", "2", "--tasks-per-node", "4", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128",
            "--global-batch-size", "8"]
    assert estimate.main(base + argv) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--batches", "4x1,4x1"], ["--batches", "8x1"],
                                  ["--batches", "8x1,1x0"], ["--batches", "8,1"],
                                  ["--schemes", "lbp"], ["--schemes", "lbp,zero2"],
                                  ["--nodes", "1"], ["--ranks-per-node", "3"]])
def test_bad_flags_are_usage_errors(argv):
    with pytest.raises(SystemExit) as e:
        nc.parse(argv)
    assert e.value.code == 2


def test_gloo_reduce_scatters_cross_the_uplink_as_an_exchange():
    """The engine's reduce-scatter on gloo is an all-to-all exchange: a world group of 8 in
    nodes of 4 puts 4 members x 4 chunks of b/7 on each uplink (2.29 b), not a ring's b; the
    one-member-per-node peer groups cross as a ring does (4 groups x b). zeropp's two-hop qgZ
    crosses nodes in its second hop only, in pairs one rank per node: 4 pairs x b."""
    model = {"num_layers": 4, "hidden_size": 128, "vocab_size": 1024}
    assert pj.exchange_uplink_factor(8, 4, 4) == pytest.approx(16 / 7)
    assert pj.exchange_uplink_factor(2, 1, 4) == pj.groups_per_node(1, 4) == 4
    one_hop = pj.plan_for(model, 8, "zero3", 1, gpus_per_node=4, gcds_per_package=2)
    assert pj._uplink_multiplicity(one_hop, "grad_reduce") == pytest.approx(16 / 7)
    p = pj.plan_for(model, 8, "zeropp", 1, gpus_per_node=4, gcds_per_package=2)
    assert pj.phase_families(p, "grad_reduce") == ("secondary", "grad_cross")
    assert pj._uplink_multiplicity(p, "grad_reduce") == 4
    assert pj._uplink_multiplicity(p, "forward_gather") == 1   # gloo's all-gather: a ring


def test_the_projection_ranks_zeropp_lbp_then_the_rest_at_every_uplink_on_this_network():
    """What the slow test's projection says on this network
    (docs/testing.md#the-choice-against-measured-step-times): lbp puts 2.78 MB per step on the
    uplink (its step's inter reduce-scatter and all-gather); ZeRO++ (zeropp) 1.06 MB at one
    micro-batch and 1.78 MB at four (one int8 world gather per step, its hpZ copy serving the
    rest, and int4 gradients across nodes in pairs at every micro-batch); zero3, zero2 and
    hsdp more. Over every uplink
    from 0.8 to 800 Mbit/s the projection puts zeropp's step at or under lbp's and lbp's under
    every other preset's, at one micro-batch of 8 and at 4 of 1."""
    model = {"num_layers": nc.MODEL["layers"], "hidden_size": nc.MODEL["hidden"],
             "vocab_size": nc.MODEL["vocab"]}
    for b, k, zeropp_bytes in ((8, 1, 1.06e6), (1, 4, 1.78e6)):
        plans = {s: pj.plan_for(model, 8, s, k, gpus_per_node=4, gcds_per_package=2)
                 for s in ("lbp", "zeropp", "zero3", "zero2", "hsdp")}
        uplink = {s: sum(p.traffic_by_phase[ph]["network"] * pj._uplink_multiplicity(p, ph)
                         for ph in pj.PHASES) for s, p in plans.items()}
        assert uplink["lbp"] == pytest.approx(2.78e6, rel=0.01)
        assert uplink["zeropp"] == pytest.approx(zeropp_bytes, rel=0.01)
        compute = pj.ComputeModel(peak_flops=0.0006e12, mfu=1.0, seq_length=nc.MODEL["seq"],
                                  micro_batch_size=b)
        for i in range(301):
            links = pj.LinkModel.from_measured(
                {"package": 0.08e9, "node": 0.11e9, "network": 1e5 * 10 ** (i / 100)},
                network="shared_uplink")
            t = {s: pj.step_time(p, model, links, compute)["step_s"] for s, p in plans.items()}
            where = f"{b} x {k}, uplink {links.bandwidth['network'] * 8 / 1e6:.3g} Mbit/s: {t}"
            assert t["zeropp"] <= t["lbp"], where
            assert t["lbp"] < min(v for s, v in t.items() if s not in ("lbp", "zeropp")), where
