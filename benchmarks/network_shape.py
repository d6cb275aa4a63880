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

The frontier-shaped uplink rate is a stated input, Frontier's compute-to-network ratio
(:func:`derive`): a Frontier node's achieved model FLOP/s per byte/s of its NICs, from public
figures (projection/collectives.FRONTIER_NODE, with their sources), times the emulated node's
own model FLOP/s, measured first on the same ranks (:func:`probe_rank`: the compute alone of
one step, every rank at once, the slowest rank), times :func:`balance`'s factor (the scaled
model's short sequence gives each parameter byte less compute than 20B's). Nothing of the cost model's step times or of
any scheme's traffic enters it: the emulation then measures what each scheme's bytes cost at
that balance.
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
                "micro_batch_size": 1, "micro_batches": 1, "recompute": "none"},
    "frontier-shaped": {"layers": 4, "hidden": 256, "heads": 4, "micro_batch_size": 4,
                        "micro_batches": 2, "recompute": "full"},
}
# Above this the 2-core machine's TCP stack, not the tbf, limits an uplink (docs/benchmarks.md).
TBF_LIMIT_MBIT = 500.0
# The uplink while the compute is timed (nothing crosses it then but the barriers).
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
    # full: every layer recomputed (args.recompute); selective: the core attention's forward
    # again in the backward (megatron-core's --recompute-modules core_attn), as the launcher runs it
    mode = getattr(args, "recompute_mode", None) or d["recompute"]
    args.recompute_mode = mode
    args.recompute = mode == "full"
    args.recompute_modules = ("core_attn",) if mode == "selective" else ()


def uplink_rate(node_flops_per_s: float, flops_per_byte: float) -> float:
    """Mbit/s each way of an uplink that gives a node of ``node_flops_per_s`` Frontier's
    ``flops_per_byte`` (achieved FLOP/s over network bytes/s)."""
    if node_flops_per_s <= 0 or flops_per_byte <= 0:
        raise ValueError(f"node FLOP/s {node_flops_per_s} and FLOP per byte {flops_per_byte} "
                         f"must be > 0")
    return node_flops_per_s / flops_per_byte * 8 / 1e6


def derivation_lines(d: Mapping[str, Any]) -> list[str]:
    if "source" not in d:   # a run whose uplink matched zero3's ratio in the cost model
        return [f"uplink rate {d['rate_mbit']:.1f} Mbit/s, set by this run from zero3's network "
                f"time over compute in the cost model ({d['target']['ratio']:.3f}), not from "
                f"stated inputs: rerun it for a rate at Frontier's stated compute-to-network "
                f"ratio"]
    lines = [
        f"uplink rate from Frontier's compute-to-network ratio ({d['source']}): "
        f"{d['flops_per_byte']:.0f} achieved model FLOP per network byte per node",
        f"  the emulated node: {d['ranks_per_node']} ranks x {d['flops_per_step_per_rank'] / 1e9:.3f}"
        f" GFLOP per step (model FLOPs, {d['micro_batches']} micro-batch(es) of "
        f"{d['micro_batch_size']}) in {d['compute_alone_s']:.3f} s (compute alone, slowest rank, "
        f"median of {len(d['probe']['compute_s'])} rounds) = {d['node_flops_per_s'] / 1e9:.3f} "
        f"GFLOP/s",
        f"  a parameter's bytes meet {d['balance']['flops_per_param_20B']:.4g} FLOP on 20B "
        f"(sequence 2048) and {d['balance']['flops_per_param']:.4g} here: x "
        f"{d['balance']['factor']:.2f}",
        f"  rate = {d['node_flops_per_s'] / 1e9:.3f} GFLOP/s / {d['flops_per_byte']:.0f} FLOP/B x "
        f"{d['balance']['factor']:.2f} = {d['rate_MB_per_s']:.3f} MB/s = {d['rate_mbit']:.1f} "
        f"Mbit/s per node uplink, each way"]
    if d.get("warning"):
        lines.append(f"  WARNING: {d['warning']}")
    return lines


# --------------------------------------------------------------------------- the probe


def probe_rank(ns_of_rank, master, spec, train, rounds: int) -> list[float]:
    """On this rank: the compute alone of one step (forward, recomputation, backward of every
    micro-batch; no collective), ``rounds`` times, every rank at once."""
    import torch.distributed as dist

    from benchmarks.network import _join, compute_ops
    from megatron_lbp.testing.tiny_gpt import init_megatron_state

    _join(ns_of_rank, master)
    init_megatron_state()   # megatron-core builds its model under its groups
    fwd_bwd, _ = compute_ops(spec, train, 1)
    out = []
    for step in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        fwd_bwd(step)
        out.append(time.perf_counter() - t0)
    return out


def balance(model: Mapping[str, int], seq: int) -> dict[str, float]:
    """How much more compute a parameter's bytes meet on 20B than on ``model`` at ``seq``.

    Every scheme's network bytes per step are a multiple of the parameters (the same units,
    dtypes and collectives at either size); the compute is the model FLOPs per token times the
    tokens, which at the same micro-batches scale with the sequence. The emulated uplink is
    this factor faster than the stated FLOP-per-byte alone would make it, so that a parameter's
    bytes take the same share of the step on the emulated node as on a Frontier node running
    20B (the scaled-down model has a 21-85 token sequence where 20B has 2048)."""
    from megatron_lbp.projection import project as pj

    big = pj.MODELS["20B"]
    p20 = pj.plan_for(big, 384, "lbp", 1).params
    fpt20 = pj.model_flops_per_token(p20, big["num_layers"], big["hidden_size"], TWENTY_B["seq"])
    pe = pj.plan_for(model, 8, "lbp", 1, gpus_per_node=8).params
    fpte = pj.model_flops_per_token(pe, model["num_layers"], model["hidden_size"], seq)
    return {"params_20B": p20, "params": pe, "flops_per_param_20B": fpt20 * TWENTY_B["seq"] / p20,
            "flops_per_param": fpte * seq / pe,
            "factor": (fpt20 * TWENTY_B["seq"] / p20) / (fpte * seq / pe)}


def derive(args, net, spec, train, on_network, log) -> dict[str, Any]:
    """The frontier-shaped uplink rate: the emulated node's measured model FLOP/s over a
    Frontier node's achieved FLOP per NIC byte (collectives.FRONTIER_NODE), times
    :func:`balance`'s factor (20B's compute per parameter byte over this model's)."""
    from megatron_lbp.projection import collectives
    from megatron_lbp.projection import project as pj

    world = args.nodes * args.ranks_per_node
    log(f"timing the compute alone on {world} ranks ({PROBE_ROUNDS} rounds) to set the uplink")
    per_rank = on_network(net, args, probe_rank, spec, train, PROBE_ROUNDS, timeout=args.timeout)
    slowest = [max(r[i] for r in per_rank) for i in range(PROBE_ROUNDS)]
    compute = statistics.median(slowest)
    model = {"num_layers": args.layers, "hidden_size": args.hidden, "vocab_size": args.vocab}
    params = pj.plan_for(model, world, "lbp", args.micro_batches,
                         gpus_per_node=args.ranks_per_node).params
    flops = pj.model_flops_per_token(params, args.layers, args.hidden, args.seq) * args.seq \
        * args.micro_batch_size * args.micro_batches
    node_rate = args.ranks_per_node * flops / compute
    per_byte = collectives.frontier_flops_per_network_byte()
    bal = balance(model, args.seq)
    rate = uplink_rate(node_rate, per_byte) * bal["factor"]
    d = {"source": collectives.FRONTIER_NODE_TEXT, "frontier_node": dict(collectives.FRONTIER_NODE),
         "flops_per_byte": per_byte, "ranks_per_node": args.ranks_per_node,
         "micro_batches": args.micro_batches, "micro_batch_size": args.micro_batch_size,
         "flops_per_step_per_rank": flops, "compute_alone_s": compute,
         "node_flops_per_s": node_rate, "balance": bal, "rate_mbit": rate,
         "rate_MB_per_s": rate / 8, "probe": {"compute_s": slowest}}
    if rate > TBF_LIMIT_MBIT:
        d["warning"] = (f"{rate:.0f} Mbit/s is above ~{TBF_LIMIT_MBIT:.0f} Mbit/s, where this "
                        f"machine's TCP stack rather than the tbf limits an uplink: the network "
                        f"will be slower than Frontier's balance")
    return d
