"""qwZ/qgZ's quantizer op on CPU ranks: DeepSpeed's own pure-torch quantizer, put where the op is missing.

DeepSpeed's CPU accelerator maps ``QuantizerBuilder`` to a stub that raises, so ZeRO++'s
qwZ and qgZ cannot run on CPU as shipped. DeepSpeed's NPU backend ships a pure-torch
implementation with the CUDA kernel's wire format (``NPUQuantizer``); :func:`install`
makes ``QuantizerBuilder`` hand that class out. One change: ``quantize`` returns its
scales flat, because gloo's all-gather checks shapes where NCCL checks only element
counts; every consumer reads them through ``.view(-1)`` or ``.numel()``. Only for
DeepSpeed's ``cpu`` accelerator: on a GPU :func:`install` raises.
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
