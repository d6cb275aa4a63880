"""Every collective the engine issues, and the bytes each one puts on each link.

:class:`Collectives` wraps the torch.distributed calls the engine needs; each
call names its group family and phase, and one path (:meth:`Collectives._issue`)
tells the registered observers (ledger, fault tracker, :class:`CommStats`, trace).
Invariants: the ledger's bytes follow the plan's ring accounting
(megatron_lbp.core.costs) exactly; a group of one rank issues nothing; gathers
and reductions run on separate communicators, each asynchronous one on its
communicator's stream; a two-rank group on gloo runs each collective as one exchange
with its receive posted first (megatron_lbp.engine.pair_exchange). Accounting:
docs/design.md.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from megatron_lbp.core.costs import LINK_CLASS_ORDER, number, ring_sent
from megatron_lbp.core.vocabulary import PHASES
from megatron_lbp.engine import faults, pair_exchange
from megatron_lbp.engine.dist_api import all_gather_single, nbytes as _nbytes
from megatron_lbp.engine.streams import Streams, StreamWork

CONTROL = "control"
ALL_PHASES = PHASES + (CONTROL,)


class CommLedger:
    """Bytes sent by this rank, per (phase, link class); exact (Fractions for all-reduce)."""

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, phase: str, link: str, nbytes: Fraction | int) -> None:
        if phase not in ALL_PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        self._bytes[(phase, link)] += Fraction(nbytes)
        self.calls[phase] += 1

    def by_phase(self) -> dict[str, dict[str, int | float]]:
        return {phase: {link: number(self._bytes.get((phase, link), Fraction(0)))
                        for link in LINK_CLASS_ORDER} for phase in ALL_PHASES}

    def by_class(self, include_control: bool = False) -> dict[str, int | float]:
        phases = ALL_PHASES if include_control else PHASES
        return {link: number(sum((self._bytes.get((p, link), Fraction(0)) for p in phases),
                                  Fraction(0)))
                for link in LINK_CLASS_ORDER}

    def reset(self) -> None:
        self._bytes.clear()
        self.calls.clear()


@dataclass
class CommStats:
    """Collectives this rank issued, and how many of them run under compute (docs/design.md §6).

    ``async_issued``: issued with async_op=True (really in flight: gloo and NCCL
    return work to wait for); ``sync_issued``: issued and completed in the call;
    ``in_flight``: asynchronous ones not yet waited for, now; ``max_in_flight``:
    the most at once. With --no-hier-overlap only ``sync_issued`` moves.
    """

    async_issued: int = 0
    sync_issued: int = 0
    in_flight: int = 0
    max_in_flight: int = 0

    def issued(self, async_op: bool) -> None:
        if not async_op:
            self.sync_issued += 1
            return
        self.async_issued += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def waited(self) -> None:
        """An asynchronous one was waited for (once)."""
        self.in_flight -= 1


@dataclass(eq=False)
class Call:
    """One collective as its observers see it, from issue to completion."""

    family: str
    phase: str
    unit: int | None
    comm: str               # the communicator's name (the trace's ``comm``)
    link: str
    nbytes: Fraction | int  # what this rank sends
    async_op: bool          # issued asynchronously (or on a stream)
    activity: faults.Activity   # what a fault diagnosis names
    on_stream: bool = False
    work: Any = None        # its work once issued asynchronously (None: done in the call)
    record: Any = None      # the schedule trace's record (set by its observer)


class CollectiveObserver:
    """Something told of every collective of one :class:`Collectives`, in program order
    (registered once: :meth:`Collectives.observe`). A hook not overridden does nothing.

    ``issuing`` runs before anything is sent (it may refuse by raising), ``calling`` on
    the thread that runs the torch.distributed call just before it (the stream's worker
    for a collective on a CPU stream), ``issued`` once it was called or submitted,
    ``waiting`` at each wait, ``completed`` once its data has landed (for a synchronous
    one: right after ``issued``)."""

    def issuing(self, call: Call) -> None:
        pass

    def calling(self, call: Call) -> None:
        pass

    def issued(self, call: Call) -> None:
        pass

    def waiting(self, call: Call, polled: bool) -> None:
        pass

    def completed(self, call: Call) -> None:
        pass


class LedgerObserver(CollectiveObserver):
    """Charges each collective's bytes to its phase and link class (the comm report)."""

    def __init__(self, ledger: CommLedger) -> None:
        self.ledger = ledger

    def issuing(self, call: Call) -> None:
        self.ledger.record(call.phase, call.link, call.nbytes)


class StatsObserver(CollectiveObserver):
    """Feeds :class:`CommStats`."""

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats

    def issued(self, call: Call) -> None:
        self.stats.issued(async_op=call.work is not None)

    def completed(self, call: Call) -> None:
        if call.work is not None:
            self.stats.waited()


class FaultObserver(CollectiveObserver):
    """Keeps the fault tracker's list of collectives in flight (what a diagnosis names) and
    hands each asynchronous one to the stall watch (NCCL; a stream's collective is watched
    where its worker runs it, :meth:`Collectives._call`)."""

    def issued(self, call: Call) -> None:
        if call.work is not None:
            faults.TRACKER.in_flight[call.activity.seq] = call.activity
            if not call.on_stream:
                faults.watch(call.work)

    def completed(self, call: Call) -> None:
        if call.work is not None:
            faults.TRACKER.in_flight.pop(call.activity.seq, None)


class InjectionObserver(CollectiveObserver):
    """The fault-injection seam (LBP_FAULT_INJECT, faults.InjectionSeam)."""

    def __init__(self, seam: faults.InjectionSeam) -> None:
        self.seam = seam

    def issuing(self, call: Call) -> None:
        self.seam.before_issue(call.phase)

    def calling(self, call: Call) -> None:
        self.seam.before_call(call.phase)

    def issued(self, call: Call) -> None:
        if call.work is not None:   # (a stream's too: the seam completes it before a kill)
            self.seam.issued(call.work)


GATHER, REDUCE = "gather", "reduce"


class Collectives:
    """The engine's only door to torch.distributed for bulk data.

    ``groups``: family -> channel ("gather" | "reduce") -> process group;
    ``comm_names``: the same keys -> the communicator's name in the trace.
    """

    def __init__(self, groups: Mapping[str, Mapping[str, Any]], sizes: Mapping[str, int],
                 links: Mapping[str, str], ledger: CommLedger | None = None,
                 comm_names: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.groups = {f: dict(by_channel) for f, by_channel in groups.items()}
        self.sizes = dict(sizes)
        self.links = dict(links)
        self.ledger = ledger or CommLedger()
        self.comm_names = {f: dict(by_channel) for f, by_channel in (comm_names or {}).items()}
        self.stats = CommStats()
        self._folds: dict[str, bool] = {}   # family -> folds_prescale
        self._exchanges: dict[str, bool] = {}   # family -> scatters_by_exchange
        self._pairs: dict[tuple[str, str], bool] = {}   # (family, channel) -> pairwise
        self._activity = {f: faults.Activity("", f, _group_ranks(next(iter(g.values()))))
                          for f, g in self.groups.items() if g}
        self._injection = faults.InjectionSeam.for_this_rank()
        # Every per-collective concern, in the order each hook runs: the bytes are charged
        # before the injection seam may refuse (as a failed send still counts), the trace
        # (registered by the wrapper) last.
        self._observers: list[CollectiveObserver] = [
            LedgerObserver(self.ledger), InjectionObserver(self._injection),
            FaultObserver(), StatsObserver(self.stats)]
        # One ordered stream per communicator, for every asynchronous collective: the
        # wrapper sets its device's.
        self.streams = Streams("cpu")
        faults.ensure_monitor()

    def stream(self, family: str, channel: str):
        """The stream of ``family``'s ``channel`` communicator (megatron_lbp.engine.streams):
        one per communicator, so families that share one share its stream and its order."""
        return self.streams[self._comm_name(family, channel)]

    def observe(self, observer: CollectiveObserver) -> None:
        """Tell ``observer`` of every collective from now on (after those registered before).
        The collectives do not depend on it."""
        if any(o is observer for o in self._observers):
            raise ValueError(f"{type(observer).__name__} already observes these collectives")
        self._observers.append(observer)

    def _comm_name(self, family: str, channel: str) -> str:
        return self.comm_names.get(family, {}).get(channel, f"{family}_{channel}")

    def _tell(self, hook: str, call: Call, *args) -> None:
        for o in self._observers:
            getattr(o, hook)(call, *args)

    def _issue(self, family: str, phase: str, collective, *args, group, async_op: bool,
               comm: str, link: str, nbytes: Fraction | int, unit: int | None = None,
               stream=None, waits=(), **kwargs):
        """Issue one collective, in program order (the observers hear of it here); a failure
        (now or at ``wait()``) becomes a diagnosed fault. On ``stream`` it runs there after
        the events ``waits`` and its work's ``wait()`` waits for the stream's event; without
        one it runs on the host (synchronously unless ``async_op``)."""
        base = self._activity.get(family)
        activity = faults.Activity(phase, family, base.ranks if base else _group_ranks(group),
                                   faults.TRACKER.next_seq(), faults.TRACKER.iteration)
        call = Call(family, phase, unit, comm, link, nbytes,
                    async_op or stream is not None, activity, on_stream=stream is not None)
        self._tell("issuing", call)
        if stream is not None:
            def run() -> None:
                self._call(call, collective, *args, group=group, async_op=False, **kwargs)

            holds = [a for a in args if isinstance(a, torch.Tensor)]
            event = stream.submit(run, waits, holds=holds, what=f"{phase} ({family})")
            work = StreamWork(event)
        else:
            # The communicator runs its collectives in the order they were issued: what its
            # stream still has queued goes first (on a GPU the communicator orders them).
            self.streams.drain(comm)
            work = self._call(call, collective, *args, group=group, async_op=async_op,
                              **kwargs)
        call.work = _TrackedWork(work, call, self) if work is not None else None
        self._tell("issued", call)
        if call.work is None:
            self._tell("completed", call)
        return call.work

    def _call(self, call: Call, collective, *args, group, async_op: bool, **kwargs):
        """Run the torch.distributed call; its work when asynchronous, else None."""
        # NCCL's wait() does not block the host: the stall watch needs a handle on every
        # collective, so a synchronous one is issued asynchronously and waited for at once.
        watch = faults.stall_watch()
        with faults.diagnosed(call.activity):
            self._tell("calling", call)
            work = collective(*args, group=group, async_op=async_op or watch is not None, **kwargs)
        if work is not None and not async_op:
            done = _TrackedWork(work, call, self, counted=False)
            watch.add(done)
            done.wait()
            work = None
        return work

    def poison_if_injected(self, grad: torch.Tensor, phase: str) -> None:
        """The fault-injection hook for gradients (LBP_FAULT_INJECT with action=nan)."""
        self._injection.poison(grad, phase)

    def _exchange(self, collective, channel: str, out: torch.Tensor, inp: torch.Tensor,
                  family: str, phase: str, total_bytes: int, async_op: bool, unit: int | None,
                  stream=None, waits=(), **kwargs):
        """One collective whose rank sends (n-1)/n of ``total_bytes`` (``inp`` may be the
        rank's own chunk of ``out``: an in-place all-gather).

        ``stream``/``waits``: run it on that stream after those events (:meth:`_submit`)."""
        n = self.sizes[family]
        if n == 1:
            if out.data_ptr() != inp.data_ptr():
                if stream is not None:
                    return _TrackedCopy(stream.submit(lambda: out.copy_(inp), waits,
                                                      holds=(out, inp), what=phase))
                out.copy_(inp)
            return None
        nbytes = ring_sent("all_gather" if channel == GATHER else "reduce_scatter",
                           total_bytes, n)
        return self._issue(family, phase, collective, out, inp,
                           group=self.groups[family][channel], async_op=async_op,
                           comm=self._comm_name(family, channel), link=self.links[family],
                           nbytes=nbytes, unit=unit, stream=stream, waits=waits, **kwargs)

    def pairwise(self, family: str, channel: str) -> bool:
        """Whether ``family``'s ``channel`` collectives run as one exchange with the receive
        posted first (megatron_lbp.engine.pair_exchange): a two-rank group on gloo."""
        key = (family, channel)
        if key not in self._pairs:
            self._pairs[key] = pair_exchange.takes(
                dist.get_backend(self.groups[family][channel]), self.sizes[family])
        return self._pairs[key]

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, family: str, phase: str,
                   async_op: bool = False, unit: int | None = None, stream=None, waits=()):
        """``stream``/``waits``: see :meth:`_exchange`."""
        collective = (pair_exchange.all_gather if self.pairwise(family, GATHER)
                      else all_gather_single())
        return self._exchange(collective, GATHER, out, inp, family, phase,
                              _nbytes(out), async_op, unit, stream=stream, waits=waits)

    def folds_prescale(self, family: str) -> bool:
        """Whether a reduce-scatter in ``family`` can multiply its inputs by a factor itself
        (``reduce_scatter(prescale=...)``): a group of more than one rank whose backend has
        PREMUL_SUM (:func:`prescale_in_collective`)."""
        if family not in self._folds:
            group = self.groups[family][REDUCE]
            self._folds[family] = (self.sizes[family] > 1
                                   and prescale_in_collective(dist.get_backend(group)))
        return self._folds[family]

    def scatters_by_exchange(self, family: str) -> bool:
        """Whether ``family``'s reduce-scatters run as an all-to-all and a local sum
        (:func:`reduce_scatter_by_exchange`): a group of more than one rank whose backend's
        own reduce-scatter sends an all-reduce's bytes (:func:`exchange_reduce_scatter`)."""
        if family not in self._exchanges:
            group = self.groups[family][REDUCE]
            self._exchanges[family] = (self.sizes[family] > 1
                                       and exchange_reduce_scatter(dist.get_backend(group)))
        return self._exchanges[family]

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, family: str, phase: str,
                       async_op: bool = False, unit: int | None = None,
                       prescale: float | None = None, stream=None, waits=()):
        """``prescale``: every rank's input multiplied by it inside the collective (NCCL's
        PREMUL_SUM: :data:`PREMUL_SUM`), instead of a separate pass over it; only where
        :meth:`folds_prescale`."""
        collective = dist.reduce_scatter_tensor
        if prescale is not None:
            if not self.folds_prescale(family):
                raise ValueError(f"the {family} group's backend cannot prescale in the "
                                 "reduce-scatter; scale the input first")
            premul = PREMUL_SUM   # looked up per call: the one seam the CPU tests replace

            def collective(out, inp, *, group, async_op):
                return premul.reduce_scatter(out, inp, prescale, group=group, async_op=async_op)
        elif self.scatters_by_exchange(family):
            collective = reduce_scatter_by_exchange
        return self._exchange(collective, REDUCE, out, inp, family, phase,
                              _nbytes(inp), async_op, unit, stream=stream, waits=waits)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, family: str, phase: str,
                   async_op: bool = False, unit: int | None = None, stream=None, waits=()):
        """Chunk i of ``inp`` (n equal chunks) goes to group rank i; chunk j of ``out`` came from j."""
        collective = (pair_exchange.all_to_all if self.pairwise(family, REDUCE)
                      else dist.all_to_all_single)
        return self._exchange(collective, REDUCE, out, inp, family, phase,
                              _nbytes(inp), async_op, unit, stream=stream, waits=waits)

    def all_reduce(self, t: torch.Tensor, family: str, phase: str,
                   op=dist.ReduceOp.SUM, async_op: bool = False, unit: int | None = None,
                   stream=None, waits=()):
        """``stream``/``waits``: see :meth:`_exchange`."""
        n = self.sizes[family]
        if n == 1:
            return None
        nbytes = ring_sent("all_reduce", _nbytes(t), n)
        collective = (pair_exchange.all_reduce
                      if self.pairwise(family, REDUCE) and pair_exchange.reduces_locally(op)
                      else dist.all_reduce)
        return self._issue(family, phase, collective, t, op=op,
                           group=self.groups[family][REDUCE], async_op=async_op,
                           comm=self._comm_name(family, REDUCE), link=self.links[family],
                           nbytes=nbytes, unit=unit, stream=stream, waits=waits)

    def broadcast(self, t: torch.Tensor, src: int, group: Any, link: str, group_size: int,
                  phase: str = CONTROL) -> None:
        """Broadcast over an arbitrary group (start-up only); charged as the root's sends."""
        if group_size > 1:
            nbytes = int(ring_sent("broadcast", _nbytes(t), group_size)) \
                if dist.get_rank() == src else 0
            self._issue("broadcast", phase, dist.broadcast, t, src=src, group=group,
                        async_op=False, comm="dp_broadcast", link=link, nbytes=nbytes)


class PremulSum:
    """NCCL's PREMUL_SUM reduce-scatter: the only backend-specific piece of folding a
    factor into the gradient reduce-scatter (everything around it is the same code on
    every backend).

    NCCL (RCCL names itself "nccl" too) multiplies each rank's input by the
    factor (in the input's dtype) as it reads it, then sums: the numbers of
    scaling first, without a pass of its own. Gloo has neither PREMUL_SUM nor AVG
    for reduce-scatters (and AVG's division after the sum would round
    differently); there the caller scales in a pass it makes anyway
    (megatron_lbp.engine.unit). The CPU tests replace :data:`PREMUL_SUM` with an
    exact gloo emulation (tests/helpers/premul_sum_gloo.py) to run the branch a GPU takes.
    """

    def available(self, backend: str) -> bool:
        return backend == "nccl" and hasattr(dist, "_make_nccl_premul_sum")

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, factor: float, *,
                       group: Any, async_op: bool):
        return dist.reduce_scatter_tensor(out, inp, op=dist._make_nccl_premul_sum(factor),
                                          group=group, async_op=async_op)


PREMUL_SUM = PremulSum()


def prescale_in_collective(backend: str) -> bool:
    """Whether reduce-scatters on a ``backend`` process group can scale their inputs
    (:class:`PremulSum`)."""
    return PREMUL_SUM.available(backend)


def exchange_reduce_scatter(backend: str) -> bool:
    """Whether reduce-scatters on a ``backend`` process group run as an all-to-all and a
    local sum (:func:`reduce_scatter_by_exchange`) instead of the backend's own.

    Gloo's reduce_scatter_tensor (torch 2.13) all-reduces the whole input and keeps
    one chunk: each rank sends 2(n-1)/n of the input, twice what a reduce-scatter
    needs and what NCCL/RCCL send, and its ring sums every chunk on every rank
    (measured with 4 ranks on one host: 1.50 x the input's bytes per rank on the
    loopback against 0.75 for all_to_all_single, and 151 ms against 50 ms for a
    38 MB fp32 input; tests/engine/test_comm_exchange.py checks the bytes). The exchange sends
    the (n-1)/n the ledger charges, so on gloo the emulated links carry the bytes the
    plan and a GPU run move. NCCL keeps its native reduce-scatter.
    """
    return backend == "gloo"


def reduce_scatter_by_exchange(out: torch.Tensor, inp: torch.Tensor, *, group: Any,
                               async_op: bool):
    """``out`` = the sum over the group of every rank's chunk ``rank`` of ``inp``: chunk i
    of ``inp`` goes to group rank i (all_to_all_single), then the n chunks received are
    summed in group-rank order when the exchange is waited for.

    The receive buffer is as large as ``inp``, as gloo's own reduce-scatter's copy of
    its input is; it lives until the wait. Returns None when synchronous.
    """
    n = dist.get_world_size(group)
    received = torch.empty_like(inp)
    if pair_exchange.takes(dist.get_backend(group), n):
        work = pair_exchange.all_to_all(received, inp, group=group, async_op=async_op)
    else:
        # Looked up per call, like every engine collective: a wrapper of torch.distributed
        # (the benchmarks' byte counters and link replay) sees the exchange.
        work = dist.all_to_all_single(received, inp, group=group, async_op=async_op)
    summed = _SumWhenReceived(work, received, out, n)
    if not async_op:
        summed.wait()
        return None
    return summed


class _SumWhenReceived:
    """The exchange of :func:`reduce_scatter_by_exchange` in flight; ``wait()`` sums."""

    __slots__ = ("_work", "_received", "_out", "_n")

    def __init__(self, work: Any, received: torch.Tensor, out: torch.Tensor, n: int) -> None:
        self._work, self._received, self._out, self._n = work, received, out, n

    def wait(self, timeout: Any = None) -> bool:
        if self._received is not None:
            if self._work is not None:
                self._work.wait()
            torch.sum(self._received.view(self._n, -1), dim=0, out=self._out.view(-1))
            self._work = self._received = None
        return True

    def is_completed(self) -> bool:
        return self._received is None or self._work is None or self._work.is_completed()


class _TrackedWork:
    """An issued collective that reports its own phase if waiting for it fails, and tells
    its observers when it is waited for and when its data has landed."""

    __slots__ = ("work", "call", "_owner", "waited", "_counted", "_polled")

    def __init__(self, work: Any, call: Call, owner: Collectives, counted: bool = True) -> None:
        self.work, self.call, self._owner, self.waited = work, call, owner, False
        self._counted = counted   # told to the observers (not the stall watch's inner handle)
        self._polled = False      # the engine's poll found it complete before its wait

    @property
    def activity(self) -> faults.Activity:
        return self.call.activity

    @property
    def record(self):
        """Its schedule trace record (None without a trace)."""
        return self.call.record

    def poll(self) -> bool:
        """The engine's non-blocking check (the stall watch's thread calls is_completed)."""
        done = bool(self.work.is_completed())
        self._polled = self._polled or done
        return done

    def wait(self) -> None:
        if self._counted:
            self._owner._tell("waiting", self.call, self._polled)
        with faults.diagnosed(self.call.activity):
            self.work.wait()
        if not self.waited and self._counted:
            self._owner._tell("completed", self.call)
        self.waited = True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _group_ranks(group: Any) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(group)) if group is not None \
            else tuple(range(dist.get_world_size()))
    except (RuntimeError, ValueError, AttributeError):  # not a live group (no ranks to name)
        return ()


class Pending:
    """An issued collective (``work`` is None once done or when it ran synchronously)
    and what to do once its data has landed."""

    def __init__(self, work: Any = None, finish: Callable[[], None] | None = None,
                 event: Any = None) -> None:
        self.work = work
        self._finish = finish
        # On a stream (megatron_lbp.engine.streams): the event after which its result is
        # complete, for a collective on another stream to wait for.
        self.event = event if event is not None else _event_of(work)

    @property
    def in_flight(self) -> bool:
        return self.work is not None or self._finish is not None

    def is_complete(self) -> bool:
        """Whether :meth:`wait` would return at once (its collective, if any, has completed):
        the engine's poll, which the schedule trace tells from a blocking wait."""
        if self.work is None:
            return True
        poll = getattr(self.work, "poll", None)
        return poll() if poll is not None else self.work.is_completed()

    def wait(self) -> None:
        work, finish, event = self.work, self._finish, self.event
        self.work = self._finish = None
        if work is not None:
            work.wait()
        if event is not None:
            event.wait()
        if finish is not None:
            finish()


def _event_of(work: Any) -> Any:
    inner = getattr(work, "work", work)
    return getattr(inner, "event", None)


class _TrackedCopy:
    """A one-rank group's "collective" on a stream: a copy, nothing on any link."""

    __slots__ = ("event", "record")

    def __init__(self, event: Any) -> None:
        self.event, self.record = event, None

    def wait(self) -> None:
        self.event.wait()

    def is_completed(self) -> bool:
        return self.event.query()
