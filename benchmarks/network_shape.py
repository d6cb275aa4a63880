"""The emulated network's models; the uplink rate giving the Frontier-shaped run Frontier's balance.

Two models (``bench network --model``):

- ``default``: the GPT the network bench always ran (4 layers, hidden 256,
  vocabulary 1024, sequence 64, 1 micro-batch of 1 sequence, no
  recomputation) at a fixed 400 Mbit/s uplink;
- ``frontier-shaped``: the 20B GPT of the projection (project.MODELS["20B"],
  sequence 2048) scaled down with its proportions kept: hidden h, sequence
  h·2048/6144 (the attention share of a layer's FLOPs, s/6h, stays 20B's),
  vocabulary h·50304/6144 rounded to a multiple of 128 (the embedding unit
  against a layer unit, and the output layer's FLOPs against a layer's, stay
  20B's), 4 layers, full recomputation, 2 micro-batches of 4 sequences (the
  tokens set the compute, hence the uplink rate that keeps zero3's balance:
  enough for a rate the tbf, not the CPU, limits). The engine gathers
  one unit per transformer layer (the bucket size no longer cuts a GPT), so
  each layer has 20B's structure: one gather and one gradient reduction per
  layer and pass, and the optimizer step's per-unit collectives.

The frontier-shaped uplink rate is derived, not chosen (:func:`derive`):
zero3's network time over its compute time equals the cost model's figure
for 20B at 384 GCDs with the same schedule (project.network_time_over_compute),
so lbp, zeropp and the others meet the network/compute balance that Frontier
would give zero3. Both are measured first on the same ranks and network
(:func:`probe_rank`): zero3's step collectives alone (all of them cross the
uplinks) at a probe rate, and the compute alone; the rate then follows from
link time ~ 1 / rate (:func:`uplink_rate`).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Mapping

MODELS = ("default", "frontier-shaped")
TWENTY_B = {"hidden": 6144, "seq": 2048, "vocab": 50304}
FRONTIER_SCHEMES = ("lbp", "zeropp", "zero3", "megatron-fsdp", "ds-zero3", "ds-zeropp")
DEFAULTS = {
    "default": {"layers": 4, "hidden": 256, "heads": 4, "vocab": 1024, "seq": 64,
                "micro_batch_size": 1, "micro_batches": 1, "recompute": False},
    "frontier-shaped": {"layers": 4, "hidden": 256, "heads": 4, "micro_batch_size": 4,
                        "micro_batches": 2, "recompute": True},
}
# Above this the 2-core machine's TCP stack, not the tbf, limits an uplink (docs/benchmarks.md).
TBF_LIMIT_MBIT = 500.0
# The probe's uplink: well below that, so that the link time scales with 1 / rate.
PROBE_RATE_MBIT = 100.0
PROBE_ROUNDS = 3


def frontier_shape(hidden: int) -> dict[str, int]:
    """Sequence and vocabulary in 20B's proportions to ``hidden``."""
    seq = max(1, round(hidden * TWENTY_B["seq"] / TWENTY_B["hidden"]))
    vocab = max(128, 128 * round(hidden * TWENTY_B["vocab"] / TWENTY_B["hidden"] / 128))
    return {"seq": seq, "vocab": vocab}


def fill_model(args) -> None:
    """Every shape flag the user left out (None) from ``args.model``'s defaults, in place."""
    d = dict(DEFAULTS[args.model])
    for key in ("layers", "hidden", "heads", "micro_batch_size", "micro_batches"):
        if getattr(args, key) is None:
            setattr(args, key, d[key])
    if args.model == "frontier-shaped":
        d.update(frontier_shape(args.hidden))
    for key in ("vocab", "seq"):
        if getattr(args, key) is None:
            setattr(args, key, d[key])
    args.recompute = d["recompute"]


def zero3_uplink_bytes(model: Mapping[str, int], world: int, ranks_per_node: int,
                       micro_batches: int, gcds_per_package: int) -> float:
    """Bytes zero3 puts on one node's uplink per optimizer step, each way (the plan's bytes)."""
    from megatron_lbp.projection import project as pj
    from megatron_lbp.core.costs import PHASES

    plan = pj.plan_for(model, world, "zero3", micro_batches, gpus_per_node=ranks_per_node,
                       gcds_per_package=gcds_per_package)
    return float(sum(plan.traffic_by_phase[ph]["network"] * pj._uplink_multiplicity(plan, ph)
                     for ph in PHASES))


def uplink_rate(probe_mbit: float, link_s: float, compute_s: float,
                target: Mapping[str, Any]) -> dict[str, Any]:
    """The uplink rate at which zero3's link time / compute time is ``target["ratio"]``.

    ``link_s``: zero3's collectives alone through uplinks of ``probe_mbit``;
    link time taken as inversely proportional to the rate.
    """
    if link_s <= 0 or compute_s <= 0 or probe_mbit <= 0:
        raise ValueError(f"probe rate {probe_mbit} Mbit/s, zero3 link {link_s} s and compute "
                         f"{compute_s} s must be > 0")
    rate = probe_mbit * link_s / (target["ratio"] * compute_s)
    return {"target": dict(target), "probe_rate_mbit": probe_mbit, "probe_link_s": link_s,
            "compute_alone_s": compute_s, "rate_mbit": rate, "rate_MB_per_s": rate / 8}


def derivation_lines(d: Mapping[str, Any]) -> list[str]:
    t = d["target"]
    recompute = "full recomputation" if t["recompute"] else "no recomputation"
    lines = [
        f"uplink rate derived: zero3's network time / compute time for {t['model']} at "
        f"{t['gcds']} GCDs in the cost model (project.network_time_over_compute: "
        f"{t['micro_batches']} micro-batches, {recompute}, {t['mfu']:.0%} MFU, "
        f"{t['network_GB_per_s_per_gcd']:g} GB/s network per GCD) = {t['network_s']:.2f} s / "
        f"{t['compute_s']:.2f} s = {t['ratio']:.3f}",
        f"  probe at {d['probe_rate_mbit']:g} Mbit/s: zero3's step collectives alone take "
        f"{d['probe_link_s']:.3f} s, the compute alone (forward, recomputation, backward; "
        f"slowest rank) {d['compute_alone_s']:.3f} s (medians of "
        f"{len(d['probe']['link_s'])} rounds)",
        f"  rate = {d['probe_rate_mbit']:g} Mbit/s x {d['probe_link_s']:.3f} s / "
        f"({t['ratio']:.3f} x {d['compute_alone_s']:.3f} s) = {d['rate_mbit']:.1f} Mbit/s = "
        f"{d['rate_MB_per_s']:.2f} MB/s per node uplink, each way",
        f"  (the plan's {d['zero3_uplink_bytes_per_step'] / 1e6:.2f} MB per uplink per step "
        f"would ask {d['plan_rate_mbit']:.1f} Mbit/s of a perfect link: TCP through the tbf "
        f"does not fill it, and gathers and reduce-scatters run one after another)"]
    if d.get("warning"):
        lines.append(f"  WARNING: {d['warning']}")
    return lines


# --------------------------------------------------------------------------- the probe


def probe_rank(ns_of_rank, master, spec, train, rounds: int, ranks_per_node: int
               ) -> dict[str, list[float]]:
    """On this rank: zero3's step collectives alone and the compute alone, ``rounds`` times.

    zero3 trains two steps (the second recorded, benchmarks.link_replay),
    then each round replays that step's collectives (barrier to barrier: all
    ranks done) and runs the compute alone (this rank's own time).
    """
    import torch.distributed as dist

    from benchmarks import link_replay
    from benchmarks.network import _join, _trainer, compute_ops

    _join(ns_of_rank, master)
    trainer = _trainer("zero3", spec, train, ranks_per_node, None)
    result = trainer.run([0])
    with link_replay.recording() as calls:
        trainer.run([1], None, result)
    replay = link_replay.Replay(calls)
    fwd_bwd, _ = compute_ops(spec, train, 1)
    out: dict[str, list[float]] = {"link_s": [], "compute_s": []}
    for step in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        replay()
        dist.barrier()
        out["link_s"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        fwd_bwd(step)
        out["compute_s"].append(time.perf_counter() - t0)
    return out


def derive(args, net, spec, train, on_network, log) -> dict[str, Any]:
    """The frontier-shaped uplink rate, from a probe run on ``net`` at PROBE_RATE_MBIT.

    zero3's collectives alone take T seconds through uplinks of rate r0 and
    the compute alone takes C; the link time scales as 1/rate while the tbf,
    not the CPU, limits the uplink, so the rate giving T'/C = target ratio is
    r0 x T / (ratio x C). The plan's bytes are printed beside: what a perfect
    uplink would need (TCP does not fill the tbf, so the measured link time is
    longer; the engine's reduce-scatters send a reduce-scatter's bytes on gloo
    too: megatron_lbp.engine.comm.exchange_reduce_scatter).
    """
    from megatron_lbp.projection import project as pj
    from benchmarks.traffic import GCDS_PER_PACKAGE

    world = args.nodes * args.ranks_per_node
    log(f"probing zero3's collectives alone and the compute alone on {world} ranks at "
        f"{PROBE_RATE_MBIT:g} Mbit/s ({PROBE_ROUNDS} rounds) to set the uplink")
    per_rank = on_network(net, args, probe_rank, spec, train, PROBE_ROUNDS, args.ranks_per_node,
                          timeout=args.timeout)
    link = statistics.median(per_rank[0]["link_s"])
    compute = statistics.median(max(r["compute_s"][i] for r in per_rank)
                                for i in range(PROBE_ROUNDS))
    target = pj.network_time_over_compute(micro_batches=args.micro_batches,
                                          recompute=args.recompute)
    model = {"num_layers": args.layers, "hidden_size": args.hidden, "vocab_size": args.vocab}
    d = uplink_rate(PROBE_RATE_MBIT, link, compute, target)
    d["zero3_uplink_bytes_per_step"] = zero3_uplink_bytes(
        model, world, args.ranks_per_node, args.micro_batches, GCDS_PER_PACKAGE)
    d["plan_rate_mbit"] = d["zero3_uplink_bytes_per_step"] * 8 / 1e6 / (target["ratio"] * compute)
    d["probe"] = {"link_s": per_rank[0]["link_s"],
                  "compute_s": [max(r["compute_s"][i] for r in per_rank)
                                for i in range(PROBE_ROUNDS)]}
    if d["rate_mbit"] > TBF_LIMIT_MBIT:
        d["warning"] = (f"{d['rate_mbit']:.0f} Mbit/s is above ~{TBF_LIMIT_MBIT:.0f} Mbit/s, "
                        f"where this machine's TCP stack rather than the tbf limits an uplink: "
                        f"zero3's network time will stay above the target (raise "
                        f"--micro-batch-size for more compute)")
    return d
