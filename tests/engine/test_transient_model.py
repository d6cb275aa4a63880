"""The plan's transient figure against the engine's real peak, on gloo ranks.

A scaled Frontier-shaped model (bf16 weights, 8 layers, the embedding ~0.65 of a
layer as at 20B, nodes of 4 ranks in packages of 2, lbp with P=2, G=4, O=8): the
peak of the engine's transient ledger and, independently, of the real storages
behind its buffers (tests/helpers/transient_fns.py), on every rank, against
``costs.transient_bytes`` for the same units. The plan's figure assumes each
reduce-scatter completes only when the schedule must wait for it; the engine also
completes those already done at its hooks, so a rank whose peers were quick holds
less. The job's peak (the largest over its ranks) is what must fit in memory.

The transient knobs (--hier-max-pending-reduces, --hier-prefetch-units,
--hier-grad-reduce-dtype, --hier-embedding-backward-gather, --hier-layer-unit) are held to the same bound at their non-default values, and a
knob must move the engine's measured peak the way the plan says (not a no-op flag).
"""
import pytest
import torch

from megatron_lbp.core import costs
from megatron_lbp.core.config import HierConfig
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec
from tests.helpers.transient_fns import measure

WORLD = 8
SPEC = TinyGPTSpec(num_layers=8, hidden_size=64, vocab_size=512, seq_length=32,
                   params_dtype=torch.bfloat16)
BASE = ["--hier-preset", "lbp", "--hier-gpus-per-node", "4"]


def _runs(cases):
    """{name: run} for (tied, micro-batches, S[, {knob flag: value}]) cases."""
    runs = {}
    for t, k, s, *rest in cases:
        knobs = rest[0] if rest else {}
        name = f"tied={t} k={k} S={s}" + "".join(f" {f}={v}" for f, v in knobs.items())
        runs[name] = (SPEC, k, t, BASE + ["--hier-secondary-group-size", str(s)]
                      + [x for f, v in knobs.items() for x in (f, str(v))])
    return runs


def _knobs(argv):
    """The knob values a run's flags give, with the engine's defaults."""
    given = dict(zip(argv[::2], argv[1::2]))
    return {"prefetch_units": int(given.get("--hier-prefetch-units", 1)),
            "max_pending_reduces": int(given.get("--hier-max-pending-reduces", 2)),
            "grad_dtype": given.get("--hier-grad-reduce-dtype", "fp32"),
            "embedding_backward_gather": given.get("--hier-embedding-backward-gather",
                                                   "gather")}


def _check(runs, floor, out=None):
    out = out or run_on_ranks(measure, WORLD, runs, rank_env=rank_location_env(4), timeout=900)
    ratios = {}
    for name, (_, k, tied, argv) in runs.items():
        _, _, numels, config, kinds = out[0][name]
        plan = costs.transient_bytes(HierConfig(**config), numels, param_dtype="bf16",
                                     tied_embedding=tied, micro_batches=k, unit_kinds=kinds,
                                     **_knobs(argv))
        for rank, res in enumerate(out):
            ledger, storages, *_ = res[name]
            assert storages == ledger, (
                f"{name} rank {rank}: the storages peaked at {storages} bytes, the ledger at "
                f"{ledger}")
            assert 0 < ledger <= plan["peak"], (
                f"{name} rank {rank}: peak transient {ledger} bytes above the plan's {plan}")
        job = max(res[name][0] for res in out)
        ratios[name] = job / plan["peak"]
    for name, r in ratios.items():   # shown with pytest -s
        print(f"job peak / plan transient: {name}: {r:.3f}")
    low = {n: round(r, 3) for n, r in ratios.items() if r < floor}
    assert not low, f"the job's peak transient is under {floor:.0%} of the plan's: {low}"
    return ratios


PENDING_1 = {"--hier-max-pending-reduces": 1}
SKIP = {"--hier-embedding-backward-gather": "skip"}
SPLIT = {"--hier-layer-unit": "split"}


@pytest.mark.slow
def test_plan_transient_is_the_engine_peak_never_below_it():
    # One launch, three runs: tied with accumulation and the node-wide secondary copy, the
    # same with one reduce-scatter in flight, and with its layers split in two as well
    # (untied and the other shapes: the slow matrix below). The floor is loose here (the
    # default suite runs on a shared machine); the slow matrix holds the 10% the plan
    # promises.
    runs = _runs([(True, 4, 4), (True, 4, 4, PENDING_1), (True, 4, 4, {**PENDING_1, **SPLIT})])
    out = run_on_ranks(measure, WORLD, runs, rank_env=rank_location_env(4), timeout=900)
    _check(runs, floor=0.75, out=out)
    # Split layers hold half a layer's weights and gradient at a time: less, as planned.
    names = list(runs)
    whole, split = (max(res[names[i]][0] for res in out) for i in (1, 2))
    _, _, numels, config, kinds = out[0][names[2]]
    planned = [costs.transient_bytes(HierConfig(**config), n, param_dtype="bf16",
                                     tied_embedding=True, micro_batches=4, max_pending_reduces=1,
                                     unit_kinds=k)["peak"]
               for n, k in ((out[0][names[1]][2], None), (numels, kinds))]
    assert planned[1] < planned[0] and split < whole, (
        f"tied, 1 in flight: split layers peaked at {split} bytes, whole at {whole}; the plan "
        f"says {planned[1]} against {planned[0]}")
    # The knob is real: one reduce-scatter less in flight holds less, by what the plan says
    # (the job's peak: every rank's, the largest).
    default, fewer = (max(res[name][0] for res in out) for name in list(runs)[:2])
    _, _, numels, config, _ = out[0][list(runs)[0]]
    plans = [costs.transient_bytes(HierConfig(**config), numels, param_dtype="bf16",
                                   tied_embedding=True, micro_batches=4, max_pending_reduces=r)
             for r in (2, 1)]
    assert plans[1]["peak"] < plans[0]["peak"], plans
    assert fewer < default, (
        f"--hier-max-pending-reduces 1 peaked at {fewer} bytes, the default 2 at {default}: "
        f"the plan says {plans[1]['peak']} against {plans[0]['peak']}")


@pytest.mark.slow
def test_plan_transient_within_ten_percent_tied_untied_accumulation_and_secondary_sizes():
    _check(_runs([(t, k, s) for t in (True, False) for k in (1, 4) for s in (0, 2, 4)]),
           floor=0.9)


@pytest.mark.slow
def test_plan_transient_within_ten_percent_at_each_knobs_values():
    """The transient knobs at their other values, each against the plan's figure for them.

    --hier-embedding-backward-gather skip is held with the others (with one reduce-scatter
    in flight to 10%), and must lower the tied job's peak as the plan does.
    Within 10% for the settings the launcher's choice runs beside the defaults
    (projection/knobs.py CHOICE_SETTINGS: one reduce-scatter in flight, with and without
    prefetch): the schedule then waits for each reduce-scatter as soon as the next is
    issued, so when they finish does not matter. With 2 or 3 in flight (a deeper prefetch,
    bf16 gradients, 3 in flight, no prefetch with 2) a rank whose reduce-scatters finished
    before the schedule had to wait for them (gloo on one host is quick next to a unit's
    compute) holds less than the plan's worst case, by as much as a gradient unit: there
    the job's peak is never above the plan's and at least 70% of it (0.757-1.000 over three
    runs on this machine, at load 40-250).
    """
    tight = [PENDING_1, {"--hier-prefetch-units": 0, "--hier-max-pending-reduces": 1},
             {**PENDING_1, **SKIP}, {**PENDING_1, **SPLIT}]
    loose = [{"--hier-prefetch-units": 2}, {"--hier-grad-reduce-dtype": "bf16"},
             {"--hier-max-pending-reduces": 3}, {"--hier-prefetch-units": 0}, SKIP, SPLIT]
    shapes = ((True, 4), (False, 1))
    runs = _runs([(t, k, 4, kn) for kn in tight + loose for t, k in shapes])
    out = run_on_ranks(measure, WORLD, runs, rank_env=rank_location_env(4), timeout=1500)
    n_tight = len(tight) * len(shapes)
    names = list(runs)
    _check({n: runs[n] for n in names[:n_tight]}, floor=0.9, out=out)
    _check({n: runs[n] for n in names[n_tight:]}, floor=0.7, out=out)
    # The embedding's knob moves the tied job's peak as the plan says: its gathered weights
    # are freed after the output layer's backward (one reduce-scatter in flight: no timing).
    pending, skipped = (max(res[names[i * len(shapes)]][0] for res in out) for i in (0, 2))
    _, _, numels, config, _ = out[0][names[0]]
    planned = [costs.transient_bytes(HierConfig(**config), numels, param_dtype="bf16",
                                     tied_embedding=True, micro_batches=4, max_pending_reduces=1,
                                     embedding_backward_gather=e)["peak"]
               for e in ("gather", "skip")]
    assert planned[1] < planned[0] and skipped < pending, (
        f"tied, 1 in flight: skip peaked at {skipped} bytes, gather at {pending}; the plan "
        f"says {planned[1]} against {planned[0]}")


@pytest.mark.slow
def test_zeropp_transient_is_the_engine_peak_never_below_it():
    """ZeRO++ (zeropp): the step's first forward gathers int8 from the world, the later ones
    from the node's secondary copy (its own int8 buffers), the backward likewise, and every
    reduce is the two-hop int4 qgZ with its fp32 partial sums; gradients in bf16."""
    name = "zeropp tied k=3"
    runs = {name: (SPEC, 3, True, ["--hier-preset", "zeropp", "--hier-gpus-per-node", "4"])}
    out = run_on_ranks(measure, WORLD, runs, rank_env=rank_location_env(4), timeout=900)
    _, _, numels, config, kinds = out[0][name]
    plan = costs.transient_bytes(HierConfig(**config), numels, param_dtype="bf16",
                                 grad_dtype="bf16", tied_embedding=True, micro_batches=3,
                                 unit_kinds=kinds, quantized_grad_families=("grad",))
    # The ledger only: the storage probe (tests/helpers/transient_fns.py) reaches a reduce's
    # input and output, not qgZ's quantized and fp32 buffers, which live inside its landing.
    for rank, res in enumerate(out):
        ledger, storages, *_ = res[name]
        assert 0 < storages <= ledger, (
            f"{name} rank {rank}: the storages peaked at {storages} bytes, the ledger at {ledger}")
        assert 0 < ledger <= plan["peak"], (
            f"{name} rank {rank}: peak transient {ledger} bytes above the plan's {plan}")
    job = max(res[name][0] for res in out)
    assert job >= 0.75 * plan["peak"], f"{name}: the job's peak {job} under 75% of {plan}"
