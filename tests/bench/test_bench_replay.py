"""The schedule replay (bench/replay.py) on hand-made traces whose answer is worked out by hand.

Each trace is a few events in program order; the durations are given per
collective and per compute interval, so every figure below follows from the
rules in the module docstring, step by step in the comments.
"""
import pytest

from megatron_lbp.projection.replay import ReplayError, explain, replay


def coll(phase, unit, comm, issued_seq, wait_seq, dur, family="param"):
    return {"phase": phase, "unit": unit, "family": family, "comm": comm, "link": "network",
            "bytes": 0, "async": wait_seq != issued_seq, "issued_seq": issued_seq,
            "wait_seq": wait_seq, "dur": dur}


def comp(pass_, unit, start_seq, end_seq, dur):
    return {"unit": unit, "micro_batch": 0, "pass": pass_, "start_seq": start_seq,
            "end_seq": end_seq, "dur": dur}


def record(collectives, compute, step=1, carried=()):
    return {"rank": 0, "step": step, "collectives": list(collectives),
            "compute": list(compute), "carried": list(carried)}


def run(*records):
    return replay(list(records), lambda rec, c: c["dur"], lambda rec, i: i["dur"])


def forward_two_units(second_comm):
    # issue g0, issue g1 (prefetch), wait g0, compute f0, wait g1, compute f1
    return record([coll("forward_gather", 0, "g", 1, 3, 2.0),
                   coll("forward_gather", 1, second_comm, 2, 6, 3.0)],
                  [comp("forward", 0, 4, 5, 1.0), comp("forward", 1, 7, 8, 1.0)])


def test_prefetch_on_one_communicator_queues_then_runs_ahead():
    # g0 runs [0, 2]; g1 is issued at 0 but its communicator is busy: [2, 5].
    # wait g0 at 0 -> clock 2 (2 s exposed, nothing computed before it: at once);
    # f0 -> 3; wait g1 at 3 -> 5 (2 s exposed; it stopped queueing at 2 < 3, so
    # all of it is its own link time, run ahead of f0); f1 -> 6.
    (step,), colls = run(forward_two_units("g"))
    assert step.step_s == pytest.approx(6.0) and step.compute_s == pytest.approx(2.0)
    fg = step.as_json()["phases"]["forward_gather"]
    assert fg["count"] == 2 and fg["link_s"] == pytest.approx(5.0)
    assert fg["exposed_s"] == pytest.approx(4.0)
    assert (fg["at_once_s"], fg["ahead_s"], fg["queued_s"]) == pytest.approx((2.0, 2.0, 0.0))
    g1 = next(c for c in colls if c.c["unit"] == 1)
    assert (g1.start, g1.end, g1.behind) == (2.0, 5.0, "forward_gather")


def test_prefetch_on_another_communicator_hides_behind_compute():
    # g1 runs [0, 3] at once; wait g0 -> 2; f0 -> 3; wait g1 at 3: done, 0 exposed; f1 -> 4.
    (step,), _ = run(forward_two_units("h"))
    assert step.step_s == pytest.approx(4.0)
    fg = step.as_json()["phases"]["forward_gather"]
    assert fg["exposed_s"] == pytest.approx(2.0) and fg["at_once_s"] == pytest.approx(2.0)


def test_gather_queued_behind_a_reduce_scatter_names_it():
    # r (4 s) then g (1 s) on communicator x, both issued at 0: r [0, 4], g [4, 5].
    # compute 2 s -> clock 2; wait g at 2 -> 5: 3 s exposed, of which [2, 4] queued
    # behind grad_reduce (2 s) and [4, 5] its own link time after compute (1 s ahead).
    # wait r at 5: already done.
    rec = record([coll("grad_reduce", 1, "x", 1, 5, 4.0, family="grad"),
                  coll("backward_gather", 0, "x", 2, 4, 1.0)],
                 [comp("backward", 1, 3, 3, 2.0)])
    (step,), _ = run(rec)
    assert step.step_s == pytest.approx(5.0)
    bg = step.as_json()["phases"]["backward_gather"]
    assert bg["exposed_s"] == pytest.approx(3.0)
    assert (bg["queued_s"], bg["ahead_s"], bg["at_once_s"]) == pytest.approx((2.0, 1.0, 0.0))
    assert bg["behind"] == {"grad_reduce": pytest.approx(2.0)}
    assert step.as_json()["phases"]["grad_reduce"]["exposed_s"] == 0.0
    (line,) = [ln for ln in explain(step.as_json()["phases"]) if ln.startswith("backward")]
    assert "2 s queued behind grad_reduce" in line and "1 s issued ahead" in line


def test_synchronous_collectives_add_up_and_are_exposed_at_once():
    # compute 1 s, then three synchronous collectives (issue = wait) of 0.5, 1.5 and 2 s.
    rec = record([coll("step_reduce", u, "inter", 2 + u, 2 + u, d, family="inter")
                  for u, d in enumerate((0.5, 1.5, 2.0))],
                 [comp("backward", 0, 1, 1, 1.0)])
    (step,), _ = run(rec)
    assert step.step_s == pytest.approx(5.0)
    sr = step.as_json()["phases"]["step_reduce"]
    assert sr["exposed_s"] == pytest.approx(4.0) and sr["at_once_s"] == pytest.approx(4.0)


def test_a_collective_carried_into_the_next_step_is_waited_for_there():
    # Step 1: compute 1 s, then p issued (3 s) and not waited for: step 1 ends at 1.
    # Step 2: compute 0.5 s -> 1.5; wait p (runs [1, 4]) -> 4: 2.5 s exposed, step 2 = 3 s.
    p = coll("step_gather", 0, "gather", 2, None, 3.0, family="inter")
    first = record([p], [comp("optimizer", None, 1, 1, 1.0)], step=1)
    second = record([], [comp("forward", 0, 1, 1, 0.5)], step=2,
                    carried=[dict(p, wait_seq=2)])
    s1, s2 = run(first, second)[0]
    assert s1.step_s == pytest.approx(1.0) and s2.step_s == pytest.approx(3.0)
    assert s2.as_json()["phases"]["step_gather"]["exposed_s"] == pytest.approx(2.5)
    assert "step_gather" not in s1.as_json()["phases"]
    # Alone, the carried collective counts as issued at the record's start: [0, 3].
    (alone,), _ = run(second)
    assert alone.step_s == pytest.approx(3.0)
    assert alone.as_json()["phases"]["step_gather"]["exposed_s"] == pytest.approx(2.5)


def test_bad_records_are_one_line_errors():
    with pytest.raises(ReplayError, match="no step records"):
        run()
    with pytest.raises(ReplayError, match="ranks \\[0, 1\\]"):
        run(record([], []), dict(record([], []), rank=1))
    with pytest.raises(ReplayError, match="lacks comm"):
        run(record([{"phase": "forward_gather", "unit": 0, "family": "param",
                     "issued_seq": 1, "wait_seq": 1}], []))


def test_a_phase_outside_the_ledgers_gets_its_own_row():
    # A newer engine's phase is replayed like any other: 1 s compute, then 2 s synchronous.
    rec = record([coll("step_prefetch", 0, "z", 2, 2, 2.0)], [comp("forward", 0, 1, 1, 1.0)])
    (step,), _ = run(rec)
    assert step.step_s == pytest.approx(3.0)
    row = step.as_json()["phases"]["step_prefetch"]
    assert row["exposed_s"] == pytest.approx(2.0) and row["at_once_s"] == pytest.approx(2.0)


# --- polls, triggers and needs (traces that say ``polled``, ``after`` and ``needs``) ----------

def polled(c, id_, after=None):
    return dict(c, id=id_, polled=True, after=after)


def need(id_, seq):
    return {"id": id_, "seq": seq}


def test_a_polled_collective_never_blocks_where_it_was_polled_only_where_it_is_needed():
    # r (3 s) issued at 0, polled at 0: not done, left in flight; compute 1 s -> 1 (a poll:
    # still running); its need at 1 holds the clock until 3: 2 s exposed, run ahead of the
    # compute; compute 1 s -> 4. Blocking at the poll instead (the trace without
    # ``polled``) costs 3 s at once and ends at 5.
    r = coll("grad_reduce", 1, "x", 1, 2, 3.0, family="grad")
    compute = [comp("backward", 1, 3, 3, 1.0), comp("backward", 0, 5, 5, 1.0)]
    (step,), _ = run(dict(record([polled(r, 1)], compute), needs=[need(1, 4)]))
    assert step.step_s == pytest.approx(4.0)
    gr = step.as_json()["phases"]["grad_reduce"]
    assert (gr["exposed_s"], gr["ahead_s"], gr["at_once_s"]) == pytest.approx((2.0, 2.0, 0.0))
    (blocking,), _ = run(record([r], compute))
    assert blocking.step_s == pytest.approx(5.0)
    assert blocking.as_json()["phases"]["grad_reduce"]["at_once_s"] == pytest.approx(3.0)


def test_a_polled_collective_done_by_its_need_costs_nothing():
    # r (1 s) polled at 0 (in flight), lands at the compute end at 2; its need at 2: nothing.
    r = polled(coll("grad_reduce", 1, "x", 1, 2, 1.0, family="grad"), 1)
    (step,), colls = run(dict(record([r], [comp("backward", 1, 3, 3, 2.0)]),
                              needs=[need(1, 4)]))
    assert step.step_s == pytest.approx(2.0)
    assert step.as_json()["phases"]["grad_reduce"]["exposed_s"] == 0.0
    assert colls[0].wait == pytest.approx(2.0)      # landed at the poll that found it done


def test_a_collective_after_another_starts_at_its_landing_on_its_stream():
    # g (2 s) polled at 0; s (1 s) issued at 0 after g (``after``): its stream runs it once g
    # has landed, [2, 3], whether or not the host waited; compute 1 s -> 1, 3 s -> 4; s's need
    # at 4 finds it done: nothing exposed.
    g = polled(coll("grad_reduce", 1, "g", 1, 2, 2.0, family="grad"), 1)
    s = polled(coll("step_reduce", 1, "inter", 3, 6, 1.0, family="inter"), 2, after=1)
    rec = dict(record([g, s], [comp("backward", 0, 4, 4, 1.0), comp("backward", 0, 5, 5, 3.0)]),
               needs=[need(2, 7)])
    (step,), colls = run(rec)
    assert step.step_s == pytest.approx(4.0)
    rs = next(c for c in colls if c.c["id"] == 2)
    assert (rs.issued, rs.start, rs.end) == pytest.approx((0.0, 2.0, 3.0))
    assert rs.behind == "grad_reduce"
    assert step.as_json()["phases"]["step_reduce"]["exposed_s"] == pytest.approx(0.0)


def test_a_need_of_a_held_collective_waits_for_its_trigger_then_its_own_link_time():
    # g (2 s) polled at 0; s held behind it, and polled (in flight); compute 0.5 s; s's need
    # at 0.5: g lands at 2, s runs [2, 3]: 2.5 s exposed, 1.5 of it held behind grad_reduce.
    g = polled(coll("grad_reduce", 1, "g", 1, 2, 2.0, family="grad"), 1)
    s = polled(coll("step_reduce", 1, "inter", 3, 4, 1.0, family="inter"), 2, after=1)
    rec = dict(record([g, s], [comp("backward", 0, 5, 5, 0.5)]), needs=[need(2, 6)])
    (step,), _ = run(rec)
    assert step.step_s == pytest.approx(3.0)
    sr = step.as_json()["phases"]["step_reduce"]
    assert sr["exposed_s"] == pytest.approx(2.5)
    assert sr["queued_s"] == pytest.approx(1.5) and sr["behind"] == {"grad_reduce": 1.5}


def test_what_follows_a_held_collective_on_its_communicator_waits_behind_it():
    # s is held behind g (2 s); t (1 s, on s's communicator, issued after s) must not pass
    # it: at t's blocking wait g lands at 2, s runs [2, 3], t [3, 4]: 4 s exposed, 3 of them
    # queued behind step_reduce.
    g = polled(coll("grad_reduce", 1, "g", 1, 2, 2.0, family="grad"), 1)
    s = polled(coll("step_reduce", 1, "inter", 3, 8, 1.0, family="inter"), 2, after=1)
    t = dict(coll("step_reduce", 0, "inter", 4, 5, 1.0, family="inter"), id=3)
    (step,), colls = run(record([g, s, t], []))
    assert step.step_s == pytest.approx(4.0)
    rt = next(c for c in colls if c.c["id"] == 3)
    assert (rt.start, rt.end, rt.behind) == (3.0, 4.0, "step_reduce")
    assert step.as_json()["phases"]["step_reduce"]["queued_s"] == pytest.approx(3.0)


def test_a_chain_carried_into_the_next_step_lands_by_poll_and_is_waited_for_where_needed():
    # Step 1: optimizer 1 s; r (2 s, first hop) issued at 1, runs [1, 3]; the step ends at 1.
    # Step 2: r polled at 1 (in flight); its second hop r2 (1 s) held behind it; forward
    # 0.5 s -> 1.5; r2's need: r lands at 3, r2 runs [3, 4]: 2.5 s exposed; step 2 = 3 s.
    r = dict(coll("step_gather", 0, "inter_gather", 2, None, 2.0, family="inter"), id=5,
             polled=False, after=None)
    first = record([r], [comp("optimizer", None, 1, 1, 1.0)], step=1)
    r2 = polled(coll("step_gather", 0, "node_gather", 2, 5, 1.0, family="grad_to_param"), 6,
                after=5)
    second = dict(record([r2], [comp("forward", 0, 3, 3, 0.5)], step=2,
                         carried=[dict(r, wait_seq=1, polled=True)]), needs=[need(6, 4)])
    s1, s2 = run(first, second)[0]
    assert s1.step_s == pytest.approx(1.0) and s2.step_s == pytest.approx(3.0)
    sg = s2.as_json()["phases"]["step_gather"]
    assert sg["count"] == 2 and sg["exposed_s"] == pytest.approx(2.5)


def test_a_need_of_a_collective_outside_the_records_is_ignored():
    (step,), _ = run(dict(record([], [comp("forward", 0, 1, 1, 1.0)]), needs=[need(99, 2)]))
    assert step.step_s == pytest.approx(1.0)
