"""Step time of every scheme on an emulated, bandwidth-limited network, and the model's prediction.

Each emulated node is a Linux network namespace (megatron_lbp.bench.netns)
whose uplink is a veth pair to a shared bridge, shaped with ``tc tbf`` in both
directions; all ranks of a node live in its namespace, so traffic inside a
node goes over its (unshaped) loopback and traffic between nodes through the
shaped uplink. gloo runs over TCP on the uplink addresses.

For every scheme the same GPT (megatron-core, bf16, larger than the test
default so that collectives are megabytes) trains a few steps; steps after the
warm-up are timed between barriers on every rank (rank 0's figures are
reported), and the median is the scheme's step time, also given as a ratio to
lbp's (scheme / lbp: above 1 means lbp is faster).

Calibration: the same namespaces are used to time all-gathers and
reduce-scatters of a few sizes over the patterns the schemes use (the whole
world and the node-to-node peer groups across the uplinks, the node groups on
loopback), and one bandwidth and latency per link class is fitted
(project.fit_link). Compute is timed without any communication: every rank
runs the forward+backward of the micro-batches and Adam on its 1/W shard at
the same time, outside the emulated network. project.step_time (the model that
projects Frontier) then predicts each scheme's step from the plan tool's
traffic for this topology; stock Megatron is modelled by the engine preset
with the same traffic (megatron-distopt as zero2, megatron-fsdp as zero3; see
``bench traffic``). Nothing else is fitted.

    python -m megatron_lbp.bench network [--json] [--nodes 2] [--ranks-per-node 4]
        [--rate-mbit 400] [--schemes lbp,zero3,...] [--steps 4] [--hidden 256] ...
    python -m megatron_lbp.bench network --sweep     # only remove stale lbpn-* namespaces

Needs root and iproute2 (``ip``, ``tc``). Everything it creates is removed on
exit, on errors, on Ctrl-C and on SIGTERM; a run that was SIGKILLed leaves
namespaces that the next run (or ``--sweep``) removes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

from megatron_lbp.bench import netns
from megatron_lbp.bench.traffic import ENGINE_SCHEMES, GCDS_PER_PACKAGE, STOCK_SCHEMES

SCHEMES = ("lbp", "zeropp", "zero3", "zero2", "hsdp") + STOCK_SCHEMES
# Engine preset whose traffic models each stock scheme (bench traffic: at K=1
# megatron-distopt moves 609,120 vs zero2's 610,560 bytes, megatron-fsdp
# 850,560 vs zero3's 814,080 on the network).
MODELLED_AS = {"megatron-distopt": "zero2", "megatron-fsdp": "zero3"}
LINK_SIZES_MB = (1.0, 4.0)


# --------------------------------------------------------------------------- rank side


def _join(ns_of_rank: list[str], master: str) -> None:
    """Enter this rank's node namespace, then bring up gloo over the uplink addresses."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    netns.enter(ns_of_rank[rank])
    dist.init_process_group(backend="gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            init_method=f"tcp://{master}:{os.environ['MASTER_PORT']}")


def _trainer(scheme: str, spec, train, ranks_per_node: int):
    from megatron_lbp.bench.traffic import setup_fsdp
    from megatron_lbp.testing.tiny_gpt import setup_hier, setup_stock

    if scheme == "megatron-distopt":
        return setup_stock(spec, train)
    if scheme == "megatron-fsdp":
        return setup_fsdp(spec, train)
    return setup_hier(spec, train, ENGINE_SCHEMES[scheme] + [
        "--hier-gpus-per-node", str(ranks_per_node),
        "--hier-gcds-per-package", str(GCDS_PER_PACKAGE)])


def rank_train(ns_of_rank, master, scheme, spec, train, warmup, ranks_per_node):
    """One scheme's training on this rank; seconds of each step after ``warmup`` and the losses."""
    import torch.distributed as dist

    _join(ns_of_rank, master)
    trainer = _trainer(scheme, spec, train, ranks_per_node)
    times, result = [], None
    for step in range(train.steps):
        dist.barrier()
        t0 = time.perf_counter()
        result = trainer.run([step], result=result)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"step_s": times[warmup:], "losses": result.losses}


def _timed(op, reps: int) -> float:
    import torch.distributed as dist

    op()  # connection set-up and first-touch costs stay out of the figure
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rank_links(ns_of_rank, master, ranks_per_node, sizes_mb, reps):
    """Timed all-gathers (bf16) and reduce-scatters (fp32) per pattern; (pattern, op, n, bytes, s).

    Patterns: "world" (all ranks, across the uplinks), "peers" (rank i of every
    node, all such groups at once: the inter-node hop of lbp and hsdp), "node"
    (the ranks of one node on loopback, every node at once). Bytes are what
    the engine's ledger charges a rank: (n-1)/n of the full buffer.
    """
    import torch
    import torch.distributed as dist

    _join(ns_of_rank, master)
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = world // ranks_per_node
    node_groups = [dist.new_group(list(range(i * ranks_per_node, (i + 1) * ranks_per_node)))
                   for i in range(nodes)]
    peer_groups = [dist.new_group(list(range(i, world, ranks_per_node)))
                   for i in range(ranks_per_node)]
    patterns = {"world": (None, world), "peers": (peer_groups[rank % ranks_per_node], nodes),
                "node": (node_groups[rank // ranks_per_node], ranks_per_node)}
    samples = []
    for name, (group, n) in patterns.items():
        for mb in sizes_mb:
            numel = max(n, int(mb * 2 ** 20) // 4 // n * n)
            gathered = torch.empty(numel, dtype=torch.bfloat16)
            shard = torch.ones(numel // n, dtype=torch.bfloat16)
            t = _timed(lambda: dist.all_gather_into_tensor(gathered, shard, group=group), reps)
            samples.append((name, "all_gather", n, 2 * numel * (n - 1) / n, t))
            full = torch.ones(numel, dtype=torch.float32)
            part = torch.empty(numel // n, dtype=torch.float32)
            t = _timed(lambda: dist.reduce_scatter_tensor(part, full, group=group), reps)
            samples.append((name, "reduce_scatter", n, 4 * numel * (n - 1) / n, t))
    return samples


def rank_compute(spec, train, steps, adam_elements):
    """Forward+backward of the micro-batches and Adam on a 1/W shard, every rank at once, no comm."""
    import torch
    import torch.distributed as dist

    from megatron_lbp.testing import tiny_gpt

    tiny_gpt.init_megatron_state(seed=spec.seed)
    model, _ = tiny_gpt.build_tiny_gpt(spec)
    rows = train.micro_batch_size

    def fwd_bwd(step):
        for micro in range(train.micro_batches):
            tokens = tiny_gpt.global_batch(step, micro, spec, train, 1)[:rows]
            (tiny_gpt.forward_loss(model, tokens) / train.micro_batches).backward()

    shard = torch.zeros(int(adam_elements), dtype=torch.float32, requires_grad=True)
    shard.grad = torch.ones_like(shard)
    adam = torch.optim.Adam([shard], lr=1e-4)
    fb, ad = [], []
    for step in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fwd_bwd(step)
        dist.barrier()
        t1 = time.perf_counter()
        adam.step()
        dist.barrier()
        fb.append(t1 - t0)
        ad.append(time.perf_counter() - t1)
    return {"fwd_bwd_s": statistics.median(fb[1:]), "adam_s": statistics.median(ad[1:])}


# --------------------------------------------------------------------------- driver


def _specs(args):
    import torch

    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec

    spec = TinyGPTSpec(num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, vocab_size=args.vocab,
                       seq_length=args.seq, params_dtype=torch.bfloat16)
    train = TrainSpec(steps=args.warmup + args.steps, micro_batch_size=args.micro_batch_size,
                      micro_batches=args.micro_batches)
    return spec, train


def _model(args) -> dict[str, int]:
    return {"num_layers": args.layers, "hidden_size": args.hidden, "vocab_size": args.vocab}


def _plans(args, schemes) -> dict[str, dict[str, Any]]:
    from megatron_lbp.bench.project import plan_for

    world = args.nodes * args.ranks_per_node
    return {s: plan_for(_model(args), world, MODELLED_AS.get(s, s), args.micro_batches,
                        gpus_per_node=args.ranks_per_node, gcds_per_package=GCDS_PER_PACKAGE)
            for s in schemes}


def _on_network(net, args, fn, *fn_args, timeout):
    from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks

    world = args.nodes * args.ranks_per_node
    ns_of_rank = [net.node_ns(r // args.ranks_per_node) for r in range(world)]
    return run_on_ranks(fn, world, ns_of_rank, net.address(0), *fn_args, timeout=timeout,
                        init_process_group=False,
                        env={"MASTER_ADDR": net.address(0), "GLOO_SOCKET_IFNAME": netns.UPLINK},
                        rank_env=rank_location_env(args.ranks_per_node))


def _fit_links(samples) -> dict[str, Any]:
    from megatron_lbp.bench.project import fit_link

    out: dict[str, Any] = {"samples": [dict(zip(("pattern", "op", "n", "bytes", "s"), s))
                                       for s in samples]}
    for cls, patterns in (("network", ("world", "peers")), ("loopback", ("node",))):
        bw, lat = fit_link([(b, n, t) for p, _, n, b, t in samples if p in patterns])
        out[cls] = {"bandwidth_MB_per_s": bw / 1e6, "latency_us": lat * 1e6,
                    "fitted_on": list(patterns)}
        for p in patterns:
            pbw, plat = fit_link([(b, n, t) for q, _, n, b, t in samples if q == p])
            out[cls][f"{p}_only"] = {"bandwidth_MB_per_s": pbw / 1e6, "latency_us": plat * 1e6}
    return out


def _calibration(args, measured, links_fit, compute_meas) -> dict[str, Any]:
    from megatron_lbp.bench import project as pj

    plans = _plans(args, list(measured))
    ref_plan = plans["lbp"]
    world = args.nodes * args.ranks_per_node
    links = pj.LinkModel.from_measured(
        {"package": links_fit["loopback"]["bandwidth_MB_per_s"] * 1e6,
         "node": links_fit["loopback"]["bandwidth_MB_per_s"] * 1e6,
         "network": links_fit["network"]["bandwidth_MB_per_s"] * 1e6},
        {"package": links_fit["loopback"]["latency_us"] * 1e-6,
         "node": links_fit["loopback"]["latency_us"] * 1e-6,
         "network": links_fit["network"]["latency_us"] * 1e-6})
    compute = pj.compute_from_measured(
        _model(args), ref_plan["params"], args.seq, args.micro_batch_size,
        compute_meas["fwd_bwd_s"] / args.micro_batches, compute_meas["adam_s"],
        ref_plan["padded_params"] / world)
    per_scheme = pj.calibrate(measured, plans, _model(args), links, compute)
    return {**per_scheme, "fit": {
        "links": {k: v for k, v in links_fit.items() if k != "samples"},
        "link_samples": links_fit["samples"],
        "model_links_MB_per_s": {c: links.bandwidth[c] / 1e6 for c in links.bandwidth},
        "model_latency_us": {c: links.latency[c] * 1e6 for c in links.latency},
        "compute_measured": compute_meas,
        "compute_model": asdict(compute),
        "modelled_as": {s: MODELLED_AS.get(s, s) for s in measured},
        "buckets": {s: p["buckets"] for s, p in plans.items()},
        "network_bytes_per_rank": {s: p["traffic_bytes"]["network"] for s, p in plans.items()},
        "tolerance": 0.2,
        "notes": "package and node links are both the namespace's loopback; "
                 "only link bandwidth/latency and compute time are fitted",
    }}


def run(args) -> dict[str, Any]:
    """Rounds of (every scheme, the link timings, the compute timing); medians over the rounds.

    Schemes are rotated from round to round and the calibration inputs are
    re-measured in each, so load from other processes on the machine falls
    on all of them alike.
    """
    from megatron_lbp.testing.multirank import run_on_ranks

    spec, train = _specs(args)
    world = args.nodes * args.ranks_per_node
    adam_elements = _plans(args, ["lbp"])["lbp"]["padded_params"] / world
    out: dict[str, Any] = {"config": config(args), "schemes": {}, "calibration": {}}
    steps = {s: [] for s in args.schemes}
    losses: dict[str, list[float]] = {}
    samples: list[list] = []
    compute: list[dict[str, float]] = []
    with netns.EmulatedNetwork(args.nodes, args.rate_mbit, delay_ms=args.delay_ms) as net:
        out["config"]["qdiscs"] = net.qdiscs()
        for round_ in range(args.runs):
            shift = round_ % len(args.schemes)
            for scheme in args.schemes[shift:] + args.schemes[:shift]:
                r = _on_network(net, args, rank_train, scheme, spec, train, args.warmup,
                                args.ranks_per_node, timeout=args.timeout)[0]
                steps[scheme] += r["step_s"]
                losses.setdefault(scheme, r["losses"])
                _progress(args, f"round {round_ + 1}/{args.runs} {scheme}: median "
                                f"{statistics.median(r['step_s']):.3f} s/step")
            per_rank = _on_network(net, args, rank_links, args.ranks_per_node,
                                   args.link_sizes_mb, 3, timeout=args.timeout)
            # A collective is done when its slowest rank is (groups of one pattern
            # share the uplink and need not get equal shares of it).
            samples.append([s[:4] + (max(r[i][4] for r in per_rank),)
                            for i, s in enumerate(per_rank[0])])
            compute.append(run_on_ranks(rank_compute, world, spec, train, 1 + max(2, args.steps),
                                        adam_elements, timeout=args.timeout)[0])
    for scheme in args.schemes:
        out["schemes"][scheme] = {"step_s": steps[scheme],
                                  "median_s": statistics.median(steps[scheme]),
                                  "losses": losses[scheme]}
    lbp = out["schemes"]["lbp"]["median_s"]
    for row in out["schemes"].values():
        row["ratio_to_lbp"] = row["median_s"] / lbp
    # Each timed collective: its median over the rounds.
    merged = [s[:4] + (statistics.median(r[i][4] for r in samples),)
              for i, s in enumerate(samples[0])]
    compute_meas = {k: statistics.median(c[k] for c in compute) for k in compute[0]}
    measured = {s: r["median_s"] for s, r in out["schemes"].items()}
    out["calibration"] = _calibration(args, measured, _fit_links(merged), compute_meas)
    out["config"]["loadavg_end"] = list(os.getloadavg())
    return out


def config(args) -> dict[str, Any]:
    import megatron.core
    import torch

    world = args.nodes * args.ranks_per_node
    plan = _plans(args, ["lbp"])["lbp"]
    return {
        "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "world_size": world,
        "packages": f"{GCDS_PER_PACKAGE} ranks each (no separate package tier: loopback)",
        "uplink_rate_mbit": args.rate_mbit, "uplink_rate_MB_per_s": args.rate_mbit / 8,
        "uplink_shaping": "tc tbf on both ends of each node's veth (both directions), "
                          "burst 64 kB, queue 200 ms",
        "delay_ms": args.delay_ms,
        "intra_node": "loopback inside the node's namespace, unshaped",
        "model": {"num_layers": args.layers, "hidden_size": args.hidden,
                  "num_attention_heads": args.heads, "vocab_size": args.vocab,
                  "seq_length": args.seq, "params": plan["params"], "dtype": "bf16",
                  "grad_reduce": "fp32"},
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
    c = out["config"]
    m = c["model"]
    lines = [
        f"emulated network: {c['nodes']} nodes x {c['ranks_per_node']} ranks (gloo/TCP), "
        f"uplink {c['uplink_rate_mbit']} Mbit/s = {c['uplink_rate_MB_per_s']:.1f} MB/s per node "
        f"each way ({c['uplink_shaping']}), delay {c['delay_ms']} ms; {c['intra_node']}",
        f"model: GPT {m['num_layers']} layers, hidden {m['hidden_size']}, heads "
        f"{m['num_attention_heads']}, vocab {m['vocab_size']}, seq {m['seq_length']}, "
        f"{m['params']:,} parameters, bf16, fp32 grad reduction; micro-batch "
        f"{c['micro_batch_size']} x {c['micro_batches']}; {c['warmup_steps']} warm-up + "
        f"{c['timed_steps']} timed steps per run, {c['runs']} run(s); load average "
        f"{c['loadavg_start'][0]:.1f} at start, {c['loadavg_end'][0]:.1f} at the end",
        f"versions: {json.dumps(c['versions'])}; {c['cpus']} CPUs",
        "",
        f"  {'scheme':<18}{'median s/step':>14}{'/ lbp':>8}{'pred / lbp':>12}{'error':>8}  within 20%",
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
        lines.append(
            f"fitted links: network {lk['network']['bandwidth_MB_per_s']:.1f} MB/s per rank, "
            f"{lk['network']['latency_us']:.0f} us (world-only "
            f"{lk['network']['world_only']['bandwidth_MB_per_s']:.1f}, peers-only "
            f"{lk['network']['peers_only']['bandwidth_MB_per_s']:.1f} MB/s); loopback "
            f"{lk['loopback']['bandwidth_MB_per_s']:.1f} MB/s per rank, "
            f"{lk['loopback']['latency_us']:.0f} us")
        cm = fit["compute_measured"]
        lines.append(f"measured compute (all ranks at once, no comm): fwd+bwd "
                     f"{cm['fwd_bwd_s']:.3f} s per step, Adam on 1/W {cm['adam_s']:.4f} s; "
                     f"stock schemes modelled as {json.dumps(fit['modelled_as'])}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        self.exit(2, f"python -m megatron_lbp.bench network: error: {message}\n")


def _sizes(text: str) -> tuple[float, ...]:
    sizes = tuple(float(x) for x in text.split(",") if x)
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(text)
    return sizes


def parse(argv) -> argparse.Namespace:
    p = _Parser(prog="python -m megatron_lbp.bench network", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4, help="even (packages of 2)")
    p.add_argument("--rate-mbit", type=float, default=400.0,
                   help="each node's uplink, Mbit/s each way (default 400 = 50 MB/s)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per uplink end")
    p.add_argument("--schemes", default=",".join(SCHEMES),
                   help=f"comma-separated subset of {','.join(SCHEMES)} (lbp is always run)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per scheme")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--runs", type=int, default=2,
                   help="rounds over all schemes (rotated), each with its own link and "
                        "compute timings; medians over all rounds")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--link-sizes-mb", default=",".join(map(str, LINK_SIZES_MB)),
                   help="buffer sizes (MB, fp32) of the timed link collectives")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per multi-rank run")
    p.add_argument("--sweep", action="store_true",
                   help="only remove namespaces left by runs that no longer exist")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for flag in ("nodes", "ranks_per_node", "steps", "runs", "layers", "hidden", "heads", "vocab", "seq",
                 "micro_batch_size", "micro_batches"):
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
    if not args.rate_mbit > 0:
        p.error(f"--rate-mbit={args.rate_mbit} must be > 0")
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
    schemes = [s for s in args.schemes.split(",") if s]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad or not schemes:
        p.error(f"--schemes: {','.join(bad) or '(empty)'} not in {','.join(SCHEMES)}")
    args.schemes = ["lbp"] + [s for s in dict.fromkeys(schemes) if s != "lbp"]
    return args


def _terminate(signum, frame):
    # SIGTERM unwinds like Ctrl-C, through every cleanup on the way out.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse(argv)
    why = netns.missing_requirements()
    if why:
        print(f"python -m megatron_lbp.bench network: error: {why}", file=sys.stderr)
        return 2
    swept = netns.sweep_stale()
    if swept:
        _progress(args, f"removed stale namespaces of earlier runs: {', '.join(swept)}")
    if args.sweep:
        return 0
    from megatron_lbp.testing.multirank import MultiRankError

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        out = run(args)
    except MultiRankError as e:
        print(f"python -m megatron_lbp.bench network: error: a rank failed; emulated network "
              f"removed\n{e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("python -m megatron_lbp.bench network: interrupted; emulated network removed",
              file=sys.stderr)
        return 130
    except netns.NetworkSetupError as e:
        print(f"python -m megatron_lbp.bench network: error: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(out) if args.json else render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
