"""The link survey's JSON file: its schema, and the one reader that refuses a bad one (pure Python).

Written by ``python -m megatron_lbp.launch survey`` (launch/link_survey.py), read by
projection/collectives.py and the launcher's estimate. Version 1 holds the machine,
the shapes, one table per (op, dtype, shape) of seconds by message bytes, the overlap
probe, the codec probe (optional: seconds of a quantizer call by elements) and what was
skipped (the fields: :func:`check`; docs/planning.md).
Invariants: ``complete`` is written last (the file is written whole, then renamed), so
a file without it was cut off; every problem is one line (:class:`SurveyError`)
naming the file and what is wrong.
"""
from __future__ import annotations

import json
import math
from typing import Any, Mapping

SCHEMA = "megatron-lbp link survey"
VERSION = 1
CONVENTION = ("message bytes: the whole buffer on each rank (an all-gather's output, a "
              "reduce-scatter's, all-to-all's or all-reduce's input); sent_bytes: what one "
              "rank sends (ring accounting, megatron_lbp/core/costs.ring_sent); seconds: every "
              "group of the shape running its collectives at once, back to back after one "
              "barrier; the mean (min, max) of the rank that took longest in all")
OPS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
DTYPES = ("int8", "int4", "bf16", "fp32")
# The engine's group shapes: the 2 GCDs of a package (P), the node (G, S), one rank per node
# with every such group running at once (the step's inter-node hop), all ranks (zero3, zeropp).
SHAPES = ("package", "node", "cross_node", "world")
TABLE_KEYS = ("bytes", "sent_bytes", "seconds", "seconds_min", "seconds_max")
OVERLAP_KEYS = ("gemm_alone_s", "gemm_with_s", "comm_alone_s", "together_s", "slowdown",
                "hidden_fraction")


class SurveyError(ValueError):
    """A survey file that cannot be used; the message is one line."""


def _need(cond: bool, path: str, what: str) -> None:
    if not cond:
        raise SurveyError(f"{path}: not a usable link survey: {what}")


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check(data: Any, path: str = "survey") -> dict:
    """``data`` if it is a complete survey of this version, else SurveyError (one line)."""
    _need(isinstance(data, dict), path, "the file is not a JSON object")
    _need(data.get("schema") == SCHEMA, path, f'"schema" is {data.get("schema")!r}, not '
          f'{SCHEMA!r}')
    _need(data.get("version") == VERSION, path, f'"version" is {data.get("version")!r}; this '
          f"reader knows {VERSION}")
    _need(data.get("complete") is True, path, 'no "complete": true (the survey was cut off '
          "before it finished): run it again")
    m = data.get("machine")
    _need(isinstance(m, dict) and all(_positive(m.get(k)) for k in
                                      ("nodes", "tasks_per_node", "gcds_per_package", "world")),
          path, '"machine" needs nodes, tasks_per_node, gcds_per_package, world > 0')
    shapes = data.get("shapes")
    _need(isinstance(shapes, dict) and shapes, path, '"shapes" is empty or missing')
    for name, s in shapes.items():
        _need(name in SHAPES, path, f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
        _need(isinstance(s, dict) and _positive(s.get("group_size")) and s["group_size"] >= 2,
              path, f"shape {name}: group_size must be >= 2")
    tables = data.get("tables")
    _need(isinstance(tables, list) and tables, path, '"tables" is empty or missing')
    seen = set()
    for i, t in enumerate(tables):
        where = f"table {i}"
        _need(isinstance(t, dict), path, f"{where} is not an object")
        key = (t.get("op"), t.get("dtype"), t.get("shape"))
        where = f"table {i} ({' '.join(map(str, key))})"
        _need(key[0] in OPS and key[1] in DTYPES and key[2] in shapes, path,
              f"{where}: op, dtype or shape unknown")
        _need(key not in seen, path, f"{where}: given twice")
        seen.add(key)
        _need(t.get("group_size") == shapes[key[2]]["group_size"], path,
              f"{where}: group_size differs from its shape's")
        cols = [t.get(k) for k in TABLE_KEYS]
        _need(all(isinstance(c, list) and c for c in cols) and len({len(c) for c in cols}) == 1,
              path, f"{where}: {', '.join(TABLE_KEYS)} must be lists of one length")
        _need(all(_positive(x) for c in cols for x in c), path,
              f"{where}: every figure must be a number > 0")
        _need(all(a < b for a, b in zip(t["bytes"], t["bytes"][1:])), path,
              f"{where}: bytes must ascend")
        _need(all(lo <= med <= hi for lo, med, hi in
                  zip(t["seconds_min"], t["seconds"], t["seconds_max"])), path,
              f"{where}: seconds_min <= seconds <= seconds_max fails")
    ov = data.get("overlap")
    if ov is not None:
        _need(isinstance(ov, dict) and isinstance(ov.get("by_op"), dict), path,
              '"overlap" needs "by_op"')
        for op, o in ov["by_op"].items():
            _need(op in OPS and isinstance(o, dict) and all(
                isinstance(o.get(k), (int, float)) and math.isfinite(o[k]) for k in OVERLAP_KEYS),
                path, f"overlap {op}: needs {', '.join(OVERLAP_KEYS)} as numbers")
    codecs = data.get("codecs")
    if codecs is not None:
        _check_codecs(codecs, path)
    return data


CODEC_KEYS = ("seconds", "seconds_min", "seconds_max")


def _check_codecs(codecs: Any, path: str) -> None:
    """The codec probe's part (launch/link_survey.codec_probe): elements ascending, per codec
    and direction a time per size, and the overlap figures."""
    _need(isinstance(codecs, dict) and isinstance(codecs.get("elements"), list)
          and codecs["elements"] and all(_positive(e) for e in codecs["elements"])
          and all(a < b for a, b in zip(codecs["elements"], codecs["elements"][1:])),
          path, '"codecs" needs "elements": ascending numbers > 0')
    by_codec = codecs.get("by_codec")
    _need(isinstance(by_codec, dict) and by_codec, path, '"codecs" needs "by_codec"')
    for name, c in by_codec.items():
        _need(name in ("int8", "int4") and isinstance(c, dict), path,
              f"codecs: unknown codec {name!r} (known: int8, int4)")
        for direction in ("encode", "decode"):
            cols = c.get(direction)
            _need(isinstance(cols, dict) and all(
                isinstance(cols.get(k), list) and len(cols[k]) == len(codecs["elements"])
                and all(_positive(x) for x in cols[k]) for k in CODEC_KEYS), path,
                f"codecs {name} {direction}: {', '.join(CODEC_KEYS)} must be lists of "
                "numbers > 0, one per element count")
            _need(all(lo <= med <= hi for lo, med, hi in
                      zip(cols["seconds_min"], cols["seconds"], cols["seconds_max"])), path,
                  f"codecs {name} {direction}: seconds_min <= seconds <= seconds_max fails")
        _need(all(isinstance(c.get(k), (int, float)) and math.isfinite(c[k])
                  for k in ("hidden_fraction", "slowdown")), path,
              f"codecs {name}: needs hidden_fraction and slowdown as numbers")


def read(path: str) -> dict:
    """The survey at ``path``, checked (SurveyError: one line naming the file)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise SurveyError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SurveyError(f"{path}: not a usable link survey: not JSON ({exc.msg} at line "
                          f"{exc.lineno}; a cut-off file?)") from None
    return check(data, path)


def table_index(data: Mapping[str, Any]) -> dict[tuple[str, str, str], Mapping[str, Any]]:
    """(op, dtype, shape) -> table."""
    return {(t["op"], t["dtype"], t["shape"]): t for t in data["tables"]}
