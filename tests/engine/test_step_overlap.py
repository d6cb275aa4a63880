"""The optimizer step overlapped with the backward before it and the forward after it (issue 13
items 4 and 5), on real gloo ranks.

8 ranks as 2 nodes of 4, lbp with P=2, G=4, O=8 (so the step's network hop, ``inter``,
has 2 ranks and the updated weights come back in two hops), a 3-layer tiny GPT, two
steps of two micro-batches, trained with overlap and with ``--no-hier-overlap`` in the
same ranks. Checked:

- the same losses, gradient norms (clipping is on), weights, evaluation loss and
  checkpoint pieces, each read right after the last step while its weight gathers are
  still in flight: whatever reads the weights waits for them;
- in the trace: the last micro-batch's backward issues every unit's network
  reduce-scatter (without overlap they all come after it), the step leaves each
  unit's updated-weights gather in flight, waited for only in the next step, whose
  forward issues the second hop;
- the G-group's reduce communicator is in chunk order (no transpose copy) and gloo
  takes the scaling pass, not the collective (the choice is by capability);
- seen by an observer of the collectives registered once (a second registration is
  refused): with overlap every bulk collective of the micro-batches and the step runs
  on its communicator's stream, without it none does.
"""
from __future__ import annotations

from collections import defaultdict

import json

import pytest
import torch

from megatron_lbp.engine.comm import prescale_in_collective
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, forward_loss, global_batch

WORLD, NODE, LAYERS = 8, 4, 3
N_UNITS = LAYERS + 2                       # embedding, layers, output
HIER = ["--hier-param-group-size", "2", "--hier-grad-group-size", "4",
        "--hier-optim-group-size", "8"]
SPEC = TinyGPTSpec(num_layers=LAYERS)
TRAIN = TrainSpec(steps=2, micro_batches=2)


def _right_after_training(trace_dir):
    import torch.distributed as dist

    from megatron_lbp.engine.comm import CollectiveObserver
    from megatron_lbp.testing.tiny_gpt import setup_hier

    class Where(CollectiveObserver):
        """(phase, on a stream) of every collective issued, and the hooks' order per call."""

        def __init__(self):
            self.calls, self.hooks, self.kept = [], defaultdict(list), []

        def issuing(self, call):
            self.calls.append((call.phase, call.on_stream))
            self.kept.append(call)   # alive, so that no later call reuses its id
            self.hooks[id(call)].append("issuing")

        def issued(self, call):
            self.hooks[id(call)].append("issued")

        def completed(self, call):
            self.hooks[id(call)].append("completed")

    out = {}
    for name, extra in (("on", []), ("off", ["--no-hier-overlap"])):
        trainer = setup_hier(SPEC, TRAIN, HIER + extra + [
            "--hier-trace", f"{trace_dir}/{name}-{{rank}}.jsonl"])
        model = trainer.model
        where = Where()
        model.comm.observe(where)
        try:
            model.comm.observe(where)
            twice = None
        except ValueError as e:
            twice = str(e)
        result = trainer.run(range(TRAIN.steps))
        got = {"losses": result.losses, "grad_norms": result.grad_norms,
               "in_flight": model.comm.stats.in_flight, "observed_twice": twice}
        # A checkpoint right after the step: its pieces as they are when the dict is made.
        pieces = model.sharded_state_dict()
        got["pieces"] = {k: v.data.clone() for k, v in pieces.items()
                         if torch.is_tensor(getattr(v, "data", None))}
        got["in_flight_after_save"] = model.comm.stats.in_flight
        got["weights"] = model.state_dict()
        # An evaluation forward after a fresh step (its gathers in flight again).
        trainer.run([TRAIN.steps], result=result)
        got["in_flight_before_eval"] = model.comm.stats.in_flight
        tokens = global_batch(99, 0, SPEC, TRAIN, trainer.dp_size)
        lo = trainer.dp_rank * TRAIN.micro_batch_size
        model.eval()
        with torch.no_grad():
            got["eval_loss"] = forward_loss(model, tokens[lo:lo + TRAIN.micro_batch_size]).item()
        model.train()
        model.settle()   # the end of training
        got["in_flight_at_end"] = model.comm.stats.in_flight
        got["calls"] = list(where.calls)
        got["hooks"] = sorted({tuple(h) for h in where.hooks.values()})
        got["grad_chunk_ordered"] = trainer.hier.grad_chunk_ordered
        got["folds_prescale"] = model.comm.folds_prescale("grad")
        b = model.buckets[1]
        b.ensure_grad_full()
        got["scatter_input_is_bucket"] = b.grad_scatter_input() is b.grad_full
        b.release_grad_full()
        out[name] = got
    out["rank"] = dist.get_rank()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("overlap")
    return trace_dir, run_on_ranks(_right_after_training, WORLD, str(trace_dir),
                                   rank_env=rank_location_env(NODE), timeout=600)


def _records(trace_dir, name, rank):
    return [json.loads(x) for x in (trace_dir / f"{name}-{rank}.jsonl").read_text().splitlines()]


def test_results_are_identical_with_and_without_the_overlap(ranks):
    _, out = ranks
    for got in out:
        on, off, r = got["on"], got["off"], got["rank"]
        assert on["losses"] == off["losses"], f"rank {r}: losses {on['losses']} != {off['losses']}"
        assert on["grad_norms"] == off["grad_norms"], (
            f"rank {r}: gradient norms {on['grad_norms']} != {off['grad_norms']}")
        assert on["eval_loss"] == off["eval_loss"], (
            f"rank {r}: evaluation right after a step: {on['eval_loss']} != {off['eval_loss']}")
        for what in ("weights", "pieces"):
            assert on[what].keys() == off[what].keys()
            assert sum(torch.is_tensor(v) for v in on[what].values()) > 5, on[what].keys()
            differ = [k for k in on[what] if torch.is_tensor(on[what][k])
                      and not torch.equal(on[what][k], off[what][k])]
            assert not differ, f"rank {r}: {what} taken right after a step differ: {differ[:4]}"


def test_what_reads_the_weights_waits_for_the_gathers_in_flight(ranks):
    _, out = ranks
    for got in out:
        on, off = got["on"], got["off"]
        assert on["in_flight"] > 0 and on["in_flight_before_eval"] > 0, (
            "the step left no weight gather in flight: nothing overlaps the next forward", on)
        assert on["in_flight_after_save"] == on["in_flight_at_end"] == 0, on
        assert off["in_flight"] == off["in_flight_before_eval"] == 0, off


def test_the_trace_shows_the_step_under_the_backward_and_the_next_forward(ranks):
    trace_dir, _ = ranks
    for rank in (0, 5):
        on = _records(trace_dir, "on", rank)
        off = _records(trace_dir, "off", rank)
        for rec, overlapped in ((on[1], True), (off[1], False)):
            backward_end = max(i["end_seq"] for i in rec["compute"]
                               if i["pass"] == "backward" and i["micro_batch"] == 1)
            optimizer = next(i for i in rec["compute"] if i["pass"] == "optimizer")
            reduces = [c for c in rec["collectives"] if c["phase"] == "step_reduce"]
            assert sorted(c["unit"] for c in reduces) == list(range(N_UNITS)), reduces
            assert all(c["issued_seq"] < optimizer["start_seq"] for c in reduces)
            under_backward = [c["unit"] for c in reduces if c["issued_seq"] < backward_end]
            if overlapped:
                # Each is issued with its unit's in-node reduce-scatter, in the hook where
                # the unit's last gradient arrives: the output layer's and the last layer's
                # are issued while later units' backward still runs.
                assert {N_UNITS - 1, N_UNITS - 2} <= set(under_backward), (
                    f"rank {rank}: only units {under_backward} reduced to the optimizer slices "
                    "during the last backward")
                assert all(c["async"] and c["micro_batch"] == 1 for c in reduces), reduces
            else:
                assert under_backward == [], f"rank {rank}: overlap off, yet {under_backward}"
        # Both hops of each unit's refresh (1/O -> 1/G network, then 1/G -> 1/P node, which
        # waits for the first on its stream) are issued at the end of step 1, still in flight
        # when its record is written, and waited for only after step 2 began.
        refresh = [c for c in on[0]["collectives"] if c["phase"] == "step_gather"]
        by_unit = defaultdict(list)
        for c in refresh:
            by_unit[c["unit"]].append(c)
        assert sorted(by_unit) == list(range(N_UNITS)), refresh
        for unit, (net, node) in by_unit.items():
            assert (net["family"], node["family"]) == ("inter", "grad_to_param"), by_unit[unit]
            assert node["after"] == net["id"] and net["issued_seq"] < node["issued_seq"]
            assert net["done"] is None and node["done"] is None, by_unit[unit]
        assert all(c["issued_seq"] > optimizer["start_seq"] for c in refresh
                   for optimizer in [next(i for i in on[0]["compute"]
                                          if i["pass"] == "optimizer")])
        carried = defaultdict(list)
        for c in on[1]["carried"]:
            carried[c["unit"]].append(c)
        assert sorted(carried) == list(range(N_UNITS)), on[1]["carried"]
        assert all(c["wait"] >= 0.0 for cs in carried.values() for c in cs), carried
        # A unit's forward gather in step 2 comes after its weights are back.
        for c in on[1]["collectives"]:
            if c["phase"] == "forward_gather" and c["micro_batch"] == 0:
                back = max(s["done_seq"] for s in carried[c["unit"]])
                assert back < c["issued_seq"], (rank, c)
        assert all(c["phase"] != "step_gather" or c["done"] is not None
                   for c in off[0]["collectives"]), "overlap off left a gather in flight"


def test_no_transpose_and_scaling_in_the_collective_only_where_the_backend_can(ranks):
    _, out = ranks
    for got in out:
        for name in ("on", "off"):
            g = got[name]
            assert g["grad_chunk_ordered"] and g["scatter_input_is_bucket"], (got["rank"], g)
            assert g["folds_prescale"] is False, "gloo has no PREMUL_SUM"
    # The choice is the backend's capability: NCCL (and RCCL, which is "nccl") has it.
    assert prescale_in_collective("nccl") and not prescale_in_collective("gloo")
    assert not prescale_in_collective("mpi")


def _refuses_prescale_on_gloo():
    import torch.distributed as dist

    from megatron_lbp.engine.comm import Collectives

    comm = Collectives({"grad": {"reduce": None}}, {"grad": dist.get_world_size()},
                       {"grad": "node"})
    try:
        comm.reduce_scatter(torch.zeros(1), torch.ones(2), "grad", "grad_reduce", prescale=0.5)
    except ValueError as err:
        return str(err)
    return None


def test_a_prescaled_reduce_scatter_is_refused_where_the_backend_cannot():
    for msg in run_on_ranks(_refuses_prescale_on_gloo, 2):
        assert msg and "cannot prescale" in msg, msg


def test_every_bulk_collective_runs_on_its_stream_with_overlap_and_none_without(ranks):
    _, out = ranks
    bulk = ("forward_gather", "backward_gather", "grad_reduce", "step_reduce", "step_gather")
    for got in out:
        r = got["rank"]
        for name, want in (("on", True), ("off", False)):
            calls = got[name]["calls"]
            assert {p for p, _ in calls} >= set(bulk), (r, name, sorted({p for p, _ in calls}))
            wrong = sorted({p for p, on in calls if p in bulk and on is not want})
            assert not wrong, (f"rank {r}, overlap {name}: {wrong} "
                               f"{'not ' if want else ''}on their communicators' streams")
            assert got[name]["hooks"] == [("issuing", "issued", "completed")], (
                f"rank {r}, overlap {name}: an observer heard {got[name]['hooks']}")
            assert "already observes" in (got[name]["observed_twice"] or ""), got[name]
