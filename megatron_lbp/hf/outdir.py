"""Output directories written whole or not at all: a sibling staging directory, renamed into place.

The import and the export write into ``.<name>.partial-<pid>`` next to the
destination and rename it into place only once everything is written, so a
failure leaves nothing behind and a reader never sees a mix. The destination
must be new, an empty directory, or (``replaceable``) a directory this tool
wrote before, recognised by its marker file; that one is exchanged with the
staging directory in one ``renameat2(RENAME_EXCHANGE)`` (Linux) and then
removed, so ``from_pretrained`` finds either the old export or the new one,
never the old files beside the new.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil

MARKER = ".megatron_lbp_export.json"


class OutputDirError(ValueError):
    pass


def check_destination(dst: str, replaceable: bool, what: str) -> None:
    """Refuse ``dst`` unless it is new, empty, or (``replaceable``) an earlier output with the marker."""
    if not os.path.exists(dst):
        parent = os.path.dirname(os.path.abspath(dst))
        if not os.path.isdir(parent):
            raise OutputDirError(f"{dst}: its parent directory {parent} does not exist")
        return
    if not os.path.isdir(dst):
        raise OutputDirError(f"{dst} exists and is not a directory")
    entries = sorted(os.listdir(dst))
    if not entries or (replaceable and MARKER in entries):
        return
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    earlier = " or an earlier export (it replaces those whole)" if replaceable else ""
    raise OutputDirError(f"{dst} is not empty ({shown}) and was not written by {what}: give a new "
                         f"or empty directory{earlier}")


@contextlib.contextmanager
def staged(dst: str, replaceable: bool, what: str, marker: dict | None = None):
    """Yield a staging directory; on success it becomes ``dst`` (replacing an earlier output)."""
    check_destination(dst, replaceable, what)
    dst = os.path.abspath(dst)
    stage = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.partial-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    try:
        yield stage
        if marker is not None:
            with open(os.path.join(stage, MARKER), "w") as f:
                json.dump(marker, f, indent=1, sort_keys=True)
        _move_into_place(stage, dst)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _move_into_place(stage: str, dst: str) -> None:
    if not os.path.exists(dst):
        os.rename(stage, dst)
        return
    if not os.listdir(dst):
        os.rmdir(dst)
        os.rename(stage, dst)
        return
    _exchange(stage, dst)            # stage now holds the earlier output; the caller removes it


def _exchange(a: str, b: str) -> None:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); two renames where it is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        at_fdcwd, rename_exchange = -100, 2
        if fn(at_fdcwd, a.encode(), at_fdcwd, b.encode(), rename_exchange) == 0:
            return
    old = b + ".old"
    os.rename(b, old)
    os.rename(a, b)
    os.rename(old, a)
