"""Bytes per rank per optimizer step on each link class, for every scheme, side by side.

One model (the tiny megatron-core GPT in bf16) trains on gloo ranks placed as
emulated nodes of 8 ranks in packages of 2 GCDs (16 ranks = 2 nodes x 4
packages x 2 GCDs). Each scheme runs two optimizer steps of K micro-batches;
the second step is counted:

- engine presets (lbp, lbp with an int8 secondary copy S=2 / S=8, zeropp with
  qwZ, zero3, zero2, hsdp): the engine's own ledger (engine/comm.py), i.e. the
  ``traffic_bytes`` of that step's report. The same step is also counted by
  :mod:`benchmarks.stock_accounting`, and the two must agree;
- stock Megatron DDP + distributed optimizer (``megatron-distopt``) and stock
  Megatron-FSDP (``megatron-fsdp``, ``optim_grads_params``): torch.distributed's
  collectives wrapped by :mod:`benchmarks.stock_accounting`, which
  charges them with the engine's formulas and link classes.

Every scheme reduces gradients in fp32 (engine default, Megatron's
``grad_reduce_in_fp32=True``, Megatron-FSDP's fp32 main grads). Scalar
collectives (loss, gradient norm, inf flags) are left out of every row.

    python -m benchmarks traffic [--micro-batches K] [--ranks 16] [--json]
        [--schemes lbp,zero3,...] [--bucket-size N]

``--json`` prints ``{scheme: {"package": bytes, "node": bytes, "network": bytes}}``
for K micro-batches (default 1). Without it, K=1 and K=4 are both run and a
table with the ratios lbp/zero3 and lbp/zeropp on the network is printed.
"""
from __future__ import annotations
from megatron_lbp.projection import json_out

import argparse
import sys
from typing import Any

from megatron_lbp.core.costs import LINK_CLASS_ORDER
from megatron_lbp.projection.schemes import (ENGINE_SCHEMES, GCDS_PER_PACKAGE, STOCK_SCHEMES,
                                             engine_argv, schemes_from)

GPUS_PER_NODE = 8
COUNTED_STEP = 1           # steps 0 and 1 run; step 1 is counted
STEPS = COUNTED_STEP + 1

SCHEMES = tuple(ENGINE_SCHEMES) + STOCK_SCHEMES


def _specs(micro_batches: int, bucket_size: int | None):
    import torch

    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec

    spec = TinyGPTSpec(params_dtype=torch.bfloat16)
    train = TrainSpec(steps=STEPS, micro_batches=micro_batches, bucket_size=bucket_size)
    return spec, train


def setup_fsdp(spec, train):
    """Stock Megatron-FSDP (``optim_grads_params``) on the default data-parallel group, on CPU.

    ``gradient_reduce_div_fusion=False``: gloo has no PREMUL_SUM. fp32 main
    weights and gradients (Megatron-FSDP's defaults for main params; main grads
    asked for explicitly), gradients reduced in fp32 like every other row.
    On gloo its parameter all-gathers are synchronous (compat.megatron_fsdp_on_gloo:
    asynchronous ones corrupt the heap now and then).
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides

    from megatron_lbp.integration import compat
    from megatron_lbp.testing import tiny_gpt

    compat.megatron_fsdp_on_gloo()
    tiny_gpt.init_megatron_state(seed=spec.seed)
    model, config = tiny_gpt.build_tiny_gpt(spec)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        gradient_reduce_div_fusion=False,
        megatron_fsdp_main_grads_dtype=torch.float32,
        megatron_fsdp_grad_comm_dtype=torch.float32,
        bucket_size=train.bucket_size,
    )
    fsdp_model = FullyShardedDataParallel(config, ddp_config, model, device=torch.device("cpu"))
    opt_config = tiny_gpt._optimizer_config(spec, train, distributed=True)
    optimizer = get_megatron_optimizer(
        opt_config, [fsdp_model], config_overrides=get_standard_config_overrides(opt_config))
    return tiny_gpt.Trainer(spec, train, fsdp_model, model, optimizer,
                            tiny_gpt.constant_schedule(optimizer, opt_config),
                            parallel_state.get_data_parallel_rank(),
                            parallel_state.get_data_parallel_world_size(),
                            parallel_state.get_data_parallel_group())


def rank_traffic(scheme: str, micro_batches: int, bucket_size: int | None,
                 gpus_per_node: int) -> dict[str, Any]:
    """On every rank: train STEPS steps of ``scheme``, count the last; this rank's bytes."""
    import torch.distributed as dist

    from benchmarks.stock_accounting import count_collectives
    from megatron_lbp.testing.tiny_gpt import setup_hier, setup_stock
    from megatron_lbp.core.topology import emulated_locations

    spec, train = _specs(micro_batches, bucket_size)
    locations = emulated_locations(dist.get_world_size(), gpus_per_node, GCDS_PER_PACKAGE)
    if scheme in ENGINE_SCHEMES:
        trainer = setup_hier(spec, train, engine_argv(scheme, gpus_per_node))
    elif scheme == "megatron-distopt":
        trainer = setup_stock(spec, train)
    elif scheme == "megatron-fsdp":
        trainer = setup_fsdp(spec, train)
    else:
        raise ValueError(f"unknown scheme {scheme!r}: must be one of {SCHEMES}")
    result = trainer.run(range(COUNTED_STEP))
    engine = scheme in ENGINE_SCHEMES
    if engine:
        trainer.model.settle()   # the last step's weight refresh is not the counted step's
    with count_collectives(locations) as ledger:
        trainer.run([COUNTED_STEP], result=result)
        if engine:
            # The step's weight refresh runs on the engine's streams after the step returns
            # (it lands under the next forward); the ledger charges it to this step.
            trainer.model.settle()
    out: dict[str, Any] = {"wrapper": ledger.by_class(),
                           "wrapper_control": ledger.by_class(include_control=True),
                           "losses": result.losses, "calls": _call_summary(ledger.calls)}
    if scheme in ENGINE_SCHEMES:
        report = result.step_reports[-1]
        hier = trainer.hier
        out.update(ledger=report["traffic_bytes"], by_phase=report["traffic_by_phase"],
                   bucket_numels=trainer.model.bucket_numels(), config=hier.config.as_dict(),
                   links=dict(hier.link_classes))
    return out


def _call_summary(calls) -> dict[str, dict[str, float]]:
    """Rank's counted calls grouped as "op n=<group size> <link> <kind>" -> {count, bytes}."""
    out: dict[str, dict[str, float]] = {}
    for c in calls:
        key = f"{c['op']} n={c['group_size']} {c['link']} {c['kind']}"
        row = out.setdefault(key, {"count": 0, "bytes": 0.0})
        row["count"] += 1
        row["bytes"] += float(c["bytes"])
    return out


def scheme_row(per_rank: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """One scheme's row from every rank's counts: rank 0's bytes by link class (``key``:
    "ledger", the engine's own, or "wrapper", the torch.distributed wrapper of
    stock_accounting), whether every rank sent the same, the most any rank sent, rank 0's
    losses and calls, and for the ledger whether the wrapper counted the same."""
    rows = [r[key] for r in per_rank]
    entry = {"bytes": rows[0], "source": "engine ledger" if key == "ledger"
             else "stock_accounting wrapper",
             "uniform_across_ranks": all(r == rows[0] for r in rows),
             "max_over_ranks": {c: max(r[c] for r in rows) for c in LINK_CLASS_ORDER},
             "losses": per_rank[0]["losses"], "calls": per_rank[0]["calls"]}
    if key == "ledger":
        entry["wrapper_agrees"] = all(r["wrapper"] == r["ledger"] for r in per_rank)
    return entry


def measure(schemes=SCHEMES, micro_batches: int = 1, ranks: int = 16,
            bucket_size: int | None = None, gpus_per_node: int = GPUS_PER_NODE,
            timeout: float = 900.0) -> dict[str, Any]:
    """Run every scheme; {scheme: {"bytes": {link: n}, "source": ..., ...} or {"unavailable": why}}.

    Engine rows also carry the ledger's bytes by phase, the bucket numels, the
    resolved config and the link class of each group family (for the plan check).
    """
    from megatron_lbp.testing.multirank import MultiRankError, rank_location_env, run_on_ranks

    gpus_per_node = min(gpus_per_node, ranks)
    out: dict[str, Any] = {}
    for scheme in schemes:
        try:
            per_rank = run_on_ranks(rank_traffic, ranks, scheme, micro_batches, bucket_size,
                                    gpus_per_node, rank_env=rank_location_env(gpus_per_node),
                                    timeout=timeout)
        except MultiRankError as e:
            if scheme != "megatron-fsdp":
                raise
            out[scheme] = {"unavailable": _first_error_line(str(e))}
            continue
        entry = scheme_row(per_rank, "ledger" if scheme in ENGINE_SCHEMES else "wrapper")
        if scheme in ENGINE_SCHEMES:
            for field in ("by_phase", "bucket_numels", "config", "links"):
                entry[field] = per_rank[0][field]
        out[scheme] = entry
    return out


def _first_error_line(message: str) -> str:
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception"))]
    return (errors[-1] if errors else lines[0])[:300]


def as_json(result: dict[str, Any]) -> dict[str, Any]:
    """The --json object: {scheme: {"package", "node", "network"}} (or {"unavailable": why})."""
    return {s: (dict(r["bytes"]) if "bytes" in r else {"unavailable": r["unavailable"]})
            for s, r in result.items()}


def _ratio(a, b) -> str:
    return f"{a / b:.4f} (1/{b / a:.2f})" if a and b else "n/a"


def render(results: dict[int, dict[str, Any]], ranks: int,
           gpus_per_node: int = GPUS_PER_NODE) -> str:
    per_node = min(ranks, gpus_per_node)
    lines = [f"bytes sent per rank per optimizer step, tiny GPT (bf16, fp32 gradient reduction), "
             f"{ranks} gloo ranks = {ranks // per_node} node(s) x "
             f"{per_node // GCDS_PER_PACKAGE} packages x {GCDS_PER_PACKAGE} GCDs; "
             f"the second of two steps is counted; scalar collectives left out"]
    for k, result in results.items():
        lines.append(f"\nK = {k} micro-batch(es)")
        lines.append(f"  {'scheme':<18}{'package':>14}{'node':>14}{'network':>14}  counted by")
        for scheme, r in result.items():
            if "bytes" not in r:
                lines.append(f"  {scheme:<18}unavailable: {r['unavailable']}")
                continue
            b = r["bytes"]
            note = r["source"]
            if "wrapper_agrees" in r:
                note += " (wrapper agrees)" if r["wrapper_agrees"] else " (WRAPPER DISAGREES)"
            if not r["uniform_across_ranks"]:
                note += " [ranks differ; rank 0 shown]"
            lines.append(f"  {scheme:<18}" + "".join(f"{b[c]:>14,.0f}" for c in LINK_CLASS_ORDER)
                         + f"  {note}")
        net = {s: r["bytes"]["network"] for s, r in result.items() if "bytes" in r}
        if "lbp" in net:
            for other in ("zero3", "zeropp", "megatron-distopt", "megatron-fsdp"):
                if other in net:
                    lines.append(f"  network lbp / {other}: {_ratio(net['lbp'], net[other])}")
    ks = sorted(results)
    if len(ks) > 1:
        lines.append("")
        for scheme in results[ks[0]]:
            vals = [results[k][scheme]["bytes"]["network"] for k in ks
                    if "bytes" in results[k].get(scheme, {})]
            if len(vals) == len(ks):
                same = "independent of K" if len(set(vals)) == 1 else "grows with K"
                lines.append(f"  {scheme:<18}network bytes at K={ks}: {vals}: {same}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks traffic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=int, default=None,
                   help="K (default: 1 with --json, else both 1 and 4)")
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE,
                   help="ranks per emulated node (packages are always 2 ranks)")
    p.add_argument("--schemes", default=",".join(SCHEMES),
                   help=f"comma-separated subset of {','.join(SCHEMES)}")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="bucket size in elements for every scheme (default: Megatron's 40M)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    schemes = schemes_from(p, args.schemes, SCHEMES)
    gpn = args.gpus_per_node
    if gpn < GCDS_PER_PACKAGE or gpn % GCDS_PER_PACKAGE:
        p.error(f"--gpus-per-node={gpn} must be a positive multiple of {GCDS_PER_PACKAGE}")
    if args.ranks < 2 or args.ranks % GCDS_PER_PACKAGE or (
            args.ranks > gpn and args.ranks % gpn):
        p.error(f"--ranks={args.ranks} must be an even number <= {gpn} "
                f"or a multiple of {gpn} (--gpus-per-node)")
    if args.micro_batches is not None and args.micro_batches < 1:
        p.error(f"--micro-batches={args.micro_batches} must be >= 1")
    ks = [args.micro_batches or 1] if (args.json or args.micro_batches) else [1, 4]
    results = {k: measure(schemes, k, args.ranks, args.bucket_size, gpn) for k in ks}
    if args.json:
        json_out.emit(as_json(results[ks[0]]))
    else:
        print(render(results, args.ranks, gpn))
    return 0


if __name__ == "__main__":
    sys.exit(main())
