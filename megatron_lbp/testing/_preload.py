"""Imported once by the forkserver that starts test ranks, so every rank starts warm."""
import megatron_lbp.integration.compat as _compat

_compat._install_python_shims()
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import megatron.core  # noqa: E402,F401

# What every rank of pretrain_gpt's entry (megatron_lbp.testing.entry) does the same
# before it reads its arguments: import megatron.training, and parse the config
# classes' field docstrings for the argument help (compat.memoize_argument_help).
import argparse  # noqa: E402

import megatron.training.training  # noqa: E402,F401
from megatron.training.arguments import add_megatron_arguments  # noqa: E402

_compat.memoize_argument_help()
add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
