"""The link survey on the emulated network: does it recover the rate the uplinks are shaped to?

    flock /tmp/lbp-netns.lock python -m benchmarks survey-network [--json] [--rate-mbit 100]
        [--nodes 2] [--ranks-per-node 2] [--sizes-mib 0.25,1,4] [--reps 3] [--out FILE]

Builds the emulated nodes of ``bench network`` (benchmarks/netns.py: one namespace per node,
its veth uplink shaped with ``tc tbf`` each way), runs ``python -m megatron_lbp.launch
survey``'s code (megatron_lbp/launch/link_survey.run) on ranks inside them, and compares the
survey's cross-node tables with the configured rate.

What is compared: in the cross-node shape every rank of a node is in its own group (one rank
per node) and every group runs at once, so a node's uplink carries ``ranks_per_node`` ranks'
sends. The figure is the uplink's achieved rate at the table's largest size:
``ranks_per_node x`` the bytes one rank sends over the survey's median time (the table's own
point, what the collective model reads there, per-collective latency included); ``ratio`` is
that over the configured rate, and the survey recovers the network when every table's ratio
is within 20% of 1. Beside it, the marginal rate between the two largest sizes (the fixed
cost subtracted out; noisier) and the fixed cost it implies.

What the configured rate can give: tbf counts whole frames, so a TCP payload is 1448 of every
1514 bytes (0.956), less the other direction's ACKs sharing the tbf (~2%): about 0.93 of the
rate at best.

What takes it below that on a shared host: an emulated node shares this machine's cores with
every other process, where a real node has its own. Each rank's threads (the gloo loop that
feeds and drains the sockets, the worker that completes a collective, the thread that issues
the next) wait for a CPU at every wake-up, and so does the kernel's softirq work that its
ksoftirqd threads take over when the cores are busy (part of the link's packet handling);
a collective's time holds those waits. The ranks run at nice -10 (RANK_NICE); what waiting
remains is recorded per run: the ranks' threads' mean wait for a CPU per wake-up
(``config.rank_threads``, netns.threads_cpu_wait) and ksoftirqd's (``config.ksoftirqd``),
beside the other processes' share of the cores (``config.other_cpu``) and the tbf's drops
(``config.qdisc_stats_end``).

Needs root and iproute2; it stops in one line without them.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from benchmarks import cpu_share, netns
from megatron_lbp.projection import json_out

PROG = "python -m benchmarks survey-network"
RATE_MBIT = 100.0
SIZES_MIB = "0.25,1,4"
ALLOWED = 0.20
RANK_NICE = -10


def _log(line: str) -> None:
    print(f"[survey-network] {line}", file=sys.stderr, flush=True)


def survey_rank(ns_of_rank, master, out_path, tasks_per_node, sizes, reps, codec_elements=(),
                gemm_dim=1):
    """On one rank: join the emulated network, run the survey (no overlap probe; the codec
    probe at ``codec_elements``, none if empty, beside a layer of ``gemm_dim``); how long this
    rank's threads ran and waited for a CPU during it (netns.threads_cpu_wait)."""
    import torch

    from benchmarks.network import _join
    from megatron_lbp.launch import link_survey

    # An emulated node shares this machine's cores with every other process on it, where a real
    # node has its own: a rank waiting on the link is woken only after other processes' time
    # slices, and that wait lands in the collective's time (10-70% of it at 80% of the cores
    # taken by others). The ranks spend most of a survey waiting on the tbf, so running them
    # ahead of others costs those little CPU time and leaves the link in the figure.
    os.nice(RANK_NICE)
    _join(ns_of_rank, master)
    before = netns.threads_cpu_wait()
    data = link_survey.run(out_path=out_path, tasks_per_node=tasks_per_node,
                           gcds_per_package=min(2, tasks_per_node), sizes=sizes, reps=reps,
                           max_seconds=1e9, overlap_bytes=0, gemm_dim=gemm_dim,
                           codec_elements=codec_elements,
                           device=torch.device("cpu"),
                           log=_log if os.environ["RANK"] == "0" else (lambda line: None),
                           command="bench survey-network")
    import torch.distributed as dist

    dist.barrier()
    return netns.cpu_wait_between(before, netns.threads_cpu_wait())


def uplink_figures(survey: dict[str, Any], rate_mbit: float) -> list[dict[str, Any]]:
    """Per cross-node table: the uplink's achieved rate (slope and at the largest size) and its
    ratio to ``rate_mbit``."""
    rpn = survey["machine"]["tasks_per_node"]
    configured = rate_mbit * 1e6 / 8
    rows = []
    for t in survey["tables"]:
        if t["shape"] != "cross_node" or len(t["sent_bytes"]) < 2:
            continue
        (x0, x1), (y0, y1) = t["sent_bytes"][-2:], t["seconds"][-2:]
        slope = rpn * (x1 - x0) / (y1 - y0) if y1 > y0 else float("inf")
        whole = rpn * x1 / y1
        rows.append({"op": t["op"], "dtype": t["dtype"], "group_size": t["group_size"],
                     "largest_bytes": t["bytes"][-1], "uplink_B_per_s": whole,
                     "ratio": whole / configured, "uplink_B_per_s_marginal": slope,
                     "ratio_marginal": slope / configured,
                     "fixed_s": max(0.0, y1 - x1 * rpn / slope) if slope > 0 else 0.0})
    return rows


def run(args) -> dict[str, Any]:
    from benchmarks.network import _on_network
    from megatron_lbp.launch import link_survey

    sizes = link_survey.parse_sizes(args.sizes_mib)
    out_path = args.out or os.path.join(tempfile.mkdtemp(prefix="lbp-survey-net-"),
                                        "survey.json")
    cpu_start = cpu_share.snapshot()
    softirq_start = netns.softirq_threads()
    with netns.EmulatedNetwork(args.nodes, args.rate_mbit, burst_kb=args.burst_kb) as net:
        burst = net.burst_for(args.rate_mbit)
        args.package_rate_mbit = 0
        waits = _on_network(net, args, survey_rank, out_path, args.ranks_per_node, sizes,
                            args.reps, timeout=args.timeout)
        qdiscs = net.qdiscs(stats=True)
    from megatron_lbp.projection import survey_file

    survey = survey_file.read(out_path)
    rows = uplink_figures(survey, args.rate_mbit)
    config = {"cpus": len(os.sched_getaffinity(0))}
    cpu_share.record(config, cpu_start, config["cpus"])
    config["ksoftirqd"] = netns.cpu_wait_between(softirq_start, netns.softirq_threads())
    config["rank_threads"] = {k: sum(w[k] for w in waits) for k in ("run_s", "wait_s", "wakeups")}
    config["rank_threads"]["mean_wait_ms"] = (1e3 * config["rank_threads"]["wait_s"]
                                              / max(1, config["rank_threads"]["wakeups"]))
    return {"config": {**config, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
                       "rate_mbit": args.rate_mbit, "burst_kb": burst,
                       "sizes_mib": args.sizes_mib, "reps": args.reps, "survey": out_path,
                       "survey_seconds": survey["seconds"], "qdisc_stats_end": qdiscs},
            "cross_node": rows,
            "within": all(abs(r["ratio"] - 1) <= ALLOWED for r in rows)}


def render(out: dict[str, Any]) -> str:
    c = out["config"]
    lines = [f"link survey on {c['nodes']} emulated nodes x {c['ranks_per_node']} ranks, uplinks "
             f"shaped to {c['rate_mbit']:g} Mbit/s each way (tbf burst {c['burst_kb']} kB); "
             f"sizes {c['sizes_mib']} MiB, {c['reps']} reps; survey {c['survey_seconds']:.1f} s",
             f"  {'op':<16}{'dtype':<6}{'uplink MB/s':>12}{'/ rate':>8}{'marginal':>10}"
             f"{'/ rate':>8}{'fixed ms':>10}"]
    for r in out["cross_node"]:
        lines.append(f"  {r['op']:<16}{r['dtype']:<6}{r['uplink_B_per_s'] / 1e6:>12.2f}"
                     f"{r['ratio']:>8.2f}{r['uplink_B_per_s_marginal'] / 1e6:>10.2f}"
                     f"{r['ratio_marginal']:>8.2f}{r['fixed_s'] * 1e3:>10.1f}")
    lo, hi = min(r["ratio"] for r in out["cross_node"]), max(r["ratio"] for r in out["cross_node"])
    k, t = c.get("ksoftirqd"), c.get("rank_threads")
    lines.append(f"cross-node figures {lo:.2f}-{hi:.2f} of the configured rate; within "
                 f"{ALLOWED:.0%}: {'yes' if out['within'] else 'NO'}"
                 + cpu_share.clause(c.get("other_cpu"))
                 + (f"; the ranks' threads waited {t['mean_wait_ms']:.2f} ms for a CPU per "
                    f"wake-up ({t['wakeups']} wake-ups)" if t else "")
                 + (f", the kernel's softirq threads {k['mean_wait_ms']:.1f} ms "
                    f"({k['wakeups']})" if k else ""))
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{PROG}: error: {message}\n")


def parse(argv) -> argparse.Namespace:
    p = _Parser(prog=PROG, description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate-mbit", type=float, default=RATE_MBIT)
    p.add_argument("--burst-kb", type=int, default=None,
                   help="the tbf's bucket (default: benchmarks/netns.py's, 5 ms of the rate)")
    p.add_argument("--sizes-mib", default=SIZES_MIB)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=None, metavar="FILE", help="keep the survey file here")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.nodes < 2 or a.ranks_per_node < 1 or a.reps < 1 or not a.rate_mbit > 0 \
            or (a.burst_kb is not None and a.burst_kb < 1):
        p.error(f"--nodes={a.nodes} must be >= 2, --ranks-per-node={a.ranks_per_node} and "
                f"--reps={a.reps} >= 1, --rate-mbit={a.rate_mbit:g} and --burst-kb > 0")
    if a.ranks_per_node > 1 and a.ranks_per_node % 2:
        p.error(f"--ranks-per-node={a.ranks_per_node} must be 1 or even (packages of 2)")
    from megatron_lbp.launch import link_survey

    try:
        link_survey.parse_sizes(a.sizes_mib)
    except link_survey.SurveyUsage as e:
        p.error(str(e))
    return a


def main(argv=None) -> int:
    args = parse(argv)
    return netns.command_main(
        PROG, lambda: run(args),
        lambda out: json_out.emit(out) if args.json else print(render(out)))


if __name__ == "__main__":
    sys.exit(main())
