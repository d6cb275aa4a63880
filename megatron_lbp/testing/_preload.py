"""Imported once by the forkserver that starts test ranks, so every rank starts warm.

megatron.training too, for the training entry's ranks (testing/entry.py). Nothing
here switches megatron-lbp's CPU runtime on: each rank does that itself, as the
entry point and tiny_gpt do in a fresh interpreter.
"""
import megatron_lbp.compat as _compat

_compat._install_python_shims()
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import megatron.core  # noqa: E402,F401
import megatron.training  # noqa: E402,F401
import megatron_lbp.pretrain_gpt  # noqa: E402,F401
