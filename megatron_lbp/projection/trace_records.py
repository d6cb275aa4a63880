"""The schedule trace's records as written (docs/schedule-trace.md), read without torch.

The launcher's dry run replays the committed traces (megatron_lbp/launch/choose.py):
importing the engine there, as megatron_lbp.projection.trace does for its summaries,
would cost seconds of torch import at every dry run. The summaries, the replay and the
launcher read the records here.
"""
from __future__ import annotations

import glob
import gzip
import json
from typing import Any, Sequence

# The format of a trace record (docs/schedule-trace.md), which megatron_lbp/engine/trace.py
# writes and the summaries and the replay read. Bump it when a field is added, removed or
# changes its meaning: the committed traces (megatron_lbp/projection/traces/index.json)
# carry the version they were recorded in, and a replay of others says to re-record them.
TRACE_FORMAT_VERSION = 2


class TraceError(Exception):
    """Bad input: printed as one line, exit status 2."""


def read_records(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Every record of the trace files ``paths`` (``.gz``: gzip; a ``{rank}`` pattern: every
    rank's file), in file order; bad input raises :class:`TraceError`."""
    files: list[str] = []
    for path in paths:
        if "{rank}" in path:
            found = sorted(glob.glob(glob.escape(path).replace(glob.escape("{rank}"), "*")))
            if not found:
                raise TraceError(f"{path}: no file matches (with {{rank}} as any rank)")
            files += found
        else:
            files.append(path)
    records = []
    for f in files:
        try:
            with (gzip.open(f, "rt") if f.endswith(".gz") else open(f)) as handle:
                for n, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise TraceError(f"{f}:{n}: not a JSON line ({err.msg})") from None
        except OSError as err:
            raise TraceError(f"{f}: {err.strerror or err}") from None
    for r in records:
        if not isinstance(r, dict) or not {"rank", "step", "collectives", "compute"} <= set(r):
            raise TraceError("a record lacks rank/step/collectives/compute: not a schedule "
                             "trace (--hier-trace)")
    return records
