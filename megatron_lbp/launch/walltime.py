"""When a job must stop training so that its last checkpoint is written before Slurm kills it.

    python -m megatron_lbp.launch exit-time --save-s 72 --step-s 22.5 --slack-s 120 \\
        [--walltime 02:00:00] [--resolved FILE]

Time left from ``SLURM_JOB_END_TIME``, else ``squeue -o %L``, else --walltime.
The margin is one save + one step + --slack-s, and at least the --signal lead + 60 s
+ one step, so the computed exit comes before Slurm's signal; rounded down to a minute.
Exit status: 0 (EXIT_DURATION_MINS, 0 without a limit), 4 (under one minute of
training left), 2 (bad input). See docs/frontier.md.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from typing import Callable, Mapping

from megatron_lbp.launch._cli import PROG, write_resolved

NO_LIMIT = ("UNLIMITED", "INFINITE", "NOT_SET", "INVALID", "")


class WalltimeError(ValueError):
    """A time that cannot be read; the message is one line."""


def parse_slurm_duration(text: str) -> int | None:
    """Seconds of a Slurm duration (``sbatch -t``, ``squeue -o %L/%l``); None for no limit.

    Slurm's forms: ``minutes``, ``minutes:seconds``, ``hours:minutes:seconds``,
    ``days-hours``, ``days-hours:minutes``, ``days-hours:minutes:seconds``.
    """
    t = text.strip()
    if t.upper() in NO_LIMIT:
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if not m:
        raise WalltimeError(f"{text!r} is not a Slurm time ([days-]hours:minutes:seconds)")
    days, a, b, c = m.groups()
    a, b, c = int(a), (int(b) if b else None), (int(c) if c else None)
    if days is not None:  # days-hours[:minutes[:seconds]]
        return int(days) * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + b * 60 + c
    if b is not None:
        return a * 60 + b
    return a * 60


def remaining_seconds(env: Mapping[str, str], now: float | None = None,
                      squeue: Callable[[str], str] | None = None) -> tuple[int | None, str]:
    """(seconds this job has left or None for no limit, where that came from)."""
    now = time.time() if now is None else now
    end = env.get("SLURM_JOB_END_TIME", "").strip()
    if end:
        if not end.isdigit():
            raise WalltimeError(f"SLURM_JOB_END_TIME={end!r} is not a Unix time")
        return max(0, int(end) - int(now)), "SLURM_JOB_END_TIME"
    job = env.get("SLURM_JOB_ID", "")
    text = (squeue or _squeue_time_left)(job)
    left = parse_slurm_duration(text)
    return (None if left is None else max(0, left)), f"squeue -o %L: {text.strip()}"


def _squeue_time_left(job: str) -> str:
    try:
        r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WalltimeError(f"cannot ask squeue for job {job}'s time left: {exc}") from None
    if r.returncode != 0 or not r.stdout.strip():
        raise WalltimeError(f"squeue -h -j {job} -o %L gave no time left "
                            f"({(r.stderr or r.stdout).strip() or 'no output'})")
    return r.stdout.strip().splitlines()[0]


SIGNAL_EARLY_S = 60  # man sbatch, --signal: "may be sent up to 60 seconds earlier than specified"


def margin_seconds(save_s: float, step_s: float, slack_s: float, signal_s: float = 0.0) -> float:
    """Seconds before the end at which training must stop: one save, one step and the slack,
    and no less than the job's --signal lead (``signal_s``, 0: none) as early as Slurm may send
    it, plus the step Megatron finishes before it looks at the clock."""
    margin = save_s + step_s + slack_s
    if signal_s > 0:
        margin = max(margin, signal_s + SIGNAL_EARLY_S + step_s)
    return margin


def exit_minutes(remaining_s: int, margin_s: float) -> int:
    """Whole minutes of training that leave ``margin_s`` before the end (may be < 1)."""
    return int((remaining_s - margin_s) // 60)


def _fmt(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ExitRefusal(Exception):
    """No exit time for this job: the one-line message, exit ``status`` (2 bad input, 4 too
    little time left)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def exit_time(save_s: float, step_s: float, slack_s: float, signal_s: float = 0.0,
              walltime: str | None = None, no_job: bool = False,
              env: Mapping[str, str] | None = None,
              squeue: Callable[[str], str] | None = None) -> tuple[int, str]:
    """(--exit-duration-in-mins, 0 without a limit; the line that says why). Inside a job (and
    not ``no_job``) the time it has left, else ``walltime``. Raises :class:`ExitRefusal`."""
    env = os.environ if env is None else env
    margin = margin_seconds(save_s, step_s, slack_s, signal_s)
    parts = f"save {save_s:.0f} s + one step {step_s:.3g} s + slack {slack_s:.0f} s"
    if margin > save_s + step_s + slack_s:
        parts = (f"the --signal lead {signal_s:.0f} s + {SIGNAL_EARLY_S} s that Slurm may send it "
                 f"early + one step {step_s:.3g} s, more than {parts}")
    try:
        if env.get("SLURM_JOB_ID") and not no_job:
            left, source = remaining_seconds(env, squeue=squeue)
            where = f"job {env['SLURM_JOB_ID']} has"
        elif walltime is not None:
            left, source = parse_slurm_duration(walltime), f"-t {walltime}"
            where = "a job of this length would have"
        else:
            left, source, where = None, "no job and no walltime", ""
    except WalltimeError as exc:
        raise ExitRefusal(2, str(exc)) from None
    if left is None:
        return 0, f"exit time: no wall-clock limit ({source}): no --exit-duration-in-mins"
    minutes = exit_minutes(left, margin)
    if minutes < 1:
        raise ExitRefusal(4, f"{where} {_fmt(left)} left ({source}), less than one minute of "
                             f"training after the exit margin of {margin:.0f} s ({parts}): submit "
                             "with a longer -t (or lower LBP_EXIT_SLACK_S)")
    return minutes, (f"exit time: {where} {_fmt(left)} left ({source}); margin {margin:.0f} s "
                     f"({parts}) -> --exit-duration-in-mins {minutes} (Megatron saves and stops "
                     f"{_fmt(left - minutes * 60)} before the end)")


def main(argv=None, env: Mapping[str, str] | None = None,
         squeue: Callable[[str], str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_lbp.launch exit-time",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save-s", type=float, required=True)
    ap.add_argument("--step-s", type=float, required=True)
    ap.add_argument("--slack-s", type=float, required=True)
    ap.add_argument("--signal-s", type=float, default=0.0,
                    help="the job's sbatch --signal lead in seconds (0: none)")
    ap.add_argument("--walltime", default=None, help="job length to plan for outside a job")
    ap.add_argument("--no-job", action="store_true",
                    help="plan for --walltime even inside a job (dry runs)")
    ap.add_argument("--resolved", default=None)
    a = ap.parse_args(argv)
    try:
        minutes, line = exit_time(a.save_s, a.step_s, a.slack_s, a.signal_s, a.walltime,
                                  a.no_job, env, squeue)
    except ExitRefusal as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.status
    print(line)
    write_resolved(a.resolved, {"EXIT_DURATION_MINS": minutes})
    return 0
