"""Test-only stand-in for Apex's CUDA extension ``fused_weight_gradient_mlp_cuda`` (never shipped).

megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication`` takes its
gradient-accumulation-fusion branch only when that extension imports: the
backward then calls ``wgrad_gemm_accum_fp32(input, grad_output, weight.main_grad)``
(or ``wgrad_gemm_accum_fp16`` for a 16-bit main_grad), which adds
``grad_output^T @ input`` into ``main_grad`` in place, and hands autograd a
dummy weight gradient. The functions here compute exactly that with torch
(products accumulated in fp32, as the CUDA kernel's GEMM does), so CPU ranks run
Megatron's real fused branch against the engine's ``main_grad`` views.

``install()`` runs on each rank before the model is built; the rank function
below trains with and without fusion and reports how often the kernel ran.
"""
import sys
import types

import torch

CALLS = {"wgrad_gemm_accum_fp32": 0, "wgrad_gemm_accum_fp16": 0}


def _accumulate(name, input, grad_output, main_grad):
    CALLS[name] += 1
    product = grad_output.reshape(-1, grad_output.shape[-1]).t().float() @ \
        input.reshape(-1, input.shape[-1]).float()
    main_grad.add_(product.to(main_grad.dtype))


def wgrad_gemm_accum_fp32(input, grad_output, main_grad):
    if main_grad.dtype != torch.float32:
        raise TypeError(f"wgrad_gemm_accum_fp32 needs an fp32 main_grad, got {main_grad.dtype}")
    _accumulate("wgrad_gemm_accum_fp32", input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(input, grad_output, main_grad):
    if main_grad.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"wgrad_gemm_accum_fp16 needs a 16-bit main_grad, got {main_grad.dtype}")
    _accumulate("wgrad_gemm_accum_fp16", input, grad_output, main_grad)


def report_calls_at_exit():
    """In a training run (the stand-in imported as a module file): one stderr line at exit."""
    import atexit

    def report():
        if any(CALLS.values()):
            print(f"[fused_weight_gradient_mlp_cuda stand-in] calls {CALLS}", file=sys.stderr,
                  flush=True)

    atexit.register(report)


def install():
    """Make the stand-in importable and let megatron-core's linear layers find it."""
    module = types.ModuleType("fused_weight_gradient_mlp_cuda")
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
    sys.modules["fused_weight_gradient_mlp_cuda"] = module
    from megatron.core.tensor_parallel import layers

    # layers.py imports the extension once, at its own import (already done here).
    layers.fused_weight_gradient_mlp_cuda = module
    layers._grad_accum_fusion_available = True


def train_fused_and_unfused(spec, train, hier_argv):
    """The same training twice on these ranks: gradient-accumulation fusion on (through the
    stand-in), then off; the fused run's result carries how often each kernel ran."""
    import dataclasses

    from megatron_lbp.testing.tiny_gpt import train_hier

    install()
    fused = train_hier(dataclasses.replace(spec, gradient_accumulation_fusion=True), train,
                       hier_argv)
    fused.extra["wgrad_calls"] = dict(CALLS)
    unfused = train_hier(dataclasses.replace(spec, gradient_accumulation_fusion=False), train,
                         hier_argv)
    return fused, unfused
