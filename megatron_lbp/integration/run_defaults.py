"""Defaults a newcomer's command expects where megatron-core 0.19.2 has none and only asserts.

Called from capabilities.resolve_training_argv with its ``add`` (one printed
line per added flag, the user's flags kept last).
"""
from __future__ import annotations

from megatron_lbp.core.argv import flag_value, given


def add_defaults(argv, add) -> None:
    _save_interval(argv, add)


def _save_interval(argv, add) -> None:
    """``--save`` without ``--save-interval`` fails Megatron's bare ``assert args.save_interval
    is not None``; its training loop saves after the last iteration whatever the interval, so
    the run's length as the interval means one checkpoint, at the end."""
    iters = flag_value(argv, "--train-iters")
    if not given(argv, "--save") or given(argv, "--save-interval") or iters is None \
            or not iters.isdigit() or int(iters) < 1:
        return
    add(["--save-interval", iters],
        "--save is given without it (megatron-core has no default); the run saves once, after "
        f"its last iteration ({iters}); give --save-interval N to save every N iterations too")
