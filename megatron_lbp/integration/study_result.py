"""One JSON result file per training run: ``LBP_RESULT_FILE=PATH python -m megatron_lbp.pretrain_gpt ...``.

The training hooks feed it: ``start`` when the train loop begins, ``on_iteration`` at
every training_log call, ``finish`` when the loop returns (a collective) or ``fail`` when
it raises (no collective: the peers may be gone). Without the variable every call
returns at once. It measures step time (the first ``LBP_RESULT_WARMUP`` iterations left
out), TFLOPS per GCD by Megatron's own FLOP count, peak memory, bytes per link class from
the engine's ledger and, with ``LBP_NET_IFACES``, interface byte counters; anything it
cannot measure is written as "not measured" with the reason, and the file says how each
figure was measured (docs/study.md, "2. The result file").
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

ENV = "LBP_RESULT_FILE"
SCHEMA = 1
MEMORY_SOURCES = {
    "gpu": "device allocator: torch.cuda.max_memory_allocated / max_memory_reserved, max over ranks",
    "ledger": "engine ledger (CPU): weight slices + gradients + optimizer state + peak transient "
              "buffers the engine holds, max over ranks and steps; activations not counted",
}
FLOP_FORMULA = ("megatron.training.training.num_floating_point_operations(args, global_batch_size) "
                "/ step time / world size / 1e12 (Megatron's --log-throughput)")

_rec: dict[str, Any] = {}
_STARTED = time.time()  # a failed result older than this process is a previous run's


def path() -> str | None:
    return os.environ.get(ENV) or None


def warmup() -> int:
    return max(int(os.environ.get("LBP_RESULT_WARMUP", "2")), 0)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _writer() -> bool:
    rank, world = _rank_world()
    return rank == world - 1


def read_interface_counters(names: list[str], root: str = "/sys/class/net") -> tuple[dict | None, str]:
    """{iface: {"tx": bytes, "rx": bytes}} or (None, why not)."""
    if not names:
        return None, f"not measured: no interfaces named (set LBP_NET_IFACES)"
    out = {}
    for name in names:
        try:
            out[name] = {k: int(open(os.path.join(root, name, "statistics", f"{k}_bytes")).read())
                         for k in ("tx", "rx")}
        except (OSError, ValueError) as err:
            return None, f"not measured: {root}/{name}/statistics unreadable ({err.__class__.__name__})"
    return out, "ok"


def _node_leader() -> bool:
    if _rec.get("local_rank") is not None:  # the runner knew it before a library changed LOCAL_RANK
        return _rec["local_rank"] == 0
    return os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0"


def start(args: Any, *, scheme: str | None = None, group_sizes: dict | None = None,
          unmeasured: str | None = None, local_rank: int | None = None) -> None:
    """Loop start. A runner other than pretrain_gpt (the DeepSpeed baseline) names its
    ``scheme`` and ``group_sizes`` itself, says in ``unmeasured`` why it has no CPU memory
    figure and no ledger bytes, and gives its ``local_rank`` in the node where LOCAL_RANK
    no longer says it."""
    if not path():
        return
    ifaces = [n for n in os.environ.get("LBP_NET_IFACES", "").split(",") if n]
    _rec.clear()
    _rec["local_rank"] = local_rank
    counters, why = read_interface_counters(ifaces) if _node_leader() else (None, "not a node leader")
    _rec.clear()
    _rec.update(t0=time.perf_counter(), last=time.perf_counter(), times={}, losses={}, ledger_mem=0,
                traffic=None, ifaces=ifaces, counters0=counters, counters_why=why, args=args,
                first_iteration=None, scheme=scheme, group_sizes=group_sizes, unmeasured=unmeasured,
                local_rank=local_rank)


def on_iteration(iteration: int, loss_dict: dict | None, report: dict | None) -> None:
    """Called once per iteration from training_log, ``report`` the engine's last step report."""
    if not _rec:
        return
    now = time.perf_counter()
    if _rec["first_iteration"] is None:
        _rec["first_iteration"] = iteration
    _rec["times"][iteration] = now - _rec["last"]
    _rec["last"] = now
    for key, value in (loss_dict or {}).items():
        if key == "lm loss":
            value = value[0] / value[1] if getattr(value, "numel", lambda: 1)() == 2 else value
            _rec["losses"][iteration] = float(value)
    if report:
        _rec["traffic"] = {k: int(v) for k, v in report["traffic_bytes"].items()}
        _rec["ledger_mem"] = max(_rec["ledger_mem"], int(sum(report["memory_bytes"].values())))


def summarize_times(times: dict[int, float], skip: int) -> dict:
    """Median and spread of the step times after the first ``skip`` iterations."""
    its = sorted(times)
    warm, kept = its[:skip], [times[i] for i in its[skip:]]
    out = {"warmup_iterations_excluded": warm, "iterations_measured": len(kept),
           "median_s": None, "min_s": None, "max_s": None, "stdev_s": None}
    if kept:
        out.update(median_s=statistics.median(kept), min_s=min(kept), max_s=max(kept),
                   stdev_s=statistics.stdev(kept) if len(kept) > 1 else 0.0)
    return out


def _describe(args: Any, hier: Any) -> dict:
    """What ran: ``hier`` is the engine's hierarchy (None for stock Megatron or before it exists)."""
    _, world = _rank_world()
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    cp = getattr(args, "context_parallel_size", 1) or 1
    dp = world // (tp * pp * cp)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "0")) or 0)
    if _rec.get("scheme"):
        scheme, groups = _rec["scheme"], dict(_rec.get("group_sizes") or {})
        nodes = int(os.environ.get("SLURM_NNODES") or (world // local if local else 1))
    elif hier is not None:
        from megatron_lbp.core.config import DEFAULT_PRESET

        # the preset names the scheme; group_sizes says what it resolved to (flags may change them)
        scheme = getattr(hier.config, "preset", None) or getattr(args, "hier_preset", None) or DEFAULT_PRESET
        groups = {k: v for k, v in hier.config.as_dict().items() if k.endswith("group_size") or k == "secondary_dtype"}
        nodes = len({loc.node for loc in hier.locations.values()})
    else:
        scheme = "distopt" if getattr(args, "use_distributed_optimizer", False) else "ddp"
        groups = {"optim_group_size": dp if scheme == "distopt" else 1}
        nodes = int(os.environ.get("SLURM_NNODES") or (world // local if local else 1))
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    return {"scheme": scheme, "group_sizes": groups, "nodes": nodes, "gcds": world,
            "tensor_parallel": tp, "pipeline_parallel": pp, "data_parallel": dp,
            "micro_batch_size": mbs, "micro_batches": gbs // (mbs * dp), "global_batch": gbs,
            "seq_length": args.seq_length, "seed": getattr(args, "seed", None),
            "train_iters": getattr(args, "train_iters", None),
            "model": {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                      "num_attention_heads": args.num_attention_heads,
                      "vocab_size": getattr(args, "padded_vocab_size", None)},
            "gcds_per_node": world // nodes if nodes else None,
            # set by the study launcher (scripts/launch/lbp_study.sh): which study, which run
            "scaling": os.environ.get("LBP_STUDY_SCALING") or None,
            "study_run": os.environ.get("LBP_STUDY_RUN") or None}


def _flops_per_step(args: Any) -> float | None:
    try:
        from megatron.training.training import num_floating_point_operations

        return float(num_floating_point_operations(args, args.global_batch_size))
    except Exception:  # a model family the formula does not know: say so rather than guess
        return None


def _reduce(values: list[float], op: str) -> list[float]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t.cpu().tolist()


def finish(args: Any, hier: Any = None) -> None:
    """End of a successful loop; every rank calls it (two all_reduces), the last rank writes."""
    if not _rec:
        return
    import torch

    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    if gpu:
        mem = [float(torch.cuda.max_memory_allocated()), float(torch.cuda.max_memory_reserved())]
    else:
        mem = [float(_rec["ledger_mem"]), 0.0]
    counters1, _ = (read_interface_counters(_rec["ifaces"]) if _node_leader()
                      else (None, "not a node leader"))
    c0 = _rec["counters0"]
    have = 1.0 if (c0 is not None and counters1 is not None) else 0.0
    leaders = 1.0 if _node_leader() else 0.0
    tx = sum(counters1[n]["tx"] - c0[n]["tx"] for n in c0) if have else 0.0
    rx = sum(counters1[n]["rx"] - c0[n]["rx"] for n in c0) if have else 0.0
    traffic = _rec["traffic"] or {}
    mem = _reduce(mem, "MAX")
    sums = _reduce([tx, rx, have, leaders, float(traffic.get("package", 0)), float(traffic.get("node", 0)),
                    float(traffic.get("network", 0))], "SUM")
    if not _writer():
        _rec.clear()
        return
    result = _common(args, "ok", None, hier)
    step = result["step_time"]
    if gpu:
        result["peak_memory_per_gcd"] = {"source": MEMORY_SOURCES["gpu"], "allocated_bytes": int(mem[0]),
                                         "reserved_bytes": int(mem[1])}
    elif _rec["traffic"] is not None:
        result["peak_memory_per_gcd"] = {"source": MEMORY_SOURCES["ledger"], "allocated_bytes": int(mem[0]),
                                         "reserved_bytes": None}
    else:
        result["peak_memory_per_gcd"] = {"source": "not measured: CPU run without the engine's ledger "
                                         f"({_rec['unmeasured'] or 'stock Megatron'})",
                                         "allocated_bytes": None, "reserved_bytes": None}
    if _rec["traffic"] is not None:
        result["ledger_bytes_per_step"] = {"source": "engine ledger, bytes sent per step summed over ranks",
                                           "package": int(sums[4]), "node": int(sums[5]),
                                           "network": int(sums[6])}
    else:
        result["ledger_bytes_per_step"] = {"source": "not measured: "
                                           f"{_rec['unmeasured'] or 'stock Megatron'} keeps no ledger"}
    iterations = len(_rec["times"])
    if sums[2] >= sums[3] and sums[3] > 0 and iterations:
        result["interface_bytes"] = {
            "source": f"/sys/class/net/{{{','.join(_rec['ifaces'])}}}/statistics, first rank of each node, "
                      "read when the loop started and ended, summed over nodes",
            "tx_bytes": int(sums[0]), "rx_bytes": int(sums[1]),
            "tx_bytes_per_step": sums[0] / iterations, "rx_bytes_per_step": sums[1] / iterations}
    elif not _rec["ifaces"]:
        result["interface_bytes"] = {"source": "not measured: no interfaces named (set LBP_NET_IFACES)"}
    else:
        result["interface_bytes"] = {"source": f"not measured: a node could not read "
                                     f"/sys/class/net/{{{','.join(_rec['ifaces'])}}}/statistics"}
    flops = _flops_per_step(args)
    tokens = args.global_batch_size * args.seq_length
    med = step["median_s"]
    result["throughput"] = {
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / med if med else None,
        "flops_per_step": flops, "flop_formula": FLOP_FORMULA,
        "tflops_per_gcd": flops / med / result["gcds"] / 1e12 if (flops and med) else None}
    write(result)
    _rec.clear()


def _common(args: Any, status: str, reason: str | None, hier: Any) -> dict:
    out = {"schema": SCHEMA, "status": status, "reason": reason}
    try:
        out.update(_describe(args, hier))
    except Exception as err:  # a failure before the args were complete: keep what is known
        out["describe_error"] = f"{err.__class__.__name__}: {err}"
    out["step_time"] = {"source": "wall clock between training_log calls on the last rank",
                        **summarize_times(_rec.get("times", {}), warmup())}
    out["loss"] = {str(k): v for k, v in sorted(_rec.get("losses", {}).items())}
    return out


def fail(args: Any, err: BaseException, hier: Any = None) -> None:
    """The loop (or the setup) raised: record status and reason from whichever rank saw it."""
    if not path():
        return
    rank, _ = _rank_world()
    reason = f"rank {rank}: {err.__class__.__name__}: {' '.join(str(err).split())[:500]}"
    result = _common(args, "failed", reason, hier) if args is not None else {
        "schema": SCHEMA, "status": "failed", "reason": reason}
    try:
        existing = load(path())
    except (OSError, ValueError):
        existing = None
    if existing and existing.get("status") == "failed" and existing.get("written_at", 0) >= _STARTED:
        return  # this run's first failure (on any rank) names the cause
    write(result)


def write(result: dict, target: str | None = None) -> None:
    """``result`` as JSON, atomically, at ``target`` (default: LBP_RESULT_FILE)."""
    from megatron_lbp.engine.checkpoint import atomic_write_text

    target = target or path()
    result = {**result, "written_at": time.time()}
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    atomic_write_text(target, json.dumps(result, indent=1, sort_keys=True) + "\n")


def load(p: str) -> dict:
    with open(p) as f:
        return json.load(f)


def record_failure(target: str, reason: str, fields: dict[str, str]) -> None:
    """A run that died without writing its own result (killed, out of memory, a node lost):
    the study records it with what it knows. An existing result file is kept."""
    if os.path.exists(target):
        return
    out: dict[str, Any] = {"schema": SCHEMA, "status": "failed", "reason": " ".join(reason.split())}
    for k, v in fields.items():
        out[k] = int(v) if v.isdigit() else v
    write(out, target)
