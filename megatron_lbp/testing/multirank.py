"""Run one function on N real torch.distributed ranks (gloo, CPU) and collect what each returned.

Each rank is a process with the environment a launcher gives (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT of a rendezvous store this process hosts on a port the OS
assigns while binding), so the code under test sees what it sees under torchrun.
Failures are the point: an exception on any rank comes back with its traceback and the
other ranks are killed after a short grace period; on timeout every rank is killed and
the error carries each unfinished rank's Python stack, dumped by faulthandler just
before the deadline.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import socket
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

# Ranks started from this forkserver have torch and megatron-core imported once,
# which turns a ~4 s start per rank into ~0.2 s on the 2-core CI machine.
_PRELOAD = ["megatron_lbp.testing._preload"]

ERROR_GRACE_S = 10.0


class MultiRankError(AssertionError):
    """One or more ranks failed or did not finish; the message names each and says why."""


@dataclass
class _Outcome:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    crashed: bool = False  # died without reporting: its stack file holds faulthandler's dump


def agent_store(world_size: int):
    """A rendezvous store as torchrun's agent hosts one (ranks connect with TORCHELASTIC_USE_AGENT_STORE)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size=world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=900), wait_for_workers=False,
                         multi_tenant=True)


def free_port() -> int:
    """A port free now, which anybody may take before it is bound: only for a private network namespace.

    On a shared machine use agent_store (the launcher hosts the store) or
    host_store_in_this_rank (rank 0 hosts it, as under srun) instead.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_OWN_STORE = []   # keeps the store of host_store_in_this_rank alive as long as the rank


def host_store_in_this_rank(world_size: int, port_box) -> int:
    """Rank 0's side of a srun-like launch: host the rendezvous store on a port the OS assigns.

    torch.distributed's own env:// set-up in this process then reuses this server
    (its rank 0 store is multi-tenant: same process, same port), so the store still
    lives and dies with rank 0 as under srun, and no other process can take the
    port between choosing and binding it. ``port_box`` (a shared multiprocessing
    Value) tells the other ranks; sets MASTER_PORT here.
    """
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=world_size, is_master=True,
                          timeout=datetime.timedelta(seconds=900), wait_for_workers=False,
                          multi_tenant=True)
    _OWN_STORE.append(store)
    os.environ["MASTER_PORT"] = str(store.port)
    port_box.value = store.port
    return store.port


def wait_for_store_port(port_box, timeout_s: float = 300.0) -> int:
    """The other ranks' side of host_store_in_this_rank: wait for rank 0's port; sets MASTER_PORT."""
    deadline = time.monotonic() + timeout_s
    while port_box.value == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no rendezvous port within {timeout_s:.0f} s")
        time.sleep(0.02)
    os.environ["MASTER_PORT"] = str(port_box.value)
    return port_box.value


def forkserver_context():
    """The multiprocessing context whose server has _PRELOAD imported (one per process).

    Python keeps one forkserver per process, started by the first ``Process.start`` of any
    forkserver context with the preload list of that moment. If something started it
    without ours, every rank would import torch and megatron cold (seconds per rank, on
    every rank of every later run): refuse rather than run the whole session slowly."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_pid is not None and server._preload_modules != _PRELOAD:
        raise RuntimeError(
            f"this process's forkserver was started with preload {server._preload_modules!r}, "
            f"not {_PRELOAD!r}, so ranks would start cold: start forkserver processes with "
            f"megatron_lbp.testing.multirank.forkserver_context(), not mp.get_context('forkserver')")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_main(fn, args, kwargs, rank, env, results, stack_file, dump_after_s, init_pg):
    os.environ.update(env)
    with open(stack_file, "w") as stacks:
        # A rank killed by a signal (SIGABRT from a C++ abort, SIGSEGV) writes its
        # Python stacks here too, so a native crash names where it happened.
        faulthandler.enable(file=stacks, all_threads=True)
        faulthandler.dump_traceback_later(dump_after_s, exit=False, file=stacks)
        try:
            import torch

            torch.set_num_threads(int(env.get("LBP_TEST_THREADS", "1")))
            if init_pg:
                import torch.distributed as dist

                dist.init_process_group(backend="gloo", rank=rank,
                                        world_size=int(env["WORLD_SIZE"]), init_method="env://")
            value = fn(*args, **kwargs)
            outcome = _Outcome(rank, True, value)
        except BaseException:  # noqa: BLE001 - the parent reports it with the traceback
            outcome = _Outcome(rank, False, error=traceback.format_exc())
        finally:
            faulthandler.cancel_dump_traceback_later()
    try:
        payload = pickle.dumps(outcome)
    except Exception:  # the value itself would not pickle: report that, not a hang
        payload = pickle.dumps(_Outcome(rank, False, error=traceback.format_exc()))
    results.put(payload)
    if init_pg:
        import torch.distributed as dist

        if dist.is_initialized():
            # Without this, a rank that finishes early can tear down gloo's
            # sockets while a peer still reads from them.
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    env: Mapping[str, str] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
    init_process_group: bool = True,
    host_store: bool = True,
    error_grace_s: float = ERROR_GRACE_S,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank values.

    ``fn`` must be importable (module level) since ranks are separate processes.
    ``env`` is added to every rank's environment, ``rank_env(rank)`` to one rank's.
    With ``init_process_group`` the default process group is up before ``fn`` runs;
    without it ``fn`` brings one up itself (env:// finds this process's store).
    ``host_store=False``: no store here, MASTER_PORT is a free port, for ``fn``s
    that host their own inside private network namespaces (bench network), where
    nobody else can take it.
    ``error_grace_s``: how long the others may still report after a rank failed (their own
    errors name what they saw) before they are killed.
    Raises MultiRankError naming every failed or unfinished rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = forkserver_context()
    results = ctx.Queue()
    store = agent_store(world_size) if host_store else None
    port = store.port if store is not None else free_port()
    stack_dir = tempfile.mkdtemp(prefix="lbp-ranks-")
    dump_after = max(timeout - 5.0, timeout * 0.8)
    procs = []
    for rank in range(world_size):
        rank_vars = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
            **({"TORCHELASTIC_USE_AGENT_STORE": "True"} if store is not None else {}),
        }
        rank_vars.update(env or {})
        if rank_env is not None:
            rank_vars.update(rank_env(rank))
        stack_file = os.path.join(stack_dir, f"rank{rank}.stack")
        p = ctx.Process(
            target=_rank_main,
            args=(fn, args, kwargs, rank, rank_vars, results, stack_file, dump_after,
                  init_process_group),
            name=f"lbp-rank{rank}",
            # Not daemonic: Megatron's checkpoint writers start worker processes of their own.
            daemon=False,
        )
        p.start()
        procs.append(p)

    outcomes: dict[int, _Outcome] = {}
    deadline = time.monotonic() + timeout
    first_error_at = None
    cut_by_grace = False   # whether the ranks left were stopped by the grace period
    try:
        while len(outcomes) < world_size:
            now = time.monotonic()
            limit = deadline
            if first_error_at is not None:
                limit = min(limit, first_error_at + error_grace_s)
            if now >= limit:
                cut_by_grace = limit < deadline
                break
            try:
                item = pickle.loads(results.get(timeout=min(1.0, limit - now)))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in outcomes and not p.is_alive() and p.exitcode not in (0, None)]
                for r in dead:
                    outcomes[r] = _Outcome(r, False, error=f"process exited with code {procs[r].exitcode} "
                                           "before reporting (killed or crashed in native code)",
                                           crashed=True)
                    first_error_at = first_error_at or time.monotonic()
                continue
            outcomes[item.rank] = item
            if not item.ok and first_error_at is None:
                first_error_at = time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(outcomes) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()

    failed = {r: o for r, o in outcomes.items() if not o.ok}
    missing = [r for r in range(world_size) if r not in outcomes]
    try:
        if failed or missing:
            raise MultiRankError(_describe_failure(failed, missing, stack_dir, timeout,
                                                   first_error_at is not None,
                                                   error_grace_s if cut_by_grace else None))
        return [outcomes[r].value for r in range(world_size)]
    finally:
        # The stacks are read into the error above; a suite starts thousands of runs.
        # A rank killed above may still hold its file open: ignore_errors.
        shutil.rmtree(stack_dir, ignore_errors=True)


def _stack_dump(stack_dir: str, rank: int) -> str:
    path = os.path.join(stack_dir, f"rank{rank}.stack")
    return open(path).read().strip() if os.path.exists(path) else ""


def _describe_failure(failed, missing, stack_dir, timeout, had_error,
                      grace_s: float | None = None) -> str:
    lines = []
    if failed:
        lines.append(f"{len(failed)} rank(s) raised: {sorted(failed)}")
    if missing:
        why = ((f"killed {grace_s:g} s after another rank failed (the grace period)"
                if grace_s is not None else f"killed at the {timeout:.0f} s timeout after another "
                "rank failed") if had_error
               else f"did not finish within {timeout:.0f} s (hang?)")
        lines.append(f"rank(s) {missing} {why}")
    for r in sorted(failed):
        lines.append(f"--- rank {r} traceback ---\n{failed[r].error.rstrip()}")
        if failed[r].crashed:
            stack = _stack_dump(stack_dir, r)
            lines.append(f"--- rank {r} stacks when it crashed ---\n{stack or '(none dumped)'}")
    if not had_error:
        for r in missing:
            stack = _stack_dump(stack_dir, r)
            lines.append(f"--- rank {r} stack shortly before the timeout ---\n{stack or '(none dumped)'}")
    return "\n".join(lines)


def run_single(fn: Callable[..., Any], *args: Any, timeout: float = 180.0, **kwargs: Any) -> Any:
    """Run ``fn`` in one fresh rank (world size 1) and return its value."""
    return run_on_ranks(fn, 1, *args, timeout=timeout, **kwargs)[0]


def rank_location_env(gpus_per_node: int) -> Callable[[int], Mapping[str, str]]:
    """Per-rank torchrun variables that place ranks as consecutive emulated nodes of ``gpus_per_node``."""

    def env(rank: int) -> Mapping[str, str]:
        return {
            "LOCAL_RANK": str(rank % gpus_per_node),
            "LOCAL_WORLD_SIZE": str(gpus_per_node),
            "GROUP_RANK": str(rank // gpus_per_node),
        }

    return env


__all__: Sequence[str] = ["MultiRankError", "run_on_ranks", "run_single", "free_port",
                          "rank_location_env", "forkserver_context", "agent_store",
                          "host_store_in_this_rank", "wait_for_store_port"]
