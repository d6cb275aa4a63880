"""Bytes per rank per optimizer step on each link class: DeepSpeed's schemes beside the engine's presets.

Counted exactly as ``python -m benchmarks traffic`` counts its stock
rows: torch.distributed's collectives wrapped by
:mod:`benchmarks.stock_accounting` (bytes each rank sends, ring
formulas, charged to the slowest link class the group spans), on the same
model (the tiny megatron-core GPT in bf16, fp32 gradient reduction in the
engine; DeepSpeed reduces in its bf16 training dtype), the second of two steps
counted, scalar collectives left out. Every scheme trains in the same ranks,
one after another (one launch per K).

    python -m benchmarks.deepspeed.traffic [--ranks 8] [--gpus-per-node 4]
        [--micro-batches K] [--schemes zero3,zeropp,ds-zero3,ds-hpz,ds-zeropp] [--json]

Without ``--micro-batches``, K=1 and K=4 are both run.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any

from megatron_lbp.deepspeed_baseline.schemes import SCHEMES as DS_SCHEMES
from benchmarks import traffic as engine_traffic
from megatron_lbp.core.costs import LINK_CLASS_ORDER

ENGINE_SCHEMES = ("lbp", "zero3", "zeropp")
SCHEMES = ENGINE_SCHEMES + DS_SCHEMES


def ds_rank_traffic(scheme: str, micro_batches: int, bucket_size: int | None,
                    gpus_per_node: int) -> dict[str, Any]:
    """On every rank: two steps of a DeepSpeed scheme, the second counted by the wrapper."""
    import torch.distributed as dist

    from megatron_lbp.deepspeed_baseline.trainer import collectives_visible, setup_deepspeed
    from benchmarks.stock_accounting import count_collectives
    from megatron_lbp.core.topology import emulated_locations

    spec, train = engine_traffic._specs(micro_batches, bucket_size)
    locations = emulated_locations(dist.get_world_size(), gpus_per_node,
                                   engine_traffic.GCDS_PER_PACKAGE)
    trainer = setup_deepspeed(spec, train, scheme, ranks_per_node=gpus_per_node)
    result = trainer.run(range(engine_traffic.COUNTED_STEP))
    with count_collectives(locations) as ledger, collectives_visible():
        trainer.run([engine_traffic.COUNTED_STEP], result=result)
    return {"wrapper": ledger.by_class(), "losses": result.losses,
            "calls": engine_traffic._call_summary(ledger.calls)}


def rank_all(schemes, micro_batches: int, bucket_size: int | None, gpus_per_node: int):
    """Every scheme in this rank, one after another; a failure is that scheme's result."""
    import torch.distributed as dist

    out = {}
    for scheme in schemes:
        try:
            if scheme in DS_SCHEMES:
                out[scheme] = ds_rank_traffic(scheme, micro_batches, bucket_size, gpus_per_node)
            else:
                out[scheme] = engine_traffic.rank_traffic(scheme, micro_batches, bucket_size,
                                                          gpus_per_node)
        except Exception:  # noqa: BLE001 - reported as this scheme's result
            out[scheme] = f"{scheme} raised on rank {dist.get_rank()}:\n{traceback.format_exc()}"
    return out


def measure(schemes=SCHEMES, micro_batches: int = 1, ranks: int = 8, gpus_per_node: int = 4,
            bucket_size: int | None = None, timeout: float = 1800.0) -> dict[str, Any]:
    """{scheme: {"bytes": rank 0's {link: n}, "max_over_ranks", "uniform_across_ranks", "calls", ...}}.

    Engine presets report the engine's own ledger (which the wrapper must equal, as in
    ``bench traffic``); DeepSpeed rows the wrapper.
    """
    from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks

    per_rank = run_on_ranks(rank_all, ranks, list(schemes), micro_batches, bucket_size,
                            gpus_per_node, rank_env=rank_location_env(gpus_per_node),
                            timeout=timeout)
    out: dict[str, Any] = {}
    for scheme in schemes:
        results = [r[scheme] for r in per_rank]
        failed = [r for r in results if isinstance(r, str)]
        if failed:
            raise RuntimeError(failed[0])
        out[scheme] = engine_traffic.scheme_row(
            results, "wrapper" if scheme in DS_SCHEMES else "ledger")
    return out


def render(results: dict[int, dict[str, Any]], ranks: int, gpus_per_node: int) -> str:
    g = engine_traffic.GCDS_PER_PACKAGE
    lines = [f"bytes sent per rank per optimizer step, tiny GPT (bf16), {ranks} gloo ranks = "
             f"{ranks // gpus_per_node} node(s) x {gpus_per_node // g} packages x {g} GCDs; "
             f"the second of two steps counted; scalar collectives left out"]
    for k, result in results.items():
        lines.append(f"\nK = {k} micro-batch(es)")
        lines.append(f"  {'scheme':<12}" + "".join(f"{c:>14}" for c in LINK_CLASS_ORDER)
                     + "  counted by")
        for scheme, r in result.items():
            note = r["source"]
            if "wrapper_agrees" in r:
                note += " (wrapper agrees)" if r["wrapper_agrees"] else " (WRAPPER DISAGREES)"
            if not r["uniform_across_ranks"]:
                note += " [ranks differ; rank 0 shown]"
            lines.append(f"  {scheme:<12}" + "".join(f"{r['bytes'][c]:>14,.0f}"
                                                      for c in LINK_CLASS_ORDER) + f"  {note}")
        net = {s: r["bytes"]["network"] for s, r in result.items()}
        for a, b in (("lbp", "ds-zeropp"), ("lbp", "ds-zero3"), ("zero3", "ds-zero3"),
                     ("zeropp", "ds-zeropp")):
            if a in net and b in net and net[b]:
                lines.append(f"  network {a} / {b}: {net[a] / net[b]:.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.deepspeed.traffic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=int, default=None)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--bucket-size", type=int, default=None)
    p.add_argument("--calls", action="store_true", help="also print each scheme's counted calls")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    schemes = engine_traffic.schemes_from(p, args.schemes, SCHEMES)
    if args.gpus_per_node < 2 or args.gpus_per_node % 2 or args.ranks % args.gpus_per_node \
            or args.ranks // args.gpus_per_node < 2:
        p.error(f"--ranks={args.ranks} must be at least two nodes of --gpus-per-node="
                f"{args.gpus_per_node} (an even number)")
    if args.micro_batches is not None and args.micro_batches < 1:
        p.error(f"--micro-batches={args.micro_batches} must be >= 1")
    ks = [args.micro_batches] if args.micro_batches else [1, 4]
    results = {k: measure(schemes, k, args.ranks, args.gpus_per_node, args.bucket_size)
               for k in ks}
    if args.json:
        print(json.dumps({k: {s: r["bytes"] for s, r in res.items()} for k, res in results.items()}))
    else:
        print(render(results, args.ranks, args.gpus_per_node))
        if args.calls:
            for k, res in results.items():
                for s, r in res.items():
                    print(f"\nK={k} {s} calls:")
                    for call, v in sorted(r["calls"].items()):
                        print(f"  {call:<48} x{v['count']:<4} {v['bytes']:>14,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
