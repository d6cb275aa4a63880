"""The traffic benchmark and its accounting of stock Megatron's collectives.

stock_accounting wraps torch.distributed; it must charge every collective
exactly as the engine's own ledger does (engine/comm.py), so that the stock
Megatron rows of the table are counted by the same rules as the engine rows.
"""
import json
import math
import subprocess
import sys
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from megatron_lbp.core import costs
from benchmarks import traffic
from benchmarks.stock_accounting import WRAPPED, count_collectives
from megatron_lbp.core.config import HierConfig
from megatron_lbp.engine import pair_exchange
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, setup_hier
from megatron_lbp.core.topology import emulated_locations

WORLD = 8
NODE = 4
LINKS = ("package", "node", "network")


def _formulas_on_ranks():
    """Known collectives over a package pair, a node and the world: bytes by the comm.py rules."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    pair = pairs[rank // 2]
    originals = {name: getattr(dist, name) for name in WRAPPED}
    with count_collectives(emulated_locations(world, 4, 2)) as ledger:
        x = torch.ones(100, dtype=torch.bfloat16)
        out = torch.empty(200, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, x, group=pair)                       # 400*(1/2) package
        dist.reduce_scatter_tensor(torch.empty(50), torch.ones(100), group=pair)  # 400/2 package
        dist.all_reduce(torch.ones(30))                                        # 2*120*7/8 network
        dist.all_gather([torch.empty(10) for _ in range(world)], torch.ones(10))  # 320*7/8 network
        dist.reduce_scatter(torch.empty(10), [torch.ones(10) for _ in range(world)])  # 320*7/8
        dist.broadcast(torch.ones(25), src=0)                                  # root: 100*7
        dist.all_reduce(torch.ones(1))                                         # control
        dist.all_to_all_single(torch.empty(80), torch.ones(80))                # 320*7/8 network
        pair_exchange.all_gather(out, x, group=pair, async_op=False)           # 200 package
    restored = all(getattr(dist, n) is originals[n] for n in WRAPPED)
    return ledger.by_class(), ledger.by_class(include_control=True), restored


def test_wrapper_charges_the_comm_formulas():
    ranks = run_on_ranks(_formulas_on_ranks, WORLD, timeout=120)
    for rank, (bulk, with_control, restored) in enumerate(ranks):
        assert restored, "torch.distributed was not restored"
        network = Fraction(2 * 120 * 7, 8) + 3 * Fraction(320 * 7, 8) + (700 if rank == 0 else 0)
        assert bulk == {"package": 600, "node": 0, "network": float(network)
                        if network.denominator > 1 else int(network)}, (rank, bulk)
        assert with_control["network"] == pytest.approx(float(network) + 2 * 4 * 7 / 8)


ENGINE_CASES = {
    "lbp-int8-S2": ["--hier-preset", "lbp", "--hier-secondary-group-size", "2"],
    "zeropp-qwZ": ["--hier-preset", "zeropp"],
    "lbp-qgZ": ["--hier-preset", "lbp", "--hier-quantize-grad-reduce"],
    "hsdp": ["--hier-preset", "hsdp"],
}


def _engine_steps_counted_twice(cases):
    """Each engine case: one real step (2 micro-batches) with the wrapper on, in the same ranks."""
    spec = TinyGPTSpec(params_dtype=torch.bfloat16)
    train = TrainSpec(steps=1, micro_batches=2, bucket_size=20000)
    out = {}
    for case, argv in cases.items():
        trainer = setup_hier(spec, train, argv + ["--hier-gpus-per-node", str(NODE)])
        with count_collectives(emulated_locations(WORLD, NODE, 2)) as ledger:
            result = trainer.run([0])
            # The step's weight gathers still in flight, whose second hop the ledger
            # charged to the step when it started them: issued and done before the count.
            trainer.model.settle()
        report = result.step_reports[-1]
        out[case] = (report["traffic_bytes"], ledger.by_class(),
                     report["traffic_by_phase"]["control"], ledger.by_class(include_control=True))
    return out


def test_wrapper_equals_engine_ledger():
    """int8 secondary, qwZ, qgZ (all-to-all), replicas (all-reduce): bulk bytes equal the ledger."""
    ranks = run_on_ranks(_engine_steps_counted_twice, WORLD, ENGINE_CASES,
                         rank_env=rank_location_env(NODE), timeout=240)
    for rank, per_case in enumerate(ranks):
        for case, (ledger, wrapped, control, wrapped_all) in per_case.items():
            assert wrapped == ledger, f"{case} rank {rank}: wrapper {wrapped} vs ledger {ledger}"
            assert ledger["network"] > 0
            # Besides the engine's scalars, the loop's loss all-reduce: a few bytes at most.
            extra = sum(wrapped_all.values()) - sum(wrapped.values())
            assert 0 < extra < 128, (case, rank, extra, control)


# --- the benchmark itself, reduced: 8 ranks as 2 nodes of 4 -------------------------------


def _plan(row, k):
    cfg = HierConfig(**row["config"])
    links = {f: c or "package" for f, c in row["links"].items()}
    return costs.estimate(cfg, row["bucket_numels"], links, param_dtype="bf16",
                          grad_dtype="fp32", micro_batches=k)


def _check_json_shape(obj, schemes):
    assert list(obj) == list(schemes), obj
    for scheme, row in obj.items():
        assert set(row) == set(LINKS), (scheme, row)
        assert all(isinstance(v, (int, float)) and v >= 0 for v in row.values()), (scheme, row)


def test_traffic_reduced_engine_rows_equal_the_plan():
    schemes = ["lbp", "lbp-int8-S8", "zeropp", "megatron-distopt"]
    k = 2
    result = traffic.measure(schemes, micro_batches=k, ranks=WORLD, gpus_per_node=NODE,
                             timeout=300)
    _check_json_shape(traffic.as_json(result), schemes)
    for scheme in schemes[:-1]:
        row = result[scheme]
        plan = _plan(row, k)
        assert row["bytes"] == plan["traffic_bytes"], (scheme, row["bytes"], plan["traffic_bytes"])
        measured = {ph: v for ph, v in row["by_phase"].items() if ph != "control"}
        assert measured == plan["traffic_by_phase"], scheme
        assert row["wrapper_agrees"] and row["uniform_across_ranks"], scheme
    stock = result["megatron-distopt"]
    assert stock["source"] == "stock_accounting wrapper" and stock["uniform_across_ranks"]
    # Megatron's DDP accumulates locally and reduces once: fp32 reduce-scatter + bf16
    # all-gather over all 8 ranks (network), a whole padded model's worth.
    n = stock["bytes"]["network"] / ((4 + 2) * (WORLD - 1) / WORLD)
    params = sum(result["lbp"]["bucket_numels"])
    assert params <= n < params * 1.05, (n, params)
    assert all(math.isfinite(x) for r in result.values() for x in r["losses"])


@pytest.mark.slow   # a 4-rank run (10 s); the engine rows' bytes stay in CI (reduced_engine_rows)
def test_traffic_cli_json():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "traffic", "--ranks", "4",
         "--gpus-per-node", "2", "--schemes", "lbp,zero3", "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # --json means JSON: the object alone on stdout, the ranks' Megatron logs on stderr
    obj = json.loads(out.stdout)
    assert "WARNING:" in out.stderr or "INFO:" in out.stderr, "the ranks' logs went missing"
    _check_json_shape(obj, ["lbp", "zero3"])
    assert 0 < obj["lbp"]["network"] < obj["zero3"]["network"], obj


def test_traffic_cli_errors():
    for bad, message in ((["--schemes", "zero4"], "--schemes: zero4"),
                         (["--ranks", "12"], "--ranks=12 must be")):
        r = subprocess.run([sys.executable, "-m", "benchmarks", "traffic", *bad],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr, (bad, r.stderr[-500:])


@pytest.mark.slow
def test_traffic_full_16_ranks_every_scheme():
    """The documented full form: 16 ranks (2 nodes x 4 packages x 2 GCDs), every scheme."""
    out = subprocess.run([sys.executable, "-m", "benchmarks", "traffic", "--json"],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    obj = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(obj) == list(traffic.SCHEMES)
    for scheme, row in obj.items():
        if scheme == "megatron-fsdp" and "unavailable" in row:
            continue
        assert set(row) == set(LINKS) and row["network"] > 0, (scheme, row)
