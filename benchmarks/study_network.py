"""The adoption study (issue 29) on the emulated network: real training runs, interface byte counters.

    python -m benchmarks study-network --out DIR [--nodes 1,2]
        [--schemes lbp,zeropp,zero3,distopt,ds-zero3,ds-zeropp] [--ranks-per-node 2]
        [--rate-mbit 200] [--iters 8] [--repeats 3]

For every node count and scheme (the study's order: node counts ascending, schemes as given),
one run of ``python -m megatron_lbp.pretrain_gpt`` with ``LBP_RESULT_FILE`` on a fresh emulated
network (benchmarks.netns: one namespace per node, its uplink ``up0`` shaped to
``--rate-mbit`` each way, ranks of a node on its loopback). Each rank is started with
``ip netns exec`` (which mounts the namespace's own /sys, so ``/sys/class/net/up0`` is that
node's uplink) and ``LBP_NET_IFACES=up0``: the result file's ``interface_bytes`` are what
crossed the node uplinks, measured, beside the engine's ledger. gloo binds to ``up0``
(GLOO_SOCKET_IFNAME); traffic between ranks of one node stays on its loopback.

Weak scaling: ``--micro-batches`` per rank at every node count. The same GPT (megatron-core,
bf16), data (the shipped demo corpus), tokenizer, seed and settings in every run. A run that
fails or times out is recorded as failed with its reason and the study goes on
(megatron_lbp.integration.study_result.record_failure). At the end ``python -m megatron_lbp.study report``'s
report is written into ``DIR/runs/`` (report.md and PNGs); ``DIR/network.json`` holds the
network's settings. Needs root and iproute2; the namespaces are removed after every run.

Schemes are a parameter (``SCHEMES``: each one's training flags); DeepSpeed's ZeRO-3 and ZeRO++
train through their own entry (megatron_lbp/deepspeed_baseline/pretrain.py), which writes the
same result file; ZeRO++ (hpZ) starts at two nodes (megatron_lbp/study/plan.MIN_NODES).
``--repeats N`` runs each (node count, scheme) N times with seeds ``--seed`` .. ``--seed+N-1``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import netns

REPO = Path(__file__).resolve().parents[1]
SCHEMES = {"lbp": ["--hier-partition", "--hier-preset", "lbp"],
           "zeropp": ["--hier-partition", "--hier-preset", "zeropp"],
           "zero3": ["--hier-partition", "--hier-preset", "zero3"],
           "distopt": ["--use-distributed-optimizer"],
           # DeepSpeed's own ZeRO-3 and ZeRO++ through its pretrain entry (same flags and data,
           # the same result file): megatron_lbp/deepspeed_baseline/pretrain.py
           "ds-zero3": ["--ds-scheme", "ds-zero3"],
           "ds-zeropp": ["--ds-scheme", "ds-zeropp"]}
ENTRY = {"ds-zero3": "megatron_lbp.deepspeed_baseline.pretrain",
         "ds-zeropp": "megatron_lbp.deepspeed_baseline.pretrain"}
PORT = 29500   # each run has a fresh network: no port of an earlier run can still be bound


class StudyError(ValueError):
    """Input the study refuses; the message is one line."""


def _ints(text: str, what: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise StudyError(f"{what} {text!r}: give comma-separated integers") from None
    if not values or values[0] < 1:
        raise StudyError(f"{what} {text!r}: give comma-separated integers >= 1")
    return values


def train_args(args, nodes: int, scheme: str, data: str, seed: int | None = None) -> list[str]:
    """pretrain_gpt's arguments for one run: the same model and settings for every scheme."""
    seed = args.seed if seed is None else seed
    gbs = args.micro_batch_size * args.micro_batches * nodes * args.ranks_per_node
    argv = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq_length),
            "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(gbs),
            "--train-iters", str(args.iters), "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--seed", str(seed), "--bf16",
            "--position-embedding-type", "rope", "--log-interval", "1", "--eval-iters", "0",
            "--eval-interval", "100000", "--split", "98,2,0", "--data-path", data,
            "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", str(REPO / "tokenizer" / "lbp_bpe.model"), *SCHEMES[scheme]]
    if scheme in ENTRY:
        argv += ["--ds-ranks-per-node", str(args.ranks_per_node)]
    elif scheme != "distopt":
        argv += ["--hier-gpus-per-node", str(args.ranks_per_node)]
    return argv


def _why(log: str) -> str:
    lines = [l for l in log.splitlines() if "Error" in l or "error:" in l or "Traceback" in l]
    return (lines[-1] if lines else (log.strip().splitlines() or ["no output"])[-1])[:300]


def run_one(args, nodes: int, scheme: str, data: str, run_dir: Path, seed: int) -> str:
    """One run on a fresh emulated network; its status ('ok' or 'failed: ...')."""
    from megatron_lbp.integration import study_result as result

    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "result.json"
    target.unlink(missing_ok=True)
    world = nodes * args.ranks_per_node
    name = run_dir.name
    status, reason = 0, ""
    with netns.EmulatedNetwork(nodes=nodes, rate_mbit=args.rate_mbit) as net, \
            open(run_dir / "log", "w") as log:
        procs = []
        for rank in range(world):
            node, local = divmod(rank, args.ranks_per_node)
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                       LOCAL_WORLD_SIZE=str(args.ranks_per_node), MASTER_ADDR=net.address(0),
                       MASTER_PORT=str(PORT), GLOO_SOCKET_IFNAME=netns.UPLINK, OMP_NUM_THREADS="1",
                       PYTHONWARNINGS="ignore", LBP_RESULT_FILE=str(target), LBP_NET_IFACES=netns.UPLINK,
                       LBP_STUDY_SCALING="weak", LBP_STUDY_RUN=name, SLURM_NNODES=str(nodes))
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", net.place(node), sys.executable, "-m",
                 ENTRY.get(scheme, "megatron_lbp.pretrain_gpt"),
                 *train_args(args, nodes, scheme, data, seed)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + args.timeout
        try:
            for p in procs:
                status = p.wait(timeout=max(deadline - time.monotonic(), 1)) or status
        except subprocess.TimeoutExpired:
            status, reason = -1, f"timed out after {args.timeout} s"
        finally:
            for p in procs:   # the first failing rank's peers, or every rank after a timeout
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if not target.exists() or result.load(str(target)).get("status") != "ok":
        text = (run_dir / "log").read_text(errors="replace")
        result.record_failure(str(target), reason or f"exit {status}: {_why(text)}",
                              {"scheme": scheme, "nodes": str(nodes), "gcds": str(world),
                               "seed": str(seed), "scaling": "weak", "study_run": name})
    got = result.load(str(target))
    return "ok" if got["status"] == "ok" else f"failed: {got.get('reason')}"


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks study-network",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the study's directory: runs/, report, network.json")
    p.add_argument("--nodes", default="1,2", help="emulated node counts [1,2]")
    p.add_argument("--schemes", default="lbp,zeropp,zero3,distopt", help=f"of {', '.join(SCHEMES)}")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate-mbit", type=float, default=200.0, help="each node uplink, each way")
    p.add_argument("--iters", type=int, default=8, help="iterations per run (the first 2 are warm-up)")
    p.add_argument("--micro-batches", type=int, default=1, help="per rank (weak scaling)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per node count and scheme, with seeds --seed, --seed+1, ... (the "
                        "report's runs column, its step spread and its loss noise floor)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is failed")
    p.add_argument("--no-report", action="store_true", help="runs only")
    args = p.parse_args(argv)
    try:
        args.node_counts = _ints(args.nodes, "--nodes")
        args.scheme_list = [s for s in args.schemes.split(",") if s]
        bad = [s for s in args.scheme_list if s not in SCHEMES]
        if bad or not args.scheme_list:
            raise StudyError(f"--schemes {args.schemes!r}: choose from {', '.join(SCHEMES)}")
        for name in ("ranks_per_node", "iters", "micro_batches", "micro_batch_size", "repeats"):
            if getattr(args, name) < 1:
                raise StudyError(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
        if args.rate_mbit <= 0:
            raise StudyError(f"--rate-mbit {args.rate_mbit}: must be positive")
    except StudyError as err:
        p.error(str(err))
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    missing = netns.missing_requirements()
    if missing:
        print(f"python -m benchmarks study-network: error: {missing}", file=sys.stderr)
        return 2
    netns.sweep_stale()
    out = Path(args.out).resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    from megatron_lbp.integration.data import build_demo_data

    data = build_demo_data(str(out / "data"), quiet=True)
    (out / "network.json").write_text(json.dumps({
        "what": "emulated nodes: one network namespace each, uplink veth shaped with tc tbf both ways, "
                "ranks of a node on its loopback (benchmarks/netns.py)",
        "uplink_rate_mbit_each_way": args.rate_mbit, "ranks_per_node": args.ranks_per_node,
        "interfaces_counted": netns.UPLINK, "nodes": args.node_counts, "schemes": args.scheme_list,
        "iterations": args.iters, "micro_batches_per_rank": args.micro_batches,
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size},
        "seed": args.seed, "repeats": args.repeats, "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "command": "python -m benchmarks study-network " + " ".join(sys.argv[1:] if argv is None else argv),
    }, indent=1) + "\n")
    from megatron_lbp.study.plan import MIN_NODES

    start = time.monotonic()
    for nodes in args.node_counts:
        for scheme in args.scheme_list:
            if nodes < MIN_NODES.get(scheme, 1):
                print(f"[study-network] {scheme} at {nodes} node(s): not run (its secondary "
                      f"partition needs {MIN_NODES[scheme]} nodes)", flush=True)
                continue
            for seed in range(args.seed, args.seed + args.repeats):
                name = f"n{nodes:03d}-{scheme}-s{seed}"
                t0 = time.monotonic()
                print(f"[study-network] {time.strftime('%H:%M:%S')} {name}: {nodes} node(s) x "
                      f"{args.ranks_per_node} ranks, uplink {args.rate_mbit:g} Mbit/s", flush=True)
                status = run_one(args, nodes, scheme, data, out / "runs" / name, seed)
                print(f"[study-network] {name}: {status} ({time.monotonic() - t0:.0f} s)",
                      flush=True)
    print(f"[study-network] every run: {time.monotonic() - start:.0f} s", flush=True)
    shutil.rmtree(out / "data", ignore_errors=True)
    if args.no_report:
        return 0
    return subprocess.run([sys.executable, "-m", "megatron_lbp.study", "report", str(out / "runs")],
                          cwd=REPO, stdout=subprocess.DEVNULL).returncode


if __name__ == "__main__":
    sys.exit(main())
