"""Checkpoint saves that a kill or a resubmission cannot tear (every run, not only --hier-partition).

megatron_lbp.integration.training_hooks puts these in megatron.training's way: the tracker
file written atomically (``AtomicTrackerStorage`` for checkpointing.py's
``maybe_msc``) and the end-of-training save skipped when it would rewrite, in
place, the checkpoint this run loaded (``resaves_loaded_checkpoint``).
"""
from __future__ import annotations

import os


TRACKER = "latest_checkpointed_iteration.txt"


def resaves_loaded_checkpoint(iteration: int, args) -> bool:
    """Whether this save would rewrite, in place, the complete checkpoint the tracker names and this run loaded.

    A job resubmitted after it finished loads its last checkpoint, trains
    nothing, and Megatron's end-of-training save writes the same iteration
    into the same iter_ directory again: a kill during that rewrite would tear
    the only checkpoint the tracker names. The state is the loaded one, so skip it.
    """
    from megatron.training import checkpointing

    save, load = getattr(args, "save", None), getattr(args, "load", None)
    if not save or not load or os.path.realpath(save) != os.path.realpath(load):
        return False
    if checkpointing.get_loaded_iteration() != iteration:
        return False
    tracker = os.path.join(save, TRACKER)
    try:
        with open(tracker) as f:
            named = f.read().strip()
    except OSError:
        return False
    if named != str(iteration) or not os.path.isfile(
            os.path.join(save, f"iter_{iteration:07d}", "metadata.json")):
        return False
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[megatron-lbp] not saving iteration {iteration} again: {save} already holds it "
              "complete (this run loaded it), and rewriting it in place could tear it", flush=True)
    return True


class AtomicTrackerFile:
    """What checkpointing.py's ``open(tracker, 'w')`` gets: the text lands atomically on close.

    Megatron truncates the tracker and then writes it, so a kill in between
    leaves an empty file, and the next start exits on it ("Invalid metadata
    file") with every checkpoint intact. Megatron only writes the tracker after
    the barrier that follows the last rank's shard write, so the checkpoint it
    names is complete; its metadata.json and directory are fsynced before the
    swap so that this also holds after a node crash (the shards are fsynced by
    the writer).
    """

    def __init__(self, path: str):
        self.path, self.parts = path, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is not None:
            return False  # the old tracker stays
        from megatron_lbp.engine.checkpoint import atomic_write_text

        text = "".join(self.parts)
        name = "release" if text.strip() == "release" else f"iter_{int(text):07d}"
        ckpt = os.path.join(os.path.dirname(self.path), name)
        atomic_write_text(self.path, text,
                          also_sync=(os.path.join(ckpt, "metadata.json"),
                                     os.path.join(ckpt, "common.pt"), ckpt),
                          before_replace=_before_replace(text.strip()))
        return False


class AtomicTrackerStorage:
    """checkpointing.py's ``maybe_msc`` with the tracker write made atomic on local file systems."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def open(self, path, mode="r", *a, **k):
        from megatron.core.msc_utils import MultiStorageClientFeature

        if ("w" in mode and os.path.basename(str(path)) == TRACKER
                and not MultiStorageClientFeature.is_enabled()):
            return AtomicTrackerFile(str(path))
        return self._inner.open(path, mode, *a, **k)


def _before_replace(iteration: str):
    """The test-only stall point before the tracker swap (integration/save_stall.py), None unless asked for."""
    if not os.environ.get("LBP_TEST_STALL_SAVE"):
        return None
    from megatron_lbp.integration import save_stall

    return lambda: save_stall.stall("tracker", iteration)
