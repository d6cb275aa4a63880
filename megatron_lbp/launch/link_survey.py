"""Link survey: the engine's collectives timed by op, dtype, message size and group shape, and an
overlap probe; one JSON file (megatron_lbp/projection/survey_file.py) the cost model reads.

    srun ... lbp_task.sh python -m megatron_lbp.launch survey --out lbp_survey.json \\
        --tasks-per-node 8 --gcds-per-package 2 [--sizes-mib 1,4,16,64,256,1024] \\
        [--max-seconds 600] [--reps 3]
    python -m megatron_lbp.launch survey --estimate --nodes 48      # the time bound, no ranks

Groups and collectives are the engine's. A case predicted to pass --max-seconds
is skipped with every larger one of its series (listed in "skipped").
Bound and overlap probe: docs/planning.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Mapping, Sequence

from megatron_lbp.projection import survey_file as sf

PROG = "lbp_survey"
MiB = 1 << 20
FULL_SIZES_MIB = (1, 4, 16, 64, 256, 1024)
# The codec probe's calls, in 2^20 elements: two sizes, so that the model separates a call's
# fixed cost (kernel launches) from its cost per element.
CODEC_MI_ELEMENTS = (1, 16)
OP_DTYPES = {"all_gather": sf.DTYPES, "all_to_all": sf.DTYPES,
             "reduce_scatter": ("bf16", "fp32"), "all_reduce": ("bf16", "fp32")}
# The overlap probe's collective per kind: the dtype the engine (or ZeRO++) sends it in.
OVERLAP_DTYPES = {"all_gather": "bf16", "reduce_scatter": "fp32", "all_to_all": "int4",
                  "all_reduce": "fp32"}


class SurveyUsage(ValueError):
    """Bad arguments; one line."""


def cases(shapes: Sequence[str], sizes: Sequence[int]) -> list[tuple[str, str, str, list[int]]]:
    """(shape, op, dtype, sizes ascending): every series the survey times, in order."""
    return [(s, op, dt, sorted(sizes)) for s in shapes for op in sf.OPS for dt in OP_DTYPES[op]]


# --------------------------------------------------------------------------- the groups


def hier_args(tasks_per_node: int, gcds_per_package: int) -> argparse.Namespace:
    """The engine's settings for the survey's groups: lbp with a node-wide secondary group
    (every shape the engine uses), the other settings at their defaults."""
    from megatron_lbp.core.config import add_hier_arguments

    args = add_hier_arguments(argparse.ArgumentParser()).parse_args([])   # the defaults
    args.hier_preset = "lbp"
    args.hier_secondary_group_size = args.hier_gpus_per_node = tasks_per_node
    args.hier_gcds_per_package = gcds_per_package
    return args


def survey_collectives(tasks_per_node: int, gcds_per_package: int, env=None):
    """(Collectives over the survey's shapes, {shape: (group size, groups, link class)}).

    Each shape is one "family" of the engine's Collectives with the communicators the engine's
    own families use for it."""
    import torch.distributed as dist

    from megatron_lbp.engine.comm import Collectives
    from megatron_lbp.engine.process_groups import build_hier_groups

    h = build_hier_groups(hier_args(tasks_per_node, gcds_per_package), env=env)
    g, world = h.groups, dist.get_world_size()
    sources = {"package": ("param", g["param"].get("gather"), g["param"].get("gather")),
               "node": ("secondary", g.get("secondary", {}).get("gather"),
                        g["grad"].get("reduce")),
               "cross_node": ("inter", g.get("inter", {}).get("gather"),
                              g.get("inter", {}).get("reduce")),
               "world": ("optim", g["optim"]["reduce"], g["optim"]["reduce"])}
    groups, sizes, links, info = {}, {}, {}, {}
    seen_sizes = set()
    for shape, (family, gather, reduce) in sources.items():
        n = len(h.ranks.get(family, ()))
        # A shape the machine does not have (one node: no cross-node groups, the world is the
        # node; packages of one GCD) is left out rather than timed twice.
        if n < 2 or gather is None or reduce is None or (shape == "world" and n in seen_sizes):
            continue
        seen_sizes.add(n)
        groups[shape] = {"gather": gather, "reduce": reduce}
        sizes[shape], links[shape] = n, h.link_classes[family]
        info[shape] = {"group_size": n, "groups": world // n, "link": links[shape]}
    return Collectives(groups, sizes, links), info


# --------------------------------------------------------------------------- one case


_TORCH_DTYPES = {"int8": "int8", "int4": "uint8", "bf16": "bfloat16", "fp32": "float32"}


def buffers(torch, op: str, dtype: str, nbytes: int, n: int, device):
    """(out, inp) of ``op`` for a message of about ``nbytes`` (a multiple of n elements)."""
    dt = getattr(torch, _TORCH_DTYPES[dtype])
    item = torch.empty((), dtype=dt).element_size()
    elems = max(n, nbytes // item // n * n)
    full = torch.ones(elems, dtype=dt, device=device)
    if op == "all_gather":
        return full, torch.ones(elems // n, dtype=dt, device=device)
    if op == "reduce_scatter":
        return torch.empty(elems // n, dtype=dt, device=device), full
    if op == "all_to_all":
        return torch.empty_like(full), full
    return full, full


def issue(coll, op: str, shape: str, out, inp, async_op: bool = False):
    from megatron_lbp.engine.comm import CONTROL

    if op == "all_gather":
        return coll.all_gather(out, inp, shape, CONTROL, async_op=async_op)
    if op == "reduce_scatter":
        return coll.reduce_scatter(out, inp, shape, CONTROL, async_op=async_op)
    if op == "all_to_all":
        return coll.all_to_all(out, inp, shape, CONTROL, async_op=async_op)
    return coll.all_reduce(out, shape, CONTROL, async_op=async_op)


class Clock:
    """Wall time that waits for the device: all streams (``sync``) or the compute stream only."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"

    def sync(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter()

    def compute_done(self) -> float:
        if self.cuda:
            self.torch.cuda.current_stream().synchronize()
        return time.perf_counter()


def agree_max(torch, dist, values: Sequence[float], device) -> list[float]:
    """The ranks' maximum of each value (one MAX all-reduce on the world): every rank decides alike."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def back_to_back(dist, clock, call: Callable[[], object], reps: int) -> list[float]:
    """This rank's seconds of ``reps`` + 1 calls, every rank at once: one barrier, then the
    calls back to back, each timed from the end of the one before (the first from the
    barrier)."""
    times = []
    dist.barrier()
    last = clock.sync()
    for _ in range(reps + 1):
        call()
        now = clock.sync()
        times.append(now - last)
        last = now
    return times


def time_case(torch, dist, coll, clock, op, shape, dtype, nbytes, reps, device) -> list[float]:
    """This rank's seconds of ``reps`` + 1 collectives, every group of ``shape`` at once
    (:func:`back_to_back`)."""
    out, inp = buffers(torch, op, dtype, nbytes, coll.sizes[shape], device)
    return back_to_back(dist, clock, lambda: issue(coll, op, shape, out, inp), reps)


def slowest_rank_reps(reps_by_rank: Sequence[Sequence[float]]) -> list[float]:
    """The times of :func:`time_case` of the rank that took longest in all; the table keeps
    their mean, and their fastest and slowest as its spread.

    The groups of a shape share links and run at once, but not in step: one group's
    collective overlaps the end of one of another's and the start of the next, so a single
    collective of one rank, or the slowest rank's of each repetition, takes more or less than
    the link's time per collective. From the barrier to the end of the last collective the
    link carries every group's bytes, so the longest total over the ranks, divided by the
    collectives, is that time. Ranks leave a barrier at different times (a scheduler's time
    slice apart on a loaded host, a straggler on a cluster); the first collective carries
    that skew, spread over all of them."""
    return list(max(reps_by_rank, key=sum))


def spread(times: Sequence[float]) -> tuple[float, float, float]:
    """(mean, fastest, slowest) of :func:`slowest_rank_reps`' times: a table's three columns."""
    return statistics.fmean(times), min(times), max(times)


# --------------------------------------------------------------------------- the overlap probe


def gemm_layer(torch, dim: int, device, dtype):
    a = torch.randn(dim, dim, device=device).to(dtype)
    w1 = torch.randn(dim, dim, device=device).to(dtype) / dim ** 0.5
    w2 = torch.randn(dim, dim, device=device).to(dtype) / dim ** 0.5

    def run(k: int):
        x = a
        for _ in range(k):
            x = torch.relu(x @ w1) @ w2
        return x
    return run


class BesideLayer:
    """A GEMM-heavy layer, and how much of another piece of work it hides."""

    def __init__(self, torch, dist, clock, device, dim: int, dtype):
        self.torch, self.dist, self.clock, self.device = torch, dist, clock, device
        self.layer = gemm_layer(torch, dim, device, dtype)
        self.layer(1)
        t0 = clock.sync()
        self.layer(2)
        self.one = max((clock.sync() - t0) / 2, 1e-6)

    def measure(self, run: Callable[[], object], start: Callable[[], Callable[[], object]],
                reps: int) -> dict[str, float]:
        """Per repetition: ``run()`` alone; the layer repeated to last as long (the ranks
        agree on the count), alone; then ``start()`` (the work begun, not waited for; it
        returns its wait) with the layer beside it. {gemm_alone_s, gemm_with_s, other_s,
        together_s, slowdown, hidden_fraction}: each time the slowest rank's, the median
        over repetitions."""
        dist, clock = self.dist, self.clock
        rows = []
        for _ in range(reps):
            dist.barrier()
            t0 = clock.sync()
            run()
            other = clock.sync() - t0
            (k,) = agree_max(self.torch, dist, [max(1, round(other / self.one))], self.device)
            dist.barrier()
            t0 = clock.sync()
            self.layer(int(k))
            alone = clock.sync() - t0
            dist.barrier()
            t0 = clock.sync()
            wait = start()
            self.layer(int(k))
            with_ = clock.compute_done() - t0
            wait()
            together = clock.sync() - t0
            rows.append((alone, with_, other, together))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        # Per repetition the slowest rank, then the median over repetitions.
        alone, with_, other, together = (statistics.median(max(g[r][j] for g in gathered)
                                                           for r in range(reps))
                                         for j in range(4))
        return {"gemm_alone_s": alone, "gemm_with_s": with_, "other_s": other,
                "together_s": together, "slowdown": with_ / alone,
                "hidden_fraction": (alone + other - together) / min(alone, other)}


def overlap_probe(torch, dist, coll, clock, shape, nbytes, dim, gemm_dtype, device,
                  reps: int = 3) -> dict:
    """{op: {gemm_alone_s, gemm_with_s, comm_alone_s, together_s, slowdown, hidden_fraction}}
    on ``shape`` with a ``nbytes`` message; every figure the slowest rank's median."""
    beside = BesideLayer(torch, dist, clock, device, dim, gemm_dtype)
    out = {}
    for op in sf.OPS:
        dtype = OVERLAP_DTYPES[op]
        o, i = buffers(torch, op, dtype, nbytes, coll.sizes[shape], device)
        issue(coll, op, shape, o, i)   # warm-up

        def start(op=op, o=o, i=i):
            work = issue(coll, op, shape, o, i, async_op=True)
            return work.wait if work is not None else (lambda: None)
        m = beside.measure(lambda: issue(coll, op, shape, o, i), start, reps)
        out[op] = {"gemm_alone_s": m["gemm_alone_s"], "gemm_with_s": m["gemm_with_s"],
                   "comm_alone_s": m["other_s"], "together_s": m["together_s"],
                   "slowdown": m["slowdown"], "hidden_fraction": m["hidden_fraction"],
                   "dtype": dtype}
    return out


# --------------------------------------------------------------------------- the codec probe


def codec_probe(torch, dist, clock, device, elements: Sequence[int], reps: int, gemm_dim: int,
                gemm_dtype) -> dict:
    """The engine's quantizers (engine/quantized.py INT8, INT4) timed on this job's devices,
    every rank at once: per codec and direction, seconds of one call by elements per call
    (from bf16 into the packed buffer, and back into fp32, as qgZ sums), the table's
    statistic (:func:`slowest_rank_reps`); then, at the largest size, an encode and a decode
    on a stream of their own while a GEMM-heavy layer runs (the engine codes on its
    communicators' streams): the hidden fraction and the layer's slowdown, the slowest
    rank's median."""
    from megatron_lbp.engine.quantized import INT4, INT8
    from megatron_lbp.engine.streams import Streams
    from megatron_lbp.quant import DEFAULT_BLOCK_SIZE as block

    codecs = {"int8": INT8, "int4": INT4}

    def buffers_for(codec, e: int):
        """(bf16 input, packed codes, fp32 output) of one call of ``e`` elements."""
        return (torch.randn(e, device=device).to(torch.bfloat16),
                torch.empty(codec.nbytes(e, block), dtype=torch.uint8, device=device),
                torch.empty(e, dtype=torch.float32, device=device))

    mine: dict[str, list[float]] = {}
    for name, codec in codecs.items():
        for e in elements:
            x, packed, out = buffers_for(codec, e)
            codec.encode(x, packed, block)      # warm-up
            for direction, call in (("encode", lambda: codec.encode(x, packed, block)),
                                    ("decode", lambda: codec.decode(packed, out, block))):
                mine[f"{name} {direction} {e}"] = back_to_back(dist, clock, call, reps)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    by_codec: dict[str, dict] = {}
    for name in codecs:
        by_codec[name] = {}
        for direction in ("encode", "decode"):
            figures = [spread(slowest_rank_reps([g[f"{name} {direction} {e}"]
                                                 for g in gathered])) for e in elements]
            by_codec[name][direction] = dict(zip(("seconds", "seconds_min", "seconds_max"),
                                                 map(list, zip(*figures))))
    beside = BesideLayer(torch, dist, clock, device, gemm_dim, gemm_dtype)
    streams = Streams(device)
    for name, codec in codecs.items():
        x, packed, out = buffers_for(codec, max(elements))

        def both(codec=codec, x=x, packed=packed, out=out):
            codec.encode(x, packed, block)
            codec.decode(packed, out, block)

        def start(name=name, both=both, held=(x, packed, out)):
            return streams[f"codec {name}"].submit(both, holds=held, what="codec probe").wait
        m = beside.measure(both, start, reps)
        by_codec[name].update(slowdown=m["slowdown"], hidden_fraction=m["hidden_fraction"])
    return {"elements": list(elements), "block_size": block, "input_dtype": "bf16",
            "output_dtype": "fp32", "gemm_dim": gemm_dim, "by_codec": by_codec}


# --------------------------------------------------------------------------- the survey


def run(*, out_path: str, tasks_per_node: int, gcds_per_package: int, sizes: Sequence[int],
        reps: int, max_seconds: float, overlap_bytes: int, gemm_dim: int, device,
        log: Callable[[str], None], env=None, command: str = "",
        codec_elements: Sequence[int] = ()) -> dict | None:
    """Time every case on this job's ranks (torch.distributed initialised); rank 0 writes
    ``out_path`` and returns the survey, the others None."""
    import torch
    import torch.distributed as dist

    from megatron_lbp.core.costs import ring_sent

    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    coll, shapes = survey_collectives(tasks_per_node, gcds_per_package, env)
    clock = Clock(torch, device)
    tables, skipped, spent = [], [], 0.0
    for shape in shapes:
        t_shape, n = time.perf_counter(), coll.sizes[shape]
        series = cases([shape], sizes)
        mine: dict[tuple, list[list[float]]] = {}
        for _, op, dtype, sz in series:
            prev = None
            for j, nbytes in enumerate(sz):
                predicted = 0.0 if prev is None else prev[1] * nbytes / prev[0] * (reps + 1)
                if spent + predicted > max_seconds:
                    skipped += [f"{op} {dtype} {shape} {b}: past --max-seconds={max_seconds:g}"
                                for b in sz[j:]]
                    break
                times = time_case(torch, dist, coll, clock, op, shape, dtype, nbytes, reps,
                                  device)
                (worst,) = agree_max(torch, dist, [max(times)], device)
                spent += worst * len(times)
                prev = (nbytes, worst)
                mine[(op, dtype, nbytes)] = times
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        done = 0
        for _, op, dtype, sz in series:
            row = {k: [] for k in sf.TABLE_KEYS}
            for nbytes in sz:
                if (op, dtype, nbytes) not in mine:
                    continue
                slowest = slowest_rank_reps([g[(op, dtype, nbytes)] for g in gathered])
                item = {"int8": 1, "int4": 1, "bf16": 2, "fp32": 4}[dtype]
                actual = max(n, nbytes // item // n * n) * item
                row["bytes"].append(actual)
                row["sent_bytes"].append(float(ring_sent(op, actual, n)))
                for key, value in zip(("seconds", "seconds_min", "seconds_max"),
                                      spread(slowest)):
                    row[key].append(value)
                done += 1
            if row["bytes"]:
                tables.append({"op": op, "dtype": dtype, "shape": shape, "group_size": n, **row})
        big = max((t for t in tables if t["shape"] == shape), key=lambda t: t["bytes"][-1],
                  default=None)
        if big:
            rate = big["sent_bytes"][-1] / big["seconds"][-1] / 1e9
            log(f"shape {shape}: {shapes[shape]['groups']} group(s) of {n} on the "
                f"{shapes[shape]['link']} link at once, {done} case(s) in "
                f"{time.perf_counter() - t_shape:.1f} s; {big['op']} {big['dtype']} "
                f"{big['bytes'][-1] / MiB:.3g} MiB: {big['seconds'][-1] * 1e3:.3g} ms, "
                f"{rate:.3g} GB/s sent per rank")
    overlap = None
    probe = next((s for s in ("cross_node", "node", "package") if s in shapes), None)
    if probe and overlap_bytes > 0:
        t0 = time.perf_counter()
        gemm_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        overlap = {"shape": probe, "message_bytes": overlap_bytes, "gemm_dim": gemm_dim,
                   "by_op": overlap_probe(torch, dist, coll, clock, probe, overlap_bytes,
                                          gemm_dim, gemm_dtype, device, reps)}
        log(f"overlap on {probe}: " + ", ".join(
            f"{op} hidden {o['hidden_fraction']:.2f} slowdown {o['slowdown']:.2f}"
            for op, o in overlap["by_op"].items()) + f" ({time.perf_counter() - t0:.1f} s)")
    codecs = None
    if codec_elements:
        t0 = time.perf_counter()
        gemm_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        codecs = codec_probe(torch, dist, clock, device, codec_elements, reps, gemm_dim,
                             gemm_dtype)
        log("codecs: " + ", ".join(
            f"{name} {d} {c[d]['seconds'][-1] / codec_elements[-1] * 1e9:.3g} ns/element"
            for name, c in codecs["by_codec"].items() for d in ("encode", "decode"))
            + f" at {codec_elements[-1]} elements; hidden beside a GEMM " + ", ".join(
                f"{name} {c['hidden_fraction']:.2f}" for name, c in codecs["by_codec"].items())
            + f" ({time.perf_counter() - t0:.1f} s)")
    if rank != 0:
        return None
    data = {"schema": sf.SCHEMA, "version": sf.VERSION, "convention": sf.CONVENTION,
            "command": command,
            "machine": {"nodes": world // tasks_per_node, "tasks_per_node": tasks_per_node,
                        "gcds_per_package": gcds_per_package, "world": world,
                        "backend": dist.get_backend(),
                        "device": (torch.cuda.get_device_name(0) if device.type == "cuda"
                                   else "cpu")},
            "shapes": shapes, "tables": tables, "overlap": overlap, "codecs": codecs,
            "skipped": skipped,
            "reps": reps, "seconds": time.perf_counter() - start}
    data["complete"] = True   # last: a reader refuses a file without it
    sf.check(data, out_path)
    tmp = f"{out_path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, out_path)
    log(f"survey: {len(tables)} table(s), {len(skipped)} case(s) skipped, "
        f"{data['seconds']:.1f} s; written to {out_path}")
    return data


# --------------------------------------------------------------------------- the bound


def estimate_seconds(nodes: int, tasks_per_node: int = 8, gcds_per_package: int = 2,
                     sizes: Sequence[int] = tuple(s * MiB for s in FULL_SIZES_MIB),
                     reps: int = 3, overlap_bytes: int = 256 * MiB,
                     codec_elements: Sequence[int] = tuple(e * MiB for e in CODEC_MI_ELEMENTS)
                     ) -> dict:
    """Seconds the survey takes at this shape on the public Frontier figures (the collective
    model without a survey, at its slow end), per shape, and in all."""
    from megatron_lbp.core.costs import ring_sent
    from megatron_lbp.projection import collectives as cm

    model = cm.CollectiveModel.public()
    world = nodes * tasks_per_node
    shapes = {"package": gcds_per_package, "node": tasks_per_node,
              "cross_node": nodes, "world": world}
    out = {}
    for shape, n in shapes.items():
        if n < 2 or (shape == "world" and n in list(shapes.values())[:3]):
            continue
        total = 0.0
        for _, op, dtype, sz in cases([shape], sizes):
            for b in sz:
                total += (reps + 1) * model.seconds(op, dtype, shape, float(ring_sent(op, b, n)),
                                                    n, rate="slow")
        out[shape] = total
    probe = next((s for s in ("cross_node", "node", "package") if s in out), None)
    if probe:
        n = shapes[probe]
        out["overlap"] = sum(4 * (reps + 1) * model.seconds(
            op, OVERLAP_DTYPES[op], probe, float(ring_sent(op, overlap_bytes, n)), n,
            rate="slow") for op in sf.OPS)
    if codec_elements:
        # every call reps + 1 times; the overlap part: per repetition an encode and a decode
        # alone, beside the layer, and the layer's own time of as long (3x)
        def call(codec, direction, e):
            return model.codec_call_seconds(codec, direction, e, rate="slow")
        out["codecs"] = sum((reps + 1) * call(c, d, e) for c in ("int8", "int4")
                            for d in ("encode", "decode") for e in codec_elements) + sum(
            3 * reps * (call(c, "encode", max(codec_elements))
                        + call(c, "decode", max(codec_elements))) for c in ("int8", "int4"))
    out["total"] = sum(out.values())
    return out


# --------------------------------------------------------------------------- the command


def add_arguments(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    ap.add_argument(f"--{prefix}sizes-mib", default=",".join(map(str, FULL_SIZES_MIB)),
                    help="message sizes in MiB (comma-separated; fractions allowed for a "
                         "quick CPU run)")
    ap.add_argument(f"--{prefix}reps", type=int, default=3)
    ap.add_argument(f"--{prefix}max-seconds", type=float, default=300.0)
    ap.add_argument(f"--{prefix}overlap-mib", type=float, default=256.0,
                    help="the overlap probe's message (0: no probe)")
    ap.add_argument(f"--{prefix}gemm-dim", type=int, default=8192)
    ap.add_argument(f"--{prefix}codec-mi-elements", default=",".join(map(str, CODEC_MI_ELEMENTS)),
                    help="the codec probe's elements per call, in units of 2^20 (comma-"
                         "separated; 0: no probe)")


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(float(x) * MiB) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SurveyUsage(f"--sizes-mib={text!r}: comma-separated numbers of MiB") from None
    if not sizes or sizes[0] < 64:
        raise SurveyUsage(f"--sizes-mib={text!r}: give sizes of at least 64 bytes")
    return sizes


def parse_codec_elements(text: str) -> list[int]:
    """"1,16" -> [2^20, 2^24] elements per call; "0" (or empty): no codec probe."""
    try:
        values = sorted({int(float(x) * MiB) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SurveyUsage(f"--codec-mi-elements={text!r}: comma-separated numbers of 2^20 "
                          "elements") from None
    if values == [0] or not values:
        return []
    if values[0] < 256:
        raise SurveyUsage(f"--codec-mi-elements={text!r}: give at least 256 elements a call "
                          "(one quantization block), or 0 for no probe")
    return values


def check_arguments(sizes_mib: str, reps: int, max_seconds: float, overlap_mib: float,
                    gemm_dim: int) -> list[int]:
    sizes = parse_sizes(sizes_mib)
    if reps < 1 or not max_seconds > 0 or overlap_mib < 0 or gemm_dim < 1:
        raise SurveyUsage(f"--reps={reps} must be >= 1, --max-seconds={max_seconds:g} > 0, "
                          f"--overlap-mib={overlap_mib:g} >= 0, --gemm-dim={gemm_dim} >= 1")
    return sizes


def main(argv=None, env: Mapping[str, str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_lbp.launch survey", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, metavar="FILE")
    ap.add_argument("--tasks-per-node", type=int, default=8)
    ap.add_argument("--gcds-per-package", type=int, default=2)
    ap.add_argument("--gpus-per-task", type=int, default=1)
    ap.add_argument("--estimate", action="store_true",
                    help="print the survey's time at --nodes on the public figures and stop")
    ap.add_argument("--nodes", type=int, default=48)
    add_arguments(ap)
    a = ap.parse_args(argv)
    env = os.environ if env is None else env
    try:
        sizes = check_arguments(a.sizes_mib, a.reps, a.max_seconds, a.overlap_mib, a.gemm_dim)
        codec_elements = parse_codec_elements(a.codec_mi_elements)
        if a.tasks_per_node < 1 or a.gcds_per_package < 1 or a.tasks_per_node % a.gcds_per_package:
            raise SurveyUsage(f"--tasks-per-node={a.tasks_per_node} must be a multiple of "
                              f"--gcds-per-package={a.gcds_per_package} (both >= 1)")
        if a.estimate:
            if a.nodes < 1:
                raise SurveyUsage(f"--nodes={a.nodes} must be >= 1")
            est = estimate_seconds(a.nodes, a.tasks_per_node, a.gcds_per_package, sizes,
                                   a.reps, int(a.overlap_mib * MiB), codec_elements)
            print(f"survey at {a.nodes} node(s) x {a.tasks_per_node} on the public figures "
                  "(slow end): " + ", ".join(f"{k} {v:.1f} s" for k, v in est.items())
                  + f"; bounded by --max-seconds={a.max_seconds:g} plus one case and the "
                  "overlap probe")
            return 0
        if not a.out:
            raise SurveyUsage("--out FILE is needed (where rank 0 writes the survey)")
        if not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
            raise SurveyUsage(f"--out {a.out}: its directory does not exist")
    except SurveyUsage as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    from megatron_lbp.launch.job_group import join_job

    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    device = join_job(rank, world, a.gpus_per_task > 0 and torch.cuda.is_available())
    try:
        run(out_path=a.out, tasks_per_node=a.tasks_per_node, gcds_per_package=a.gcds_per_package,
            sizes=sizes, reps=a.reps, max_seconds=a.max_seconds,
            overlap_bytes=int(a.overlap_mib * MiB), gemm_dim=a.gemm_dim, device=device,
            codec_elements=codec_elements,
            log=(lambda line: print(f"[lbp survey] {line}", flush=True)) if rank == 0
            else (lambda line: None), env=env,
            command="python -m megatron_lbp.launch survey " + " ".join(argv or sys.argv[1:]))
        dist.barrier()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
