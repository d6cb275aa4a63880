"""Where a test run's wall time goes: an opt-in pytest plugin, and its summary.

    LBP_TEST_PROBE_OUT=/tmp/probe.jsonl bash scripts/test.sh -n 0 -p tests.helpers.runnable_probe tests/e2e
    python -m tests.helpers.runnable_probe /tmp/probe.jsonl

For each test's setup, call and teardown it appends one JSON line: the wall time; the CPU
time of the pytest process, of the children it waited for and of the multirank harness's
forkserver and the ranks it reaped (``time`` misses those: nobody waits for the
forkserver); and, sampled five times a second over every thread of this process's tree,
how long no thread was runnable or in disk wait (``idle``: sleeps, timeouts), exactly one was (``one``: a
second core would idle) or more were. Threads waiting for a core count as runnable, so
the split holds on a loaded machine, where the wall time does not.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time

import pytest

OUT = os.environ.get("LBP_TEST_PROBE_OUT", "runnable_probe.jsonl")
SAMPLE_S = 0.2
_TICK = os.sysconf("SC_CLK_TCK")


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _fields(stat: bytes) -> list[bytes]:
    """/proc/.../stat's fields after the command name (state is [0], ppid [1], utime [11])."""
    return stat[stat.rfind(b")") + 2:].split()


class _Sampler(threading.Thread):
    """Counts the runnable threads of this process's tree (itself excluded) every SAMPLE_S."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="runnable-probe")
        self.root = os.getpid()
        self.lock = threading.Lock()
        self.by_runnable = {"idle": 0.0, "one": 0.0, "several": 0.0}

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (stat := _read(f"/proc/{entry.name}/stat")):
                children.setdefault(int(_fields(stat)[1]), []).append(int(entry.name))
        tree = [self.root]
        for pid in tree:
            tree += children.get(pid, [])
        return tree

    def _runnable(self, me: int) -> int:
        n = 0
        for pid in self._tree():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                stat = _read(f"/proc/{pid}/task/{tid}/stat")
                if int(tid) != me and stat and _fields(stat)[0] in (b"R", b"D"):
                    n += 1
        return n

    def run(self) -> None:
        me, last = threading.get_native_id(), time.monotonic()
        while True:
            time.sleep(SAMPLE_S)
            n = self._runnable(me)
            now = time.monotonic()
            with self.lock:
                self.by_runnable["idle" if n == 0 else "one" if n == 1 else "several"] += now - last
            last = now

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return dict(self.by_runnable)


_SAMPLER: _Sampler | None = None


def _cpu() -> dict[str, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    ranks = 0.0
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid
    if pid is not None and (stat := _read(f"/proc/{pid}/stat")):
        ranks = sum(int(x) for x in _fields(stat)[11:15]) / _TICK
    return {"own": own.ru_utime + own.ru_stime, "waited": waited.ru_utime + waited.ru_stime,
            "forkserver": ranks}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _SAMPLER
    if _SAMPLER is None:   # in the process that runs tests (an xdist worker, not the controller)
        _SAMPLER = _Sampler()
        _SAMPLER.start()
    yield


def _record(item, phase: str):
    wall, cpu, runnable = time.monotonic(), _cpu(), _SAMPLER.snapshot()
    yield
    cpu_after, runnable_after = _cpu(), _SAMPLER.snapshot()
    row = {"test": item.nodeid, "phase": phase, "wall": round(time.monotonic() - wall, 2),
           **{f"cpu_{k}": round(cpu_after[k] - cpu[k], 2) for k in cpu},
           **{k: round(runnable_after[k] - runnable[k], 2) for k in runnable}}
    with open(OUT, "a") as f:
        f.write(json.dumps(row) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _record(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _record(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _record(item, "teardown")


def summary(rows: list[dict]) -> str:
    total = {k: sum(r[k] for r in rows) for k in
             ("wall", "cpu_own", "cpu_waited", "cpu_forkserver", "idle", "one", "several")}
    cpu = total["cpu_own"] + total["cpu_waited"] + total["cpu_forkserver"]
    sampled = total["idle"] + total["one"] + total["several"] or 1.0
    tests = len({r["test"] for r in rows})
    return (f"{tests} tests: wall {total['wall']:.0f} s; CPU {cpu:.0f} s (pytest "
            f"{total['cpu_own']:.0f}, waited-for children {total['cpu_waited']:.0f}, forkserver "
            f"ranks {total['cpu_forkserver']:.0f}); runnable threads: none "
            f"{100 * total['idle'] / sampled:.0f}%, one {100 * total['one'] / sampled:.0f}%, "
            f"several {100 * total['several'] / sampled:.0f}% of the sampled time")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m tests.helpers.runnable_probe PROBE.jsonl [...]")
    print(summary([json.loads(line) for path in sys.argv[1:] for line in open(path)]))
