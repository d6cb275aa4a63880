"""Stand-in modules for the GPU extensions this machine lacks, written into a test's directory.

Capability detection (megatron_lbp.capabilities) decides by what imports; these
files make an extension importable under its real module name so that the
detection, and Megatron's own ``try: import ...``, see it present. They hold no
kernels (calling one raises), except Apex's weight-gradient GEMM (torch
functions of the same signature); they live only in tests: never on a
shipped path.
"""
from __future__ import annotations

from pathlib import Path

_RAISE = 'raise NotImplementedError("test stand-in: no kernel here")'
_FN = f"def {{name}}(*args, **kwargs):\n    {_RAISE}\n"

# capability -> {relative path: source}
STANDINS = {
    "transformer_engine": {
        "transformer_engine/__init__.py": "",
        "transformer_engine/pytorch/__init__.py": "",
        "transformer_engine/pytorch/fp8.py": ("class FP8GlobalStateManager:\n    pass\n\n"
                                             + _FN.format(name="fp8_autocast")
                                             + _FN.format(name="fp8_model_init")),
        "transformer_engine/pytorch/attention/__init__.py": "",
        "transformer_engine/pytorch/attention/rope.py": _FN.format(name="apply_rotary_pos_emb"),
    },
    # The one stand-in with kernels: the torch functions of tests/helpers/fused_wgrad_standin.py,
    # so that a training run takes megatron-core's fused weight-gradient branch.
    "apex_wgrad": {
        "fused_weight_gradient_mlp_cuda.py": (
            "from tests.helpers.fused_wgrad_standin import (report_calls_at_exit, wgrad_gemm_accum_fp16,"
            "\n                                        wgrad_gemm_accum_fp32)\n"
            "report_calls_at_exit()\n"),
    },
    "apex": {"apex/__init__.py": ""},
    "apex_layer_norm": {
        "apex/__init__.py": "",
        "apex/normalization/__init__.py": "",
        "apex/normalization/fused_layer_norm.py": "class FusedLayerNormAffineFunction:\n    pass\n",
        "fused_layer_norm_cuda.py": _FN.format(name="forward_affine"),
    },
    "softmax_kernels": {f"{name}.py": _FN.format(name="forward") for name in (
        "scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
        "scaled_softmax_cuda")},
    "flash_attn": {"flash_attn/__init__.py": _FN.format(name="flash_attn_func")},
}
TOP_LEVEL = sorted({rel.split("/")[0].removesuffix(".py") for files in STANDINS.values()
                    for rel in files})


def write_standins(root: Path, *capabilities: str) -> Path:
    """The stand-ins for ``capabilities`` (names of STANDINS) under ``root``; returns root."""
    root.mkdir(parents=True, exist_ok=True)
    for cap in capabilities:
        for rel, source in STANDINS[cap].items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
    return root
