"""The engine's contract with Megatron's training loop: state dicts, reports, refusals."""
import argparse
import json

import pytest
import torch

from megatron_lbp.integration.megatron_adapter import check_megatron_args
from megatron_lbp.testing.multirank import MultiRankError, rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, setup_hier

LBP = ["--hier-param-group-size", "2", "--hier-grad-group-size", "4"]
TOPO = rank_location_env(4)
SPEC = TinyGPTSpec()
TRAIN = TrainSpec(micro_batches=2, bucket_size=20000)


def _resume_losses(split):
    """Losses of steps [split, 6) after restoring the state saved at ``split``, and without."""
    straight = setup_hier(SPEC, TRAIN, LBP)
    straight.run(range(split))
    model_sd = straight.model.state_dict()
    opt_sd = straight.optimizer.state_dict()
    sched_sd = straight.scheduler.state_dict()
    expected = straight.run(range(split, 6)).losses

    resumed = setup_hier(SPEC, TRAIN, LBP)        # fresh weights and optimizer
    resumed.model.load_state_dict(model_sd)
    resumed.optimizer.load_state_dict(opt_sd)
    resumed.scheduler.load_state_dict(sched_sd)
    return expected, resumed.run(range(split, 6)).losses


def test_state_dict_round_trip_resumes_bit_identically():
    out = run_on_ranks(_resume_losses, 8, 3, rank_env=TOPO)
    expected, got = out[0]
    assert got == expected, f"resumed losses {got} != uninterrupted {expected}"


def _write_report(path):
    trainer = setup_hier(SPEC, TrainSpec(steps=3, bucket_size=20000), LBP + ["--hier-comm-report", path])
    trainer.run(range(3))


def test_comm_report_has_one_json_line_per_step(tmp_path):
    path = tmp_path / "comm.jsonl"
    run_on_ranks(_write_report, 8, str(path), rank_env=TOPO)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3], lines
    for r in lines:
        assert r["rank"] == 0
        assert set(r["traffic_bytes"]) == {"package", "node", "network"}
        assert set(r["traffic_by_phase"]) >= {"forward_gather", "backward_gather", "grad_reduce",
                                              "step_reduce", "step_gather"}
        assert r["memory_bytes"]["primary"] > 0 and r["memory_bytes"]["peak_transient"] > 0
    # Every step, the first included: a step's 1/G -> 1/P weight gathers are issued under
    # the next forward but charged to the step that wrote the weights.
    for r in lines[1:]:
        assert r["traffic_by_phase"] == lines[0]["traffic_by_phase"], (
            f"step {r['step']} sent other bytes than step 1:\n {r['traffic_by_phase']}\n"
            f" {lines[0]['traffic_by_phase']}")
    assert lines[0]["traffic_by_phase"]["step_gather"]["node"] > 0, lines[0]


def _per_rank_report(path):
    setup_hier(SPEC, TrainSpec(steps=1, bucket_size=20000),
               LBP + ["--hier-comm-report", path]).run(range(1))


def test_comm_report_per_rank_with_rank_placeholder(tmp_path):
    run_on_ranks(_per_rank_report, 8, str(tmp_path / "comm-{rank}.jsonl"), rank_env=TOPO)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"comm-{r}.jsonl" for r in range(8)]


def _add_parameter_after_wrapping():
    trainer = setup_hier(SPEC, TrainSpec(steps=1), ["--hier-param-group-size", "2"])
    trainer.inner.extra = torch.nn.Linear(2, 2)
    trainer.model.zero_grad_buffer()


def test_parameters_created_after_wrapping_are_refused():
    with pytest.raises(MultiRankError, match=r"parameters changed after wrapping .*extra\.weight"):
        run_on_ranks(_add_parameter_after_wrapping, 2)


def _bad_group(argv):
    setup_hier(SPEC, TrainSpec(steps=1), argv)


def test_group_sizes_that_do_not_divide_the_data_parallel_size_fail_on_every_rank():
    with pytest.raises(MultiRankError) as err:
        run_on_ranks(_bad_group, 8, ["--hier-grad-group-size", "3"], rank_env=TOPO)
    msg = str(err.value)
    assert "8 rank(s) raised" in msg and "--hier-grad-group-size=3" in msg, msg


@pytest.mark.parametrize("attr,flag", [
    ("use_megatron_fsdp", "--use-megatron-fsdp"),
    ("use_torch_fsdp2", "--use-torch-fsdp2"),
    ("use_custom_fsdp", "--use-custom-fsdp"),
])
def test_conflicting_megatron_data_parallel_flags_are_refused(attr, flag):
    with pytest.raises(ValueError) as err:
        check_megatron_args(argparse.Namespace(**{attr: True}))
    msg = str(err.value)
    assert "--hier-partition" in msg and flag in msg and "\n" not in msg, msg


@pytest.mark.parametrize("attr,value,flag", [
    ("num_experts", 8, "--num-experts"),
    ("expert_model_parallel_size", 2, "--expert-model-parallel-size"),
    ("tensor_model_parallel_size", 2, "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", 2, "--pipeline-model-parallel-size"),
])
def test_unsupported_parallelism_is_refused(attr, value, flag):
    with pytest.raises(ValueError, match=flag):
        check_megatron_args(argparse.Namespace(**{attr: value}))


def test_plain_data_parallel_args_pass():
    check_megatron_args(argparse.Namespace(tensor_model_parallel_size=1, num_experts=None,
                                           use_megatron_fsdp=False))


def _broadcast_from_rank0():
    import torch.distributed as dist

    trainer = setup_hier(SPEC, TrainSpec(steps=1), LBP)
    # Ranks 0 and 1 (the first P-group) hold the canonical slices; all others drift.
    if dist.get_rank() >= 2:
        for b in trainer.model.buckets:
            b.primary.add_(float(dist.get_rank()))
    trainer.model.broadcast_params()
    return trainer.final_params()


def test_broadcast_params_makes_every_rank_hold_the_first_holders_weights():
    out = run_on_ranks(_broadcast_from_rank0, 8, rank_env=TOPO)
    reference = run_on_ranks(_initial_weights, 1)[0]
    for rank, params in enumerate(out):
        for name, w in params.items():
            assert torch.equal(w, reference[name]), f"rank {rank}: {name} differs from rank 0's"


def _initial_weights():
    trainer = setup_hier(SPEC, TrainSpec(steps=1), [])
    return trainer.final_params()


def _poisoned_step(poison_rank):
    import torch.distributed as dist
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    trainer = setup_hier(SPEC, TrainSpec(steps=1, bucket_size=20000), LBP)
    opt = trainer.optimizer
    opt.grad_scaler = DynamicGradScaler(initial_scale=2.0 ** 10, min_scale=1.0, growth_factor=2.0,
                                        backoff_factor=0.5, growth_interval=100, hysteresis=1)
    before = {n: t.clone() for n, t in trainer.final_params().items()}
    trainer.model.zero_grad_buffer()
    loss = torch.tensor(0.0)
    from megatron_lbp.testing.tiny_gpt import forward_loss, global_batch

    tokens = global_batch(0, 0, SPEC, trainer.train, trainer.dp_size)
    lo = trainer.dp_rank * 2
    (forward_loss(trainer.model, tokens[lo:lo + 2]) * opt.get_loss_scale()).backward()
    trainer.model.finish_grad_sync()
    if dist.get_rank() == poison_rank:
        trainer.model.buckets[-1].grad_shard[0] = float("inf")
    ok, norm, _ = opt.step()
    after = trainer.final_params()
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    return ok, norm, opt.get_loss_scale().item(), unchanged


def test_inf_gradient_on_one_rank_skips_the_step_on_every_rank():
    out = run_on_ranks(_poisoned_step, 8, 5, rank_env=TOPO)
    for rank, (ok, norm, scale, unchanged) in enumerate(out):
        assert ok is False and norm is None, f"rank {rank} stepped: ok={ok} norm={norm}"
        assert scale == 2.0 ** 9, f"rank {rank}: loss scale {scale}, expected backoff to 512"
        assert unchanged, f"rank {rank}: weights changed in a skipped step"


def test_bucket_buffers_live_on_the_parameters_device():
    # 'meta' stands in for a GPU here: nothing in a bucket may default to the CPU.
    from megatron_lbp.engine.buckets import FlatBucket
    from megatron_lbp.engine.memory import TransientLedger

    p = torch.nn.Parameter(torch.zeros(300, 7, device="meta"))
    b = FlatBucket(0, [("w", p)], dp_index=0, world_size=2, param_group_size=2, grad_group_size=2,
                   optim_group_size=2, secondary_group_size=2, grad_dtype=torch.float32,
                   transient=TransientLedger(), secondary_dtype="int8", quant_block_size=256)
    b.grad_view(b.slots[0])
    for name in ("full", "primary", "grad_shard", "secondary", "grad_full"):
        assert getattr(b, name).device.type == "meta", f"bucket.{name} is on {getattr(b, name).device}"
