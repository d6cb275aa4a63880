"""The shell commands of a page's ```bash blocks, run as a user types them, in a scratch directory.

The directory gets the checkout's ``.venv`` and ``scripts`` (symlinks), so
``.venv/bin/python ...`` and ``scripts/preprocess_data.py`` resolve as they do
from the repository root, and a ``torchrun`` on PATH that is the venv's
``python -m torch.distributed.run --standalone`` (its own rendezvous port, as
several jobs share the machine). transformers comes from the test copy
(megatron_lbp.testing.hf_env), never installed into the venv: a block's
``pip install`` line is checked to be there and not run.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from megatron_lbp.testing import hf_env

REPO = Path(__file__).resolve().parents[2]


def bash_blocks(page: Path, after: str | None = None) -> list[str]:
    """The ```bash blocks of ``page`` (those after the heading ``after``, if given)."""
    text = page.read_text()
    if after is not None:
        text = text[text.index(after):]
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[str]:
    """One string per command: continuation lines joined, comment-only lines dropped."""
    joined = block.replace("\\\n", " ")
    return [re.sub(r"\s+", " ", line).strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def without_comment(command: str) -> str:
    return re.sub(r"\s+#.*$", "", command)


def substitute(command: str, subs: dict[str, str]) -> str:
    for old, new in subs.items():
        command = command.replace(old, new)
    return command


def scratch(root: Path) -> dict[str, str]:
    """Prepare ``root`` as the user's working directory; the environment to run commands in."""
    root.mkdir(parents=True, exist_ok=True)
    for name in (".venv", "scripts"):
        if not (root / name).exists():
            (root / name).symlink_to(REPO / name)
    bin_dir = root / ".bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "torchrun"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m torch.distributed.run --standalone "$@"\n')
    shim.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1",
                PYTHONPATH=hf_env.path(), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")


def run(command: str, cwd: Path, env: dict, timeout: int = 1800) -> tuple[int, str, float]:
    """(exit status, output, wall seconds) of ``command`` in bash."""
    t0 = time.perf_counter()
    out = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout)
    return out.returncode, out.stdout + out.stderr, time.perf_counter() - t0
