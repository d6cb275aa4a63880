"""The CPU time other processes took while a benchmark ran.

The benchmarks used to judge that from the 1-minute load average, which cannot
tell: it lags by a minute (in ``bench report`` it still holds the previous
section's ranks) and counts every runnable thread of the run itself, whose 8
ranks with their gloo threads put it at 30 on a 2-core machine that ran
nothing else. What other processes used is the machine's busy CPU time
(``/proc/stat``: user, nice, system) less this process tree's: this process
and the children it reaped (``os.times``) plus every live descendant with the
children it reaped (``/proc/<pid>/stat``), so ranks started from a forkserver,
which reaps them itself, count as the run's own. Interrupt time is left out of
both sides. Linux only; elsewhere :func:`snapshot` returns None and nothing is
reported.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

# Other processes taking more than this share of the cores during a run make
# its times measure them as much as the schemes.
WARN_SHARE = 0.10


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float
    busy_s: float     # the machine's user + nice + system time, all CPUs
    own_s: float      # this process tree's user + system time


def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    user, nice, system = (int(v) for v in fields[1:4])
    return (user + nice + system) / _ticks()


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:  # gone between the listing and the read
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return text[text.rindex(")") + 2:].split()


def _descendants_cpu_s(root: int) -> float:
    """utime + stime + cutime + cstime of every live descendant of ``root``."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is None:
            continue
        # After the command name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
        children.setdefault(int(fields[1]), []).append(int(name))
        cpu[int(name)] = sum(int(v) for v in fields[11:15])
    total, todo = 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total / _ticks()


def snapshot() -> CpuSnapshot | None:
    """The machine's and this process tree's CPU time now; None where /proc has no stat."""
    if not os.path.exists("/proc/stat"):
        return None
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    return CpuSnapshot(wall=time.monotonic(), busy_s=_machine_busy_s(),
                       own_s=own + _descendants_cpu_s(os.getpid()))


def others_between(start: CpuSnapshot | None, end: CpuSnapshot | None,
                   cpus: int) -> dict[str, Any] | None:
    """CPU seconds other processes used between two snapshots, and their share of the cores."""
    if start is None or end is None:
        return None
    wall = end.wall - start.wall
    # Ticks round both sides separately: a small negative difference is none.
    others = max(0.0, (end.busy_s - start.busy_s) - (end.own_s - start.own_s))
    return {"others_cpu_s": others, "own_cpu_s": end.own_s - start.own_s, "wall_s": wall,
            "cpus": cpus, "others_share": others / (wall * cpus) if wall > 0 else 0.0}


def record(into: dict[str, Any], start: CpuSnapshot | None, cpus: int) -> None:
    """Put what other processes used since ``start`` under ``other_cpu`` in a benchmark's
    result, and, above WARN_SHARE, the warning under ``load_warning``."""
    into["other_cpu"] = others_between(start, snapshot(), cpus)
    text = warning(into["other_cpu"])
    if text:
        into["load_warning"] = text


def warning(share: dict[str, Any] | None) -> str | None:
    """The line a benchmark prints when other processes took the cores from it, else None."""
    if not share or share["others_share"] <= WARN_SHARE:
        return None
    return (f"other processes used {share['others_share']:.0%} of the {share['cpus']} CPUs "
            f"during the run ({share['others_cpu_s']:.0f} CPU-s in {share['wall_s']:.0f} s): "
            f"the times measure them as much as the schemes; compare ratios only across "
            f"runs that had the cores to themselves")


def clause(share: dict[str, Any] | None) -> str:
    """'; other processes used N% of the cores ...' to end a setup line; '' without a
    measurement (results from before this module)."""
    if not share:
        return ""
    return (f"; other processes used {share['others_share']:.0%} of the {share['cpus']} "
            f"CPUs during the run")
