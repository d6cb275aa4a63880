"""What DeepSpeed needs in the environment before it is first imported, on CPU ranks or GPUs.

``DS_ACCELERATOR=cpu`` only where torch sees no GPU (then gloo); ``LOCAL_SIZE`` = ranks
per (emulated) node, which qgZ's hierarchical path reads as the device count;
``TORCH_EXTENSIONS_DIR`` under the virtual environment, so one JIT build of an op serves
every later run. After the import, :func:`skip_shm_comm_op` skips the CPU accelerator's
shared-memory op, which only tensor-parallel inference uses and whose JIT build would
cost every fresh environment's first run.
"""
from __future__ import annotations

import os
import sys


def extensions_dir() -> str:
    """Where JIT-built DeepSpeed ops are cached unless TORCH_EXTENSIONS_DIR says otherwise."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch-extensions")


def prepare(ranks_per_node: int | None = None) -> None:
    """Set DeepSpeed's environment in this process; call before ``import deepspeed``.

    LOCAL_SIZE and TORCH_EXTENSIONS_DIR are read when used, so a DeepSpeed imported
    earlier still sees them; the accelerator is chosen on import and is checked.

    ``ranks_per_node``: the (emulated) node size; defaults to LOCAL_WORLD_SIZE (torchrun).
    Variables the user set are kept.
    """
    import torch

    if not torch.cuda.is_available() and "deepspeed.accelerator.real_accelerator" in sys.modules:
        # Imported already (megatron-core probes for it): its choice is made; without a GPU
        # and without DS_ACCELERATOR it detected its CPU accelerator, which is what we need.
        from deepspeed.accelerator import get_accelerator

        if get_accelerator()._name != "cpu":
            raise RuntimeError(f"DeepSpeed chose its {get_accelerator()._name!r} accelerator "
                               f"before megatron_lbp.deepspeed_baseline.environment.prepare() ran; this "
                               f"machine has no GPU: set DS_ACCELERATOR=cpu")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if ranks_per_node:
            os.environ["LOCAL_SIZE"] = str(ranks_per_node)
        elif os.environ.get("LOCAL_WORLD_SIZE"):
            os.environ.setdefault("LOCAL_SIZE", os.environ["LOCAL_WORLD_SIZE"])
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())


def skip_shm_comm_op(deepspeed) -> None:
    """On DeepSpeed's CPU accelerator, mark its shared-memory comm op unbuildable so that
    the torch backend's start-up skips its JIT build (``deepspeed.comm.torch.build_shm_op``
    returns None for an op its table calls incompatible; ``inference_all_reduce`` then takes
    torch.distributed's all_reduce). Call after ``import deepspeed``, before
    ``deepspeed.initialize`` or ``deepspeed.init_distributed``. GPU accelerators have no
    such op and are left alone."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator()._name != "cpu":
        return
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
