"""The yardstick: stock megatron-core DDP + DistributedOptimizer on 4 gloo ranks equals one process.

If this fails, nothing measured against "stock Megatron" elsewhere in the suite means anything.
"""
import pytest
import torch

from megatron_lbp.testing.multirank import run_on_ranks, run_single
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, train_reference, train_stock_megatron

LOSS_TOL = 1e-5
WORLD = 4


def _max_rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "train",
    [
        TrainSpec(steps=6),
        # gradient accumulation with Megatron's asynchronous, bucketed reduce-scatter
        TrainSpec(steps=5, micro_batches=2, overlap_grad_reduce=True, bucket_size=4000),
    ],
    ids=["plain", "accum2-overlap-buckets"],
)
def test_stock_distributed_optimizer_matches_single_process(train):
    spec = TinyGPTSpec(num_layers=2, hidden_size=64)
    ref = run_single(train_reference, spec, train, WORLD)
    ranks = run_on_ranks(train_stock_megatron, WORLD, spec, train)

    assert len(ref.losses) == train.steps >= 5
    for r, res in enumerate(ranks):
        assert res.losses == ranks[0].losses, f"rank {r} logged {res.losses}, rank 0 {ranks[0].losses}"
    stock = ranks[0]
    diffs = [abs(a - b) for a, b in zip(stock.losses, ref.losses)]
    assert max(diffs) <= LOSS_TOL, (
        f"loss differs by up to {max(diffs):.3g} (> {LOSS_TOL}):\n stock {stock.losses}\n ref   {ref.losses}"
    )
    assert _max_rel(stock.grad_norms, ref.grad_norms) <= 1e-5, (
        f"grad norms differ:\n stock {stock.grad_norms}\n ref   {ref.grad_norms}"
    )
    # The loss must actually move, or equality would prove nothing.
    assert stock.losses[-1] < stock.losses[0] - 0.05, f"loss did not fall: {stock.losses}"
    worst = max(
        ((name, (stock.params[name] - ref.params[name]).abs().max().item()) for name in ref.params),
        key=lambda kv: kv[1],
    )
    assert worst[1] <= 1e-5, f"final weights differ most in {worst[0]}: {worst[1]:.3g}"
    for r, res in enumerate(ranks[1:], 1):
        for name, p in res.params.items():
            assert torch.equal(p, stock.params[name]), f"rank {r} ends with a different {name} than rank 0"
