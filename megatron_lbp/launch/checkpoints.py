"""The checkpoint directory of a campaign: what is in it, what to keep, whether there is room.

    python -m megatron_lbp.launch checkpoints prune DIR --keep-last K [--milestone-every N]
                                                      [--at-start] [--dry-run]
    python -m megatron_lbp.launch checkpoints space DIR --checkpoint-bytes B
    python -m megatron_lbp.launch checkpoints chain DIR --train-iters N
                                                      [--previous-iteration I --previous-job J]

A checkpoint is *complete* when its ``metadata.json`` exists. ``prune`` never deletes
the newest K, the tracker's, the newest complete one or a milestone, nor (without
--at-start) an incomplete one; ``space`` exits 4 below two checkpoints' room; ``chain``
says complete, stalled (exit 5) or continue. See docs/frontier.md.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_lbp.core.costs import gb_text
from megatron_lbp.launch._cli import PROG, Parser, write_resolved

TRACKER = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"iter_(\d{7,})$")
# What a torch_dist save writes; a directory holding only these (and no metadata.json) is a torn save.
TORCH_DIST_FILES = re.compile(r"(__\d+_\d+\.distcp|\.metadata|common\.pt|metadata\.json)(\.tmp.*)?$")
GB = 1e9


class CheckpointError(ValueError):
    """An unreadable checkpoint directory; the message is one line."""


@dataclass(frozen=True)
class Checkpoint:
    iteration: int
    path: Path
    complete: bool
    nbytes: int
    link: bool

    @property
    def name(self) -> str:
        return self.path.name


def read_tracker(directory: Path) -> int | None:
    """The iteration the tracker names (None: no tracker; 0: Megatron's 'release')."""
    path = directory / TRACKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if text == "release":
        return 0
    if not text.isdigit():
        raise CheckpointError(f"{path}: {text!r} is not an iteration number (a torn tracker): "
                              "restore it from the newest complete iter_* directory")
    return int(text)


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def scan(directory: Path) -> tuple[int | None, list[Checkpoint]]:
    """(tracker iteration, checkpoints sorted by iteration) of ``directory`` (may not exist)."""
    if not directory.exists():
        return None, []
    found = []
    for entry in directory.iterdir():
        m = ITER_DIR.match(entry.name)
        if not m or not entry.is_dir():
            continue
        found.append(Checkpoint(int(m.group(1)), entry, (entry / "metadata.json").is_file(),
                                _size(entry), entry.is_symlink()))
    return read_tracker(directory), sorted(found, key=lambda c: c.iteration)


def _is_torn_torch_dist(c: Checkpoint) -> bool:
    return not c.complete and all(TORCH_DIST_FILES.match(p.name) for p in c.path.iterdir())


def retention(tracker: int | None, checkpoints: list[Checkpoint], keep_last: int,
              milestone_every: int = 0, at_start: bool = False
              ) -> tuple[dict[int, str], list[Checkpoint]]:
    """({iteration kept: why}, checkpoints to delete) under the rules of the module docstring."""
    if keep_last < 1:
        raise CheckpointError(f"LBP_KEEP_LAST={keep_last}: keep at least the newest checkpoint (1)")
    complete = [c for c in checkpoints if c.complete]
    keep: dict[int, str] = {}

    def mark(c: Checkpoint, why: str) -> None:
        keep.setdefault(c.iteration, why)

    if complete:
        mark(complete[-1], "newest complete")
    for c in complete[-keep_last:]:
        mark(c, f"newest {keep_last}")
    for c in checkpoints:
        if tracker is not None and c.iteration == tracker:
            mark(c, "named by the tracker")
        if c.link:
            mark(c, "a symbolic link")
    if milestone_every > 0:
        seen: set[int] = set()
        for c in complete:
            window = c.iteration // milestone_every
            if window >= 1 and window not in seen:
                seen.add(window)
                mark(c, f"milestone (first at or after {window * milestone_every})")
    delete = [c for c in complete if c.iteration not in keep]
    if at_start:
        delete += [c for c in checkpoints
                   if c.iteration not in keep and _is_torn_torch_dist(c)]
    return keep, sorted(delete, key=lambda c: c.iteration)


def free_bytes(directory: Path) -> tuple[int, Path]:
    """Free bytes (for this user) on the file system that holds ``directory`` or would hold it."""
    probe = directory
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize, probe


_gb = functools.partial(gb_text, digits=2, mb_below=0.1 * GB)


def cmd_prune(a) -> int:
    if a.every:
        # Beside a running training: incomplete checkpoints (a save in progress) are never
        # touched; ended by SIGTERM from the launcher.
        while True:
            time.sleep(a.every)
            prune_once(a, quiet=True)
    return prune_once(a)


def prune_once(a, quiet: bool = False) -> int:
    """One pass of the retention rules; ``quiet``: say nothing when nothing is deleted."""
    line = prune_line(a, quiet)
    if line:
        print(a.prefix + line, flush=True)
    return 0


def prune_line(a, quiet: bool = False) -> str | None:
    """One pass of the retention rules (``a.dry_run``: deleting nothing), and its line (None:
    ``quiet`` and nothing deleted)."""
    tracker, checkpoints = scan(a.dir)
    keep, delete = retention(tracker, checkpoints, a.keep_last, a.milestone_every, a.at_start)
    kept = ", ".join(f"iter_{i:07d} ({why})" for i, why in sorted(keep.items()))
    verb = "would delete" if a.dry_run else "deleted"
    freed = sum(c.nbytes for c in delete)
    gone = ", ".join(c.name + ("" if c.complete else " (torn save)") for c in delete)
    rule = (f"newest {a.keep_last} + first at or after every {a.milestone_every} iterations"
            if a.milestone_every else f"newest {a.keep_last}")
    for c in delete:
        if not a.dry_run:
            # metadata.json first: a deletion cut short leaves a torn save, never a
            # "complete" checkpoint with shards missing.
            (c.path / "metadata.json").unlink(missing_ok=True)
            shutil.rmtree(c.path)
    torn = [c.name for c in checkpoints if not c.complete and c not in delete]
    if quiet and not delete:
        return None
    return (f"retention ({rule}) in {a.dir}: keep {kept or 'nothing yet'}"
            + (f"; {verb} {gone} ({_gb(freed)})" if delete else "; nothing to delete")
            + (f"; left in place (incomplete: a save in progress or torn): {', '.join(torn)}"
               if torn else ""))


def space(directory: Path, checkpoint_bytes: int) -> tuple[bool, str]:
    """(whether two checkpoints fit in ``directory``'s file system, the line that says so)."""
    _, checkpoints = scan(directory)
    complete = [c for c in checkpoints if c.complete]
    on_disk = complete[-1].nbytes if complete else 0
    one = max(checkpoint_bytes, on_disk)
    basis = (f"the newest on disk, {complete[-1].name}" if on_disk > checkpoint_bytes
             else "the estimate")
    free, probe = free_bytes(directory)
    need = 2 * one
    line = (f"{probe} has {_gb(free)} free; two checkpoints need 2 x {_gb(one)} = {_gb(need)} "
            f"({basis})")
    if free < need:
        return False, (f"CHECKPOINT_DIR={directory}: its file system {line}: free space there "
                       "(older checkpoints, LBP_KEEP_LAST), or set CHECKPOINT_DIR to a larger one")
    return True, f"checkpoint space: {line}: enough"


def error_text(directory: Path, exc: Exception) -> str:
    """A checkpoint directory that cannot be read, in one line (CheckpointError, OSError)."""
    if isinstance(exc, OSError):
        return f"{directory}: {exc.strerror or exc}"
    return str(exc)


def cmd_space(a) -> int:
    ok, line = space(a.dir, a.checkpoint_bytes)
    if not ok:
        print(f"{PROG}: error: {line}", file=sys.stderr)
        return 4
    print(line)
    return 0


def cmd_chain(a) -> int:
    tracker, _ = scan(a.dir)
    now = tracker or 0
    if now >= a.train_iters:
        print(f"chain: training complete (the tracker names iteration {now} of TRAIN_ITERS="
              f"{a.train_iters}): nothing to train, no next job")
        write_resolved(a.resolved, {"CHAIN_STATE": "complete", "TRACKER_ITERATION": now})
        return 0
    if a.previous_iteration is not None and now <= a.previous_iteration:
        print(f"{PROG}: error: chain stops: no progress since job {a.previous_job or '?'} "
              f"started (the tracker in {a.dir} still names iteration {now}): not training and "
              f"not submitting the next job; read job {a.previous_job or '?'}'s log",
              file=sys.stderr)
        return 5
    since = ("" if a.previous_iteration is None else
             f", up from {a.previous_iteration} when job {a.previous_job or '?'} started")
    print(f"chain: the tracker names iteration {now} of {a.train_iters}{since}: continuing")
    write_resolved(a.resolved, {"CHAIN_STATE": "continue", "TRACKER_ITERATION": now})
    return 0


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the launcher ends the pruner
    ap = Parser(prog="python -m megatron_lbp.launch checkpoints", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    p = sub.add_parser("prune")
    p.add_argument("dir", type=Path)
    p.add_argument("--keep-last", type=int, required=True)
    p.add_argument("--milestone-every", type=int, default=0)
    p.add_argument("--at-start", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--every", type=float, default=0.0, help="prune every this many seconds, "
                   "until killed")
    p.add_argument("--prefix", default="", help="start of each printed line")
    s = sub.add_parser("space")
    s.add_argument("dir", type=Path)
    s.add_argument("--checkpoint-bytes", type=int, required=True)
    c = sub.add_parser("chain")
    c.add_argument("dir", type=Path)
    c.add_argument("--train-iters", type=int, required=True)
    c.add_argument("--previous-iteration", type=int, default=None)
    c.add_argument("--previous-job", default=None)
    for q in (p, s, c):
        q.add_argument("--resolved", default=None)
    a = ap.parse_args(argv)
    try:
        return {"prune": cmd_prune, "space": cmd_space, "chain": cmd_chain}[a.cmd](a)
    except (CheckpointError, OSError) as exc:
        print(f"{PROG}: error: {error_text(a.dir, exc)}", file=sys.stderr)
        return 2
