"""Part B: torch.distributed at world size 1, the handle and stream behaviour the engine relies on.

With each collective queued behind about a second of GEMMs: ``is_completed()`` is False
when issued, ``wait()`` returns at once (on NCCL it only orders streams),
``is_completed()`` turns True after the GEMMs, the results are right, and storage freed
after ``wait()`` and reused at once does not corrupt them. Streams and events go through
torch's device-generic API (torch.Stream, torch.Event), as the engine's streams do. On
gloo with CPU tensors (the tests) only the results and the handle calls are checked.
Then the link survey's codec probe on the device: the engine's quantizers' nanoseconds per
element against the HBM speed the step model assumes without a survey.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_lbp.engine.dist_api import all_gather_single

NUMEL = 1 << 24                    # 16M elements per collective (64 MiB fp32)
GEMM_SECONDS = 1.0                 # how long the queue in front of the collectives runs
HOST_RETURN_S = 0.1                # "wait() returns at once": well under the queue's length


def _reduce_scatter_single() -> Callable:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collectives(device: torch.device, numel: int = NUMEL) -> dict[str, tuple[Callable, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """name -> (issue(async) -> work, input, output, expected output) at world size 1."""
    world = dist.get_world_size()
    if world != 1:
        raise ValueError(f"part B runs at world size 1, the process group has {world} ranks")
    g = torch.Generator(device="cpu").manual_seed(7)
    src = {name: torch.randn(numel, generator=g).to(device) for name in ("ag", "rs", "a2a")}
    out = {name: torch.full_like(t, float("nan")) for name, t in src.items()}
    return {
        "all_gather": (lambda: all_gather_single()(out["ag"], src["ag"], async_op=True),
                       src["ag"], out["ag"], src["ag"].clone()),
        "reduce_scatter": (lambda: _reduce_scatter_single()(out["rs"], src["rs"], async_op=True),
                           src["rs"], out["rs"], src["rs"].clone()),
        "all_to_all": (lambda: dist.all_to_all_single(out["a2a"], src["a2a"], async_op=True),
                       src["a2a"], out["a2a"], src["a2a"].clone()),
    }


class GemmQueue:
    """Enough GEMMs queued on the current stream to keep the device busy ~``seconds``."""

    def __init__(self, device: torch.device, seconds: float = GEMM_SECONDS, n: int = 8192):
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        torch.mm(self.a, self.b, out=self.c)
        torch.accelerator.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            torch.mm(self.a, self.b, out=self.c)
        torch.accelerator.synchronize()
        per = (time.perf_counter() - t) / 5
        self.count = max(1, int(seconds / per))
        self.seconds = self.count * per

    def queue(self) -> float:
        """Queue the GEMMs; the host seconds it took to queue them."""
        t = time.perf_counter()
        for _ in range(self.count):
            torch.mm(self.a, self.b, out=self.c)
        return time.perf_counter() - t


def handles_behind_gemms(device: torch.device, gemms: GemmQueue | None) -> list[dict[str, Any]]:
    """Each collective issued behind the GEMM queue (none on CPU): the handle's answers,
    how long the host spent in wait(), the result, and the storage released after wait()."""
    rows = []
    for name, (issue, src, out, expected) in collectives(device).items():
        queued_s = 0.0
        if gemms:
            torch.accelerator.synchronize()
            queued_s = gemms.queue()
        work = issue()
        completed_at_issue = work.is_completed()
        t = time.perf_counter()
        work.wait()
        wait_s = time.perf_counter() - t
        completed_after_wait = work.is_completed()
        # The engine's release: storage to 0 bytes right after wait(), then a new buffer the
        # compute stream writes at once (the caching allocator may hand it the same memory).
        src_ptr = src.untyped_storage().data_ptr()
        src.untyped_storage().resize_(0)
        reuse = torch.empty(expected.numel(), dtype=expected.dtype, device=device)
        reused_memory = reuse.untyped_storage().data_ptr() == src_ptr
        reuse.fill_(12345.0)
        host_ahead = not work.is_completed()
        t = time.perf_counter()
        if gemms:
            torch.accelerator.synchronize()
        sync_s = time.perf_counter() - t
        rows.append({"collective": name, "gemm_queue_s": round(gemms.seconds, 3) if gemms else 0.0,
                     "queue_host_s": round(queued_s, 4),
                     "is_completed_at_issue": completed_at_issue,
                     "wait_host_s": round(wait_s, 4),
                     "is_completed_after_wait": completed_after_wait,
                     "is_completed_while_queued": not host_ahead,
                     "is_completed_after_sync": work.is_completed(),
                     "sync_s": round(sync_s, 3),
                     "released_memory_reused": reused_memory,
                     "result_right": bool(torch.equal(out, expected))})
    return rows


def streams_and_events(device: torch.device, gemms: GemmQueue) -> dict[str, Any]:
    """A collective on a side stream ordered by events, all through the device-generic API."""
    compute = torch.accelerator.current_stream(device)
    side = torch.Stream(device=device)
    name, (issue, src, out, expected) = next(iter(collectives(device).items()))
    torch.accelerator.synchronize()
    gemms.queue()
    ready = torch.Event()
    ready.record(compute)
    ready_at_issue = ready.query()
    side.wait_event(ready)
    t = time.perf_counter()
    with side:                       # the collective is issued with the side stream current
        work = issue()
        work.wait()                  # the side stream (current here) waits; the host does not
        done = torch.Event()
        done.record(side)
    issue_s = time.perf_counter() - t
    done_while_queued = done.query()
    compute.wait_event(done)
    result = out.clone()             # runs on the compute stream after `done`
    torch.accelerator.synchronize()
    return {"collective": name, "ready_event_done_at_issue": ready_at_issue,
            "issue_and_wait_host_s": round(issue_s, 4),
            "done_event_while_queued": done_while_queued,
            "done_event_after_sync": done.query(),
            "result_right": bool(torch.equal(result, expected))}


def engine_streams(device: torch.device, gemms: GemmQueue | None) -> dict[str, Any]:
    """The engine's own streams (megatron_lbp.engine.streams), as its step chains use them: a
    collective on one communicator's stream, a second hop on another's after the first's
    event, both submitted at once behind the GEMM queue; the compute stream (the host, on
    CPU) waits for the second's event, then reads the result."""
    from megatron_lbp.engine.streams import StreamWork, Streams

    streams = Streams(device)
    (_, (_, src, out, expected)), = list(collectives(device).items())[:1]
    hop = torch.full_like(out, float("nan"))
    if gemms:
        torch.accelerator.synchronize()
        gemms.queue()
    t = time.perf_counter()
    first = streams["inter_gather"].submit(
        lambda: all_gather_single()(out, src, async_op=False), holds=(src, out),
        what="first hop")
    second = streams["grad_to_param_gather"].submit(lambda: hop.copy_(out), waits=(first,),
                                                    holds=(out, hop), what="second hop")
    submit_s = time.perf_counter() - t
    done_while_queued = second.query() if gemms else False
    t = time.perf_counter()
    StreamWork(second).wait()
    wait_s = time.perf_counter() - t
    result = hop.clone()        # after the wait: on the compute stream, ordered after `second`
    if gemms:
        torch.accelerator.synchronize()
    return {"streams": type(streams["inter_gather"]).__name__,
            "submit_host_s": round(submit_s, 4), "wait_host_s": round(wait_s, 4),
            "second_hop_done_while_queued": done_while_queued,
            "second_hop_done_after_sync": second.query(),
            "result_right": bool(torch.equal(result, expected))}


def judge(rows: list[dict[str, Any]], stream: dict[str, Any] | None,
          engine: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The checks over the measured behaviour (device run: host ahead of the device)."""
    checks = []
    for r in rows:
        n = r["collective"]
        checks += [
            {"name": f"{n}: is_completed() False while queued behind the GEMMs",
             "ok": not r["is_completed_at_issue"] and not r["is_completed_while_queued"],
             "detail": f"at issue {r['is_completed_at_issue']}, after wait "
                       f"{r['is_completed_after_wait']}, with the GEMMs still queued "
                       f"{r['is_completed_while_queued']}"},
            {"name": f"{n}: wait() returns without blocking the host",
             "ok": r["wait_host_s"] < HOST_RETURN_S,
             "detail": f"wait() took {r['wait_host_s']} s with {r['gemm_queue_s']} s of GEMMs queued"},
            {"name": f"{n}: is_completed() True after the device finished",
             "ok": r["is_completed_after_sync"], "detail": str(r["is_completed_after_sync"])},
            {"name": f"{n}: result right with its input released after wait()",
             "ok": r["result_right"],
             "detail": f"released memory reused by the next allocation: "
                       f"{r['released_memory_reused']}"},
        ]
    if stream is not None:
        checks += [
            {"name": "side stream: collective ordered by events, host not blocked",
             "ok": (not stream["ready_event_done_at_issue"]
                    and not stream["done_event_while_queued"]
                    and stream["issue_and_wait_host_s"] < HOST_RETURN_S),
             "detail": f"ready event done at issue {stream['ready_event_done_at_issue']}, done "
                       f"event while queued {stream['done_event_while_queued']}, host "
                       f"{stream['issue_and_wait_host_s']} s"},
            {"name": "side stream: result right on the compute stream after its event",
             "ok": stream["result_right"] and stream["done_event_after_sync"],
             "detail": f"result right {stream['result_right']}"},
        ]
    if engine is not None:
        checks += [
            {"name": "engine streams: a two-hop chain submitted without blocking the host",
             "ok": (not engine["second_hop_done_while_queued"]
                    and engine["submit_host_s"] < HOST_RETURN_S
                    and engine["wait_host_s"] < HOST_RETURN_S),
             "detail": f"{engine['streams']}: submit {engine['submit_host_s']} s, wait "
                       f"{engine['wait_host_s']} s, second hop done while queued "
                       f"{engine['second_hop_done_while_queued']}"},
            {"name": "engine streams: the second hop read the first's result after its event",
             "ok": engine["result_right"] and engine["second_hop_done_after_sync"],
             "detail": f"result right {engine['result_right']}"},
        ]
    return checks


CODEC_ELEMENTS = (1 << 20, 1 << 24)   # the link survey's default codec sizes


def codec_rates(device: torch.device, elements=CODEC_ELEMENTS, gemm_dim: int = 8192
                ) -> dict[str, Any]:
    """The link survey's codec probe (launch/link_survey.codec_probe) on this device at world
    size 1, and per codec and direction its nanoseconds per element at the largest size beside
    what the step model assumes without a survey (HBM speed, projection/collectives.py)."""
    from megatron_lbp.launch import link_survey
    from megatron_lbp.projection import collectives

    cuda = device.type == "cuda"
    probe = link_survey.codec_probe(torch, dist, link_survey.Clock(torch, device), device,
                                    list(elements), 3, gemm_dim,
                                    torch.bfloat16 if cuda else torch.float32)
    public, e = collectives.CollectiveModel.public(), max(elements)
    rows = []
    for codec, c in probe["by_codec"].items():
        for direction in ("encode", "decode"):
            seconds = c[direction]["seconds"][-1]
            assumed = public.codec_call_seconds(codec, direction, e, "fast")
            rows.append({"codec": codec, "direction": direction, "elements": e,
                         "ns_per_element": round(seconds / e * 1e9, 4),
                         "assumed_ns_per_element": round(assumed / e * 1e9, 4),
                         "measured_over_assumed": round(seconds / assumed, 3),
                         "hidden_fraction": round(c["hidden_fraction"], 3)})
    return {"probe": probe, "rows": rows}


def judge_codecs(codecs: dict[str, Any]) -> list[dict[str, Any]]:
    """The codec probe ran on the device and timed every codec and direction; the detail is
    the figure a device adds: how far the quantizers are from the HBM speed the step model
    assumes without a survey."""
    rows = codecs["rows"]
    return [{"name": "codec probe: the engine's int8 and int4 quantizers timed on the device",
             "ok": len(rows) == 4 and all(r["ns_per_element"] > 0 for r in rows),
             "detail": "; ".join(f"{r['codec']} {r['direction']} {r['ns_per_element']:.3g} "
                                 f"ns/element ({r['measured_over_assumed']:.3g}x the HBM "
                                 f"assumption), hidden {r['hidden_fraction']:.2f}"
                                 for r in rows)}]


def init_world_of_one(backend: str) -> None:
    import tempfile

    store = dist.FileStore(tempfile.mktemp(prefix="lbp-partb-"), 1)
    dist.init_process_group(backend, rank=0, world_size=1, store=store)


def run(opts) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    init_world_of_one("nccl")
    gemms = GemmQueue(device)
    rows = handles_behind_gemms(device, gemms)
    stream = streams_and_events(device, gemms)
    engine = engine_streams(device, gemms)
    codecs = codec_rates(device)
    dist.destroy_process_group()
    return {"checks": judge(rows, stream, engine) + judge_codecs(codecs),
            "figures": {"collectives": rows, "side_stream": stream, "engine_streams": engine,
                        "codecs": codecs}}
