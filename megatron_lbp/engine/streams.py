"""Ordered streams for the step's collectives, and the events that order them across streams.

Every asynchronous collective runs on its communicator's stream; a hop that reads
another communicator's output waits for that hop's event; the compute waits for
an event only where it uses the data. :class:`DeviceStream` (GPU: a torch.Stream,
no host sync) and :class:`WorkerStream` (CPU/gloo: one ordered worker thread).
Invariants: nothing is issued because the host saw something finish, so every
rank issues the same collectives in the same order; a buffer a task holds is
freed only after its event (:func:`check_free` raises :class:`BufferInFlight`).
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch


class BufferInFlight(RuntimeError):
    """A buffer was freed or overwritten while a task on a stream still reads or writes it."""


_held_lock = threading.Lock()
_held: dict[int, list[str]] = {}     # storage data_ptr -> names of the tasks holding it


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def check_free(tensor: torch.Tensor | None, what: str) -> None:
    """Refuse to free or overwrite ``tensor`` while a stream task holds its storage."""
    if tensor is None or tensor.untyped_storage().nbytes() == 0:
        return
    with _held_lock:
        holders = _held.get(_storage_key(tensor))
        if holders:
            raise BufferInFlight(f"{what} freed or overwritten while {holders[0]} still uses it "
                                 "(wait for its event first)")


class CpuEvent:
    """Set once its task is done (or failed: :meth:`wait` raises the task's error)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """The current stream (the host, on CPU) waits for it."""
        self._done.wait()
        if self.error is not None:
            raise self.error

    def block(self) -> None:
        """The host waits for it (the same on CPU)."""
        self.wait()


class DeviceEvent:
    def __init__(self, event: Any) -> None:
        self.event = event

    def query(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        """The current stream waits for it; the host does not."""
        torch.accelerator.current_stream().wait_event(self.event)

    def block(self) -> None:
        self.event.synchronize()


class WorkerStream:
    """One ordered worker thread: tasks run one after another, in submission order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._last: CpuEvent | None = None     # the event of the task submitted last

    def submit(self, fn: Callable[[], Any], waits: Sequence[Any] = (),
               holds: Iterable[torch.Tensor | None] = (), what: str = "") -> CpuEvent:
        event = CpuEvent()
        keys = [_storage_key(t) for t in holds if t is not None]
        label = f"{what or 'a task'} on stream {self.name}"
        with _held_lock:
            for k in keys:
                _held.setdefault(k, []).append(label)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"lbp-stream-{self.name}",
                                            daemon=True)
            self._thread.start()
        self._tasks.put((fn, list(waits), keys, label, event))
        self._last = event
        return event

    def drain(self) -> None:
        """The host waits until every task submitted so far has run (a failed one's error
        stays with its event)."""
        if self._last is not None:
            self._last._done.wait()

    def close(self) -> None:
        """The worker ends once the tasks submitted before have run."""
        if self._thread is not None:
            self._tasks.put(None)

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            fn, waits, keys, label, event = task
            error = None
            try:
                for w in waits:
                    w.wait()
                fn()
            except BaseException as e:   # raised where the event is waited for
                error = e
            finally:
                with _held_lock:
                    for k in keys:
                        holders = _held.get(k, [])
                        if label in holders:
                            holders.remove(label)
                        if not holders:
                            _held.pop(k, None)
                event.set(error)


class DeviceStream:
    """A stream of the accelerator: tasks are enqueued on it from the host, at once."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.stream = torch.Stream(device=device)

    def submit(self, fn: Callable[[], Any], waits: Sequence[Any] = (),
               holds: Iterable[torch.Tensor | None] = (), what: str = "") -> DeviceEvent:
        compute = torch.accelerator.current_stream()
        self.stream.wait_stream(compute)     # the inputs were written on the compute stream
        for w in waits:
            self.stream.wait_event(w.event)
        with self.stream:
            fn()
        # A buffer allocated on the compute stream and dropped by the host before this
        # stream is done with it (a packed send buffer) is not reused until it is.
        for t in holds:
            if t is not None:
                t.record_stream(self.stream)
        return DeviceEvent(self.stream.record_event())

    def drain(self) -> None:
        """Nothing: a communicator runs its collectives in the order the host enqueued them,
        whatever the stream."""


class Streams:
    """The streams of one engine, one per communicator, created on first use."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._streams: dict[str, Any] = {}
        # An engine that goes away ends its workers (a test builds many in one process).
        weakref.finalize(self, _close_all, self._streams)

    def __getitem__(self, name: str):
        s = self._streams.get(name)
        if s is None:
            s = (DeviceStream(name, self.device) if _is_accelerator(self.device)
                 else WorkerStream(name))
            self._streams[name] = s
        return s


    def drain(self, name: str) -> None:
        """Before a collective on ``name``'s communicator runs on the host: what its stream
        still holds goes first (:meth:`WorkerStream.drain`)."""
        s = self._streams.get(name)
        if s is not None:
            s.drain()


def _close_all(streams: dict[str, Any]) -> None:
    for s in streams.values():
        if isinstance(s, WorkerStream):
            s.close()


def _is_accelerator(device: torch.device) -> bool:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc is not None and device.type == acc.type


class StreamWork:
    """A collective submitted to a stream, seen as torch.distributed work: ``wait()`` makes
    the current stream (on CPU: the host) wait for its event."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self, timeout: Any = None) -> bool:
        self.event.wait()
        return True

    def is_completed(self) -> bool:
        return self.event.query()
