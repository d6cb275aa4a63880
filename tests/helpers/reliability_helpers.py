"""Launch the real training entry on local ranks, kill it like a node failure, read exact losses and checkpoints."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

from megatron_lbp.testing.entry import EntryJob
from tests.helpers.pretrain_runner import REPO, why

TRACKER = "latest_checkpointed_iteration.txt"


def start(nproc: int, args: list[str], log: Path, env: dict | None = None) -> EntryJob:
    """The training entry on ``nproc`` ranks (tests/helpers/pretrain_runner.py's forkserver launcher), all output into ``log``."""
    return EntryJob(nproc, args, log, env={"PYTHONWARNINGS": "ignore", **(env or {})}, cwd=REPO)


def wait_for(proc: EntryJob, log: Path, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in log.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before {needle!r}:\n"
                                 + "\n".join(log.read_text().splitlines()[-30:]))
        time.sleep(0.2)
    kill_tree(proc)
    raise AssertionError(f"no {needle!r} within {timeout} s:\n" + "\n".join(log.read_text().splitlines()[-30:]))


def kill_tree(proc: EntryJob) -> None:
    """SIGKILL every rank and every process it started at once, as a node failure or scancel does."""
    proc.kill()


def finish(proc: EntryJob, log: Path, timeout: float = 900) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise
    text = log.read_text()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{why(text)}"
    return text


def losses(path: Path, key: str = "lm loss") -> dict[int, float]:
    """{iteration: loss} from an LBP_LOSS_LOG file (full precision); an iteration logged twice must agree."""
    out: dict[int, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        it, k, value = line.split("\t")
        if k == key:
            assert out.setdefault(int(it), float(value)) == float(value), f"iteration {it} logged twice, differently"
    return out


def tracker(save: Path) -> str:
    return (save / TRACKER).read_text()


def checkpoint_tensors(ckpt_dir: Path, scratch: Path) -> dict:
    """Every tensor of a torch_dist checkpoint, whole (DCP reassembles the ranks' pieces)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / (ckpt_dir.parent.name + "_" + ckpt_dir.name + ".pt")
    dcp_to_torch_save(str(ckpt_dir), str(out))
    state = torch.load(out, weights_only=False)
    flat = {}

    def walk(prefix, tree):
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(tree, torch.Tensor):
            flat[prefix] = tree
    walk("", state)
    return flat


def tensor_differences(a: dict, b: dict) -> list[str]:
    """Keys missing on one side and tensors not bit-identical (dtype, shape, every element)."""
    import torch

    diffs = [f"{k}: only in the first" for k in sorted(set(a) - set(b))]
    diffs += [f"{k}: only in the second" for k in sorted(set(b) - set(a))]
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            diffs.append(f"{k}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        elif not torch.equal(_bits(x), _bits(y)):
            n = int((x != y).sum())
            diffs.append(f"{k}: bytes differ; {n} of {x.numel()} elements differ by value (max |d| "
                         f"{float((x.float() - y.float()).abs().max())})")
    return diffs


def _bits(t):
    """The bytes of a tensor: bit-identical means -0.0 differs from 0.0 and NaN equals the same NaN."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)
