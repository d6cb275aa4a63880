"""Each task's place checked at task start: ranks fill nodes in order, package mates share a package.

    python -m megatron_lbp.launch placement --tasks-per-node 8 --gcds-per-package 2 \\
        --gpus-per-task 1 [--exchange-root /tmp] [--allow-non-colocated]

Verifies rank = node * T + local rank (Slurm's variables), the task's GCD from
``ROCR_VISIBLE_DEVICES`` (package = d // P), and that its package mates' GCDs
(exchanged under --exchange-root) are distinct and in one package.
Exit status 0, 4 with one line naming the rank and what is wrong (a warning with
--allow-non-colocated), 2 bad input. See docs/frontier.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

PROG = "lbp_task"
VISIBILITY = ("ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")


class PlacementError(ValueError):
    """A task that is not where the hierarchy assumes; the message is one line."""


@dataclass(frozen=True)
class Task:
    rank: int
    node: int
    local: int
    host: str
    devices: tuple[str, ...]
    source: str


def _int(env: Mapping[str, str], name: str) -> int:
    v = env.get(name, "")
    if not v.isdigit():
        raise ValueError(f"{name}={v!r}: this runs in an srun task (an integer is expected)")
    return int(v)


def task_from_env(env: Mapping[str, str]) -> Task:
    source = next((v for v in VISIBILITY if env.get(v, "").strip()), "")
    devices = tuple(d.strip() for d in env.get(source, "").split(",") if d.strip()) if source else ()
    return Task(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NODEID"), _int(env, "SLURM_LOCALID"),
                env.get("SLURMD_NODENAME") or os.uname().nodename, devices, source)


def check_task(t: Task, tasks_per_node: int, gpus_per_task: int) -> None:
    """What one task can check alone: its rank's place in its node, one visible device per GPU."""
    expected = t.node * tasks_per_node + t.local
    if t.rank != expected:
        raise PlacementError(
            f"rank {t.rank} is local rank {t.local} on node {t.node} ({t.host}), but the hierarchy "
            f"needs rank = node x {tasks_per_node} + local rank = {expected}: ranks must fill "
            "nodes in order (srun's default block distribution; check SRUN_EXTRA_ARGS)")
    if gpus_per_task < 1:
        return
    if not t.devices:
        raise PlacementError(
            f"rank {t.rank} on {t.host}: no ROCR_VISIBLE_DEVICES (nor CUDA_VISIBLE_DEVICES / "
            f"GPU_DEVICE_ORDINAL): srun --gpus-per-task={gpus_per_task} --gpu-bind=... sets it")
    if len(t.devices) != gpus_per_task:
        raise PlacementError(
            f"rank {t.rank} on {t.host} sees {len(t.devices)} devices ({t.source}="
            f"{','.join(t.devices)}), expected {gpus_per_task} per task: check GPU_BIND and "
            "SRUN_EXTRA_ARGS")


def package_of(device: str, gcds_per_package: int) -> int | None:
    return int(device) // gcds_per_package if device.isdigit() else None


def check_package(t: Task, mates: Mapping[int, str], gcds_per_package: int) -> str:
    """``mates``: local rank -> device of every task of t's package (t included). A summary line."""
    devices = {loc: d for loc, d in sorted(mates.items())}
    if len(set(devices.values())) != len(devices):
        raise PlacementError(
            f"local ranks {list(devices)} on {t.host} share a device ({devices}): each task needs "
            "its own GCD (GPU_BIND)")
    packages = {loc: package_of(d, gcds_per_package) for loc, d in devices.items()}
    if None in packages.values():
        return (f"devices {devices} on {t.host} are not device numbers; their package is "
                "checked by the health check's PCI locations")
    if len(set(packages.values())) != 1:
        pairs = ", ".join(f"local rank {loc} -> device {devices[loc]} (package {p})"
                          for loc, p in packages.items())
        raise PlacementError(
            f"local ranks {list(devices)} on {t.host} form one weight group (P="
            f"{gcds_per_package}) but sit on different packages: {pairs}: use --gpu-bind=closest "
            "(Frontier) or a map_gpu list that keeps each pair on one package, or "
            "--hier-allow-non-colocated")
    gcds = ",".join(devices.values())
    return (f"rank {t.rank} is local rank {t.local} of node {t.node} ({t.host}); local ranks "
            f"{','.join(map(str, devices))} on devices {gcds} = package {packages[t.local]}")


def _exchange_dir(t: Task, root: Path, step: str) -> Path:
    return root / f"lbp-placement-{step}" / t.host


def publish(t: Task, root: Path, step: str) -> None:
    """This task's devices where its node's other tasks read them (before any check can stop it)."""
    d = _exchange_dir(t, root, step)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{t.local}.{os.getpid()}"
    tmp.write_text(",".join(t.devices))
    os.replace(tmp, d / str(t.local))


def exchange(t: Task, root: Path, step: str, gcds_per_package: int, timeout: float) -> dict[int, str]:
    """Its package mates' devices (local rank -> devices), this task's own included."""
    d = _exchange_dir(t, root, step)
    first = t.local - t.local % gcds_per_package
    wanted = range(first, first + gcds_per_package)
    deadline = time.monotonic() + timeout
    while True:
        found = {loc: (d / str(loc)).read_text() for loc in wanted if (d / str(loc)).exists()}
        if len(found) == gcds_per_package:
            return found
        if time.monotonic() > deadline:
            missing = [loc for loc in wanted if loc not in found]
            raise PlacementError(
                f"rank {t.rank} on {t.host}: its package mate(s) (local rank(s) {missing}) did not "
                f"report their device within {timeout:g} s in {d}")
        time.sleep(0.05)


def main(argv=None, env: Mapping[str, str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_lbp.launch placement",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks-per-node", type=int, required=True)
    ap.add_argument("--gcds-per-package", type=int, required=True)
    ap.add_argument("--gpus-per-task", type=int, required=True)
    ap.add_argument("--exchange-root", type=Path, default=Path("/tmp"))
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--allow-non-colocated", action="store_true")
    a = ap.parse_args(argv)
    env = os.environ if env is None else env
    try:
        t = task_from_env(env)
        step = f"{env.get('SLURM_JOB_ID', 'nojob')}.{env.get('SLURM_STEP_ID', '0')}"
        if a.gpus_per_task > 0:
            publish(t, a.exchange_root, step)
        check_task(t, a.tasks_per_node, a.gpus_per_task)
        if a.gpus_per_task < 1:
            summary = (f"rank {t.rank} is local rank {t.local} of node {t.node} ({t.host}); "
                       "CPU ranks (no device to check)")
        else:
            mates = exchange(t, a.exchange_root, step, a.gcds_per_package, a.timeout)
            summary = check_package(t, mates, a.gcds_per_package)
    except ValueError as exc:
        rank = env.get("SLURM_PROCID", "?")
        if isinstance(exc, PlacementError) and a.allow_non_colocated:
            print(f"{PROG}: warning (--hier-allow-non-colocated): {exc}", file=sys.stderr)
            return 0
        print(f"{PROG}: error: placement: {exc}" + ("" if isinstance(exc, PlacementError)
                                                     else f" (rank {rank})"), file=sys.stderr)
        return 4 if isinstance(exc, PlacementError) else 2
    if t.rank == 0:
        print(f"[lbp_task] placement verified: {summary}", flush=True)
    return 0
