"""qwZ/qgZ's quantizer op on CPU ranks: DeepSpeed's own pure-torch quantizer, put where the op is missing.

DeepSpeed's CPU accelerator maps ``QuantizerBuilder`` to a stub whose ``load()``
raises "This op had not been implemented on CPU backend", so ZeRO++'s quantized
weight gather (qwZ, ``partition_parameters.CUDAQuantizer``) and quantized
gradient all-to-all (qgZ, ``runtime.comm.coalesced_collectives``) cannot run on
CPU as shipped. DeepSpeed ships a pure-torch implementation of the same op, with
the CUDA kernel's wire format (per-group symmetric scales, truncation toward
zero, int4 packing, qgZ's swizzled layout), for its NPU backend
(``deepspeed/ops/op_builder/npu/quantizer.py``, ``NPUQuantizer``). Its code is
plain torch and runs on CPU tensors; :func:`install` makes
``deepspeed.ops.op_builder.QuantizerBuilder`` hand that class out.

One change: ``quantize`` returns its scales flat instead of [groups, 1]. qwZ
all-gathers the scales into a flat buffer (``all_gather_into_tensor``); NCCL
checks only element counts, gloo checks shapes and fails ("ProcessGroupGloo::
allgather: invalid tensor size at index 0 (expected (1, 1), got (1))", seen with
the [groups, 1] scales on 4 ranks). Every consumer (``dequantize``, qgZ's
``quantized_reduction``) reads the scales through ``.view(-1)`` or ``.numel()``.

Used only when DeepSpeed's accelerator is ``cpu``: on a GPU the real kernel is
built and this module refuses to install (:func:`install` raises).
"""
from __future__ import annotations

_installed = False


def _cpu_quantizer_class():
    from deepspeed.ops.op_builder.npu.quantizer import NPUQuantizer

    class CPUQuantizer(NPUQuantizer):
        """NPUQuantizer with flat scales from ``quantize`` (gloo's all-gather needs them flat)."""

        @staticmethod
        def quantize(input_vals, groups, num_bits, quant_type):
            q, scales = NPUQuantizer.quantize(input_vals, groups, num_bits, quant_type)
            return q, scales.reshape(-1)

    return CPUQuantizer


class _CPUQuantizerBuilder:
    """Stands in for DeepSpeed's QuantizerBuilder: ``load()`` gives the pure-torch op."""

    NAME = "quantizer"
    _op = None

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True):
        if _CPUQuantizerBuilder._op is None:
            _CPUQuantizerBuilder._op = _cpu_quantizer_class()
        return _CPUQuantizerBuilder._op


def needed() -> bool:
    """True when DeepSpeed runs on its CPU accelerator (the quantizer op is a stub there)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()._name == "cpu"


def install() -> None:
    """Make DeepSpeed's QuantizerBuilder load the pure-torch quantizer; CPU accelerator only."""
    global _installed
    if _installed:
        return
    if not needed():
        raise RuntimeError("megatron_lbp.deepspeed_baseline.cpu_quantizer is for DeepSpeed's CPU accelerator "
                           "only; on a GPU DeepSpeed builds its own quantizer kernel")
    import deepspeed.ops.op_builder as op_builder

    # Both users look the builder up on this module at call time
    # (deepspeed.ops.op_builder.QuantizerBuilder().load()).
    op_builder.QuantizerBuilder = _CPUQuantizerBuilder
    _installed = True
