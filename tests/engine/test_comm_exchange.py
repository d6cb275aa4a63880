"""Gloo's reduce-scatter as an all-to-all and a local sum (engine/comm.py), on real gloo ranks.

Gloo's own reduce_scatter_tensor all-reduces its whole input, so each rank
sends twice what a reduce-scatter (and NCCL) sends; the engine runs its gloo
reduce-scatters as an exchange instead. Checked here, on 4 ranks:

- values: the exchange gives every rank what gloo's reduce_scatter_tensor
  gives, synchronously and asynchronously, fp32 and bf16, through the engine's
  Collectives as through the function itself, and the ledger still charges
  (n-1)/n of the input;
- bytes sent (each rank's own count of what it wrote to its sockets): the exchange
  sends (n-1)/n of the input per rank, gloo's own reduce-scatter about twice that; this is the
  reason for the exchange, and the test says so if a torch release changes it;
- a wrong exchange (chunks summed from the wrong rank) is caught by the value check.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_lbp.engine import comm as comm_mod
from megatron_lbp.testing.multirank import run_on_ranks

WORLD = 4


def _rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _values(broken: bool):
    rank = dist.get_rank()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        inp = _rank_input(rank, WORLD * 1000, dtype)
        ref = torch.empty(1000, dtype=dtype)
        dist.reduce_scatter_tensor(ref, inp.clone())
        wide = sum(_rank_input(r, WORLD * 1000, dtype).float() for r in range(WORLD))
        exact = wide[rank * 1000:(rank + 1) * 1000]
        for async_op in (False, True):
            got = torch.empty(1000, dtype=dtype)
            sent = inp.roll(1000) if broken else inp
            work = comm_mod.reduce_scatter_by_exchange(got, sent, group=None, async_op=async_op)
            if async_op:
                assert work is not None and not isinstance(work, bool)
                work.wait()
                assert work.is_completed()
            else:
                assert work is None
            # Relative to the sum. fp32: gloo's result up to the order of the additions.
            # bf16: gloo's ring rounds every partial sum (1.3% off seen here), so the
            # exchange is held to the exact sum, within one ulp (2**-8): its sum is wide
            # and rounds once.
            tol = 1e-6 if dtype == torch.float32 else 2 ** -8
            scale = exact.abs().clamp(min=1.0)
            out[f"{dtype}-{async_op}"] = (
                float(((got.float() - ref.float()).abs() / scale).max()),
                float(((got.float() - exact).abs() / scale).max()), tol)
    # Through the engine's door: it takes the exchange on gloo, and charges the same bytes.
    c = comm_mod.Collectives({"grad": {"reduce": None}}, {"grad": WORLD}, {"grad": "node"})
    inp = _rank_input(rank, WORLD * 1000, torch.float32)
    got = torch.empty(1000)
    c.reduce_scatter(got, inp, "grad", "grad_reduce", async_op=True).wait()
    ref = torch.empty(1000)
    dist.reduce_scatter_tensor(ref, inp.clone())
    out["collectives"] = (float((got - ref).abs().max()), 0.0, 1e-5)
    return {"diffs": out, "exchange": c.scatters_by_exchange("grad"),
            "charged": c.ledger.by_phase()["grad_reduce"]["node"]}


@pytest.mark.parametrize("broken", [False, True], ids=["exchange", "broken-exchange"])
def test_exchange_gives_what_gloo_reduce_scatter_gives(broken):
    for rank, r in enumerate(run_on_ranks(_values, WORLD, broken)):
        bad = {k: d for k, d in r["diffs"].items() if k != "collectives" and (
            d[1] > d[2] or ("float32" in k and d[0] > d[2]))}
        if broken:
            assert bad, f"rank {rank}: an exchange of the wrong chunks went unnoticed"
            continue
        assert not bad, (f"rank {rank}: the exchange differs from gloo's reduce_scatter_tensor "
                         f"(max |difference| / max(|sum|, 1) against gloo, against the exact sum; bound): {bad}")
        d = r["diffs"]["collectives"]
        assert d[0] <= d[2], f"rank {rank}: Collectives.reduce_scatter differs by {d[0]}"
        assert r["exchange"], f"rank {rank}: the engine did not take the exchange on gloo"
        assert r["charged"] == 4 * WORLD * 1000 * (WORLD - 1) // WORLD, r["charged"]


def _bytes_written() -> int:
    """Bytes this process has passed to write()/writev(): gloo's pairs send with writev.

    This rank's own count, not the loopback's: other processes on the machine (the suite's
    other worker, other runs) send over the same loopback while this test measures."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def _bytes_per_rank():
    numel = 4 * 2 ** 20   # 16 MB of fp32: the store's own traffic is noise beside it
    inp = torch.ones(numel)
    out = torch.empty(numel // WORLD)
    ways = {"native": lambda: dist.reduce_scatter_tensor(out, inp),
            "exchange": lambda: comm_mod.reduce_scatter_by_exchange(out, inp, group=None,
                                                                    async_op=False)}
    sent = {}
    for name, f in ways.items():
        f()
        dist.barrier()
        before = _bytes_written()
        for _ in range(3):
            f()
        # Every rank has received all it waits for: every send of the three is written.
        dist.barrier()
        sent[name] = (_bytes_written() - before) / 3 / (numel * 4)
    return sent


def test_exchange_sends_a_reduce_scatters_bytes_and_gloo_twice_that():
    per_rank = run_on_ranks(_bytes_per_rank, WORLD)
    sent = {k: sum(r[k] for r in per_rank) / WORLD for k in per_rank[0]}
    ideal = (WORLD - 1) / WORLD
    assert abs(sent["exchange"] - ideal) < 0.1 * ideal, (
        f"the exchange sent {sent['exchange']:.3f} x the input per rank, a reduce-scatter "
        f"sends {ideal:.3f}")
    assert sent["native"] > 1.6 * ideal, (
        f"gloo's reduce_scatter_tensor sent {sent['native']:.3f} x the input per rank, no "
        f"longer about twice a reduce-scatter's {ideal:.3f}: exchange_reduce_scatter's reason "
        "is gone, reconsider it (engine/comm.py)")
