"""Part E: four gloo ranks on the one GPU, the engine with device memory.

NCCL refuses several ranks on one GPU; gloo serves CUDA tensors. Each collective the engine
issues on gloo is tried first with CUDA tensors (the part stops naming one that is not
served); then the tiny GPT trains with lbp (P=2, G=4, O=4) and with the int8 secondary
(S=4), every state in device memory, against the same model trained in one process with
torch's AdamW: the losses must agree (fp32; the int8 copy within its error).
"""
from __future__ import annotations

from typing import Any

import torch

WORLD = 4
FP32_RTOL = 1e-4
INT8_RTOL = 5e-2
ENGINE_ARGV = {
    "lbp": ["--hier-preset", "lbp", "--hier-gpus-per-node", "4", "--hier-gcds-per-package", "2",
            "--hier-secondary-group-size", "0"],
    "lbp-int8": ["--hier-preset", "lbp", "--hier-gpus-per-node", "4",
                 "--hier-gcds-per-package", "2", "--hier-secondary-group-size", "4",
                 "--hier-secondary-dtype", "int8"],
}


def probe_collectives(device: str = "cuda") -> dict[str, str]:
    """On each rank: collective -> "ok", or what went wrong, with ``device`` tensors."""
    import torch.distributed as dist

    from megatron_lbp.engine.dist_api import all_gather_single

    rank, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    mine = torch.arange(8, dtype=torch.float32, device=dev) + 100 * rank
    every = torch.cat([torch.arange(8, dtype=torch.float32) + 100 * r for r in range(n)])
    out: dict[str, str] = {}

    def attempt(name, fn, expected):
        try:
            got = fn()
            out[name] = "ok" if torch.equal(got.cpu(), expected) else f"wrong result {got.cpu()[:4].tolist()}"
        except Exception as exc:  # noqa: BLE001 - the answer is what failed
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"

    def gather():
        o = torch.empty(8 * n, device=dev)
        all_gather_single()(o, mine)
        return o

    def a2a():
        o = torch.empty(8 * n, device=dev)
        dist.all_to_all_single(o, torch.cat([mine] * n))
        return o

    def reduce():
        t = mine.clone()
        dist.all_reduce(t)
        return t

    def bcast():
        t = mine.clone()
        dist.broadcast(t, src=0)
        return t

    attempt("all_gather", gather, every)
    attempt("all_to_all", a2a, every)
    attempt("all_reduce", reduce, sum(torch.arange(8, dtype=torch.float32) + 100 * r
                                      for r in range(n)))
    attempt("broadcast", bcast, torch.arange(8, dtype=torch.float32))
    return out


def train_on_rank(steps: int) -> dict[str, Any]:
    """On each rank: the engine's losses per configuration; rank 0 adds the reference's."""
    import torch.distributed as dist

    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, train_hier, train_reference

    torch.cuda.set_device(0)
    spec, train = TinyGPTSpec(), TrainSpec(steps=steps, micro_batches=2, bucket_size=20000)
    out = {}
    for name, argv in ENGINE_ARGV.items():
        result = train_hier(spec, train, argv)
        out[name] = {"losses": result.losses,
                     "device": str(next(iter(result.params.values())).device)}
    if dist.get_rank() == 0:
        out["reference"] = {"losses": train_reference(spec, train, dist.get_world_size()).losses}
    return out


def judge(probe: dict[str, str], trained: dict[str, Any] | None) -> list[dict[str, Any]]:
    failed = {k: v for k, v in probe.items() if v != "ok"}
    checks = [{"name": "gloo serves the engine's collectives for CUDA tensors", "ok": not failed,
               "detail": "; ".join(f"{k}: {v}" for k, v in failed.items()) or ", ".join(probe)}]
    if trained is None:
        return checks
    ref = trained["reference"]["losses"]
    for name, rtol in (("lbp", FP32_RTOL), ("lbp-int8", INT8_RTOL)):
        got = trained[name]["losses"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        checks.append({"name": f"{name} on 4 gloo ranks with CUDA tensors matches the reference",
                       "ok": worst <= rtol,
                       "detail": f"losses {got} reference {ref}: largest relative difference "
                                 f"{worst:.2e} (bound {rtol})"})
    return checks


def run(opts) -> dict[str, Any]:
    from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks

    env = {"CUDA_VISIBLE_DEVICES": "0"}
    probes = run_on_ranks(probe_collectives, WORLD, "cuda", timeout=25, env=env)
    probe = {k: v for p in probes for k, v in p.items() if v != "ok"} or probes[0]
    checks = judge(probe, None)
    if not checks[0]["ok"]:
        return {"checks": checks, "figures": {"probe": probes},
                "reason": "gloo does not serve " + checks[0]["detail"]}
    ranks = run_on_ranks(train_on_rank, WORLD, 4, timeout=30, env=env,
                         rank_env=rank_location_env(WORLD))
    return {"checks": judge(probe, ranks[0]), "figures": {"probe": probes, "ranks": ranks[0]}}
