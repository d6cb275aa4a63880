"""Test-only seam (LBP_TEST_STALL_SAVE=ITERATION:POINT): hold a checkpoint save at POINT so a test can kill it there.

Imported only when the variable is set (training_hooks.hook_checkpointing_module,
checkpoint_guard), so a run without it carries none of this. POINT ``shards``:
every shard written, the checkpoint's metadata.json not; ``tracker``: the
checkpoint complete, the new tracker fsynced as a temporary file but not swapped
in. Prints one line, then sleeps until killed.
"""
from __future__ import annotations

import os

from megatron_lbp.core import patching

SAVE_CONFIG = patching.declare(
    __name__, "test stall before metadata.json", "megatron.core.dist_checkpointing.serialization:save_config",
    "LBP_TEST_STALL_SAVE=ITERATION:shards (tests only)",
    "a test kills the job with every shard written and metadata.json not")


def stall(point: str, iteration: str) -> None:
    want = os.environ.get("LBP_TEST_STALL_SAVE", "")
    if want != f"{iteration}:{point}":
        return
    import time

    print(f"[megatron-lbp] test stall: {point} of iteration {iteration}", flush=True)
    while True:
        time.sleep(60)


def install() -> None:
    def make(orig_save_config):
        def save_config(config, checkpoint_dir):
            # The shards and DCP's .metadata are on disk; metadata.json is not yet.
            stall("shards", os.path.basename(str(checkpoint_dir)).removeprefix("iter_").lstrip("0"))
            return orig_save_config(config, checkpoint_dir)
        return save_config

    patching.apply(SAVE_CONFIG, make)
