"""Imported once by the forkserver that starts test ranks, so every rank starts warm."""
import megatron_lbp.compat as _compat

_compat._install_python_shims()
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import megatron.core  # noqa: E402,F401
