"""A lost rank or a stuck collective: who, in which phase, one log line, and every rank exits.

Collectives mark their phase, family and ranks (:data:`TRACKER`); a rank whose
collective fails (:func:`diagnose`), or whose collective stalls (the stall watch,
on nccl or with ``LBP_FAULT_STALL_WATCH=1``), raises a flag through the job's
rendezvous store; every live rank checks in, the ranks that never do are the
lost ones, every rank prints one line naming them and the phase, and exits
within ``exit_grace_s`` (:class:`CollectiveFault`).
``LBP_FAULT_INJECT="rank=3,phase=grad_reduce,iteration=2"`` (``action=hang``
or ``nan``) is the testing aid. Details: docs/faults.md.
"""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import json
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_lbp.core import patching
from megatron_lbp.core.argv import flag_value, given

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
DEFAULT_CHECKIN_S = 15.0
INJECT_ENV = "LBP_FAULT_INJECT"
STALL_WATCH_ENV = "LBP_FAULT_STALL_WATCH"
# CleanUpOnly: an NCCL error or timeout aborts the communicators; the process stays for the verdict.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")

_PREFIX = "lbp_fault/"
_FLAG = _PREFIX + "flag"            # set once a collective failed somewhere
_WAKE = _PREFIX + "wake/"           # + rank: what that rank's monitor waits for
_DETECTORS = _PREFIX + "detectors"  # counter: the first detector coordinates
_CHECKED_IN = _PREFIX + "checked_in"
_VERDICT = _PREFIX + "verdict"
_ACKS = _PREFIX + "acks"
_CLOSING = "closing"                # a wake key's value at a normal end
_CLOSING_ACKS = _PREFIX + "closing_acks"


class CollectiveFault(RuntimeError):
    """A hierarchy collective failed; the message is the one-line diagnosis."""

    def __init__(self, message: str, lost: list[int], verdict: dict[str, Any]) -> None:
        super().__init__(message)
        self.lost = lost
        self.verdict = verdict


class RankLostError(CollectiveFault):
    """One or more ranks died (or their host did): ``lost`` names them."""


@dataclass(frozen=True)
class Activity:
    phase: str
    family: str
    ranks: tuple[int, ...]
    seq: int | None = None          # this rank's count of issued collectives, at issue
    iteration: int | None = None    # the iteration it was issued in

    def as_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "family": self.family, "ranks": list(self.ranks),
                "seq": self.seq, "iteration": self.iteration}

    def describe(self) -> str:
        if not self.ranks:
            return self.phase
        return f"{self.phase} (group '{self.family}', ranks {format_ranks(self.ranks)})"


class _Tracker:
    """What this rank's main thread is doing, for the monitor and the messages."""

    def __init__(self) -> None:
        self.iteration = 1
        self.current: Activity | None = None
        self.last: Activity | None = None
        self.issued = 0                             # collectives issued so far
        self.in_flight: dict[int, Activity] = {}    # seq -> issued asynchronously, not waited for

    def next_seq(self) -> int:
        self.issued += 1
        return self.issued

    def enter(self, activity: Activity) -> None:
        self.current = activity

    def leave(self) -> None:
        self.last, self.current = self.current or self.last, None

    def describe(self) -> str:
        if self.current is not None:
            return f"in {self.current.phase} ('{self.current.family}')"
        last = f" after {self.last.phase}" if self.last else ""
        return f"computing{last}"


TRACKER = _Tracker()


@contextmanager
def diagnosed(activity: Activity):
    """The main thread is in ``activity``: a RuntimeError in it becomes a diagnosed fault."""
    TRACKER.enter(activity)
    try:
        yield
    except RuntimeError as err:
        raise diagnose(activity, err) from err
    finally:
        TRACKER.leave()


def format_ranks(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return str(ranks)


# --- settings -------------------------------------------------------------------------------
_settings = {"checkin_s": DEFAULT_CHECKIN_S, "collective_timeout_s": DEFAULT_COLLECTIVE_TIMEOUT_S}


def configure(checkin_s: float | None = None, collective_timeout_s: float | None = None) -> None:
    if checkin_s is not None:
        _settings["checkin_s"] = float(checkin_s)
    if collective_timeout_s is not None:
        _settings["collective_timeout_s"] = float(collective_timeout_s)


def configure_from_args(args: Any) -> datetime.timedelta:
    """Take --hier-fault-checkin-s / --hier-collective-timeout-s; return the groups' timeout."""
    configure(getattr(args, "hier_fault_checkin_s", None),
              getattr(args, "hier_collective_timeout_s", None))
    return datetime.timedelta(seconds=_settings["collective_timeout_s"])


def exit_grace_s() -> float:
    """How long a rank that knows the verdict may take to exit on its own before it is ended."""
    return 2.0 * _settings["checkin_s"] + 10.0


# --- fault injection ------------------------------------------------------------------------
class Injection:
    """Kill (or hang) this process right before its first ``phase`` collective of ``iteration``."""

    def __init__(self, phase: str, iteration: int, action: str) -> None:
        self.phase, self.iteration, self.action = phase, iteration, action
        self.poisoned = False

    def poison(self, grad: Any, phase: str) -> None:
        """``action=nan``: one nan in this rank's own gradient, once, in the chosen iteration."""
        if (self.action != "nan" or self.poisoned or phase != self.phase
                or TRACKER.iteration != self.iteration):
            return
        self.poisoned = True
        print(f"[megatron-lbp] fault injection: rank {dist.get_rank()} writes a nan into its "
              f"gradient before {phase} at iteration {self.iteration} ({INJECT_ENV})",
              file=sys.stderr, flush=True)
        grad.view(-1)[0] = float("nan")

    def fires(self, phase: str) -> bool:
        """Whether :meth:`before` kills (or hangs) this rank at a ``phase`` collective now."""
        return self.action != "nan" and phase == self.phase and TRACKER.iteration == self.iteration

    def before(self, phase: str) -> None:
        if not self.fires(phase):
            return
        print(f"[megatron-lbp] fault injection: rank {dist.get_rank()} {self.action}s before "
              f"{phase} at iteration {self.iteration} ({INJECT_ENV})", file=sys.stderr, flush=True)
        if self.action == "hang":
            while True:
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)


class InjectionSeam:
    """Where the collectives meet fault injection (LBP_FAULT_INJECT); inert on a rank that
    injects nothing. It keeps the asynchronous collectives not yet waited for, so that a
    rank dies between collectives: everything issued before the chosen one is complete."""

    def __init__(self, injection: Injection | None) -> None:
        self._injection = injection
        self._unwaited: list[Any] = []

    @classmethod
    def for_this_rank(cls) -> "InjectionSeam":
        return cls(injection_for_this_rank())

    def before_issue(self, phase: str) -> None:
        if self._injection is not None and self._injection.fires(phase):
            while self._unwaited:
                self._unwaited.pop(0).wait()

    def before_call(self, phase: str) -> None:
        if self._injection is not None:
            self._injection.before(phase)

    def issued(self, tracked: Any) -> None:
        if self._injection is not None:
            self._unwaited = [w for w in self._unwaited if not w.waited] + [tracked]

    def poison(self, grad: Any, phase: str) -> None:
        if self._injection is not None:
            self._injection.poison(grad, phase)


def parse_injection(text: str) -> dict[str, Any]:
    fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    unknown = set(fields) - {"rank", "phase", "iteration", "action"}
    if unknown or not {"rank", "phase", "iteration"} <= set(fields):
        raise ValueError(f"{INJECT_ENV}={text!r}: expected rank=R,phase=P,iteration=N"
                         "[,action=kill|hang|nan]")
    action = fields.get("action", "kill")
    if action not in ("kill", "hang", "nan"):
        raise ValueError(f"{INJECT_ENV}={text!r}: action must be kill, hang or nan")
    if action == "nan" and fields["phase"] != "grad_reduce":
        raise ValueError(f"{INJECT_ENV}={text!r}: action=nan poisons a gradient, so it needs "
                         "phase=grad_reduce")
    return {"rank": int(fields["rank"]), "phase": fields["phase"],
            "iteration": int(fields["iteration"]), "action": action}


def injection_for_this_rank() -> Injection | None:
    text = os.environ.get(INJECT_ENV)
    if not text or not dist.is_initialized():
        return None
    spec = parse_injection(text)
    if spec["rank"] != dist.get_rank():
        return None
    return Injection(spec["phase"], spec["iteration"], spec["action"])


# --- the monitor ----------------------------------------------------------------------------
class _Monitor:
    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.lock = threading.Lock()
        self.checked_in = False
        self.verdict: dict[str, Any] | None = None
        self.reported = False
        self.thread = threading.Thread(target=self._watch, name="lbp-fault-monitor", daemon=True)

    def check_in(self, store: Any, record: dict[str, Any]) -> None:
        with self.lock:
            if self.checked_in:
                return
            self.checked_in = True
        store.set(f"{_PREFIX}in/{self.rank}", json.dumps(record))
        store.add(_CHECKED_IN, 1)

    def report(self, line: str) -> None:
        """Print this rank's one line, once, whichever thread learns the verdict first."""
        with self.lock:
            if self.reported:
                return
            self.reported = True
        print(line, file=sys.stderr, flush=True)

    def _watch(self) -> None:
        try:
            store = self.store.clone()  # its own connection: a blocking wait stalls nobody
            wake = _WAKE + str(self.rank)
            while True:
                try:
                    store.wait([wake], datetime.timedelta(days=1))
                    break
                except RuntimeError as err:
                    if "timeout" not in str(err).lower():
                        raise
            if store.get(wake).decode() == _CLOSING:
                store.add(_CLOSING_ACKS, 1)
                return
            self.check_in(store, _record(self.rank, waiting_on()))
            store.wait([_VERDICT], datetime.timedelta(seconds=_settings["checkin_s"] + 30))
            self.verdict = json.loads(store.get(_VERDICT))
            store.add(_ACKS, 1)
        except Exception:  # noqa: BLE001 - the store went away: the main thread will see why
            return
        # Said now, wherever the main thread will fail (maybe outside the engine).
        self.report(verdict_line(self.verdict, self.rank))
        # Backstop: the main thread normally raises within seconds; if it is stuck
        # elsewhere (a collective outside the engine, interpreter shutdown), end it.
        faulthandler.dump_traceback_later(exit_grace_s() + 10.0, exit=True)
        time.sleep(exit_grace_s())
        print(f"[megatron-lbp] rank {self.rank}: still running {exit_grace_s():g} s after the "
              "verdict; exiting (where each thread was:)", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(3)


_monitor: _Monitor | None = None


def ensure_monitor() -> None:
    """Start this rank's monitor once torch.distributed is up (no-op on one rank)."""
    global _monitor
    if _monitor is not None or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    store = dist.distributed_c10d._get_default_store()
    _monitor = _Monitor(store, dist.get_rank(), dist.get_world_size())
    _monitor.thread.start()
    if dist.get_backend() == "nccl" or os.environ.get(STALL_WATCH_ENV) == "1":
        global _stall_watch
        _stall_watch = _StallWatch(_settings["collective_timeout_s"] / 2.0)
        _stall_watch.thread.start()
    # A thread still blocked inside the store client when the interpreter tears
    # down C++ state aborts the process ("terminate called"): release it first.
    atexit.register(_stop_monitor, _monitor)
    if dist.get_rank() == 0:
        # Rank 0's store leaves with it: release the monitors first, or each of them
        # logs a lost connection at every normal end. Python's exit runs atexit;
        # a multiprocessing child (the test harness) runs only its finalizers.
        atexit.register(_announce_closing, store, dist.get_world_size())
        multiprocessing.util.Finalize(None, _announce_closing, (store, dist.get_world_size()),
                                      exitpriority=0)


def _stop_monitor(mon: _Monitor) -> None:
    if not mon.thread.is_alive() or mon.checked_in:
        return  # already done, or busy with a fault (then it ends the process itself)
    try:
        mon.store.set(_WAKE + str(mon.rank), _CLOSING)
        mon.thread.join(timeout=2.0)
    except Exception:  # noqa: BLE001 - the store is gone, and with it the blocked wait
        pass


def _announce_closing(store: Any, world: int) -> None:
    try:
        if store.check([_FLAG]):
            return
        store.multi_set([_WAKE + str(r) for r in range(world)], [_CLOSING] * world)
        deadline = time.monotonic() + 2.0
        while store.add(_CLOSING_ACKS, 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - nothing to tell anyone then
        pass


# --- NCCL: the stall watch ------------------------------------------------------------------
class _StallWatch:
    """Collectives issued and not yet completed on the device, oldest first; one that is
    older than ``window_s`` is diagnosed from this thread (the main thread may sit in a
    device synchronisation that only NCCL's watchdog would end)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.poll_s = min(1.0, window_s / 20.0)
        self.lock = threading.Lock()
        self.pending: list[tuple[float, Any]] = []  # (issued at, tracked work), oldest first
        self.thread = threading.Thread(target=self._run, name="lbp-stall-watch", daemon=True)

    def add(self, tracked: Any) -> None:
        with self.lock:
            self._drop_completed()
            self.pending.append((time.monotonic(), tracked))

    def oldest(self) -> tuple[float, Any] | None:
        """The oldest collective not completed yet."""
        with self.lock:
            self._drop_completed()
            return self.pending[0] if self.pending else None

    def _drop_completed(self) -> None:
        # All of them, not only from the left: a work holds its tensors, and a slow
        # collective on one communicator must not keep faster ones' buffers alive.
        self.pending = [(at, t) for at, t in self.pending if not _completed(t)]

    def _run(self) -> None:
        while _monitor is None or _monitor.verdict is None:
            time.sleep(self.poll_s)
            head = self.oldest()
            if head is None or time.monotonic() - head[0] <= self.window_s:
                continue
            issued, tracked = head
            act = tracked.activity
            diagnose(act, TimeoutError(
                f"Timed out: {act.phase} not completed {time.monotonic() - issued:.0f} s after it "
                f"was issued (stall window: half of --hier-collective-timeout-s "
                f"{2 * self.window_s:g} s)"))
            return


def _completed(tracked: Any) -> bool:
    try:
        return bool(tracked.is_completed())
    except RuntimeError:  # failed: the main thread's wait() or next issue raises it
        return True


_stall_watch: _StallWatch | None = None


def stall_watch() -> _StallWatch | None:
    """The stall watch when this backend's wait() does not block (NCCL), else None."""
    return _stall_watch


def watch(tracked: Any) -> None:
    """Hand an issued collective to the stall watch, where there is one (NCCL)."""
    if _stall_watch is not None:
        _stall_watch.add(tracked)


def waiting_on() -> Activity | None:
    """What this rank waits for: the collective its main thread is in, else (NCCL) the
    oldest one still running on the device."""
    if TRACKER.current is not None or _stall_watch is None:
        return TRACKER.current
    head = _stall_watch.oldest()
    return head[1].activity if head is not None else None


def prepare_backend_environment(argv, environ) -> list[str]:
    """Before any process group: the NCCL setting the verdict needs (--hier-partition on nccl).

    Returns the lines to print: what was set, or why a value the user set
    defeats the verdict.
    """
    if not given(argv, "--hier-partition") or (flag_value(argv, "--distributed-backend")
                                               or "nccl") != "nccl":
        return []
    name, value = NCCL_ERROR_HANDLING
    if name not in environ:
        environ[name] = value
        return [f"[megatron-lbp] setting {name}={value} (CleanUpOnly): an NCCL error or timeout "
                "aborts the communicators but leaves the process, so the survivors can name "
                "the lost rank before exiting"]
    if environ[name] != value:
        return [f"[megatron-lbp] warning: {name}={environ[name]} (set in the environment): an "
                "NCCL error may end this process before the survivors name the lost rank; "
                f"{name}={value} lets them"]
    return []


def check_timing(backend: str, collective_timeout_s: float, checkin_s: float) -> None:
    """On NCCL the verdict must be out before the watchdog's timeout: one line if it cannot."""
    if backend != "nccl" and os.environ.get(STALL_WATCH_ENV) != "1":
        return
    need = 2.0 * (checkin_s + 10.0)
    if collective_timeout_s < need:
        raise ValueError(
            f"--hier-collective-timeout-s {collective_timeout_s:g} is too short with "
            f"--hier-fault-checkin-s {checkin_s:g} on {backend}: a stuck collective is "
            f"diagnosed after half of it ({collective_timeout_s / 2:g} s) plus the check-in, "
            f"and that verdict must come before NCCL's watchdog timeout; use at least {need:g}")


# --- diagnosis ------------------------------------------------------------------------------
# Order of the collectives within one iteration: a rank that never joined an
# earlier one cannot have been lost in a later one.
PHASE_ORDER = ("forward_gather", "backward_gather", "grad_reduce", "step_reduce", "control",
               "step_gather")


def _record(rank: int, activity: Activity | None, error: str | None = None) -> dict[str, Any]:
    in_flight = TRACKER.in_flight.copy()  # one C call: safe against the main thread's edits
    return {"rank": rank, "iteration": TRACKER.iteration,
            "doing": f"in {activity.phase}" if activity else TRACKER.describe(),
            "activity": None if activity is None else activity.as_dict(),
            "in_flight": [a.as_dict() for _, a in sorted(in_flight.items())],
            "error": error}


def _issue_order(record: dict[str, Any], activity: dict[str, Any]) -> tuple:
    """When ``activity`` was issued; older records without issue numbers go by phase."""
    iteration = activity.get("iteration") or record["iteration"]
    seq = activity.get("seq")
    return (iteration, float("inf") if seq is None else seq, _phase_rank(activity["phase"]))


def diagnose(activity: Activity, error: BaseException) -> CollectiveFault:
    """Turn a failed collective into one diagnosed fault (printed once); the caller raises it."""
    rank = dist.get_rank()
    mon = _monitor
    verdict = mon.verdict if mon is not None and mon.verdict is not None else \
        _coordinate(activity, error, rank)
    line = verdict_line(verdict, rank)
    if mon is not None:
        mon.report(line)
        # However this rank got here, it may not outlive the verdict for long.
        faulthandler.dump_traceback_later(exit_grace_s() + 10.0, exit=True)
    else:
        print(line, file=sys.stderr, flush=True)
    cls = RankLostError if verdict["lost"] else CollectiveFault
    return cls(line, verdict["lost"], verdict)


def _coordinate(activity: Activity, error: BaseException, rank: int) -> dict[str, Any]:
    message = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    record = _record(rank, activity, message)
    mon = _monitor
    try:
        store = dist.distributed_c10d._get_default_store()
        if mon is not None:
            mon.check_in(store, record)
        # Also when the monitor checked in first: the error is what the verdict may quote.
        store.set(f"{_PREFIX}error/{rank}", json.dumps(record))
        first = store.add(_DETECTORS, 1) == 1
        store.set(_FLAG, "fault")
        world = dist.get_world_size()
        store.multi_set([_WAKE + str(r) for r in range(world)], ["fault"] * world)
        if first:
            return _decide(store, record)
        try:
            store.wait([_VERDICT], datetime.timedelta(seconds=_settings["checkin_s"] + 30))
        except RuntimeError as err:
            if "timeout" not in str(err).lower():
                raise
            return _decide(store, record)  # the coordinator went silent: decide here
        return json.loads(store.get(_VERDICT))
    except Exception as err:  # noqa: BLE001 - the store itself is gone
        return {"lost": [0], "where": record, "store_lost": True,
                "store_error": str(err).splitlines()[0][:200], "alive": {},
                "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"}


def _decide(store: Any, record: dict[str, Any]) -> dict[str, Any]:
    world = dist.get_world_size()
    deadline = time.monotonic() + _settings["checkin_s"]
    while store.add(_CHECKED_IN, 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = {}
    for r in range(world):
        key = f"{_PREFIX}in/{r}"
        if store.check([key]):
            alive[r] = json.loads(store.get(key))
    lost = [r for r in range(world) if r not in alive]
    # The collective a lost rank never joined: the earliest-issued one with it that a
    # survivor is blocked in or has in flight (detection order between survivors is a
    # race; issue order is the same on every rank).
    waiting = [(a, act) for a in alive.values()
               for act in ([a["activity"]] if a["activity"] else []) + a.get("in_flight", [])
               if set(act["ranks"]) & set(lost)]
    first = min(waiting, key=lambda w: _issue_order(*w), default=None)
    where = ({**first[0], "activity": first[1], "iteration": _issue_order(*first)[0]}
             if first else None) or (_timed_out(store, world) if not lost else None) or record
    same = (lambda act: act.get("seq") == where["activity"].get("seq")
            if where["activity"].get("seq") is not None
            else act["phase"] == where["activity"]["phase"])
    verdict = {"lost": lost, "where": where, "store_lost": False,
               "waited_by": sorted({a["rank"] for a, act in waiting if same(act)}),
               "alive": {str(r): a["doing"] for r, a in alive.items()},
               "checkin_s": _settings["checkin_s"]}
    store.set(_VERDICT, json.dumps(verdict))
    # Stay (and keep the store up, when this is rank 0) until every live rank's
    # monitor has read it: a rank that learns it later may no longer reach the store.
    try:
        deadline = time.monotonic() + 5.0
        while store.add(_ACKS, 0) < len(alive) and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - the store host left after reading it: fine
        pass
    return verdict


def _timed_out(store: Any, world: int) -> dict[str, Any] | None:
    """Nobody lost: the collective that timed out says most. Its peers may only have seen
    the connection the timed-out rank closed, and may have reported first; wait briefly."""
    deadline = time.monotonic() + 2.0
    while True:
        for r in range(world):
            key = f"{_PREFIX}error/{r}"
            if store.check([key]):
                rec = json.loads(store.get(key))
                if "Timed out" in (rec["error"] or ""):
                    return rec
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _phase_rank(phase: str) -> int:
    return PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER)


def verdict_line(verdict: dict[str, Any], rank: int) -> str:
    where = verdict["where"]
    act = where["activity"]
    place = Activity(act["phase"], act["family"], tuple(act["ranks"])).describe()
    if verdict.get("store_lost") and verdict.get("agent_store"):
        return (f"[megatron-lbp] rank {rank}: {place} failed at iteration {where['iteration']} "
                f"and torchrun's rendezvous store no longer answers ({verdict['store_error']}): "
                "which rank was lost is unknown; exiting")
    if verdict.get("store_lost"):
        return (f"[megatron-lbp] rank {rank} lost rank(s) [0] during {place} at iteration "
                f"{where['iteration']}: the rendezvous store rank 0 hosts no longer answers "
                f"({verdict['store_error']}); exiting")
    if verdict["lost"]:
        return (f"[megatron-lbp] rank {rank} lost rank(s) {verdict['lost']} during {place} at "
                f"iteration {where['iteration']} (waited for by rank(s) {verdict['waited_by']}; "
                f"no check-in within {verdict['checkin_s']:g} s); exiting")
    by_doing: dict[str, list[int]] = {}
    for r, doing in verdict["alive"].items():
        by_doing.setdefault(doing, []).append(int(r))
    ranks = "; ".join(f"{format_ranks(rs)} {doing}" for doing, rs in sorted(by_doing.items()))
    return (f"[megatron-lbp] rank {rank}: {place} failed at iteration {where['iteration']} "
            f"({where['error']}) but every rank is alive; ranks: {ranks}; exiting")


# --- collectives outside the engine ----------------------------------------------------------
OUTSIDE = Activity("a collective outside the engine", "", ())


EXCEPTHOOK = patching.declare(
    __name__, "lost peer excepthook", "sys:excepthook", "--hier-partition runs (wrap_model)",
    "a lost peer seen in Megatron's own collectives is named before the traceback")


def install_excepthook() -> None:
    """Diagnose a peer's loss that surfaced in a collective the engine does not issue
    (Megatron's loss and timer reductions) before Python prints the traceback."""
    def make(previous):
        def hook(exc_type, exc, tb):
            if _monitor is not None and _is_comm_error(exc):
                try:
                    diagnose(OUTSIDE, exc)
                except Exception:  # noqa: BLE001 - the traceback below still says what failed
                    pass
            previous(exc_type, exc, tb)
        return hook

    patching.apply(EXCEPTHOOK, make)


def _is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, CollectiveFault) or not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        key in text for key in ("gloo", "NCCL", "Connection reset", "Connection closed",
                                "Timed out"))
