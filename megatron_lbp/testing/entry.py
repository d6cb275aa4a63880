"""``python -m megatron_lbp.pretrain_gpt`` on N local ranks without paying its start-up N times.

Each rank is forked from the multirank harness's server (torch and megatron-core already
imported, _preload.py) with the variables torchrun gives a worker, a rendezvous store the
launcher hosts, the caller's working directory and one merged log file, and runs
``megatron_lbp.integration.pretrain_gpt.main(argv)``. Exit status as torchrun reports it;
once a rank fails the others get SIGTERM, then SIGKILL. Interpreter start-up and
torchrun's agent are not exercised here: tests/unit/test_patches.py and
tests/e2e/test_bad_input_matrix.py start the entry in fresh interpreters, and the real
Slurm test with srun.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from megatron_lbp.testing.multirank import agent_store, forkserver_context

TERM_GRACE_S = 10.0


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun --nproc-per-node=world sets for one worker on a single host.

    Like torchrun, the launcher hosts the rendezvous store (TORCHELASTIC_USE_AGENT_STORE):
    every rank connects to it as a client.
    """
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1",
    }


def as_entry_process(argv: Sequence[str], environ: Mapping[str, str] | None, cwd: str | None) -> None:
    """In a process forked from the harness's server: become ``python -m megatron_lbp.pretrain_gpt argv``.

    ``environ`` (when given) replaces the server's environment, as exec would;
    exit status and output are the caller's business (SystemExit propagates).
    The server has torch and megatron-core imported, not megatron.training: that
    import (0.2 s) configures logging, so it happens here, inside main(), in the
    same order as in a fresh interpreter.
    """
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
    import multiprocessing
    import warnings

    import torch

    from megatron_lbp.integration import pretrain_gpt

    # A fresh interpreter's default start method (fork on Linux), not the server's:
    # Megatron's data-loader workers are not picklable.
    multiprocessing.set_start_method(None, force=True)
    if os.environ.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.argv = [pretrain_gpt.__file__]   # what python -m puts there (argparse's prog)
    pretrain_gpt.main(list(argv))
    sys.stdout.flush()
    sys.stderr.flush()


def _entry_rank(argv: list[str], environ: dict[str, str], cwd: str, log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    as_entry_process(argv, environ, cwd)


def _captured_rank(argv: list[str], environ: dict[str, str], cwd: str, out_path: str,
                   err_path: str) -> None:
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    as_entry_process(argv, environ, cwd)


def run_entry_captured(argv: Sequence[str], environ: Mapping[str, str], cwd: str | os.PathLike,
                       *, timeout: float = 600) -> subprocess.CompletedProcess:
    """One rank of ``python -m megatron_lbp.pretrain_gpt argv``, forked warm, stdout and stderr apart.

    For checks of what the entry says and does before it trains (the bad-input matrix):
    ``environ`` is the whole environment (as exec gets it), ``cwd`` the working
    directory. The exit status is the process's: SystemExit's code, 1 (and the
    traceback on stderr) for an uncaught exception, as in a fresh interpreter.
    """
    import tempfile

    ctx = forkserver_context()
    with tempfile.TemporaryDirectory(prefix="lbp-entry-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out_path, err_path):
            Path(path).write_text("")
        p = ctx.Process(target=_captured_rank, name="lbp-entry",
                        args=(list(argv), dict(environ), str(cwd), out_path, err_path))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            _signal(p.pid, signal.SIGKILL)
            p.join()
            raise subprocess.TimeoutExpired("megatron_lbp.pretrain_gpt", timeout)
        return subprocess.CompletedProcess(
            ["python", "-m", "megatron_lbp.pretrain_gpt", *argv], p.exitcode,
            Path(out_path).read_text(errors="replace"), Path(err_path).read_text(errors="replace"))


class EntryJob:
    """The ranks of one launch; the parts of subprocess.Popen's interface the tests use."""

    def __init__(self, nproc: int, argv: Sequence[str], log_path: str | os.PathLike, *,
                 env: Mapping[str, str] | None = None,
                 rank_env: Callable[[int], Mapping[str, str]] | None = None,
                 cwd: str | os.PathLike | None = None):
        if nproc < 1:
            raise ValueError(f"nproc={nproc} must be >= 1")
        self.log_path = str(log_path)
        Path(self.log_path).write_text("")
        ctx = forkserver_context()
        self._store = agent_store(nproc)
        port = self._store.port
        base = dict(os.environ)
        self.procs = []
        for rank in range(nproc):
            environ = {**base, **torchrun_env(rank, nproc, port), **(env or {})}
            if rank_env is not None:
                environ.update(rank_env(rank))
            p = ctx.Process(target=_entry_rank, name=f"lbp-entry-rank{rank}",
                            args=(list(argv), environ, str(cwd or os.getcwd()), self.log_path),
                            daemon=False)  # Megatron's checkpoint writers start processes of their own
            p.start()
            self.procs.append(p)
        self.pids = [p.pid for p in self.procs]
        self.returncode: int | None = None
        self._failed_at: float | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        codes = [p.exitcode for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed and self._failed_at is None:
            self._failed_at = time.monotonic()
            for p in self.procs:   # torchrun stops the other workers when one fails
                if p.exitcode is None:
                    _signal(p.pid, signal.SIGTERM)
        if failed and self._failed_at is not None and time.monotonic() - self._failed_at > TERM_GRACE_S:
            self.kill()
            codes = [p.exitcode for p in self.procs]
        if all(c is not None for c in codes):
            for p in self.procs:
                p.join()
            self.returncode = next((c for c in codes if c != 0), 0)
            self._store = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"megatron_lbp.pretrain_gpt on {len(self.procs)} ranks",
                                                timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL every rank and everything it started, at once (as a node failure does)."""
        import psutil

        tree = []
        for pid in self.pids:
            try:
                root = psutil.Process(pid)
                tree += [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for sig in (signal.SIGSTOP, signal.SIGKILL):   # frozen first: nothing forks or exits meanwhile
            for p in tree:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
        for p in self.procs:
            p.join(timeout=30)
        psutil.wait_procs(tree, timeout=30)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run_entry(nproc: int, argv: Sequence[str], log_path: str | os.PathLike, *,
              timeout: float = 900, env: Mapping[str, str] | None = None,
              rank_env: Callable[[int], Mapping[str, str]] | None = None,
              cwd: str | os.PathLike | None = None) -> tuple[int, str]:
    """(exit status, merged log) of one launch; on timeout every rank is killed and TimeoutExpired raised."""
    job = EntryJob(nproc, argv, log_path, env=env, rank_env=rank_env, cwd=cwd)
    try:
        job.wait(timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        raise
    return job.returncode, Path(log_path).read_text(errors="replace")


__all__ = ["EntryJob", "as_entry_process", "run_entry", "torchrun_env"]
