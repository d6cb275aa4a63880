"""megatron-lbp's per-interval figures as TensorBoard scalars, beside Megatron's own.

Called from ``training_hooks.after_training_log`` every --log-interval iterations; writes
through Megatron's writer (with --tensorboard-dir, on the last rank) under
``megatron-lbp/``: bytes sent per link class and bytes held per state (the engine's
ledger, the interval line's figures), tokens per second since the previous interval
(everything Megatron does between steps included), on GPU torch.cuda's memory peaks over
the interval, and with --hier-trace the last traced step's exposed communication. The
interval log line gets " tokens/s X |" appended, so the log carries every figure written.
"""
from __future__ import annotations

import time
from typing import Any

PREFIX = "megatron-lbp/"
_last: dict[str, float] = {}


def scalars(iteration: int, args: Any, report: dict | None, optimizer: Any = None) -> dict[str, float]:
    """{tag: value} for this interval (see the module docstring)."""
    out: dict[str, float] = {}
    if report:
        for cls, nbytes in report["traffic_bytes"].items():
            out[f"bytes sent per step/{cls}"] = float(nbytes)
        for state, nbytes in report["memory_bytes"].items():
            out[f"held bytes/{state}"] = float(nbytes)
    now = time.monotonic()
    if "iteration" in _last and iteration > _last["iteration"]:
        tokens = args.global_batch_size * args.seq_length * (iteration - _last["iteration"])
        out["tokens per second"] = tokens / (now - _last["time"])
    _last.update(iteration=iteration, time=now)
    import torch

    if torch.cuda.is_available():
        out["peak memory/allocated"] = float(torch.cuda.max_memory_allocated())
        out["peak memory/reserved"] = float(torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
    record = _last_trace_record(optimizer)
    if record is not None:
        from megatron_lbp.engine.trace_summary import step_summary

        out["exposed communication seconds"] = step_summary(record)["exposed_s"]
    return out


def _last_trace_record(optimizer: Any) -> dict | None:
    """The engine's last schedule-trace record (--hier-trace): the trace file's last line
    (read from its end: the file grows by one record per step)."""
    for model in getattr(optimizer, "models", ()):
        trace = getattr(getattr(model, "comm", None), "trace", None)
        path = getattr(trace, "path", None)
        if path:
            return _last_json_line(path)
    return None


def _last_json_line(path: str) -> dict | None:
    import json
    import os

    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            pos, tail = end, b""
            while pos > 0 and tail.count(b"\n") < 2:
                step = min(1 << 16, pos)
                pos -= step
                f.seek(pos)
                tail = f.read(step) + tail
    except OSError:
        return None
    lines = [line for line in tail.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1]) if lines else None
    except ValueError:
        return None


def write(iteration: int, args: Any, report: dict | None, optimizer: Any = None) -> str:
    """Write this interval's scalars with Megatron's writer (if it has one here); the text to
    append to the interval log line."""
    values = scalars(iteration, args, report, optimizer)
    from megatron.training.global_vars import get_tensorboard_writer

    writer = get_tensorboard_writer()
    if writer is not None:
        for tag, value in values.items():
            writer.add_scalar(PREFIX + tag, value, iteration)
        writer.flush()
    rate = values.get("tokens per second")
    return f" tokens/s {rate:.1f} |" if rate is not None else ""
