"""``--json`` means JSON: the object alone on standard output, every other line on standard error.

The benchmarks start gloo ranks that import megatron.training, whose log
handler writes to standard output (``megatron/training/log_handler.py``), and
Megatron prints its own progress there too: 177 ``WARNING:``/``INFO:`` lines
came ahead of ``bench traffic --json``'s object, so ``| jq`` and ``json.loads``
failed. :func:`reserve_stdout` keeps a copy of the real standard output for
:func:`emit` and points file descriptor 1 at standard error, for this process
and every process it starts afterwards.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

_reserved: TextIO | None = None


def reserve_stdout() -> None:
    """From now on only :func:`emit` writes to the real standard output (idempotent)."""
    global _reserved
    if _reserved is not None:
        return
    sys.stdout.flush()
    _reserved = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)


def emit(obj: Any) -> None:
    """One JSON object, one line, on the real standard output."""
    stream = _reserved if _reserved is not None else sys.stdout
    stream.write(json.dumps(obj) + "\n")
    stream.flush()
