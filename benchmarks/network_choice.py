"""The launcher's choice against measured step times on the emulated network (issue 26 item 3).

    python -m benchmarks network-choice [--json] [--rate-mbit 20] [--batches 8x1,1x4]
        [--schemes lbp,zeropp] [--rounds 3] [--warmup 0] [--links-from health|survey] ...

On the two-node emulated network (benchmarks/netns.py; 2 nodes x 4 ranks, packages of 2;
each node's uplink shaped to ``--rate-mbit`` each way, a stated input: RATE_MBIT), with the
tiny GPT of ``bench network``, at two global batches, each given as micro-batch size x
micro-batches per step (``--batches``; global batch = ranks x both): by default one large
micro-batch (8 sequences per rank, 1 per step: global batch 64) and small ones (1 sequence,
4 per step: global batch 32, 4 micro-batches of per-micro-batch traffic):

1. the links, as the user measures them: the launcher's health check
   (``python -m megatron_lbp.launch health --links-out FILE``) runs on the emulated nodes'
   ranks and writes the link file the choice reads (``--links``), or with ``--links-from
   survey`` the link survey (benchmarks/survey_network.py's ranks) writes the survey the
   choice reads (``--survey``);
2. the compute rate of the CPU ranks at each batch's micro-batch size: the forward+backward
   of one micro-batch of the same GPT, no communication, every rank at once
   (``network.compute_ops``), timed in every kept round beside the steps; rate = the cost
   model's FLOPs of one micro-batch (``project.model_flops_per_token`` x tokens) / its
   median seconds (slowest rank), given to the choice as ``--peak-tflops RATE --mfu 1``
   (nothing is fitted to the step times);
3. the real step times of the schemes at both batches, in the same rank processes, stepped
   in interleaved rounds (two consecutive steps of every (scheme, batch) per round, order
   rotated; the second is timed, barrier to barrier on rank 0, so that the first one's weight
   refresh lands under its forward as in a run; its own refresh is then waited for untimed,
   ``settle``, so that it does not cross the uplink under the next scheme's step); the first
   ``--warmup`` rounds are dropped, medians kept;
4. the choice's ranking (``megatron_lbp.launch.choose.rank``, the code behind ``python -m
   megatron_lbp.plan --choose``) at each global batch, from the link file (with
   ``--network-model shared_uplink``: each emulated node has one shaped uplink; the per-GCD
   model, Frontier's, is printed beside it) or the survey, and the measured rate, read for
   each scheme's row at the micro-batch size and recomputation the run used.

The result says, per batch, which scheme the projection prefers and which was measured
faster; the slow tests (tests/bench/test_network_choice.py with the health check,
tests/bench/test_survey_network.py with the survey) assert that they agree at both batches,
whichever scheme that is.

Needs root and iproute2.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

from benchmarks import netns
from benchmarks.network import _join, compute_ops
from megatron_lbp.projection import json_out
from megatron_lbp.projection.schemes import GCDS_PER_PACKAGE, engine_argv

# scheme -> (the choice's row label, the engine's flags): the same secondary copy in both.
SCHEMES = {
    "lbp": ("lbp S=0", ["--hier-secondary-group-size", "0"]),
    "zeropp": ("zeropp", []),          # its preset's secondary: the node's ranks
    "zero3": ("zero3", []),
}
PROG = "python -m benchmarks network-choice"
DEFAULT_SCHEMES = ("lbp", "zeropp")
MODEL = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 1024, "seq": 64}
HEALTH_MB = 2.0   # MiB per rank of the health check's all-gathers
# The uplink, each way per node: a stated input. Nothing of the cost model or of any scheme's
# traffic enters it; the measured step times are what the choice is held against. At 2.5 MB/s
# the schemes' uplink bytes per step (0.96-2.78 MB: test_network_choice) take 0.4-1.1 s, so
# the network weighs in every step.
RATE_MBIT = 20.0


# --------------------------------------------------------------------------- rank side


def health_rank(ns_of_rank, links_out: str, ranks_per_node: int) -> int:
    """The launcher's health check, as a job step runs it, on this rank's emulated node."""
    from megatron_lbp.launch import health

    netns.enter(ns_of_rank[int(os.environ["RANK"])])
    return health.main(["--tasks-per-node", str(ranks_per_node), "--gcds-per-package",
                        str(GCDS_PER_PACKAGE), "--gpus-per-task", "0", "--require-gpu", "none",
                        "--min-fraction", "0", "--megabytes", str(HEALTH_MB),
                        "--links-out", links_out])


def rank_rounds(ns_of_rank, master, schemes, spec, trains, rounds, warmup, ranks_per_node):
    """Every (scheme, batch) stepped twice in a row per round (the second timed), order
    rotated, plus the compute of one micro-batch of each batch alone (kept rounds); seconds
    per kept round of each."""
    import torch.distributed as dist

    from megatron_lbp.testing.tiny_gpt import setup_hier

    _join(ns_of_rank, master)
    keys = [(s, k) for k in trains for s in schemes]
    trainers = {(s, k): setup_hier(spec, trains[k], engine_argv(s, ranks_per_node,
                                                                *SCHEMES[s][1]))
                for s, k in keys}
    # one micro-batch of each batch's size, no communication
    alone = {k: compute_ops(spec, replace(t, micro_batches=1), 1)[0] for k, t in trains.items()}
    results = dict.fromkeys(keys)
    out = {"step_s": {f"{s}@{k}": [] for s, k in keys},
           "micro_batch_s": {k: [] for k in trains}}

    def timed(fn, *a):
        dist.barrier()
        t0 = time.perf_counter()
        value = fn(*a)
        dist.barrier()
        return time.perf_counter() - t0, value

    for r in range(warmup + rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            trainer = trainers[key]
            # The steady state of training: the untimed step's weight refresh (lbp's inter
            # and grad_to_param all-gathers, issued at the end of a step to land under the
            # next forward) lands under the timed step's forward, as it would in a run; the
            # timed step's own refresh is waited for untimed, so that it crosses the uplink
            # neither under the next (scheme, batch) of the round nor in anyone's time.
            results[key] = trainer.run([2 * r], None, results[key])
            t, results[key] = timed(trainer.run, [2 * r + 1], None, results[key])
            trainer.model.settle()
            if r >= warmup:
                out["step_s"][f"{key[0]}@{key[1]}"].append(t)
        if r >= warmup:
            for k, fwd_bwd in alone.items():
                out["micro_batch_s"][k].append(timed(fwd_bwd, r)[0])
    out["losses"] = {f"{s}@{k}": results[(s, k)].losses for s, k in keys}
    return out


# --------------------------------------------------------------------------- driver


def _on_network(net, args, fn, *fn_args):
    from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks

    world = args.nodes * args.ranks_per_node
    ns_of_rank = [net.place(r // args.ranks_per_node) for r in range(world)]
    return run_on_ranks(fn, world, ns_of_rank, *fn_args, timeout=args.timeout,
                        init_process_group=False, host_store=False,
                        env={"MASTER_ADDR": net.address(0), "GLOO_SOCKET_IFNAME": netns.UPLINK},
                        rank_env=rank_location_env(args.ranks_per_node))


def estimate_argv(args, global_batch: int, micro_batch_size: int, links: str,
                  rate_tflops: float, network_model: str) -> list[str]:
    """The estimate/choice flags of this run: the model, the machine, the measured inputs
    (``links``: the health check's link file, or with ``--links-from survey`` the survey's)."""
    measured = (["--survey", links] if args.links_from == "survey" else
                ["--links", links, "--network-model", network_model])
    return ["--nodes", str(args.nodes), "--tasks-per-node", str(args.ranks_per_node),
            "--gcds-per-package", str(GCDS_PER_PACKAGE), "--num-layers", str(MODEL["layers"]),
            "--hidden-size", str(MODEL["hidden"]), "--num-attention-heads", str(MODEL["heads"]),
            "--seq-length", str(MODEL["seq"]), "--vocab-size", str(MODEL["vocab"]),
            "--global-batch-size", str(global_batch),
            "--micro-batch-size", str(micro_batch_size), "--recompute", "none",
            "--preset", "auto", "--choose", "--mfu", "1",
            "--peak-tflops", f"{rate_tflops:.9g}", *measured]


def projected(args, global_batch: int, micro_batch_size: int, links: str, rate_tflops: float,
              network_model: str) -> dict[str, float]:
    """{scheme: the choice's projected step seconds} at this batch (its row at the run's
    micro-batch size, no recomputation)."""
    from megatron_lbp.launch import choose, estimate

    a = estimate.job_from_args(estimate.build_parser().parse_args(
        estimate_argv(args, global_batch, micro_batch_size, links, rate_tflops, network_model)))
    rows = choose.rank(a)
    out = {}
    for s in args.schemes:
        row = next(r for r in rows if r.scheme == SCHEMES[s][0]
                   and r.choice.micro_batch_size == micro_batch_size
                   and r.choice.recompute == "none")
        out[s] = row.choice.step_s
    return out


def flops_per_micro_batch(args, micro_batch_size: int) -> float:
    """The cost model's FLOPs of one micro-batch (fwd+bwd, the plan's parameter count)."""
    from megatron_lbp.core.plan import Model
    from megatron_lbp.projection.project import model_flops_per_token

    # any scheme: the same parameters
    params = sum(n for _, n in Model(MODEL["layers"], MODEL["hidden"], MODEL["vocab"],
                                     table_rows=MODEL["seq"],
                                     num_attention_heads=MODEL["heads"]).units())
    return model_flops_per_token(params, MODEL["layers"], MODEL["hidden"], MODEL["seq"]) * \
        MODEL["seq"] * micro_batch_size


def run(args) -> dict[str, Any]:
    import torch

    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec

    world = args.nodes * args.ranks_per_node
    spec = TinyGPTSpec(num_layers=MODEL["layers"], hidden_size=MODEL["hidden"],
                       num_attention_heads=MODEL["heads"], vocab_size=MODEL["vocab"],
                       seq_length=MODEL["seq"], params_dtype=torch.bfloat16)
    # batch name "BxK": micro-batch size B, K micro-batches per step
    trains = {name: TrainSpec(steps=2 * (args.warmup + args.rounds), micro_batch_size=b,
                              micro_batches=k) for name, (b, k) in args.batches.items()}
    work = tempfile.mkdtemp(prefix="lbp-network-choice-")
    links = os.path.join(work, "links.json")
    out: dict[str, Any] = {"config": {
        "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "world_size": world,
        "rate_mbit": args.rate_mbit, "model": MODEL, "batches": list(args.batches),
        "schemes": list(args.schemes), "rounds": args.rounds, "warmup": args.warmup,
        "loadavg_start": list(os.getloadavg())}}
    with netns.EmulatedNetwork(args.nodes, args.rate_mbit) as net:
        if args.links_from == "survey":
            from benchmarks import survey_network as sn
            from megatron_lbp.launch import link_survey

            links = os.path.join(work, "survey.json")
            _on_network(net, args, sn.survey_rank, net.address(0), links, args.ranks_per_node,
                        link_survey.parse_sizes(args.survey_sizes_mib), 3,
                        link_survey.parse_codec_elements(args.survey_codec_mi_elements),
                        MODEL["hidden"])
            from megatron_lbp.projection import survey_file

            out["links"] = {"survey": links, "cross_node": sn.uplink_figures(
                survey_file.read(links), args.rate_mbit)}
        else:
            codes = _on_network(net, args, health_rank, links, args.ranks_per_node)
            if any(codes):
                raise RuntimeError(f"the health check failed on some rank: exit codes {codes}")
            with open(links) as f:
                out["links"] = json.load(f)
        ranks = _on_network(net, args, rank_rounds, net.address(0), list(args.schemes), spec,
                            trains, args.rounds, args.warmup, args.ranks_per_node)
    first = ranks[0]
    out["batches"] = {}
    for name, (b, k) in args.batches.items():
        gb = world * b * k
        # The compute ends with its slowest rank (every rank computes at once).
        mb_s = statistics.median(max(r["micro_batch_s"][name][i] for r in ranks)
                                 for i in range(args.rounds))
        flops = flops_per_micro_batch(args, b)
        rate = flops / mb_s / 1e12
        measured = {s: statistics.median(first["step_s"][f"{s}@{name}"]) for s in args.schemes}
        proj = projected(args, gb, b, links, rate, "shared_uplink")
        # With a survey its cross-node tables already hold the shared uplink (every group at once)
        per_rank = proj if args.links_from == "survey" else projected(args, gb, b, links, rate,
                                                                      "per_rank")
        out["batches"][name] = {
            "global_batch": gb, "micro_batch_size": b, "micro_batches": k,
            "compute": {"micro_batch_s": mb_s, "flops_per_micro_batch": flops,
                        "rate_tflops": rate},
            "measured_s": measured,
            "measured_rounds_s": {s: first["step_s"][f"{s}@{name}"] for s in args.schemes},
            "projected_s": proj, "projected_per_rank_network_s": per_rank,
            "projected_faster": min(proj, key=proj.get),
            "measured_faster": min(measured, key=measured.get),
            "losses": {s: first["losses"][f"{s}@{name}"] for s in args.schemes},
            "choose": f"python -m megatron_lbp.plan --choose --world-size {world} "
                      f"--gpus-per-node {args.ranks_per_node} " + " ".join(
                          estimate_argv(args, gb, b, "LINKS.json", rate, "shared_uplink")[4:]),
        }
    out["compute_how"] = ("fwd+bwd of one micro-batch, no communication, all ranks at once "
                          "(slowest rank), median over kept rounds; rate = the cost model's "
                          "FLOPs / seconds, given as --peak-tflops with --mfu 1")
    out["config"]["loadavg_end"] = list(os.getloadavg())
    return out


def render(out: dict[str, Any]) -> str:
    c = out["config"]
    links = out["links"].get("GB_per_s_per_gcd") or {
        f"cross-node {r['op']} {r['dtype']} / rate": r["ratio"]
        for r in out["links"]["cross_node"]}
    lines = [f"emulated network: {c['nodes']} nodes x {c['ranks_per_node']} ranks, uplink "
             f"{c['rate_mbit']:g} Mbit/s each way; GPT {c['model']}; {c['warmup']} warm-up + "
             f"{c['rounds']} kept rounds; load {c['loadavg_start'][0]:.1f} -> "
             f"{c['loadavg_end'][0]:.1f}",
             "links measured (health check: GB/s per GCD, one direction; survey: the uplink's "
             "figure over its rate): " + ", ".join(
                 f"{k} {v:.4g}" for k, v in links.items())]
    for name, b in out["batches"].items():
        lines.append(
            f"global batch {b['global_batch']} ({b['micro_batch_size']} x {b['micro_batches']} "
            f"per step; compute {b['compute']['micro_batch_s']:.3f} s per micro-batch = "
            f"{b['compute']['rate_tflops'] * 1e3:.3g} GFLOP/s per rank): projected (shared "
            "uplink; per-GCD network) / measured median s: " + "; ".join(
                f"{s} {b['projected_s'][s]:.3f} ({b['projected_per_rank_network_s'][s]:.3f}) / "
                f"{b['measured_s'][s]:.3f}" for s in b["measured_s"])
            + f" -> projected faster {b['projected_faster']}, measured faster "
            f"{b['measured_faster']}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{PROG}: error: {message}\n")


def _batches(text: str) -> dict[str, tuple[int, int]]:
    """"8x1,1x8" -> {"8x1": (8, 1), "1x8": (1, 8)}: two distinct (micro-batch size, count)."""
    out = {}
    for item in text.split(","):
        b, sep, k = item.partition("x")
        if not sep or not b.isdigit() or not k.isdigit() or int(b) < 1 or int(k) < 1:
            raise ValueError(text)
        out[f"{int(b)}x{int(k)}"] = (int(b), int(k))
    if len(out) != 2:
        raise ValueError(text)
    return out


def parse(argv) -> argparse.Namespace:
    p = _Parser(prog=PROG, description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--rate-mbit", default=str(RATE_MBIT),
                   help=f"each node's uplink, Mbit/s each way (a stated input; default "
                        f"{RATE_MBIT:g})")
    p.add_argument("--batches", default="8x1,1x4",
                   help="the two batches, each micro-batch size x micro-batches per step")
    p.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                   help=f"the two schemes compared, of {','.join(SCHEMES)}")
    p.add_argument("--rounds", type=int, default=3, help="kept rounds")
    p.add_argument("--warmup", type=int, default=0,
                   help="rounds dropped first (each round's first step of a scheme is untimed)")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per multi-rank run")
    p.add_argument("--links-from", choices=("health", "survey"), default="health",
                   help="what the choice reads: the health check's link file (--links, with "
                        "--network-model shared_uplink), or the link survey's tables (--survey)")
    p.add_argument("--survey-sizes-mib", default="0.25,1,4",
                   help="the survey's message sizes with --links-from survey")
    p.add_argument("--survey-codec-mi-elements", default="0.00390625,0.0625",
                   help="the survey's codec probe, elements per call in 2^20 (the tiny GPT's "
                        "quantizer calls code 10^2-10^5 elements)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        args.batches = _batches(args.batches)
    except ValueError:
        p.error(f"--batches={args.batches!r}: two distinct BxK (micro-batch size x "
                "micro-batches per step), e.g. 8x1,1x8")
    args.schemes = [s for s in args.schemes.split(",") if s]
    if len(set(args.schemes)) != 2 or any(s not in SCHEMES for s in args.schemes):
        p.error(f"--schemes={','.join(args.schemes)}: two distinct of {','.join(SCHEMES)}")
    for flag in ("nodes", "ranks_per_node", "rounds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    if args.nodes < 2:
        p.error(f"--nodes={args.nodes} must be >= 2 (the network joins nodes)")
    if args.ranks_per_node % GCDS_PER_PACKAGE:
        p.error(f"--ranks-per-node={args.ranks_per_node} must be a multiple of "
                f"{GCDS_PER_PACKAGE}")
    try:
        args.rate_mbit = float(args.rate_mbit)
    except ValueError:
        p.error(f"--rate-mbit={args.rate_mbit!r}: a rate in Mbit/s, stated (the uplink is an "
                "input of the emulation, never derived from the model)")
    from megatron_lbp.launch import link_survey

    try:
        link_survey.parse_codec_elements(args.survey_codec_mi_elements)
    except link_survey.SurveyUsage as exc:
        p.error(str(exc))
    if args.warmup < 0 or not args.rate_mbit > 0:
        p.error(f"--warmup={args.warmup} must be >= 0 and --rate-mbit={args.rate_mbit:g} > 0")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    return netns.command_main(
        PROG, lambda: run(args),
        lambda out: json_out.emit(out) if args.json else print(render(out)))


if __name__ == "__main__":
    sys.exit(main())
