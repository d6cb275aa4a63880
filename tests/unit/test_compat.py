"""The CPU runtime for megatron-core: on only without an accelerator, and each patch does its job."""
import logging
import subprocess
import sys

import pytest
import torch

from megatron_lbp.testing.multirank import run_on_ranks, run_single


def _enable_and_probe():
    from megatron_lbp.integration import compat

    records = []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("megatron_lbp.integration.compat").addHandler(Catch())
    before = compat.cpu_runtime_active()
    active = compat.enable()
    compat.enable()  # idempotent: no second log line, no double wrapping
    # What a megatron.core.optimizer module sees from Tensor.type(), and what anyone else sees.
    scope = {"__name__": "megatron.core.optimizer.distrib_optimizer", "x": torch.zeros(1)}
    exec("seen = x.type(); seen_bf16 = x.bfloat16().type()", scope)
    return {
        "before": before,
        "active": active,
        "log": records,
        "zeros_cuda": str(torch.zeros(2, device="cuda").device),
        "tensor_int_device": str(torch.tensor([1.0], device=0).device),
        "meta_untouched": str(torch.empty(2, device="meta").device),
        "to_cuda": str(torch.ones(1).to("cuda").device),
        "to_dtype": str(torch.ones(1).to(torch.float64).dtype),
        "dot_cuda": str(torch.ones(1).cuda().device),
        "new_zeros": str(torch.ones(1).new_zeros(3, device="cuda").device),
        "current_device": torch.cuda.current_device(),
        "type_from_megatron_optimizer": (scope["seen"], scope["seen_bf16"]),
        "type_from_elsewhere": torch.zeros(1).type(),
        "event_ms": torch.cuda.Event(enable_timing=True).elapsed_time(torch.cuda.Event()),
        "memory_allocated": torch.cuda.memory_allocated(),
    }


def test_cpu_runtime_switches_on_once_and_maps_cuda_to_cpu():
    got = run_single(_enable_and_probe)
    assert got["before"] is False and got["active"] is True, got
    assert len(got["log"]) == 1 and "CPU runtime for megatron-core is active" in got["log"][0], got["log"]
    for key in ("zeros_cuda", "tensor_int_device", "to_cuda", "dot_cuda", "new_zeros"):
        assert got[key] == "cpu", f"{key}: expected cpu, got {got[key]}"
    assert got["meta_untouched"] == "meta", "a non-CUDA device argument was rewritten"
    assert got["to_dtype"] == "torch.float64"
    assert got["current_device"] == 0
    assert got["type_from_megatron_optimizer"] == ("torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor")
    assert got["type_from_elsewhere"] == "torch.FloatTensor", "Tensor.type() changed outside megatron's optimizer"
    assert got["event_ms"] == 0.0 and got["memory_allocated"] == 0


def _rng_tracker_streams():
    from megatron_lbp.testing.tiny_gpt import init_megatron_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    init_megatron_state(seed=7)
    state = torch.get_rng_state()
    plain = torch.rand(4)
    torch.set_rng_state(state)
    with get_cuda_rng_tracker().fork():
        forked = torch.rand(4)
    after_fork = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        forked_again = torch.rand(4)
    return plain, forked, after_fork, forked_again


def test_megatron_rng_tracker_forks_the_cpu_generator():
    plain, forked, after_fork, forked_again = run_single(_rng_tracker_streams)
    assert not torch.equal(plain, forked), "the model-parallel RNG stream equals the default stream"
    assert torch.equal(plain, after_fork), "forking the tracker disturbed the default CPU stream"
    assert not torch.equal(forked, forked_again), "the tracker did not advance its own stream"


def _dist_checkpoint_roundtrip(ckpt_dir):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, build_tiny_gpt, init_megatron_state

    init_megatron_state(seed=3)
    model, _ = build_tiny_gpt(TinyGPTSpec())
    saved = {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None}
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    dist.barrier()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(loaded, strict=False)
    diffs = {k: (model.state_dict()[k] - v).abs().max().item()
             for k, v in saved.items() if torch.is_floating_point(v)}
    return max(diffs.values()), len(diffs)


def test_dist_checkpointing_roundtrip_on_gloo_ranks(tmp_path):
    (tmp_path / "ckpt").mkdir()  # Megatron expects the directory to exist
    out = run_on_ranks(_dist_checkpoint_roundtrip, 2, str(tmp_path / "ckpt"))
    for rank, (worst, count) in enumerate(out):
        assert count > 10, f"rank {rank}: only {count} tensors in the state dict"
        assert worst == 0.0, f"rank {rank}: a reloaded tensor differs by {worst}"
    assert (tmp_path / "ckpt" / "metadata.json").exists(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())


@pytest.mark.slow
def test_nothing_is_patched_when_an_accelerator_is_present():
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "orig_zeros, orig_to, orig_cur = torch.zeros, torch.Tensor.to, torch.cuda.current_device\n"
        "from megatron_lbp.integration import compat\n"
        "assert compat.enable() is False\n"
        "assert torch.zeros is orig_zeros and torch.Tensor.to is orig_to\n"
        "assert torch.cuda.current_device is orig_cur\n"
        "from megatron.core.dist_checkpointing.strategies import filesystem_async as fa\n"
        "assert not hasattr(fa.get_write_results_queue, '__lbp_patch__')  # spawn kept\n"
        "print('untouched')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "untouched" in out.stdout, out.stderr[-2000:]


def test_python_311_shim_makes_megatron_training_importable():
    code = "import megatron_lbp, typing; import megatron.training.models.gpt; print(typing.override)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


_COMPILE_PROBE = """
import sys, torch
from megatron_lbp.integration import compat
compat.enable()
import megatron.core, megatron.core.fusions.fused_bias_gelu  # decorates with torch.compile
assert 'torch._inductor' not in sys.modules, 'Inductor imported by decorating alone'
def f(x):
    return x * 2 + 1
g = torch.compile(f, backend='eager')
assert g.__name__ == 'f' and torch.equal(g(torch.ones(3)), f(torch.ones(3)))
assert 'torch._dynamo' in sys.modules, 'the first call did not compile'
m = torch.compile(torch.nn.Linear(2, 2), backend='eager')
assert type(m).__name__ == 'OptimizedModule', type(m)
print('ok')
"""


@pytest.mark.slow
def test_torch_compile_of_a_function_is_set_up_at_its_first_call():
    out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("flags, warmed", [
    (dict(swiglu=False, bias_gelu_fusion=False, bias_swiglu_fusion=True, bias_dropout_fusion=False),
     False),
    (dict(swiglu=False, bias_gelu_fusion=True, bias_swiglu_fusion=False, bias_dropout_fusion=False),
     True),
    (dict(swiglu=True, bias_gelu_fusion=False, bias_swiglu_fusion=True, bias_dropout_fusion=False),
     True),
    (dict(swiglu=False, bias_gelu_fusion=False, bias_swiglu_fusion=False, bias_dropout_fusion=True),
     True),
])
def test_jit_warmup_runs_only_for_kernels_the_model_calls(monkeypatch, flags, warmed):
    import types

    import megatron.training

    from megatron_lbp.integration import cpu_runtime

    calls = []
    monkeypatch.setattr(megatron.training, "get_args", lambda: types.SimpleNamespace(**flags))
    cpu_runtime._skip_unused_jit_warmup(lambda *a, **k: calls.append((a, k)))(tp_size=1)
    assert calls == ([((), {"tp_size": 1})] if warmed else []), (flags, calls)


def _fsdp_coalesced_blocks_left_in_flight():
    """Per Megatron-FSDP coalesced block of collectives: was it left in flight (async), patched and not."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    from benchmarks.traffic import setup_fsdp
    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec

    spec = TinyGPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=1024,
                       seq_length=16)
    train = TrainSpec(steps=1, micro_batch_size=2, bucket_size=1500, overlap_grad_reduce=True)
    trainer = setup_fsdp(spec, train)  # installs compat.megatron_fsdp_on_gloo
    pipeline, coalescing = pgb.AllGatherPipeline, pgb._coalescing_manager
    patched = pipeline.all_gather_params
    counts = {}
    for step, (name, method) in enumerate((("patched", patched), ("stock", patched.__wrapped__))):
        seen = counts[name] = []

        def record(group=None, device=None, async_ops=False, _seen=seen):
            _seen.append(async_ops)
            return coalescing(group, device, async_ops)

        pipeline.all_gather_params, pgb._coalescing_manager = method, record
        try:
            trainer.run([step])
        finally:
            pipeline.all_gather_params, pgb._coalescing_manager = patched, coalescing
    return counts


def test_megatron_fsdp_gathers_synchronously_on_gloo():
    counts = run_on_ranks(_fsdp_coalesced_blocks_left_in_flight, 2, timeout=180)[0]
    assert counts["patched"] and not any(counts["patched"]), (
        f"with compat.megatron_fsdp_on_gloo, coalesced blocks left in flight: {counts}")
    # The check can fail: Megatron-FSDP's own asynchronous gathers leave blocks in flight.
    assert any(counts["stock"]), f"stock Megatron-FSDP left no block in flight: {counts}"


def test_checkpoint_result_queue_is_forked_on_the_cpu_runtime():
    """cpu_runtime: the torch_dist writer's Manager is forked, not spawned (no torch import in it)."""
    code = (
        "from megatron_lbp.integration import compat\n"
        "assert compat.enable()\n"
        "from megatron.core.dist_checkpointing.strategies import filesystem_async as fa\n"
        "q = fa.get_write_results_queue()\n"
        "q.put(1); assert q.get() == 1\n"
        "print(type(q._manager._process).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ForkProcess", out.stdout
