"""Distributed (torch_dist) checkpoints written from the shards, read back under any hierarchy."""
import pytest
import torch

from megatron_lbp.engine.checkpoint import flat_range_pieces
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, setup_hier

SPEC = TinyGPTSpec()
LBP8 = ["--hier-param-group-size", "2", "--hier-grad-group-size", "4"]


def _train(world):
    # The same global batch whatever the world size: 16 sequences per micro-batch.
    return TrainSpec(micro_batch_size=16 // world, micro_batches=2, bucket_size=20000)


def _state(trainer, is_loading=False):
    model_sd = trainer.model.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def _save_then_continue(ckpt, argv, world, steps, more):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    trainer = setup_hier(SPEC, _train(world), argv)
    trainer.run(range(steps))
    dist_checkpointing.save(_state(trainer), ckpt)
    dist.barrier()
    return trainer.run(range(steps, steps + more)).losses


def _load_then_continue(ckpt, argv, world, steps, more):
    from megatron.core import dist_checkpointing

    trainer = setup_hier(SPEC, _train(world), argv)
    loaded = dist_checkpointing.load(_state(trainer, is_loading=True), ckpt)
    trainer.model.load_state_dict(loaded["model"])
    trainer.optimizer.load_state_dict(loaded["optimizer"])
    return trainer.run(range(steps, steps + more)).losses


def test_resume_from_a_distributed_checkpoint_is_bit_identical(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    topo = rank_location_env(4)
    expected = run_on_ranks(_save_then_continue, 8, ckpt, LBP8, 8, 3, 2, rank_env=topo)[0]
    got = run_on_ranks(_load_then_continue, 8, ckpt, LBP8, 8, 3, 2, rank_env=topo)[0]
    assert got == expected, f"resumed {got} != uninterrupted {expected}"


# Moving between hierarchies and world sizes (lbp/8 -> zero2/4 -> lbp/8), with the
# optimizer state compared by value: tests/engine/test_reshard_optimizer_state.py.


@pytest.mark.parametrize("shape,start,stop", [
    ((10,), 3, 7), ((4, 5), 0, 20), ((4, 5), 3, 17), ((4, 5), 5, 10), ((4, 5), 7, 9),
    ((3, 4), 4, 12), ((1, 7), 2, 5),
])
def test_flat_ranges_become_rectangles_that_tile_the_range(shape, start, stop):
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    flat = full.reshape(-1)[start:stop]
    covered = []
    for local, offset, a, b in flat_range_pieces(shape, start, stop):
        assert len(local) == len(shape)
        region = full[tuple(slice(o, o + n) for o, n in zip(offset, local))]
        assert torch.equal(region.reshape(-1), flat[a:b]), (shape, start, stop, local, offset)
        covered.append((a, b))
    assert covered[0][0] == 0 and covered[-1][1] == stop - start
    assert all(x[1] == y[0] for x, y in zip(covered, covered[1:])), covered
    assert len(covered) <= 3
