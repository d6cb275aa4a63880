"""Recording a step's collectives and issuing them again alone (bench/link_replay.py), on real gloo ranks."""
import torch
import torch.distributed as dist

from benchmarks import link_replay
from benchmarks.stock_accounting import WRAPPED
from megatron_lbp.engine import pair_exchange
from megatron_lbp.testing.multirank import run_on_ranks


def _signature(calls):
    return [(c.name, c.args, {k: v for k, v in c.kwargs.items() if k != "group"})
            for c in calls]


def _record_replay_rerecord():
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    originals = {name: getattr(dist, name) for name in WRAPPED}
    shard = torch.full((4,), float(rank + 1), dtype=torch.bfloat16)
    gathered = torch.zeros(8, dtype=torch.bfloat16)
    grads = torch.arange(8, dtype=torch.float32)
    part = torch.zeros(4)
    flag = torch.ones(1)
    with link_replay.recording() as calls:
        dist.all_gather_into_tensor(output_tensor=gathered, input_tensor=shard, group=pair)
        dist.reduce_scatter_tensor(part, grads, group=pair, async_op=True).wait()
        dist.all_reduce(flag)
        # the engine's two-rank exchange: a batch of a receive and a send
        pair_exchange.all_gather(torch.zeros(8), torch.full((4,), float(rank)), group=pair,
                                 async_op=True).wait()
    assert {name: getattr(dist, name) for name in WRAPPED} == originals
    kept = (gathered.clone(), part.clone(), flag.clone())
    replay = link_replay.Replay(calls)
    replay()
    replay()
    # The replay wrote its own buffers, never the step's live tensors.
    assert all(torch.equal(a, b) for a, b in zip(kept, (gathered, part, flag)))
    with link_replay.recording() as again:
        replay()
    by_comm = sorted(calls, key=link_replay._communicator_key)  # the replay's order
    return {"count": replay.count, "same": _signature(by_comm) == _signature(again),
            "first": _signature(calls)[0], "gathered": gathered.float().tolist()}


def test_a_recorded_step_replays_the_same_collectives_on_its_own_buffers():
    out = run_on_ranks(_record_replay_rerecord, 2)
    for r in out:
        assert r["count"] == 4 and r["same"], r
        name, args, kwargs = r["first"]
        assert name == "all_gather_into_tensor" and args == ()
        assert kwargs["output_tensor"] == link_replay.TensorSpec((8,), torch.bfloat16), kwargs
        assert r["gathered"] == [1.0] * 4 + [2.0] * 4


def _interleaved_differently():
    """Two communicators over the same ranks, their calls interleaved in opposite orders on
    the two ranks (as the engine's polled chains can): the replay must not deadlock."""
    import datetime

    rank = dist.get_rank()
    short = datetime.timedelta(seconds=20)   # a deadlock fails fast instead of hanging
    a = dist.new_group([0, 1], timeout=short)
    b = dist.new_group([0, 1], timeout=short)
    x, y = torch.ones(4), torch.ones(4)
    with link_replay.recording() as calls:
        first, second = ((a, x), (b, y)) if rank == 0 else ((b, y), (a, x))
        works = [dist.all_reduce(t, group=g, async_op=True) for g, t in (first, second)]
        for w in works:
            w.wait()
    replay = link_replay.Replay(calls)
    replay()
    return [c.kwargs["group"].group_name for c in calls]


def test_calls_interleaved_differently_on_each_rank_replay_without_deadlock():
    orders = run_on_ranks(_interleaved_differently, 2, timeout=120)
    assert orders[0] == orders[1][::-1], f"the ranks recorded the same interleaving: {orders}"
