"""Two-rank gloo groups' collectives as one exchange (engine/pair_exchange.py), on real gloo ranks.

Four ranks, two groups of two that are not neighbours ({0, 2}, and {3, 1} in that group-rank
order), so a peer or a half taken from the wrong place shows. Every collective the engine routes to the exchange gives what
gloo's own gives, bit for bit, synchronously and asynchronously, fp32 and bf16; the engine's
Collectives take the exchange for a two-rank gloo group and gloo's own for four ranks, and
the ledger charges what it charged before. A swapped half is caught by the same comparison.
Why the exchange exists (its directions at once on a shaped link) is measured on the
emulated network: tests/bench/test_survey_network.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_lbp.engine import comm as comm_mod
from megatron_lbp.engine import pair_exchange
from megatron_lbp.engine.dist_api import all_gather_single
from megatron_lbp.testing.multirank import run_on_ranks

WORLD = 4
NUMEL = 1000


def _data(rank: int, dtype: torch.dtype, numel: int = NUMEL) -> torch.Tensor:
    g = torch.Generator().manual_seed(77 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _run(fn, async_op: bool):
    work = fn(async_op)
    if async_op:
        assert work is not None, "an asynchronous exchange returned no work"
        work.wait()
        assert work.is_completed()
    else:
        assert work is None, "a synchronous exchange returned a work"


def _compare(broken: bool):
    rank = dist.get_rank()
    # {0, 2} in order; {3, 1} with its group ranks the reverse of the global order, as the
    # engine's chunk-ordered gradient groups can be (process_groups._new_group)
    groups = [dist.new_group([0, 2]), dist.new_group([3, 1], sort_ranks=False)]
    pair = groups[rank % 2]
    differs = []

    def check(name, got, ref):
        if not torch.equal(got, ref):
            differs.append(f"{name}: max |diff| {float((got.float() - ref.float()).abs().max())}")

    for dtype in (torch.float32, torch.bfloat16):
        for async_op in (False, True):
            tag = f"{dtype} async={async_op}"
            x = _data(rank, dtype)
            # all-gather, from a separate input and in place (the input is this rank's half)
            ref = torch.empty(2 * NUMEL, dtype=dtype)
            all_gather_single()(ref, x, group=pair)
            got = torch.empty(2 * NUMEL, dtype=dtype)
            sent = x.roll(1) if broken else x
            _run(lambda a: pair_exchange.all_gather(got, sent, group=pair, async_op=a), async_op)
            check(f"all_gather {tag}", got, ref)
            inplace = torch.zeros(2 * NUMEL, dtype=dtype)
            mine = inplace.view(2, -1)[dist.get_group_rank(pair, rank)]
            mine.copy_(x)
            _run(lambda a: pair_exchange.all_gather(inplace, mine, group=pair, async_op=a),
                 async_op)
            check(f"all_gather in place {tag}", inplace, ref)
            # all-to-all
            y = _data(10 + rank, dtype, 2 * NUMEL)
            ref = torch.empty_like(y)
            dist.all_to_all_single(ref, y, group=pair)
            got = torch.empty_like(y)
            _run(lambda a: pair_exchange.all_to_all(got, y, group=pair, async_op=a), async_op)
            check(f"all_to_all {tag}", got, ref)
            # reduce-scatter: the engine's gloo reduce-scatter takes the exchange for two ranks
            ref = torch.empty(NUMEL, dtype=dtype)
            dist.reduce_scatter_tensor(ref, y.clone(), group=pair)
            got = torch.empty(NUMEL, dtype=dtype)
            _run(lambda a: comm_mod.reduce_scatter_by_exchange(got, y, group=pair, async_op=a),
                 async_op)
            check(f"reduce_scatter {tag}", got, ref)
            # all-reduce, SUM and MAX
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                ref = x.clone()
                dist.all_reduce(ref, op=op, group=pair)
                got = x.clone()
                _run(lambda a: pair_exchange.all_reduce(got, op=op, group=pair, async_op=a),
                     async_op)
                check(f"all_reduce {op} {tag}", got, ref)
    # Through the engine's door: the exchange for two gloo ranks, gloo's own for four; the
    # ledger charges a ring's bytes either way.
    c = comm_mod.Collectives({"inter": {"gather": pair, "reduce": pair},
                              "optim": {"gather": None, "reduce": None}},
                             {"inter": 2, "optim": WORLD}, {"inter": "network", "optim": "network"})
    x = _data(rank, torch.float32)
    got = torch.empty(2 * NUMEL)
    c.all_gather(got, x, "inter", "forward_gather", async_op=True).wait()
    ref = torch.empty(2 * NUMEL)
    all_gather_single()(ref, x, group=pair)
    check("Collectives.all_gather", got, ref)
    return {"differs": differs,
            "pairwise": {(f, ch): c.pairwise(f, ch) for f in ("inter", "optim")
                         for ch in ("gather", "reduce")},
            "charged": c.ledger.by_phase()["forward_gather"]["network"]}


@pytest.mark.parametrize("broken", [False, True], ids=["exchange", "swapped-half"])
def test_a_pair_exchange_gives_what_gloo_gives(broken):
    for rank, r in enumerate(run_on_ranks(_compare, WORLD, broken)):
        if broken:
            assert any(d.startswith("all_gather") for d in r["differs"]), (
                f"rank {rank}: an all-gather sending the wrong data went unnoticed")
            continue
        assert not r["differs"], f"rank {rank}: the exchange differs from gloo's: {r['differs']}"
        assert r["pairwise"] == {("inter", "gather"): True, ("inter", "reduce"): True,
                                 ("optim", "gather"): False, ("optim", "reduce"): False}, (
            f"rank {rank}: which groups take the exchange: {r['pairwise']}")
        assert r["charged"] == 4 * NUMEL, (
            f"rank {rank}: the ledger charged {r['charged']} bytes for a two-rank all-gather "
            f"of {2 * 4 * NUMEL}; a ring sends half: {4 * NUMEL}")


def test_takes_only_two_rank_gloo_groups():
    assert pair_exchange.takes("gloo", 2)
    assert not pair_exchange.takes("gloo", 3) and not pair_exchange.takes("gloo", 1)
    assert not pair_exchange.takes("nccl", 2)
    assert pair_exchange.reduces_locally(dist.ReduceOp.SUM)
    assert not pair_exchange.reduces_locally(dist.ReduceOp.PRODUCT)
