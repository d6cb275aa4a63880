"""Launch the real training entry as a process tree, kill it like a node failure, read exact losses and checkpoints."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megatron_lbp.testing.multirank import free_port
from tests.pretrain_runner import REPO, why

TRACKER = "latest_checkpointed_iteration.txt"


def command(nproc: int) -> tuple[list[str], dict]:
    if nproc == 1:
        return ([sys.executable, "-m", "megatron_lbp.pretrain_gpt"],
                {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--master-port", str(free_port()), "-m", "megatron_lbp.pretrain_gpt"], {})


def start(nproc: int, args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """The entry point in its own session, stdout and stderr into ``log``."""
    cmd, extra = command(nproc)
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra, **(env or {}))
    with open(log, "w") as out:
        return subprocess.Popen(cmd + args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=full_env, start_new_session=True)


def wait_for(proc: subprocess.Popen, log: Path, needle: str, timeout: float) -> None:
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


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker at once, as a node failure or scancel does.

    torchrun starts each worker in a session of its own, so killing the
    launcher's process group would leave the workers running: collect the
    whole tree first, freeze it, then kill it.
    """
    try:
        root = psutil.Process(proc.pid)
        tree = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.send_signal(signal.SIGSTOP)
        except psutil.NoSuchProcess:
            pass
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(tree, timeout=30)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 900) -> str:
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
