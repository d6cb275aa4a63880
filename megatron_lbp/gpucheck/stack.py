"""What this machine is, and whether its GPU stack is the one the check needs.

Read without starting a part: torch's build and devices, megatron-core's version, whether
Triton imports and NCCL is built in. A machine with an NVIDIA GPU but a CPU build of torch
(or no megatron-core) is refused with one line naming what is missing and the script that
sets it up (scripts/gpu_setup.sh); a machine without a GPU runs what CPU can.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
from typing import Any

MEGATRON_CORE = "0.19.2"
SETUP = "bash scripts/gpu_setup.sh"


def nvidia_gpus() -> list[str]:
    """GPUs the driver lists (``nvidia-smi -L``), whatever torch was built for."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.startswith("GPU ")]


def describe() -> dict[str, Any]:
    """The device and software stack, for the result's header (imports torch, not megatron)."""
    import torch

    from megatron_lbp.quant import bench

    info: dict[str, Any] = {
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None), "python": platform.python_version(),
        "cpu": bench.cpu_model(), "cpu_count": os.cpu_count(),
        "driver_gpus": nvidia_gpus(), "cuda_available": torch.cuda.is_available(),
    }
    try:
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
    except Exception:  # noqa: BLE001 - absent or broken: reported as None
        info["megatron_core"] = None
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        info["triton"] = None
    import torch.distributed as dist

    info["nccl"] = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        v = torch.cuda.nccl.version()   # a tuple on recent torch, an int on older ones
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = props.total_memory
        info["gpu_count"] = torch.cuda.device_count()
        info["device"] = f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch " \
                         f"{torch.__version__}, CUDA {torch.version.cuda or torch.version.hip}"
    else:
        info["device"] = f"CPU only: {info['cpu']} ({info['cpu_count']} cores), torch " \
                         f"{torch.__version__}"
    return info


def refusal(info: dict[str, Any], require_gpu: bool) -> str | None:
    """One line saying why the check must not start, or None.

    A GPU the driver shows but torch cannot use, or ``require_gpu`` without one, is refused:
    the GPU parts would all report "needs a GPU" and the device minutes would be spent on
    nothing. megatron-core must be the pinned version wherever parts C-E run.
    """
    if info["driver_gpus"] and not info["cuda_available"]:
        build = "a CPU build" if not info["torch_cuda"] else f"built for CUDA {info['torch_cuda']}"
        return (f"gpu_check: refused: the driver lists {len(info['driver_gpus'])} GPU(s) but "
                f"torch {info['torch']} ({build}) cannot use them; run {SETUP}")
    if require_gpu and not info["cuda_available"]:
        return f"gpu_check: refused: --require-gpu and torch sees no CUDA device; run {SETUP}"
    if info["megatron_core"] != MEGATRON_CORE:
        return (f"gpu_check: refused: megatron-core {info['megatron_core']} installed, "
                f"{MEGATRON_CORE} needed; run {SETUP}")
    if info["cuda_available"]:
        missing = [name for name in ("triton", "nccl") if not info[name]]
        if missing:
            return (f"gpu_check: refused: a CUDA device but no {' and no '.join(missing)} in "
                    f"this torch install; run {SETUP}")
    return None
