"""The step's program (megatron_lbp.core.program): its collectives, their streams and
dependencies, its buffers, for each knob; pure, no ranks."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest

from megatron_lbp.core import program as pg

LBP = {"param": 2, "secondary": 4, "grad": 4, "inter": 2, "replica": 2, "grad_to_param": 2,
       "optim": 8}
KINDS = ("embedding", "layer", "layer", "layer", "output")
SPLIT = ("embedding", "attention", "mlp", "attention", "mlp", "output")


def _program(**kw):
    kw.setdefault("unit_kinds", KINDS)
    kw.setdefault("group_sizes", LBP)
    return pg.step_program(pg.ProgramSpec(**kw))


def _issues(prog, **match):
    return [op for op in prog.issues() if all(getattr(op, k) == v for k, v in match.items())]


def test_one_layer_listing_is_its_collectives_streams_and_dependencies():
    prog = _program(tied_embedding=True)
    got = [(op.phase, op.comm, tuple(prog.ops[w].comm for w in op.waits))
           for op in _issues(prog, unit=2)]
    assert got == [
        ("forward_gather", "param_gather", ("grad_to_param_gather",)),  # the last refresh
        ("backward_gather", "secondary_gather", ()),
        ("grad_reduce", "grad_reduce", ()),
        ("step_reduce", "inter_reduce", ("grad_reduce",)),
        ("step_reduce", "replica_reduce", ("inter_reduce",)),
        ("step_gather", "inter_gather", ()),
        ("step_gather", "grad_to_param_gather", ("inter_gather",)),
    ], prog.listing(2)
    forward_gather = _issues(prog, unit=2, phase="forward_gather")[0]
    refresh = _issues(prog, unit=2, family="grad_to_param")[0]
    assert forward_gather.waits == (refresh.index,), "the previous step's refresh"


def test_a_family_of_one_rank_issues_nothing_and_int8_families_exchange():
    sizes = dict(LBP, inter=1, replica=1, grad_to_param=1, secondary=0)
    prog = _program(group_sizes=sizes, quantized_grad_families=("grad",))
    assert {op.family for op in prog.issues()} == {"param", "grad", "optim"}
    assert {op.collective for op in _issues(prog, family="grad")} == {"all_to_all"}
    # without a secondary copy the backward gathers come from the P-group again
    assert {op.family for op in _issues(prog, phase="backward_gather")} == {"param"}


@pytest.mark.parametrize("d", [0, 1, 2])
def test_prefetch_issues_the_next_units_gathers_at_the_current_ones_point(d):
    prog = _program(prefetch_units=d)
    forward = _issues(prog, phase="forward_gather", micro_batch=0)
    assert [op.unit for op in forward] == list(range(len(KINDS)))
    for op in forward:
        assert op.at == max(0, op.unit - d), (d, op.text(), op.at)


def test_without_overlap_nothing_is_prefetched_and_the_step_reduces_in_the_step():
    prog = _program(overlap=False, prefetch_units=2)
    assert all(op.at == op.unit for op in _issues(prog, phase="forward_gather"))
    assert {op.segment for op in _issues(prog, phase="step_reduce")} == {pg.STEP}
    # and every reduce-scatter is waited for at its own point
    for op in _issues(prog, phase="grad_reduce"):
        waits = [w for w in prog.ops if w.action == "wait" and w.waits == (op.index,)]
        assert [w.at for w in waits] == [op.at], op.text()


@pytest.mark.parametrize("r", [1, 2, 3])
def test_pending_reduces_never_exceed_the_bound_and_the_last_backward_starts_the_step(r):
    prog = _program(max_pending_reduces=r, micro_batches=2)
    open_ = set()
    for op in prog.ops:
        if op.action == "issue" and op.phase == "grad_reduce":
            open_.add(op.index)
            assert len(open_) <= r + 1, op.text()
        elif op.action == "wait":
            open_.discard(op.waits[0])
    step = _issues(prog, phase="step_reduce")
    assert {(op.segment, op.micro_batch) for op in step} == {(pg.BACKWARD, 1)}
    # each unit's network reduction waits for that unit's last reduce-scatter, not an earlier one
    for op in _issues(prog, phase="step_reduce", family="inter"):
        (producer,) = [prog.ops[w] for w in op.waits]
        assert (producer.phase, producer.unit, producer.micro_batch) == \
            ("grad_reduce", op.unit, 1), op.text()
        # issued at once, in the same hook, its stream waiting for the reduce-scatter's
        # event: not where the host later waits for the reduce-scatter
        assert op.at == producer.at and not any(
            o.action == "wait" and o.waits == (producer.index,)
            for o in prog.ops[producer.index:op.index]), op.text()


def test_two_hop_qgz_issues_both_hops_at_once_the_second_after_the_first():
    sizes = {"param": 8, "secondary": 4, "grad": 8, "optim": 8, "grad_cross": 2}
    prog = _program(group_sizes=sizes, quantized_grad_families=("grad",), micro_batches=2)
    hop1 = _issues(prog, phase="grad_reduce", family="secondary")
    hop2 = _issues(prog, phase="grad_reduce", family="grad_cross")
    assert len(hop1) == len(hop2) == 2 * len(KINDS), prog.listing(1)
    for first, second in zip(hop1, hop2):
        assert second.waits == (first.index,) and second.comm == "grad_cross_reduce", \
            (first.text(), second.text())
        assert (second.at, second.micro_batch, second.unit) == \
            (first.at, first.micro_batch, first.unit), second.text()
        between = prog.ops[first.index + 1:second.index]
        assert all(o.action == "alloc" for o in between), [o.text() for o in between]
    # the host waits only for hop 2 (its event comes after hop 1's)
    waited = {o.waits[0] for o in prog.ops if o.action == "wait"}
    assert waited.isdisjoint(op.index for op in hop1)
    assert {op.index for op in hop2} <= waited


def test_the_program_command_lists_one_units_collectives(capsys):
    from megatron_lbp.projection import program_cli

    assert program_cli.main(["--hier-world-size", "8", "--hier-gpus-per-node", "4",
                             "--hier-preset", "lbp", "--hier-optim-group-size", "4",
                             "--layers", "3", "--unit", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "schedule trace format" in out[0] and "unit 2 (layer) of 5 units" in out[0], out[0]
    issued = [line.split("#", 1)[1] for line in out[1:] if " issue " in line]
    comms = [line.split(" on ")[1].split()[0] for line in issued]
    assert comms == ["param_gather", "param_gather", "grad_reduce", "replica_reduce",
                     "grad_to_param_gather"], out
    with pytest.raises(SystemExit):
        program_cli.main(["--hier-world-size", "8", "--hier-gpus-per-node", "4", "--unit", "9"])
    assert "--unit=9" in capsys.readouterr().err


def test_skip_leaves_the_embedding_ungathered_for_its_own_backward():
    tied = _program(tied_embedding=True, embedding_backward_gather="skip")
    gathered = [op.at for op in _issues(tied, phase="backward_gather", unit=0)]
    assert gathered == [len(KINDS) - 1], "only for the output layer that computes with it"
    untied = _program(embedding_backward_gather="skip")
    assert not _issues(untied, phase="backward_gather", unit=0)
    assert _issues(_program(), phase="backward_gather", unit=0)


def test_split_layers_keep_the_attention_half_until_the_mlp_half_is_needed():
    prog = _program(unit_kinds=SPLIT)
    frees = {op.unit: op.at for op in prog.ops
             if op.action == "free" and op.buffer == "weights" and op.segment == pg.FORWARD}
    assert frees[1] == 2 and frees[3] == 4, frees
    assert frees[2] == 2 and frees[4] == 4, frees


@pytest.mark.parametrize("knobs", [
    dict(zip(("tied_embedding", "micro_batches", "prefetch_units", "max_pending_reduces",
              "overlap", "embedding_backward_gather", "unit_kinds"), values))
    for values in itertools.product([False, True], [1, 3], [0, 1, 2], [1, 2], [True, False],
                                    ["gather", "skip"], [KINDS, SPLIT])])
def test_every_buffer_is_freed_once_and_only_after_its_collectives_landed(knobs):
    prog = _program(**knobs)
    live = Counter()
    waited = set()
    issued_by = {}   # (unit, segment, micro_batch) -> collectives writing its gather/reduce buffers
    for op in prog.ops:
        key = (op.unit, op.segment, op.micro_batch)
        if op.action == "issue":
            assert op.index not in waited
            for w in op.waits:
                assert prog.ops[w].comm != op.comm, f"a same-stream wait: {op.text()}"
            if op.phase in ("forward_gather", "backward_gather", "grad_reduce"):
                issued_by.setdefault(key, []).append(op.index)
        elif op.action == "wait":
            assert prog.ops[op.waits[0]].action == "issue", op.text()
            waited.add(op.waits[0])
        elif op.action == "alloc":
            live[(op.buffer, op.unit)] += 1
            assert live[(op.buffer, op.unit)] == 1, f"{op.text()} twice"
        elif op.action == "free":
            assert live[(op.buffer, op.unit)] == 1, f"{op.text()} of nothing"
            live[(op.buffer, op.unit)] -= 1
            if op.buffer in ("gather", "reduce"):
                phase = {"gather": ("forward_gather", "backward_gather"),
                         "reduce": ("grad_reduce",)}[op.buffer]
                mine = [i for i in issued_by.get(key, []) if prog.ops[i].phase in phase]
                assert all(i in waited for i in mine), f"{op.text()} before its collective landed"
    assert not +live, f"never freed: {+live}"
    # every communicator's collectives are one ordered stream: the program's order
    for comm in {op.comm for op in prog.issues()}:
        seq = [op.index for op in prog.issues() if op.comm == comm]
        assert seq == sorted(seq)


def test_bad_knobs_are_refused_in_one_line():
    for bad, msg in [(dict(prefetch_units=-1), "prefetch_units"),
                     (dict(micro_batches=0), "micro_batches"),
                     (dict(max_pending_reduces=0), "max_pending_reduces"),
                     (dict(embedding_backward_gather="never"), "embedding_backward_gather")]:
        with pytest.raises(ValueError, match=msg) as e:
            _program(**bad)
        assert "\n" not in str(e.value)
