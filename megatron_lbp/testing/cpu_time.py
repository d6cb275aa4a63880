"""CPU seconds of a command and of every process it starts: ``python -m megatron_lbp.testing.cpu_time CMD...``.

On a shared machine wall time says more about the neighbours than about a test;
the CPU time a test module costs does not. ``time`` misses most of it here: the
multi-rank harness's ranks are children of its forkserver, which nobody waits
for, so their CPU time never reaches the shell. This process makes itself the
subreaper of the command's tree (Linux prctl PR_SET_CHILD_SUBREAPER), waits for
every orphan that lands on it, and prints one line to stderr::

    [cpu_time] wall 136.7 s, cpu 412.3 s (user 380.1, sys 32.2), exit 0

Exit status: the command's.
"""
from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m megatron_lbp.testing.cpu_time CMD [ARGS...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"cpu_time: prctl failed (errno {ctypes.get_errno()}): not Linux?", file=sys.stderr)
        return 2
    start = time.monotonic()
    proc = subprocess.Popen(argv)
    code = proc.wait()
    while True:   # the orphans the command left (the forkserver and its ranks)
        try:
            os.wait()
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"[cpu_time] wall {time.monotonic() - start:.1f} s, cpu "
          f"{usage.ru_utime + usage.ru_stime:.1f} s (user {usage.ru_utime:.1f}, "
          f"sys {usage.ru_stime:.1f}), exit {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
