"""Gradient-accumulation fusion with the hierarchy: Megatron's fused wgrad lands in the buckets.

Each rank stands in for Apex's missing CUDA extension with a torch function of
the same signature (tests/helpers/fused_wgrad_standin.py), so megatron-core's real
LinearWithGradAccumulationAndAsyncCommunication takes its fused branch: the
weight gradient is accumulated into ``weight.main_grad`` (a view of the
bucket's fp32 gradient buffer) and autograd receives a dummy, which the
engine's hook must count without adding. The tied embedding gets its output
layer's gradient fused and its lookup gradient unfused (Megatron's
``zero_out_wgrad``), so both routes meet in one parameter.
"""
import pytest
import torch

from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec
from tests.helpers.fused_wgrad_standin import train_fused_and_unfused

WORLD = 8
TOPOLOGY = rank_location_env(4)
LBP = ["--hier-preset", "lbp", "--hier-param-group-size", "2", "--hier-grad-group-size", "4",
       "--hier-optim-group-size", "8"]
REL = 1e-6


def _worst(got, ref):
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))


def _compare(fused, unfused, label):
    assert len(fused.losses) == len(unfused.losses)
    worst = _worst(fused.losses, unfused.losses)
    assert worst <= REL, (f"{label}: fused losses differ by {worst:.3g} relative:\n"
                          f" fused   {fused.losses}\n unfused {unfused.losses}")
    for name, w in unfused.params.items():
        diff = (fused.params[name] - w).abs().max().item()
        assert diff <= REL * max(w.abs().max().item(), 1.0), f"{label}: final {name} differs by {diff:.3g}"


@pytest.mark.slow
def test_fused_wgrad_trains_like_the_unfused_path_for_10_iterations():
    train = TrainSpec(steps=10, micro_batches=2, bucket_size=20000)
    ranks = run_on_ranks(train_fused_and_unfused, WORLD, TinyGPTSpec(), train, LBP,
                         rank_env=TOPOLOGY)
    # 2 layers x 4 linear layers + the tied output layer, per micro-batch.
    want = 10 * 2 * (2 * 4 + 1)
    for r, (fused, _) in enumerate(ranks):
        calls = fused.extra["wgrad_calls"]["wgrad_gemm_accum_fp32"]
        assert calls == want, f"rank {r}: the fused wgrad kernel ran {calls} times, expected {want}"
    fused, unfused = ranks[0]
    _compare(fused, unfused, "lbp P2 G4 O8")
    assert unfused.losses[-1] < unfused.losses[0] - 0.1, unfused.losses


def test_fused_wgrad_under_full_recomputation_and_bf16_gradient_buffers():
    """Recomputed layers capture main_grad again in their second forward; a bf16 buffer takes _fp16."""
    train = TrainSpec(steps=3, micro_batches=2, bucket_size=20000)
    argv = ["--hier-preset", "zero3", "--hier-grad-reduce-dtype", "bf16"]
    fused, unfused = run_on_ranks(train_fused_and_unfused, 4, TinyGPTSpec(recompute=True), train,
                                  argv, rank_env=rank_location_env(4))[0]
    calls = fused.extra["wgrad_calls"]
    assert calls["wgrad_gemm_accum_fp16"] == 3 * 2 * 9 and not calls["wgrad_gemm_accum_fp32"], calls
    # bf16 buffers: the fused kernel adds the fp32 product of both micro-batch
    # halves' activations into bf16 differently from the unfused hook (autograd's
    # fp32 gradient, then one add); measured 6e-6 relative over 3 steps (fp32
    # buffers above: identical), while a dropped or doubled gradient moves it 1e-2.
    worst = _worst(fused.losses, unfused.losses)
    assert worst <= 1e-4, f"fused vs unfused (bf16 buffers): {worst:.3g}\n {fused.losses}\n {unfused.losses}"
    assert torch.isfinite(torch.tensor(fused.losses)).all()


@pytest.mark.slow
def test_fused_wgrad_with_split_layers_keeps_the_bias_gradient_that_came_first():
    """--hier-layer-unit split: a half's bias gradient (unfused, from the layer's
    bias-dropout-add) reaches its bucket before the half's backward zeroes the windows the
    fused kernel will accumulate into; only the unwritten ones may be zeroed."""
    train = TrainSpec(steps=3, micro_batches=2, bucket_size=20000)
    argv = LBP + ["--hier-layer-unit", "split"]
    fused, unfused = run_on_ranks(train_fused_and_unfused, WORLD, TinyGPTSpec(), train, argv,
                                  rank_env=TOPOLOGY)[0]
    assert fused.extra["wgrad_calls"]["wgrad_gemm_accum_fp32"] == 3 * 2 * (2 * 4 + 1)
    _compare(fused, unfused, "lbp P2 G4 O8, split layers")


@pytest.mark.slow
def test_the_training_entry_keeps_fusion_on_where_the_kernel_imports(tmp_path):
    """python -m megatron_lbp.pretrain_gpt with Apex's extension importable (the stand-in as a
    module file): capability detection keeps Megatron's default fusion, the engine serves it,
    and the losses are those of the same run with --no-gradient-accumulation-fusion.

    Slow (two start-ups): CI covers its parts, the engine's fused path above and the
    detection in tests/unit/test_capabilities.py."""
    import os

    from tests.helpers.pretrain_runner import REPO, TINY, demo_data, run_pretrain, why
    from tests.helpers.standins import write_standins

    standins = write_standins(tmp_path / "standins", "apex_wgrad")
    env = {"PYTHONPATH": os.pathsep.join([str(standins), str(REPO)]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    args = TINY + ["--data-path", demo_data(tmp_path / "data"), "--train-iters", "3",
                   "--global-batch-size", "8", "--hier-partition", "--hier-gpus-per-node", "2"]
    code, log, fused = run_pretrain(2, args, env=env)
    assert code == 0, why(log)
    assert "adding --no-gradient-accumulation-fusion" not in log, why(log)
    assert "[fused_weight_gradient_mlp_cuda stand-in] calls" in log, why(log)
    code, log, unfused = run_pretrain(2, args + ["--no-gradient-accumulation-fusion"], env=env)
    assert code == 0, why(log)
    assert "[fused_weight_gradient_mlp_cuda stand-in] calls" not in log, why(log)
    assert sorted(fused) == [1, 2, 3] and fused == unfused, (fused, unfused)
