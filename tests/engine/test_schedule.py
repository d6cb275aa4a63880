"""The engine's schedule on real gloo ranks, read back from its own trace.

8 ranks as 2 nodes x 2 packages x 2 GCDs, a 3-layer megatron-core GPT, lbp with
P=2, G=4, O=8 and a bf16 secondary copy with S = G = 4 (so the backward gather
and the gradient reduce-scatter run over the same ranks). Three trainers in the
same ranks, two optimizer steps of two micro-batches each:

- ``recompute``: full activation recomputation, prefetch depth 1 (defaults);
- ``depth2``: no recomputation, ``--hier-prefetch-units 2``, trace on rank 0 only;
- ``off``: no recomputation, ``--no-hier-overlap``.

What is checked: the units are the model's (embedding, each layer, output) and
the plan tool, given the same GPT shape, predicts the engine's bytes and memory
exactly; the next units' gathers are issued before the current unit computes, in
forward, backward and recomputation; gathers and reductions never share a
communicator; the trace's fields, and its bytes against the comm report; the
counters; ``bench trace`` on the files; and, recorded in the same ranks, the
reference trace of the committed traces (megatron_lbp/projection/traces): its
program structure must be the committed one's, so an engine whose schedule
changed fails here until the traces are re-recorded.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from dataclasses import asdict

import pytest

from megatron_lbp.core import costs
from megatron_lbp.launch import plan
from megatron_lbp.projection import project_replay
from megatron_lbp.projection import trace as bench_trace
from megatron_lbp.projection.structure import difference, structure
from megatron_lbp.engine.comm import ALL_PHASES
from megatron_lbp.engine.trace import ScheduleTrace, output_path
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec

WORLD = 8
NODE = 4
LAYERS = 3
HIER = ["--hier-param-group-size", "2", "--hier-grad-group-size", "4",
        "--hier-optim-group-size", "8", "--hier-secondary-group-size", "4",
        "--hier-secondary-dtype", "bf16"]
TRAIN = TrainSpec(steps=2, micro_batches=2)   # Megatron's 40M bucket size: units regardless
KINDS = ["embedding"] + ["layer"] * LAYERS + ["output"]


def _runs(trace_dir):
    import torch.distributed as dist

    from megatron_lbp.testing.tiny_gpt import setup_hier

    runs = {
        "recompute": (True, HIER + ["--hier-trace", f"{trace_dir}/recompute-{{rank}}.jsonl"]),
        "depth2": (False, HIER + ["--hier-prefetch-units", "2",
                                  "--hier-trace", f"{trace_dir}/depth2.jsonl"]),
        "off": (False, HIER + ["--no-hier-overlap",
                               "--hier-trace", f"{trace_dir}/off-{{rank}}.jsonl"]),
    }
    out = {}
    for name, (recompute, argv) in runs.items():
        trainer = setup_hier(TinyGPTSpec(num_layers=LAYERS, recompute=recompute), TRAIN, argv)
        model = trainer.model
        result = trainer.run(range(TRAIN.steps))
        steps_run = TRAIN.steps
        if name == "recompute":
            # The last step's weight gathers still run (the next forward would wait for them).
            in_flight_after_step = model.comm.stats.in_flight
            # An optimizer state load re-gathers the weights: not in the next step's
            # comm report; in its trace record only the second hop, issued under its
            # forward (in place of the hop of the step before, as big).
            trainer.optimizer.load_state_dict(trainer.optimizer.state_dict())
            trainer.run([TRAIN.steps], result=result)
            steps_run += 1
        model.settle()   # the end of training: nothing left in flight
        out[name] = {
            "losses": result.losses, "reports": result.step_reports,
            "units": model.unit_table(),
            "names": [[s.name for s in u.bucket.slots] for u in model.units],
            "stats": asdict(model.comm.stats), "steps_run": steps_run,
            # The trainer drains the samples after each micro-batch; whatever is left after.
            "samples": result.extra.get("overlap_samples", []) + model.take_overlap_samples(),
            "traced": model.trace is not None,
        }
        if name == "recompute":
            out[name]["in_flight_after_step"] = in_flight_after_step
    hier = trainer.hier
    untraced = setup_hier(TinyGPTSpec(num_layers=LAYERS), TRAIN, HIER)
    # The committed traces' reference, recorded again in these ranks (2 layers, seconds).
    project_replay.record_reference_on_rank(f"{trace_dir}/reference.jsonl")
    out["groups"] = {"secondary": hier.ranks["secondary"], "grad": hier.ranks["grad"],
                     "rank": dist.get_rank(), "untraced_has_trace": untraced.model.trace
                     is not None}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("trace")
    return trace_dir, run_on_ranks(_runs, WORLD, str(trace_dir), rank_env=rank_location_env(NODE),
                                   timeout=600)


def _records(trace_dir, name, rank=None):
    path = trace_dir / (f"{name}-{rank}.jsonl" if rank is not None else f"{name}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _plan(k=TRAIN.micro_batches, extra=()):
    return plan.plan_json(["--world-size", str(WORLD), "--gpus-per-node", str(NODE),
                           "--num-layers", str(LAYERS), "--hidden-size", "64",
                           "--vocab-size", "128", "--params-dtype", "fp32",
                           "--micro-batches", str(k), "--json", *HIER, *extra])


# --- the committed traces ----------------------------------------------------------------

def test_the_committed_traces_are_todays_engine_schedule(ranks):
    """The committed reference trace was recorded with the committed traces (one
    ``record_traces`` call): today's engine must give its program structure again."""
    assert (WORLD, NODE) == (project_replay.REFERENCE["ranks"],
                             project_replay.REFERENCE["gpus_per_node"])
    trace_dir, _ = ranks
    fresh = _records(trace_dir, "reference")
    committed = project_replay.load(project_replay.TRACES_DIR / project_replay.REFERENCE["file"])
    why = difference(structure(fresh), structure(committed))
    assert not why, (f"the engine's schedule is not the one megatron_lbp/projection/traces holds "
                     f"({why}): re-record with {project_replay.RECORD_COMMAND} "
                     f"({project_replay.RECORD_MINUTES}) and commit the directory")


# --- units -------------------------------------------------------------------------------

def test_units_are_the_models_layers_and_the_plan_predicts_them_exactly(ranks):
    _, out = ranks
    want = costs.gpt_units(LAYERS, 64, 128)   # the tiny GPT: tied embeddings, rope
    for rank, got in enumerate(out):
        run = got["recompute"]
        table = run["units"]
        assert [u["kind"] for u in table] == KINDS, table
        assert [u.get("layer") for u in table] == [None, *range(LAYERS), None], table
        assert [u["numel"] for u in table] == [n for _, n in want], (table, want)
        for u, names in zip(table, run["names"]):
            prefix = {"embedding": "embedding.", "output": "decoder.final_layernorm.",
                      "layer": f"decoder.layers.{u.get('layer')}."}[u["kind"]]
            assert all(n.startswith(prefix) for n in names), (u, names)
        # Biases and norms travel with their layer: one unit per layer, nothing else.
        assert sum(1 for u in table if u["kind"] == "layer") == LAYERS
        for name in ("recompute", "depth2", "off"):
            report = got[name]["reports"][-1]
            depth = {"recompute": 1, "depth2": 2, "off": 0}[name]
            p = _plan(extra=["--hier-prefetch-units", str(depth)] if name != "off"
                      else ["--no-hier-overlap"])
            measured = {ph: v for ph, v in report["traffic_by_phase"].items() if ph != "control"}
            assert measured == p["traffic_by_phase"], (
                f"{name} rank {rank}: engine bytes per phase and link\n {measured}\n"
                f"plan for the GPT shape\n {p['traffic_by_phase']}")
            for state in costs.MEMORY_STATES:
                assert report["memory_bytes"][state] == p["memory_bytes"][state], (name, state)
            peak = report["memory_bytes"]["peak_transient"]
            assert 0 < peak <= p["transient_bytes"]["peak"], (
                f"{name} rank {rank}: peak transient {peak} above the plan's bound "
                f"{p['transient_bytes']}")
            assert p["buckets"] == len(table) and p["padded_params"] == sum(
                u["padded_numel"] for u in table)


# --- prefetch ----------------------------------------------------------------------------

def _index(record):
    """(phase, unit, micro-batch) -> collective; (pass, unit, micro-batch) -> compute interval."""
    gathers = {}
    for c in record["collectives"]:
        if c["phase"] in ("forward_gather", "backward_gather"):
            gathers.setdefault((c["phase"], c["unit"], c["micro_batch"]), c)
    compute = {}
    for i in record["compute"]:
        compute.setdefault((i["pass"], i["unit"], i["micro_batch"]), i)
    return gathers, compute


def _assert_ahead(gathers, compute, phase, pass_, order, depth, label):
    """Unit order[i + j]'s gather was issued before order[i] started computing, j = 1..depth."""
    for mb in range(TRAIN.micro_batches):
        for i, current in enumerate(order):
            start = compute[(pass_, current, mb)]["start_seq"]
            for nxt in order[i + 1:i + 1 + depth]:
                issued = gathers[(phase, nxt, mb)]["issued_seq"]
                assert issued < start, (
                    f"{label}, micro-batch {mb}: the {phase} of unit {nxt} was issued at point "
                    f"{issued}, after unit {current}'s {pass_} began at point {start}")


def test_next_units_are_gathered_before_the_current_one_computes(ranks):
    trace_dir, _ = ranks
    layers = list(range(1, LAYERS + 1))
    for rank in (0, 5):
        # Full recomputation: forward, then each layer recomputed in backward order.
        gathers, compute = _index(_records(trace_dir, "recompute", rank)[-1])
        _assert_ahead(gathers, compute, "forward_gather", "forward", [0, *layers, 4], 1,
                      f"rank {rank} forward")
        _assert_ahead(gathers, compute, "backward_gather", "recompute", layers[::-1], 1,
                      f"rank {rank} recompute")
        # The output layer's backward already has the last layer's gather in flight.
        _assert_ahead(gathers, compute, "backward_gather", "backward", [4, LAYERS], 1,
                      f"rank {rank} backward")
    gathers, compute = _index(_records(trace_dir, "depth2")[-1])
    _assert_ahead(gathers, compute, "forward_gather", "forward", [0, *layers, 4], 2, "depth 2")
    # The tied embedding is gathered with the output layer: then layers back to front.
    _assert_ahead(gathers, compute, "backward_gather", "backward", [4, *layers[::-1]], 2,
                  "depth 2 backward")


def test_counters_and_trace_agree_on_what_ran_under_compute(ranks):
    trace_dir, out = ranks
    for rank, got in enumerate(out):
        on, off = got["recompute"], got["off"]
        assert on["stats"]["async_issued"] > 0 and on["stats"]["in_flight"] == 0, on["stats"]
        # The updated weights' gathers of a step run into the next one (issue 13 item 4).
        assert on["in_flight_after_step"] > 0, on
        assert got["depth2"]["stats"]["max_in_flight"] >= 3, got["depth2"]["stats"]
        # The next unit is in flight whenever a unit starts computing, except at the end
        # of a pass (output unit, last layer recomputed, embedding's backward).
        busy = sum(1 for s in on["samples"] if s > 0)
        per_micro_batch = 2 * len(KINDS) + LAYERS     # forward, backward, recompute
        assert len(on["samples"]) == on["steps_run"] * TRAIN.micro_batches * per_micro_batch, (
            on["steps_run"], on["samples"])
        assert busy >= len(on["samples"]) // 2, on["samples"]
        assert off["stats"] == {"async_issued": 0, "sync_issued": off["stats"]["sync_issued"],
                                "in_flight": 0, "max_in_flight": 0} and \
            off["stats"]["sync_issued"] > 0, off["stats"]
        assert set(off["samples"]) == {0}, off["samples"]
        assert got["depth2"]["losses"] == off["losses"], "prefetch depth changed the losses"
        assert got["depth2"]["traced"] == (rank == 0), "without {rank} only rank 0 traces"
        assert not got["groups"]["untraced_has_trace"]
    for rec in _records(trace_dir, "off", 3):
        assert all(not c["async"] and c["wait_seq"] == c["issued_seq"]
                   for c in rec["collectives"]), "a collective ran asynchronously with overlap off"


def test_gathers_never_share_a_communicator_with_reductions(ranks):
    trace_dir, out = ranks
    # The same members (the G-group's reduce communicator lists them in chunk order).
    assert out[0]["groups"]["secondary"] == tuple(sorted(out[0]["groups"]["grad"])), \
        out[0]["groups"]
    for rank in (0, 6):
        comms = defaultdict(set)
        for rec in _records(trace_dir, "recompute", rank):
            for c in rec["collectives"]:
                comms[c["phase"]].add(c["comm"])
        assert comms["backward_gather"] == {"secondary_gather"}, comms
        assert comms["forward_gather"] == {"param_gather"}, comms
        assert comms["grad_reduce"] == {"grad_reduce"}, comms
        gathers = comms["forward_gather"] | comms["backward_gather"] | comms["step_gather"]
        reductions = comms["grad_reduce"] | comms["step_reduce"] | comms["control"]
        assert not gathers & reductions, (gathers, reductions)


# --- the trace itself --------------------------------------------------------------------

COLLECTIVE_FIELDS = {"phase", "unit", "micro_batch", "family", "comm", "link", "bytes", "async",
                     "issued", "issued_seq", "wait", "wait_seq", "done", "done_seq",
                     "id", "polled", "after"}


def _second_hop(rec):
    """Bytes per link of a record's 1/G -> 1/P weight gathers (its own step's: issued at its
    optimizer step with the first hop, on their streams)."""
    hop = defaultdict(float)
    for c in rec["collectives"]:
        if c["phase"] == "step_gather" and c["family"] == "grad_to_param":
            hop[c["link"]] += c["bytes"]
    return hop


def test_trace_fields_and_bytes_equal_the_comm_report(ranks):
    trace_dir, out = ranks
    for rank, got in enumerate(out):
        records = _records(trace_dir, "recompute", rank)
        assert [r["step"] for r in records] == [1, 2, 3]
        # Each step's record holds both hops of its own refresh, issued at its optimizer step.
        assert all(_second_hop(r)["node"] > 0 for r in records), [_second_hop(r) for r in records]
        for rec, report in zip(records, got["recompute"]["reports"]):
            assert rec["rank"] == rank and rec["t_start"] == 0.0 < rec["t_end"]
            assert rec["micro_batches"] == 2 and rec["prefetch_units"] == 1
            assert rec["units"] == got["recompute"]["units"]
            # The step before's weight gathers, done under this step (none before step 1).
            assert (rec["carried"] == []) == (rec["step"] == 1), rec["carried"]
            assert all(c["phase"] == "step_gather" for c in rec["carried"]), rec["carried"]
            seqs = []
            sent = defaultdict(lambda: defaultdict(float))
            for c in rec["collectives"]:
                assert set(c) == COLLECTIVE_FIELDS, sorted(c)
                sent[c["phase"]][c["link"]] += c["bytes"]
                if c["done"] is None:   # still in flight at the step's end: carried
                    assert c["phase"] == "step_gather" and c["async"], c
                    seqs.append(c["issued_seq"])
                    continue
                assert c["issued"] <= c["wait"] <= c["done"], c
                assert c["issued_seq"] <= c["wait_seq"] < c["done_seq"], c
                assert (c["wait_seq"] > c["issued_seq"]) == c["async"], c
                seqs += [c["issued_seq"], c["done_seq"]] + ([c["wait_seq"]] if c["async"] else [])
                if c["phase"] == "control":
                    assert c["micro_batch"] is None, c
                elif c["phase"] == "step_reduce":   # under the last backward (issue 13)
                    assert c["micro_batch"] == 1 and c["unit"] in range(len(KINDS)), c
                elif c["phase"] == "step_gather":   # both hops: at the optimizer step
                    assert c["micro_batch"] is None and c["unit"] in range(len(KINDS)), c
                else:
                    assert c["micro_batch"] in (0, 1) and c["unit"] in range(len(KINDS)), c
            seqs += [n["seq"] for n in rec["needs"]]
            passes = defaultdict(int)
            for i in rec["compute"]:
                assert i["start"] <= i["end"] and i["start_seq"] < i["end_seq"], i
                seqs += [i["start_seq"], i["end_seq"]]
                passes[i["pass"]] += 1
            assert len(seqs) == len(set(seqs)), "two points share a sequence number"
            assert dict(passes) == {"forward": 2 * len(KINDS), "recompute": 2 * LAYERS,
                                    "backward": 2 * len(KINDS), "optimizer": 1}, dict(passes)
            # Every collective is charged where it is issued: the record's bytes are the report's.
            for ph, by_link in report["traffic_by_phase"].items():
                for link, nbytes in by_link.items():
                    assert sent[ph][link] == pytest.approx(nbytes, abs=1e-6), (
                        f"rank {rank} step {rec['step']} {ph}/{link}: trace {sent[ph][link]} "
                        f"bytes, comm report {nbytes}")


def test_trace_links_each_hop_to_the_one_its_stream_waits_for_and_nothing_is_polled(ranks):
    """The fields the replay needs (projection/replay.py): each later hop of the optimizer
    step's chains, and each unit's network reduction, names the collective it waits for
    (``after``), issued before it, for the same unit; the engine never polls, so nothing is
    ``polled`` and no need is recorded apart from a blocking wait."""
    trace_dir, _ = ranks
    for rank in (0, 5):
        records = _records(trace_dir, "recompute", rank)
        seen = {}
        for rec in records:
            assert rec["needs"] == [], rec["needs"]
            for c in rec["collectives"] + rec["carried"]:
                assert isinstance(c["id"], int) and c["id"] > 0 and not c["polled"], c
                if c in rec["carried"]:
                    assert seen[c["id"]]["issued_seq"] == c["issued_seq"], c
                else:
                    assert c["id"] not in seen, f"rank {rank}: id {c['id']} twice"
                seen[c["id"]] = c
            for c in rec["collectives"]:
                if c["after"] is None:
                    assert not (c["phase"] == "step_reduce" or c["family"] == "grad_to_param"), c
                    continue
                trigger = seen[c["after"]]
                assert trigger["unit"] == c["unit"], (trigger, c)
                pair = (trigger["phase"], trigger["family"], c["phase"], c["family"])
                assert pair in {("grad_reduce", "grad", "step_reduce", "inter"),
                                ("step_gather", "inter", "step_gather", "grad_to_param")}, pair
                if trigger in rec["collectives"]:
                    assert trigger["issued_seq"] < c["issued_seq"], (trigger, c)


def test_bench_trace_summarises_the_files(ranks, capsys):
    trace_dir, out = ranks
    pattern = str(trace_dir / "recompute-{rank}.jsonl")
    # A summary of files, but under a load of 400 the 120 s this had was not enough.
    r = subprocess.run([sys.executable, "-m", "benchmarks", "trace", pattern, "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["steps"] == [2, 3] and sorted(got["ranks"], key=int) == [str(i) for i in range(WORLD)]
    report = out[0]["recompute"]["reports"][-1]["traffic_by_phase"]  # steps 2, 3 send the same
    for ph in ALL_PHASES:
        row = got["median"]["phases"][ph]
        assert row["bytes"] == pytest.approx(sum(report[ph].values())), (ph, row)
        assert row["exposed_s"] >= 0 and row["count"] >= 0
    assert 0 < got["median"]["exposed_s"] < got["median"]["step_s"]
    assert bench_trace.main([pattern, "--steps", "all"]) == 0
    text = capsys.readouterr().out
    assert "step(s) 1-3" in text and "1 embedding, 3 layers, 1 output" in text, text
    for bad, needle in (([str(trace_dir / "nothing.jsonl")], "nothing.jsonl"),
                        ([pattern, "--steps", "x"], "--steps=x"),
                        ([pattern, "--steps", "7"], "none of the steps [7]"),
                        ([], "give a trace PATH")):
        assert bench_trace.main(bad) == 2, bad
        err = capsys.readouterr().err
        assert needle in err and len(err.splitlines()) == 1, (bad, err)


# --- pure parts --------------------------------------------------------------------------

class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_trace_record_carries_collectives_still_in_flight(tmp_path):
    path = tmp_path / "t.jsonl"
    trace = ScheduleTrace(str(path), rank=3, clock=_Clock())
    trace.start_micro_batch()                           # each clock reading adds 1 s
    late = trace.issued("step_gather", 2, "inter", "inter_gather", "network", 64, True)
    early = trace.issued("forward_gather", 1, "param", "param_gather", "package", 32, True)
    trace.waiting(early)
    trace.completed(early)
    first = trace.end_step(1)
    trace.start_micro_batch()                                   # the next step's t_start
    trace.waiting(late)
    trace.completed(late)
    second = trace.end_step(2)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [first, second]
    assert first["collectives"][0]["done"] is None and first["carried"] == []
    assert first["collectives"][1]["issued"] == 2.0 and first["collectives"][1]["done"] == 4.0
    carried = second["carried"]
    assert len(carried) == 1 and carried[0]["phase"] == "step_gather", second
    assert carried[0]["issued"] < 0 < carried[0]["wait"] < carried[0]["done"], carried
    assert second["collectives"] == [] and second["micro_batches"] == 1
    assert bench_trace.exposed(carried[0]) == 1.0 and bench_trace.exposed(
        first["collectives"][0]) == 0.0
    trace.issued("step_gather", 0, "inter", "inter_gather", "network", 8, False)
    trace.discard()
    assert trace.end_step(3)["collectives"] == [], "a discarded collective was written"


def test_trace_needs_only_what_a_poll_took_once_and_links_by_id(tmp_path):
    from megatron_lbp.engine.trace import link_after, need

    trace = ScheduleTrace(str(tmp_path / "t.jsonl"), rank=0, clock=_Clock())
    trace.start_micro_batch()
    g = trace.issued("grad_reduce", 1, "grad", "grad_reduce", "node", 64, True)
    s = trace.issued("step_reduce", 1, "inter", "inter_reduce", "network", 16, True)
    b = trace.issued("backward_gather", 0, "param", "param_gather", "package", 8, True)
    trace.waiting(g, polled=True)      # a poll found it done
    trace.completed(g)
    link_after(s, g)
    trace.waiting(b)                   # blocking: its own need
    trace.completed(b)
    need(b)                            # nothing: blocked on already
    need(s)                            # nothing: not taken yet (its wait will say)
    need(g)
    need(g)                            # only the first need counts
    rec = trace.end_step(1)
    by_unit = {c["phase"]: c for c in rec["collectives"]}
    assert [c["id"] for c in rec["collectives"]] == [1, 2, 3]
    assert by_unit["grad_reduce"]["polled"] and not by_unit["backward_gather"]["polled"]
    assert by_unit["step_reduce"]["after"] == 1 and by_unit["grad_reduce"]["after"] is None
    assert [n["id"] for n in rec["needs"]] == [1], rec["needs"]
    assert rec["needs"][0]["seq"] > by_unit["grad_reduce"]["done_seq"]
    # Ids go on across records; the need of a collective landed in an earlier record is
    # written in the record where it came.
    trace.start_micro_batch()
    assert trace.issued("forward_gather", 0, "param", "param_gather", "package", 8,
                        True).id == 4
    trace.waiting(s, polled=True)
    trace.completed(s)
    assert trace.end_step(2)["needs"] == []
    need(s)
    assert [n["id"] for n in trace.end_step(3)["needs"]] == [2]


def test_trace_path_rule_is_the_comm_reports():
    assert output_path("t-{rank}.jsonl", 5) == "t-5.jsonl"
    assert output_path("t.jsonl", 0) == "t.jsonl" and output_path("t.jsonl", 1) is None


def test_the_engine_does_not_import_the_planning_cli():
    """What the engine and the plan tool share lives below both (costs, topology, layout)."""
    import ast
    from pathlib import Path

    engine = Path(__file__).resolve().parents[2] / "megatron_lbp" / "engine"
    for path in sorted(engine.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "megatron_lbp":
                names = [f"megatron_lbp.{a.name}" for a in node.names]
            assert "megatron_lbp.plan" not in names, f"{path.name}:{node.lineno} imports the plan CLI"


def test_grouping_declared_units_other_runs_dtypes_and_tied_users():
    import torch

    from megatron_lbp.engine.grouping import UnitSpec, group_into_units

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.blocks = torch.nn.ModuleList([Block(), Block()])
            self.extra = torch.nn.Linear(8, 30)            # 270 elements, in no declared unit
            self.half = torch.nn.Linear(4, 4).to(torch.bfloat16)
            self.head = torch.nn.Linear(8, 16, bias=False)

    m = Model()
    specs = [UnitSpec("embedding", (m.emb,)),
             *[UnitSpec("layer", (blk,), i) for i, blk in enumerate(m.blocks)],
             UnitSpec("output", (m.head,))]
    got = group_into_units(m, specs, bucket_size=100, extra_weight_users={m.head: [m.emb.weight]})
    kinds = [(u.kind, u.layer, sum(p.numel() for _, p in u.params)) for u in got.units]
    # A declared unit whole, whatever the bucket size; the rest cut at it, one dtype per unit.
    assert kinds == [("embedding", None, 128), ("layer", 0, 88), ("layer", 1, 88),
                     ("other", None, 240), ("other", None, 30), ("other", None, 20),
                     ("output", None, 128)], kinds
    assert [n for n, _ in got.units[1].params] == ["blocks.0.a.weight", "blocks.0.a.bias",
                                                   "blocks.0.b.weight", "blocks.0.b.bias"]
    assert got.units[5].params[0][1].dtype == torch.bfloat16
    # The head computes with the embedding's weight: it uses both units, its home is its own.
    assert got.uses[m.head] == [6, 0] and got.home[m.head] == 6
    assert got.uses[m.blocks[1]] == [2] and got.uses[m.extra] == [3, 4]
    assert m.head in got.units[0].users and m.emb in got.units[0].users
    with pytest.raises(ValueError, match="unit kind"):
        UnitSpec("decoder", (m.emb,))
