"""Every rank issues the same collectives in the same order, whatever its timing.

8 gloo ranks as 2 emulated nodes x 2 packages x 2 GCDs, a 4-layer GPT, two
optimizer steps of two micro-batches of one sequence, each rank's schedule trace
on. Every rank sleeps a random time (its own seed) in the schedule's hooks and
before every collective, odd ranks mostly in the hooks and even ranks mostly
before the collectives, so a rank that decides what to issue from what it sees
finished would see other things than its peers. Checked, step by step: each
rank's sequence of (phase, unit, micro-batch, family, communicator), sorted by
``issued_seq``, is rank 0's.

- ``lbp-int8``: lbp P=2, G=4, O=8 with the int8 secondary copy over the node
  (S=4) and qgZ on the network reduction (bf16 weights);
- ``lbp-R2``: O=4, so each unit's reduction has a replica all-reduce after its
  network reduce-scatter (fp32);
- tests of the test, in the same ranks: the engine that issues the network
  reductions when a hook finds the in-node reduce-scatter done
  (broken_engine.issue_on_poll) must fail the comparison; the engine that takes
  the step's chains as done without waiting (broken_engine.chains_not_awaited)
  must be stopped by the streams' buffer check before it reads a gradient that a
  collective still writes.
"""
from __future__ import annotations

import contextlib
import json
import random
import time
from unittest import mock

import pytest

from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks

WORLD = 8
NODE = 4
LBP = ["--hier-preset", "lbp", "--hier-param-group-size", "2", "--hier-grad-group-size", "4"]
INT8 = LBP + ["--hier-optim-group-size", "8", "--hier-secondary-group-size", "4",
              "--hier-secondary-dtype", "int8", "--hier-quantize-grad-reduce"]
R2 = LBP + ["--hier-optim-group-size", "4"]
# ZeRO++ over 2 nodes: the step-scoped secondary serves later gathers, qgZ's two int4 hops
ZEROPP = ["--hier-preset", "zeropp"]
POLL = "issue on poll (broken)"
NOT_AWAITED = "chains not awaited (broken)"


@contextlib.contextmanager
def _random_delays(rank: int):
    """Sleep in the schedule's hooks and before each collective (on every thread)."""
    from megatron_lbp.engine import comm, schedule

    rng = random.Random(4100 + rank)
    hook_s, call_s = (0.004, 0.0) if rank % 2 else (0.0, 0.004)

    def delayed(fn, base):
        def run(*args, **kwargs):
            time.sleep(base + rng.uniform(0.0, 0.003))
            return fn(*args, **kwargs)
        return run

    with contextlib.ExitStack() as stack:
        for name in ("pre_forward", "post_forward", "pre_backward", "grad_ready"):
            stack.enter_context(mock.patch.object(
                schedule.UnitSchedule, name, delayed(getattr(schedule.UnitSchedule, name),
                                                     hook_s)))
        stack.enter_context(mock.patch.object(
            comm.Collectives, "_call", delayed(comm.Collectives._call, call_s)))
        yield


def _runs(trace_dir):
    import torch
    import torch.distributed as dist

    from megatron_lbp.engine.streams import BufferInFlight
    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, setup_hier
    from tests.helpers import broken_engine

    rank = dist.get_rank()
    train = TrainSpec(steps=2, micro_batches=2, micro_batch_size=1)
    bf16 = TinyGPTSpec(num_layers=4, params_dtype=torch.bfloat16)
    runs = {"lbp-int8": (bf16, INT8, None), "lbp-R2": (TinyGPTSpec(num_layers=4), R2, None),
            "zeropp": (bf16, ZEROPP, None),
            POLL: (bf16, INT8, broken_engine.issue_on_poll),
            NOT_AWAITED: (bf16, INT8, broken_engine.chains_not_awaited)}
    out = {}
    for name, (spec, argv, broken) in runs.items():
        path = f"{trace_dir}/{name.split()[0]}-{{rank}}.jsonl"
        trainer = setup_hier(spec, train, argv + ["--hier-trace", path])
        with _random_delays(rank), (broken() if broken else contextlib.nullcontext()):
            try:
                trainer.run(range(train.steps))
                trainer.model.settle()
                out[name] = "trained"
            except BufferInFlight as e:
                out[name] = f"refused: {e}"
                trainer.model.settle()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("order")
    return trace_dir, run_on_ranks(_runs, WORLD, str(trace_dir),
                                   rank_env=rank_location_env(NODE), timeout=900)


def _sequences(trace_dir, name, rank):
    path = trace_dir / f"{name.split()[0]}-{rank}.jsonl"
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        issued = sorted(rec["collectives"], key=lambda c: c["issued_seq"])
        out.append((rec["step"], [(c["phase"], c["unit"], c["micro_batch"], c["family"],
                                   c["comm"]) for c in issued]))
    return out


def _first_difference(trace_dir, name):
    """'' when every rank issued rank 0's sequence in every step, else where the first
    rank's first difference is."""
    want = _sequences(trace_dir, name, 0)
    for rank in range(1, WORLD):
        got = _sequences(trace_dir, name, rank)
        if len(got) != len(want):
            return f"rank {rank}: {len(got)} step records, rank 0 {len(want)}"
        for (step, seq), (_, ref) in zip(got, want):
            if seq != ref:
                at = next((i for i, (a, b) in enumerate(zip(seq, ref)) if a != b),
                          min(len(seq), len(ref)))
                return (f"step {step}, rank {rank}, collective {at}: issued {seq[at:at + 2]}, "
                        f"rank 0 {ref[at:at + 2]}")
    return ""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lbp-int8", "lbp-R2", "zeropp"])
def test_every_rank_issues_rank_0s_sequence_step_by_step(ranks, name):
    trace_dir, out = ranks
    assert all(o[name] == "trained" for o in out), [o[name] for o in out]
    seq = _sequences(trace_dir, name, 0)
    comms = {c[4] for _, s in seq for c in s}
    # the cross-communicator chains are all there: node -> network (-> replica) reduction,
    # the refresh's network and node hops (O = G in lbp-R2: no network hop)
    want = {"lbp-int8": {"grad_reduce", "inter_reduce", "inter_gather", "grad_to_param_gather"},
            "lbp-R2": {"grad_reduce", "replica_reduce", "grad_to_param_gather"},
            "zeropp": {"param_gather", "secondary_gather", "secondary_reduce", "grad_cross_reduce"}}[name]
    assert want <= comms, comms
    why = _first_difference(trace_dir, name)
    assert not why, f"{name}: ranks issue in different orders: {why}"


@pytest.mark.slow
def test_the_comparison_fails_on_an_engine_that_issues_on_poll(ranks):
    trace_dir, out = ranks
    assert all(o[POLL] == "trained" for o in out), [o[POLL] for o in out]
    assert _first_difference(trace_dir, POLL), (
        "an engine that issues the network reductions when it sees a reduce-scatter done "
        "gave every rank the same order: the comparison cannot fail")


@pytest.mark.slow
def test_a_gradient_read_while_its_collective_runs_is_refused(ranks):
    _, out = ranks
    refused = [o[NOT_AWAITED] for o in out]
    assert all(r.startswith("refused:") and "reduced gradient" in r for r in refused), refused
