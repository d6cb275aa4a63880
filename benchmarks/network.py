"""Step time of every scheme on an emulated, bandwidth-limited network, and the model's prediction.

Each emulated node is a Linux network namespace (benchmarks.netns)
whose uplink is a veth pair to a shared bridge, shaped with ``tc tbf`` in both
directions; all ranks of a node live in its namespace, so traffic inside a
node goes over its (unshaped) loopback and traffic between nodes through the
shaped uplink. gloo runs over TCP on the uplink addresses.

Every scheme trains the same GPT (megatron-core, bf16, larger than the test
default so that collectives are megabytes) on the same rank processes, set up
side by side and stepped in turns: round r runs one step of every scheme
(order rotated each round), then the link timings and the compute timing
below, so load from other processes on the machine falls on all of them alike.
Steps are timed from a barrier to a barrier (rank 0's figures); rounds before
the warm-up count are dropped; a scheme's step time is the median, also given
as a ratio to lbp's (scheme / lbp: above 1 means lbp is faster).

Calibration, from timings in the same rounds (the slowest rank's, median over
rounds): all-gathers (bf16) and reduce-scatters (fp32) of a few sizes over the
patterns the schemes use, the whole world and the node-to-node peer groups
across the uplinks, the node groups on loopback, give one bandwidth and
latency per link class (project.fit_link; package and node are both
loopback). The network is one shared uplink per node, so it is fitted and
modelled on the bytes crossing that uplink (project.fit_uplink,
LinkModel(network="shared_uplink")), not on the bytes each rank sends.
Compute is timed without any communication: every rank runs the
forward+backward of the micro-batches and Adam on a 1/W shard at once.
project.step_time (the model that projects Frontier) then predicts each
scheme's step from the plan tool's traffic for this topology; stock Megatron
is modelled by the engine preset with the same traffic (megatron-distopt as
zero2, megatron-fsdp as zero3; see ``bench traffic``). Nothing else is fitted.

Per scheme, beside the step (benchmarks.network_exposure): the compute
alone (the same GPT as a plain module, no collective), the link time of the
scheme's own step collectives timed alone (recorded in a warm-up round,
replayed back to back in every kept round: benchmarks.link_replay),
the exposed communication (step - compute alone) and its share of the link
time, and for engine schemes what their schedule trace (``--hier-trace``) says
the rank waited on, per phase. ``--model frontier-shaped`` scales 20B's
proportions down (full recomputation, 2 micro-batches) and sets the uplink at
Frontier's compute-to-network ratio from public figures, measuring the
compute first (benchmarks.network_shape); the derivation is printed.

    python -m benchmarks network [--json] [--model default|frontier-shaped]
        [--nodes 2] [--ranks-per-node 4] [--rate-mbit 400] [--schemes lbp,zero3,...]
        [--steps 4] [--hidden 256] [--trace-dir DIR] ...
    python -m benchmarks network --package-rate-mbit 1600   # + a package tier
    python -m benchmarks network --sweep     # only remove stale lbpn-* namespaces

Needs root and iproute2 (``ip``, ``tc``). Everything it creates is removed on
exit, on errors, on Ctrl-C and on SIGTERM; a run that was SIGKILLed leaves
namespaces that the next run (or ``--sweep``) removes.
"""
from __future__ import annotations
from megatron_lbp.projection import json_out

import argparse
import contextlib
import functools
import glob
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from benchmarks import cpu_share, netns, network_shape
from megatron_lbp.engine.dist_api import all_gather_single
from megatron_lbp.projection.schemes import (DISTOPT, DS_SCHEMES, ENGINE_SCHEMES, FSDP,
                                             GCDS_PER_PACKAGE,
                                             MODELLED_AS, STOCK_SCHEMES, engine_argv,
                                             schemes_from)

# DeepSpeed's schemes train the same GPT on the same batches in the same ranks, stepped in
# the same rounds.
SCHEMES = ("lbp", "zeropp", "zero3", "zero2", "hsdp") + STOCK_SCHEMES + DS_SCHEMES
LINK_SIZES_MB = (1.0, 4.0)
# 50 MB/s per node each way = 12.5 MB/s per rank when all 4 ranks of a node send
# across (Frontier's per-GCD figure in MB instead of GB); loopback gives each
# rank ~100-200 MB/s at these sizes on the 2-core machine (node : network
# ~ 8-16 : 1). Faster uplinks stop being the bottleneck: the 2 cores' TCP
# stack, not the tbf, then limits what crosses (measured at 800 Mbit/s).
RATE_MBIT = 400.0


# --------------------------------------------------------------------------- rank side


def _join(ns_of_rank: list[str], master: str) -> None:
    """Enter this rank's node namespace, then bring up gloo over the uplink addresses."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    netns.enter(ns_of_rank[rank])
    dist.init_process_group(backend="gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            init_method=f"tcp://{master}:{os.environ['MASTER_PORT']}")


def _trainer(scheme: str, spec, train, ranks_per_node: int, trace_dir: str | None):
    from benchmarks.traffic import setup_fsdp
    from megatron_lbp.testing.tiny_gpt import setup_hier, setup_stock

    if scheme == DISTOPT:
        return setup_stock(spec, train)
    if scheme == FSDP:
        return setup_fsdp(spec, train)
    if scheme in DS_SCHEMES:
        from megatron_lbp.deepspeed_baseline.trainer import setup_deepspeed

        return setup_deepspeed(spec, train, scheme, ranks_per_node=ranks_per_node)
    trace = ["--hier-trace", trace_path(trace_dir, scheme)] if trace_dir else []
    return setup_hier(spec, train, engine_argv(scheme, ranks_per_node, *trace))


def trace_path(trace_dir: str, scheme: str) -> str:
    """Where an engine scheme's ranks write their schedule trace (one file per rank)."""
    return os.path.join(trace_dir, f"{scheme}-trace-{{rank}}.jsonl")


def _link_ops(ranks_per_node: int, sizes_mb, tiered: bool = False):
    """Timed collectives (pattern, op, n, bytes charged, callable) on this rank's groups.

    Patterns: "world" (all ranks, across the uplinks), "peers" (rank i of every
    node; all such groups at once: the inter-node hop of lbp and hsdp), "node"
    (the ranks of one node on loopback, every node at once). All-gathers in
    bf16, reduce-scatters in fp32 (as the schemes issue them, on gloo as the engine's
    exchange: megatron_lbp.engine.comm.exchange_reduce_scatter); bytes are what
    the engine's ledger charges a rank: (n-1)/n of the full buffer.
    """
    import torch
    import torch.distributed as dist

    from megatron_lbp.engine.comm import exchange_reduce_scatter, reduce_scatter_by_exchange

    reduce_scatter = (reduce_scatter_by_exchange if exchange_reduce_scatter(dist.get_backend())
                      else dist.reduce_scatter_tensor)
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = world // ranks_per_node
    node_groups = [dist.new_group(list(range(i * ranks_per_node, (i + 1) * ranks_per_node)))
                   for i in range(nodes)]
    peer_groups = [dist.new_group(list(range(i, world, ranks_per_node)))
                   for i in range(ranks_per_node)]
    patterns = {"world": (None, world), "peers": (peer_groups[rank % ranks_per_node], nodes),
                "node": (node_groups[rank // ranks_per_node], ranks_per_node)}
    if tiered:  # the two ranks of a package on their loopback, every package at once
        pkg = GCDS_PER_PACKAGE
        package_groups = [dist.new_group(list(range(i, i + pkg))) for i in range(0, world, pkg)]
        patterns["package"] = (package_groups[rank // pkg], pkg)
    ops = []
    for name, (group, n) in patterns.items():
        for mb in sizes_mb:
            numel = max(n, int(mb * 2 ** 20) // 4 // n * n)
            gathered = torch.empty(numel, dtype=torch.bfloat16)
            shard = torch.ones(numel // n, dtype=torch.bfloat16)
            full = torch.ones(numel, dtype=torch.float32)
            part = torch.empty(numel // n, dtype=torch.float32)
            ops.append((name, "all_gather", n, 2 * numel * (n - 1) / n, functools.partial(
                all_gather_single(), gathered, shard, group=group)))
            # Timed as the engine issues it: on gloo an exchange (engine/comm.py).
            ops.append((name, "reduce_scatter", n, 4 * numel * (n - 1) / n, functools.partial(
                reduce_scatter, part, full, group=group, async_op=False)))
    return ops


def compute_ops(spec, train, adam_elements):
    """Forward+backward of the micro-batches, and Adam on a 1/W shard: no communication at all."""
    import torch

    from megatron_lbp.testing import tiny_gpt

    model, _ = tiny_gpt.build_tiny_gpt(spec)
    rows = train.micro_batch_size

    def fwd_bwd(step):
        for micro in range(train.micro_batches):
            tokens = tiny_gpt.global_batch(step, micro, spec, train, 1)[:rows]
            (tiny_gpt.forward_loss(model, tokens) / train.micro_batches).backward()

    shard = torch.zeros(int(adam_elements), dtype=torch.float32, requires_grad=True)
    shard.grad = torch.ones_like(shard)
    adam = torch.optim.Adam([shard], lr=1e-4)
    return fwd_bwd, adam.step


def _landed(trainer) -> None:
    """Wait until the step's collectives still in flight have run (an engine scheme runs its
    collectives on stream workers after issuing them: the recorder sees a call when it
    runs, so without this each rank would record the step's last ones, or the step
    before's, as its timing fell, and the replay would deadlock)."""
    settle = getattr(getattr(trainer, "model", None), "settle", None)
    if settle is not None:
        settle()


def rank_bench(ns_of_rank, master, schemes, spec, train, warmup, ranks_per_node, sizes_mb,
               adam_elements, tiered=False, trace_dir=None):
    """Every scheme, the link collectives and the compute, interleaved step by step on this rank.

    Round r runs one training step of every scheme (order rotated by r), each
    timed collective once, each scheme's own step collectives alone
    (link_replay: recorded in the last warm-up round, or the first round
    without warm-up) and the compute once, so that load from other processes
    on the machine falls on all of them alike. Rounds before ``warmup`` are
    not kept. Returns seconds per kept round for each.
    """
    import torch.distributed as dist

    from benchmarks import link_replay

    _join(ns_of_rank, master)
    trainers = {s: _trainer(s, spec, train, ranks_per_node, trace_dir) for s in schemes}
    results = dict.fromkeys(schemes)
    links = _link_ops(ranks_per_node, sizes_mb, tiered)
    fwd_bwd, adam_step = compute_ops(spec, train, adam_elements)
    out = {"step_s": {s: [] for s in schemes}, "link_s": [[] for _ in links],
           "replay_s": {s: [] for s in schemes}, "fwd_bwd_s": [], "adam_s": []}
    record_round = max(warmup - 1, 0)
    calls: dict[str, list] = {}
    replays: dict[str, link_replay.Replay] = {}

    def timed(fn, *a, until_all_done=False):
        dist.barrier()
        t0 = time.perf_counter()
        value = fn(*a)
        if until_all_done:
            dist.barrier()
        return time.perf_counter() - t0, value

    for step in range(train.steps):
        keep = step >= warmup
        shift = step % len(schemes)
        order = schemes[shift:] + schemes[:shift]
        for s in order:
            if step == record_round:
                # DeepSpeed calls the collectives it bound at start-up: make it call the recorder
                visible = getattr(trainers[s], "collectives_visible", contextlib.nullcontext)
                _landed(trainers[s])
                with link_replay.recording() as calls[s], visible():
                    t, results[s] = timed(trainers[s].run, [step], None, results[s],
                                          until_all_done=True)
                    _landed(trainers[s])
            else:
                t, results[s] = timed(trainers[s].run, [step], None, results[s],
                                      until_all_done=True)
            if keep:
                out["step_s"][s].append(t)
        if step == record_round:
            replays = {s: link_replay.Replay(calls[s]) for s in schemes}
        if keep:
            for s in order:  # each scheme's step collectives alone, all ranks done
                t, _ = timed(replays[s], until_all_done=True)
                out["replay_s"][s].append(t)
        # Collectives and compute: this rank's own finish; the driver takes the slowest rank.
        for i, (*_, op) in enumerate(links):
            t, _ = timed(op)
            if keep:
                out["link_s"][i].append(t)
        t, _ = timed(fwd_bwd, step)
        t_adam, _ = timed(adam_step)
        if keep:
            out["fwd_bwd_s"].append(t)
            out["adam_s"].append(t_adam)
    out["losses"] = {s: results[s].losses for s in schemes}
    out["links"] = [link[:4] for link in links]
    out["replayed_collectives"] = {s: r.count for s, r in replays.items()}
    return out


# --------------------------------------------------------------------------- driver


def _specs(args):
    import torch

    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec

    spec = TinyGPTSpec(num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, vocab_size=args.vocab,
                       seq_length=args.seq, params_dtype=torch.bfloat16,
                       recompute=args.recompute,
                       recompute_modules=tuple(getattr(args, "recompute_modules", ())))
    train = TrainSpec(steps=args.warmup + args.steps, micro_batch_size=args.micro_batch_size,
                      micro_batches=args.micro_batches)
    return spec, train


def _model(args) -> dict[str, int]:
    return {"num_layers": args.layers, "hidden_size": args.hidden, "vocab_size": args.vocab}


def _plans(args, schemes) -> dict[str, Any]:
    from megatron_lbp.projection.project import plan_for

    world = args.nodes * args.ranks_per_node
    return {s: plan_for(_model(args), world, MODELLED_AS.get(s, s), args.micro_batches,
                        gpus_per_node=args.ranks_per_node, gcds_per_package=GCDS_PER_PACKAGE)
            for s in schemes}


def _on_network(net, args, fn, *fn_args, timeout):
    from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks

    world = args.nodes * args.ranks_per_node
    rpn = args.ranks_per_node
    ns_of_rank = [net.place(r // rpn, (r % rpn) // GCDS_PER_PACKAGE) for r in range(world)]
    return run_on_ranks(fn, world, ns_of_rank, net.address(0), *fn_args, timeout=timeout,
                        # rank 0 hosts the store inside its node's namespace (a free port there)
                        init_process_group=False, host_store=False,
                        env={"MASTER_ADDR": net.address(0), "GLOO_SOCKET_IFNAME": netns.UPLINK},
                        rank_env=rank_location_env(args.ranks_per_node))


def _fit_links(samples, ranks_per_node: int, tiered: bool = False) -> dict[str, Any]:
    """Bandwidth and latency per link class; the network's as one node's shared uplink.

    Every node has one uplink, so the network is fitted on the bytes crossing
    it (project.fit_uplink: the world group's ring crosses once, the
    ranks_per_node peer groups once each); the per-rank fits (bytes one rank
    sends) are kept beside it to show what the uplink rule reconciles.
    """
    from megatron_lbp.projection.project import fit_link, fit_uplink

    out: dict[str, Any] = {"samples": [dict(zip(("pattern", "op", "n", "bytes", "s"), s))
                                       for s in samples]}
    in_node = {"world": ranks_per_node, "peers": 1}  # members of one group in one node
    net = ("world", "peers")
    bw, lat = fit_uplink([(b, n, in_node[p], t) for p, _, n, b, t in samples if p in net],
                         ranks_per_node)
    out["network"] = {"bandwidth_MB_per_s": bw / 1e6, "latency_us": lat * 1e6,
                      "fitted_on": list(net), "per": "node uplink, each way"}
    for p in net:
        ubw, ulat = fit_uplink([(b, n, in_node[p], t) for q, _, n, b, t in samples if q == p],
                               ranks_per_node)
        pbw, plat = fit_link([(b, n, t) for q, _, n, b, t in samples if q == p])
        out["network"][f"{p}_only"] = {"bandwidth_MB_per_s": ubw / 1e6, "latency_us": ulat * 1e6,
                                       "per_rank_bandwidth_MB_per_s": pbw / 1e6,
                                       "per_rank_latency_us": plat * 1e6}
    pbw, plat = fit_link([(b, n, t) for p, _, n, b, t in samples if p in net])
    out["network"]["per_rank"] = {"bandwidth_MB_per_s": pbw / 1e6, "latency_us": plat * 1e6}
    classes = [("node", ("node",)), ("package", ("package",))] if tiered else [
        ("loopback", ("node",))]
    for cls, patterns in classes:
        bw, lat = fit_link([(b, n, t) for p, _, n, b, t in samples if p in patterns])
        out[cls] = {"bandwidth_MB_per_s": bw / 1e6, "latency_us": lat * 1e6,
                    "fitted_on": list(patterns), "per": "rank"}
    return out


def _calibration(args, measured, links_fit, compute_meas) -> dict[str, Any]:
    """The run's fit (links and compute as the cost model takes them), then predict() from it."""
    from megatron_lbp.projection import project as pj

    ref_plan = _plans(args, ["lbp"])["lbp"]
    world = args.nodes * args.ranks_per_node
    tiered = "package" in links_fit
    fitted = {"package": links_fit["package" if tiered else "loopback"],
              "node": links_fit["node" if tiered else "loopback"],
              "network": links_fit["network"]}
    links = pj.LinkModel.from_measured(
        {c: f["bandwidth_MB_per_s"] * 1e6 for c, f in fitted.items()},
        {c: f["latency_us"] * 1e-6 for c, f in fitted.items()}, network="shared_uplink")
    compute = pj.compute_from_measured(
        _model(args), ref_plan.params, args.seq, args.micro_batch_size,
        compute_meas["fwd_bwd_s"] / args.micro_batches, compute_meas["adam_s"],
        ref_plan.padded_params / world)
    return predict(args, measured, {
        "links": {k: v for k, v in links_fit.items() if k != "samples"},
        "link_samples": links_fit["samples"],
        "model_links_MB_per_s": {c: links.bandwidth[c] / 1e6 for c in links.bandwidth},
        "network_model": links.network,
        "model_latency_us": {c: links.latency[c] * 1e6 for c in links.latency},
        "compute_measured": compute_meas,
        "compute_model": asdict(compute),
        "tolerance": 0.2,
        "notes": ("package: a package's loopback, node: the shaped package links, "
                  if tiered else "package and node links are both the namespace's loopback; ")
                 + "network: one node's shared uplink, each way (a collective costs the "
                 "bytes crossing it: per-rank bytes x groups of its family in the node); "
                 "only link bandwidth/latency and compute time are fitted",
    })


# What predict() reads from a fit; the rest of the fit is record (benchmarks.recalibrate checks
# a stored one for these before it predicts again).
PREDICTED_FROM = ("model_links_MB_per_s", "model_latency_us", "network_model", "compute_model",
                  "tolerance")


def predict(args, measured: dict[str, float], fit: dict[str, Any]) -> dict[str, Any]:
    """Every scheme's calibration entry, and ``fit`` with the plans' figures, from the fit alone.

    The prediction reads only the fit's PREDICTED_FROM and the plans of
    ``args``'s topology, so that the report can make it again from a stored run
    with the cost model of the report's day (benchmarks.recalibrate); the run
    comes here too, so both are one computation.
    """
    from megatron_lbp.projection import project as pj

    links = pj.LinkModel.from_measured(
        {c: mb * 1e6 for c, mb in fit["model_links_MB_per_s"].items()},
        {c: us * 1e-6 for c, us in fit["model_latency_us"].items()},
        network=fit["network_model"])
    compute = pj.ComputeModel(**fit["compute_model"])
    plans = _plans(args, list(measured))
    per_scheme = pj.calibrate(measured, plans, _model(args), links, compute,
                              tolerance=fit["tolerance"])
    return {**per_scheme, "fit": {
        **fit,
        "modelled_as": {s: MODELLED_AS.get(s, s) for s in measured},
        "buckets": {s: p.buckets for s, p in plans.items()},
        "network_bytes_per_rank": {s: p.traffic_bytes["network"] for s, p in plans.items()},
    }}


def run(args) -> dict[str, Any]:
    """``--runs`` multi-rank runs of rank_bench (first scheme rotated); medians over all rounds."""
    from benchmarks import network_exposure as nx
    from benchmarks import network_shape

    cpu_start = cpu_share.snapshot()
    spec, train = _specs(args)
    world = args.nodes * args.ranks_per_node
    adam_elements = _plans(args, ["lbp"])["lbp"].padded_params / world
    out: dict[str, Any] = {"config": config(args), "schemes": {}, "calibration": {}}
    derived = args.rate_mbit is None  # frontier-shaped: at Frontier's compute/network ratio
    steps = {s: [] for s in args.schemes}
    replay_s = {s: [] for s in args.schemes}
    link_s: list[list[float]] = []
    fwd_bwd: list[float] = []
    adam: list[float] = []
    tiered = args.package_rate_mbit > 0
    packages = args.ranks_per_node // GCDS_PER_PACKAGE if tiered else 0
    trace_root = args.trace_dir or tempfile.mkdtemp(prefix="lbp-network-trace-")
    trace_dirs = [os.path.join(trace_root, f"run{r + 1}") for r in range(args.runs)]
    for d in trace_dirs:
        os.makedirs(d, exist_ok=True)
        for f in glob.glob(os.path.join(d, "*-trace-*.jsonl")):
            os.remove(f)  # the trace appends: start from nothing
    with netns.EmulatedNetwork(args.nodes, network_shape.PROBE_RATE_MBIT if derived
                               else args.rate_mbit, packages=packages,
                               package_rate_mbit=args.package_rate_mbit,
                               delay_ms=args.delay_ms) as net:
        if derived:
            derivation = network_shape.derive(args, net, spec, train, _on_network,
                                              lambda line: _progress(args, line))
            args.rate_mbit = derivation["rate_mbit"]
            net.set_rate(args.rate_mbit)
            out["config"].update(rate_derivation=derivation, uplink_rate_mbit=args.rate_mbit,
                                 uplink_rate_MB_per_s=args.rate_mbit / 8)
            for line in network_shape.derivation_lines(derivation):
                _progress(args, line)
        out["config"]["qdiscs"] = net.qdiscs()
        for run_ in range(args.runs):
            shift = run_ % len(args.schemes)
            order = args.schemes[shift:] + args.schemes[:shift]
            per_rank = _on_network(net, args, rank_bench, order, spec, train, args.warmup,
                                   args.ranks_per_node, args.link_sizes_mb, adam_elements,
                                   tiered, trace_dirs[run_], timeout=args.timeout)
            first = per_rank[0]
            for s in args.schemes:
                steps[s] += first["step_s"][s]
                replay_s[s] += first["replay_s"][s]
            # Collectives and compute end with their slowest rank.
            slowest = [[max(r["link_s"][i][k] for r in per_rank) for k in range(args.steps)]
                       for i in range(len(first["links"]))]
            link_s = [old + new for old, new in zip(link_s, slowest)] if link_s else slowest
            fwd_bwd += [max(r["fwd_bwd_s"][k] for r in per_rank) for k in range(args.steps)]
            adam += [max(r["adam_s"][k] for r in per_rank) for k in range(args.steps)]
            losses = first["losses"]
            _progress(args, f"run {run_ + 1}/{args.runs}: " + ", ".join(
                f"{s} {statistics.median(first['step_s'][s]):.3f}" for s in args.schemes)
                + " s/step (medians)")
        # Drops would mean retransmissions, i.e. TCP timers, not the rate, in the step times.
        out["config"]["qdisc_stats_end"] = net.qdiscs(stats=True)
    compute_meas = {"fwd_bwd_s": statistics.median(fwd_bwd), "adam_s": statistics.median(adam)}
    compute_s = compute_meas["fwd_bwd_s"] + compute_meas["adam_s"]
    kept = range(args.warmup + 1, args.warmup + args.steps + 1)  # optimizer steps count from 1
    for scheme in args.schemes:
        row = out["schemes"][scheme] = {"step_s": steps[scheme],
                                        "median_s": statistics.median(steps[scheme]),
                                        "losses": losses[scheme],
                                        "link_replay_s": replay_s[scheme],
                                        "replayed_collectives":
                                            first["replayed_collectives"][scheme]}
        row.update(nx.figures(row["median_s"], compute_s, statistics.median(replay_s[scheme])))
        if scheme in ENGINE_SCHEMES:
            row["trace"] = nx.trace_summary([trace_path(d, scheme) for d in trace_dirs], kept)
    out["config"]["compute_alone"] = nx.compute_alone_text(
        args.recompute or bool(getattr(args, "recompute_modules", ())))
    out["config"]["trace_dir"] = trace_root if args.trace_dir else None
    if not args.trace_dir:
        shutil.rmtree(trace_root, ignore_errors=True)
    lbp = out["schemes"]["lbp"]["median_s"]
    for row in out["schemes"].values():
        row["ratio_to_lbp"] = row["median_s"] / lbp
    out["explained"] = [nx.explain(s, r) for s, r in out["schemes"].items()]
    samples = [tuple(link) + (statistics.median(ts),) for link, ts in zip(first["links"], link_s)]
    measured = {s: r["median_s"] for s, r in out["schemes"].items()}
    out["calibration"] = _calibration(args, measured,
                                      _fit_links(samples, args.ranks_per_node, tiered),
                                      compute_meas)
    zero3 = out["schemes"].get("zero3")
    if derived and zero3:
        # What the derived rate gave: zero3's own collectives alone over the compute alone.
        out["config"]["rate_derivation"]["achieved_ratio"] = \
            zero3["link_s"] / compute_meas["fwd_bwd_s"]
    out["config"]["loadavg_end"] = list(os.getloadavg())
    cpu_share.record(out["config"], cpu_start, out["config"]["cpus"])
    return out


def config(args) -> dict[str, Any]:
    import megatron.core
    import torch

    world = args.nodes * args.ranks_per_node
    plan = _plans(args, ["lbp"])["lbp"]
    return {
        "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "world_size": world,
        "packages": (f"{GCDS_PER_PACKAGE} ranks each, one namespace per package, joined to "
                     f"their node's bridge by veths shaped to {args.package_rate_mbit} Mbit/s "
                     f"each way" if args.package_rate_mbit > 0 else
                     f"{GCDS_PER_PACKAGE} ranks each (no separate package tier: loopback)"),
        "package_rate_mbit": args.package_rate_mbit,
        "uplink_rate_mbit": args.rate_mbit,
        "uplink_rate_MB_per_s": None if args.rate_mbit is None else args.rate_mbit / 8,
        "uplink_shaping": "tc tbf on both ends of each node's veth (both directions), "
                          "bucket 5 ms of the rate (4-64 kB), queue 200 ms",
        "delay_ms": args.delay_ms,
        "intra_node": ("loopback inside a package's namespace (unshaped), package links "
                       "between packages" if args.package_rate_mbit > 0 else
                       "loopback inside the node's namespace, unshaped"),
        "model_name": args.model,
        "model": {"num_layers": args.layers, "hidden_size": args.hidden,
                  "num_attention_heads": args.heads, "vocab_size": args.vocab,
                  "seq_length": args.seq, "params": plan.params, "dtype": "bf16",
                  "grad_reduce": "fp32", "recompute": getattr(args, "recompute_mode", "full" if args.recompute else "none"),
                  "units": plan.units},
        "micro_batch_size": args.micro_batch_size, "micro_batches": args.micro_batches,
        "warmup_steps": args.warmup, "timed_steps": args.steps, "schemes": list(args.schemes),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "megatron_core": megatron.core.__version__, "kernel": platform.release()},
        "runs": args.runs, "cpus": len(os.sched_getaffinity(0)),
        "loadavg_start": list(os.getloadavg()),
    }


def _progress(args, line: str) -> None:
    print(f"[network] {line}", file=sys.stderr if args.json else sys.stdout, flush=True)


def render(out: dict[str, Any]) -> str:
    from benchmarks import network_exposure, network_shape

    c = out["config"]
    m = c["model"]
    lines = [
        f"emulated network: {c['nodes']} nodes x {c['ranks_per_node']} ranks (gloo/TCP), "
        f"uplink {c['uplink_rate_mbit']:.1f} Mbit/s = {c['uplink_rate_MB_per_s']:.2f} MB/s per "
        f"node each way ({c['uplink_shaping']}), delay {c['delay_ms']} ms; {c['intra_node']}",
        f"model {c['model_name']}: GPT {m['num_layers']} layers, hidden {m['hidden_size']}, heads "
        f"{m['num_attention_heads']}, vocab {m['vocab_size']}, seq {m['seq_length']}, "
        f"{m['params']:,} parameters, bf16, fp32 grad reduction, recomputation "
        f"{m['recompute']}; micro-batch {c['micro_batch_size']} x {c['micro_batches']}; "
        f"{c['warmup_steps']} warm-up + {c['timed_steps']} timed steps per run, {c['runs']} "
        f"run(s); load average {c['loadavg_start'][0]:.1f} at start, "
        f"{c['loadavg_end'][0]:.1f} at the end{cpu_share.clause(c.get('other_cpu'))}",
        f"versions: {json.dumps(c['versions'])}; {c['cpus']} CPUs",
        *([f"WARNING: {c['load_warning']}"] if c.get("load_warning") else []),
        *(network_shape.derivation_lines(c["rate_derivation"])
          + ([f"  in the run: zero3's collectives alone / compute alone = "
              f"{c['rate_derivation']['achieved_ratio']:.3f}"]
             if "achieved_ratio" in c["rate_derivation"] else [])
          if c.get("rate_derivation") else []),
        "",
        f"compute alone: {c['compute_alone']}; link: each scheme's step collectives timed "
        f"alone; exposed = median - compute alone; trace waits: the engine's schedule trace, "
        f"time the rank waited on collectives (at once: no compute since the issue; ahead: "
        f"issued ahead of compute shorter than its link time)",
        *network_exposure.render_table(out["schemes"]),
        *(f"  {line}" for line in out.get("explained", [])),
        "",
        f"  {'scheme':<18}{'median s/step':>14}{'/ lbp':>8}{'pred / lbp':>12}{'error':>8}"
        "  within 20%",
    ]
    cal = out["calibration"]
    for s, r in out["schemes"].items():
        k = cal.get(s, {})
        lines.append(f"  {s:<18}{r['median_s']:>14.3f}{r['ratio_to_lbp']:>8.2f}"
                     f"{k.get('predicted_ratio', float('nan')):>12.2f}"
                     f"{100 * k.get('rel_error', float('nan')):>7.1f}%  "
                     f"{'yes' if k.get('within_20pct') else 'NO'}")
    fit = cal.get("fit", {})
    if fit:
        lk = fit["links"]
        lines.append("")
        net = lk["network"]
        lines.append(
            f"fitted links: network {net['bandwidth_MB_per_s']:.1f} MB/s per node uplink, "
            f"{net['latency_us']:.0f} us (world-only {net['world_only']['bandwidth_MB_per_s']:.1f}"
            f", peers-only {net['peers_only']['bandwidth_MB_per_s']:.1f} MB/s; per rank: world "
            f"{net['world_only']['per_rank_bandwidth_MB_per_s']:.1f}, peers "
            f"{net['peers_only']['per_rank_bandwidth_MB_per_s']:.1f}); " + "; ".join(
                f"{c} {lk[c]['bandwidth_MB_per_s']:.1f} MB/s per rank, "
                f"{lk[c]['latency_us']:.0f} us" for c in ("node", "package", "loopback")
                if c in lk))
        cm = fit["compute_measured"]
        lines.append(f"measured compute (all ranks at once, no comm): fwd+bwd "
                     f"{cm['fwd_bwd_s']:.3f} s per step, Adam on 1/W {cm['adam_s']:.4f} s; "
                     f"stock schemes modelled as {json.dumps(fit['modelled_as'])}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        self.exit(2, f"python -m benchmarks network: error: {message}\n")


def _sizes(text: str) -> tuple[float, ...]:
    sizes = tuple(float(x) for x in text.split(",") if x)
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(text)
    return sizes


def parse(argv) -> argparse.Namespace:
    p = _Parser(prog="python -m benchmarks network", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=network_shape.MODELS, default="default",
                   help="default: the 4-layer GPT at 400 Mbit/s; frontier-shaped: 20B's "
                        "proportions scaled down, full recomputation, 2 micro-batches, the "
                        "uplink derived from zero3's network/compute on Frontier")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4, help="even (packages of 2)")
    p.add_argument("--rate-mbit", type=float, default=None,
                   help=f"each node's uplink, Mbit/s each way (default: {RATE_MBIT:g} = "
                        f"{RATE_MBIT / 8:g} MB/s for the default model, derived for "
                        f"frontier-shaped)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per uplink end")
    p.add_argument("--package-rate-mbit", type=float, default=0.0,
                   help="second tier: each package of 2 ranks its own namespace, joined to its "
                        "node by a link of this rate each way (default 0: off, a node's ranks "
                        "share its loopback)")
    p.add_argument("--schemes", default=None,
                   help=f"comma-separated subset of {','.join(SCHEMES)} (lbp is always run; "
                        f"default all, {','.join(network_shape.FRONTIER_SCHEMES)} for "
                        f"frontier-shaped)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per scheme")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--runs", type=int, default=1,
                   help="separate multi-rank runs (starting scheme rotated); medians over all")
    shape = p.add_argument_group("model shape (defaults per --model; frontier-shaped derives "
                                 "--seq and --vocab from --hidden)")
    for flag in ("layers", "hidden", "heads", "vocab", "seq", "micro-batch-size",
                 "micro-batches"):
        shape.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--recompute", dest="recompute_mode", choices=("none", "selective", "full"),
                   default=None, help="activation recomputation (default: none for the default "
                                      "model, full for frontier-shaped)")
    p.add_argument("--trace-dir", default=None,
                   help="keep the engine schemes' schedule traces here (run<N>/<scheme>-trace-"
                        "<rank>.jsonl; default: a temporary directory, removed)")
    p.add_argument("--link-sizes-mb", default=",".join(map(str, LINK_SIZES_MB)),
                   help="buffer sizes (MB, fp32) of the timed link collectives")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per multi-rank run")
    p.add_argument("--sweep", action="store_true",
                   help="only remove namespaces left by runs that no longer exist")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    network_shape.fill_model(args)
    if args.schemes is None:
        args.schemes = ",".join(network_shape.FRONTIER_SCHEMES if args.model == "frontier-shaped"
                                else SCHEMES)
    if args.rate_mbit is None and args.model == "default":
        args.rate_mbit = RATE_MBIT
    for flag in ("nodes", "ranks_per_node", "steps", "runs", "layers", "hidden", "heads", "vocab",
                 "seq", "micro_batch_size", "micro_batches"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    if args.nodes < 2:
        p.error(f"--nodes={args.nodes} must be >= 2 (the network joins nodes)")
    if args.nodes > 250:
        p.error(f"--nodes={args.nodes} must be <= 250 (one /24 subnet)")
    if args.ranks_per_node % GCDS_PER_PACKAGE:
        p.error(f"--ranks-per-node={args.ranks_per_node} must be a multiple of "
                f"{GCDS_PER_PACKAGE} (packages of {GCDS_PER_PACKAGE})")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup} must be >= 0")
    if args.rate_mbit is not None and not args.rate_mbit > 0:
        p.error(f"--rate-mbit={args.rate_mbit} must be > 0")
    if args.package_rate_mbit < 0:
        p.error(f"--package-rate-mbit={args.package_rate_mbit} must be >= 0 (0: off)")
    if args.delay_ms < 0:
        p.error(f"--delay-ms={args.delay_ms} must be >= 0")
    if args.hidden % args.heads:
        p.error(f"--hidden={args.hidden} must be a multiple of --heads={args.heads}")
    if args.vocab % 128:
        p.error(f"--vocab={args.vocab} must be a multiple of 128 (Megatron's padding)")
    try:
        args.link_sizes_mb = _sizes(args.link_sizes_mb)
    except ValueError:
        p.error(f"--link-sizes-mb={args.link_sizes_mb!r}: comma-separated sizes > 0")
    schemes = schemes_from(p, args.schemes, SCHEMES)
    args.schemes = ["lbp"] + [s for s in dict.fromkeys(schemes) if s != "lbp"]
    return args


def main(argv=None) -> int:
    args = parse(argv)
    why = netns.missing_requirements()
    if why:
        print(f"python -m benchmarks network: error: {why}", file=sys.stderr)
        return 2
    swept = netns.sweep_stale()
    if swept:
        _progress(args, f"removed stale namespaces of earlier runs: {', '.join(swept)}")
    if args.sweep:
        return 0
    from megatron_lbp.testing.multirank import MultiRankError

    with netns.signals_unwind():
        try:
            out = run(args)
        except MultiRankError as e:
            print(f"python -m benchmarks network: error: a rank failed; emulated network "
                  f"removed\n{e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("python -m benchmarks network: interrupted; emulated network removed",
                  file=sys.stderr)
            return 130
        except netns.NetworkSetupError as e:
            print(f"python -m benchmarks network: error: {e}", file=sys.stderr)
            return 1
    json_out.emit(out) if args.json else print(render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
