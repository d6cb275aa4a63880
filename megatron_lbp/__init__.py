"""megatron-lbp: Low-Bandwidth Partitioning (three-level, topology-aware ZeRO) for Megatron-LM."""

from megatron_lbp.integration import compat as _compat

# Only the Python-version shim runs at import (it is needed before any
# megatron.training import); the CPU runtime is switched on by compat.enable().
_compat._install_python_shims()
# megatron-core's expected notices (Transformer Engine/Apex absent, GPTModel deprecated) in
# one line on rank 0 instead of one per rank and model: before megatron-core is imported.
_compat.quiet_known_notices()

__version__ = "0.1.0"
