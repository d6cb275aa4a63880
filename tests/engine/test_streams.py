"""The CPU streams (megatron_lbp.engine.streams): ordered workers, events across streams,
errors raised where waited for, and buffers held until their task is done."""
from __future__ import annotations

import threading

import pytest
import torch

from megatron_lbp.engine.streams import (BufferInFlight, CpuEvent, Streams, WorkerStream,
                                         check_free)


def test_a_stream_runs_in_submission_order_and_waits_for_another_streams_event():
    streams = Streams("cpu")
    a, b = streams["a"], streams["b"]
    assert isinstance(a, WorkerStream) and streams["a"] is a
    gate = threading.Event()
    ran = []
    first = a.submit(lambda: (gate.wait(), ran.append("a1")))
    # b's task waits for a's first: submitted now, it runs only after
    second = b.submit(lambda: ran.append("b1"), waits=[first])
    third = a.submit(lambda: ran.append("a2"))
    assert not second.query() and ran == [], "the host submitted without waiting"
    gate.set()
    third.wait()
    second.wait()
    assert ran.index("a1") < ran.index("a2") and ran.index("a1") < ran.index("b1"), ran


def test_a_failed_task_raises_where_its_event_is_waited_for_and_its_consumers_fail_too():
    s, t = WorkerStream("fails"), WorkerStream("after")

    def boom():
        raise RuntimeError("collective failed")

    ev = s.submit(boom)
    consumer = t.submit(lambda: None, waits=[ev])
    with pytest.raises(RuntimeError, match="collective failed"):
        ev.wait()
    with pytest.raises(RuntimeError, match="collective failed"):
        consumer.wait()
    s.submit(lambda: None).wait()   # the stream goes on


def test_a_buffer_is_refused_while_a_task_holds_it_and_released_when_it_is_done():
    s = WorkerStream("holds")
    buf, other = torch.zeros(8), torch.zeros(8)
    gate = CpuEvent()
    ev = s.submit(lambda: buf.add_(1.0), waits=[gate], holds=[buf], what="the sum")
    with pytest.raises(BufferInFlight, match="the sum on stream holds"):
        check_free(buf[2:], "a view of the buffer")   # the storage counts, not the view
    check_free(other, "another buffer")
    gate.set()
    ev.wait()
    check_free(buf, "the buffer")
    assert torch.equal(buf, torch.ones(8))


def test_the_workers_end_with_the_streams_that_own_them():
    import gc

    streams = Streams("cpu")
    ev = streams["x"].submit(lambda: None)
    ev.wait()
    thread = streams["x"]._thread
    assert thread.is_alive()
    del streams, ev
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive(), "a worker outlived its streams"


def test_drain_returns_once_everything_submitted_before_has_run():
    s = WorkerStream("drained")
    gate, ran = threading.Event(), []
    s.submit(lambda: (gate.wait(), ran.append(1)))
    s.submit(lambda: ran.append(2))
    done = threading.Event()
    t = threading.Thread(target=lambda: (s.drain(), done.set()))
    t.start()
    assert not done.wait(0.2), "drain returned while a task was still queued"
    gate.set()
    t.join(timeout=30)
    assert done.is_set() and ran == [1, 2], ran
    WorkerStream("never used").drain()   # nothing submitted: returns at once
