"""Every preset of the engine trains exactly like stock Megatron DDP + DistributedOptimizer.

8 gloo ranks placed as 2 nodes x 2 packages x 2 GCDs, tiny megatron-core GPT,
10 steps with 2 micro-batches each. fp32: losses, reported gradient norms and
final weights agree to 1e-5 relative (the only differences are summation orders
of the reductions). The gradient norm is compared because Adam plus clipping at
1.0 hides a constant gradient-scale error from the losses (tests/helpers/broken_engine.py gradient_scale: x2 or
x8 moves the loss by ~1e-4); the norm shows it in full. Each test's trainings
run one after another in the same 8 ranks (stock first), and each new check is
run once on a deliberately broken engine (tests/helpers/broken_engine.py) and must fail.
"""
import functools
import json
import math

import pytest
import torch

from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, train_several, trained
from tests.helpers import broken_engine

WORLD = 8
TOPOLOGY = rank_location_env(4)       # nodes of 4 ranks, packages of 2
TRAIN = TrainSpec(steps=10, micro_batches=2, bucket_size=20000)
SPEC = TinyGPTSpec()
FP32_REL = 1e-5

PRESETS = {
    "lbp-P2-G4-O8": ["--hier-preset", "lbp", "--hier-param-group-size", "2",
                     "--hier-grad-group-size", "4", "--hier-optim-group-size", "8"],
    "zero3": ["--hier-preset", "zero3"],
    "zero2": ["--hier-preset", "zero2"],
    "hsdp": ["--hier-preset", "hsdp"],
    "lbp-P1": ["--hier-param-group-size", "1"],
    "lbp-O4-R2": ["--hier-optim-group-size", "4"],
}


# Generous: 8 trainings in one launch, on a machine that may be shared.
TIMEOUT = 900

# 1/G in place of 1/W (G=4, W=8): every reduced gradient twice what it must be.
WRONG_SCALE = "lbp, gradients x2 (broken)"
WRONG_SCALE_FAULT = {WRONG_SCALE: functools.partial(broken_engine.gradient_scale, 2.0)}
# Rank 5 loses the step's weight gathers (its P-group {4, 5} trains on partly old weights).
STALE_RANK = "lbp, rank 5 keeps stale weights (broken)"
STALE_RANK_FAULT = {STALE_RANK: functools.partial(broken_engine.stale_weights_on_rank, 5)}


def run_all(spec, train, configs, faults=None):
    """Per rank, {name: TrainResult or traceback} of every configuration, in order."""
    return run_on_ranks(train_several, WORLD, spec, train, configs, rank_env=TOPOLOGY,
                        timeout=TIMEOUT, faults=faults)


@pytest.fixture(scope="module")
def fp32():
    return run_all(SPEC, TRAIN, {"stock": None, **PRESETS,
                                 WRONG_SCALE: PRESETS["lbp-P2-G4-O8"],
                                 STALE_RANK: PRESETS["lbp-P2-G4-O8"]},
                   {**WRONG_SCALE_FAULT, **STALE_RANK_FAULT})


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_same_per_step(what, got, ref, tol, label):
    worst = max(rel(a, b) for a, b in zip(got, ref))
    print(f"{label}: {what} at most {worst:.3g} relative from stock")
    assert len(got) == len(ref) and worst <= tol, (
        f"{label}: {what} differ by up to {worst:.3g} relative (> {tol}):\n"
        f" engine {got}\n stock  {ref}")


def assert_same_losses(got, ref, tol, label):
    _assert_same_per_step("losses", got.losses, ref.losses, tol, label)


def assert_same_grad_norms(got, ref, tol, label):
    """The gradient norm each step reported (before clipping), engine against stock."""
    _assert_same_per_step("grad norms", got.grad_norms, ref.grad_norms, tol, label)


def assert_same_weights(got, ref, tol, label):
    """Every final weight within ``tol`` of the largest |w| of its tensor (at least 1)."""
    assert set(got.params) == set(ref.params), f"{label}: other parameters {sorted(got.params)}"
    for name, ref_w in ref.params.items():
        diff = (got.params[name] - ref_w).abs().max().item()
        scale = ref_w.abs().max().item()
        assert diff <= tol * max(scale, 1.0), (
            f"{label}: final {name} differs by {diff:.3g} (max |w| {scale:.3g}, bound "
            f"{tol:.3g} x max(|w|, 1))")


def assert_same_training(got, ref, tol, label, weight_tol=None):
    assert_same_losses(got, ref, tol, label)
    assert_same_grad_norms(got, ref, tol, label)
    assert_same_weights(got, ref, tol if weight_tol is None else weight_tol, label)


def assert_ranks_hold_the_same_weights(ranks, label):
    """Each rank's gathered final weights equal rank 0's bit for bit.

    The logged losses are all-reduced before they are logged, so equal losses on
    every rank prove nothing; the weights each rank assembles from its shards do.
    """
    for r, res in enumerate(ranks):
        for name, w in ranks[0].params.items():
            assert torch.equal(res.params[name], w), (
                f"{label}: rank {r}'s final {name} differs from rank 0's by "
                f"{(res.params[name] - w).abs().max().item():.3g}")


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_matches_stock_megatron_fp32(preset, fp32):
    stock = trained(fp32[0], "stock")
    ranks = [trained(r, preset) for r in fp32]
    assert_ranks_hold_the_same_weights(ranks, preset)
    assert_same_training(ranks[0], stock, FP32_REL, preset)
    assert stock.losses[-1] < stock.losses[0] - 0.1, f"the loss barely moved: {stock.losses}"


def test_grad_norm_check_fails_on_a_wrong_gradient_scale(fp32):
    """The test of the test: the engine with every gradient doubled fails the norm check."""
    stock, bad = trained(fp32[0], "stock"), trained(fp32[0], WRONG_SCALE)
    with pytest.raises(AssertionError, match="grad norms differ"):
        assert_same_grad_norms(bad, stock, FP32_REL, WRONG_SCALE)
    # the same engine unbroken passes it (the fault is what fails, not the check's set-up)
    assert_same_grad_norms(trained(fp32[0], "lbp-P2-G4-O8"), stock, FP32_REL, "lbp-P2-G4-O8")


def test_rank_weight_check_fails_when_one_rank_keeps_stale_weights(fp32):
    """The test of the test: rank 5 drops the step's weight gathers. Every rank logs the
    same losses (all-reduced), so only the per-rank weight comparison can see it."""
    ranks = [trained(r, STALE_RANK) for r in fp32]
    assert all(r.losses == ranks[0].losses for r in ranks), "logged losses differ between ranks"
    with pytest.raises(AssertionError, match=r"rank [45]'s final \S+ differs from rank 0's"):
        assert_ranks_hold_the_same_weights(ranks, STALE_RANK)
    # the unbroken engine of the same launch passes it
    assert_ranks_hold_the_same_weights([trained(r, "lbp-P2-G4-O8") for r in fp32], "lbp-P2-G4-O8")


def test_parameter_count_not_divisible_by_world():
    # hidden 36 (2 heads of 18) and vocab 127: a parameter count no power of two divides.
    spec = TinyGPTSpec(hidden_size=36, num_attention_heads=2, vocab_size=127)
    train = TrainSpec(steps=5, micro_batches=2, bucket_size=5000)
    runs = run_all(spec, train, {"stock": None, "lbp": PRESETS["lbp-P2-G4-O8"]})[0]
    ref, got = trained(runs, "stock"), trained(runs, "lbp")
    numels = got.extra["bucket_numels"]
    assert sum(numels) % WORLD != 0, f"model has {sum(numels)} parameters, divisible by {WORLD}"
    assert any(n % (WORLD * 128) for n in numels), numels
    assert_same_training(got, ref, FP32_REL, "odd-sized model")


OVERLAP_OFF_INSIDE = "--hier-overlap, engine synchronous (broken)"
# Phases whose collectives the schedule issues asynchronously with --hier-overlap.
OVERLAPPED_PHASES = ("forward_gather", "backward_gather", "grad_reduce")


def async_by_phase(trace_path):
    """{phase: [asynchronous, synchronous] collectives} over every step of one trace file."""
    counts = {}
    with open(trace_path) as f:
        for line in f:
            for c in json.loads(line)["collectives"]:
                counts.setdefault(c["phase"], [0, 0])[0 if c["async"] else 1] += 1
    return counts


def assert_overlaps(ranks, trace_path, label):
    """Gathers and reductions issued asynchronously, and some in flight while units compute.

    From the engine's own counters (docs/design.md §6): Collectives.stats and
    HierDataParallel.overlap_samples (the in-flight count at each unit's compute
    start), on every rank; the per-phase split from rank 0's schedule trace.
    """
    for r, res in enumerate(ranks):
        stats, samples = res.extra["comm_stats"], res.extra["overlap_samples"]
        assert stats["async_issued"] > 0 and stats["max_in_flight"] > 0, (
            f"{label}: rank {r} issued no collective asynchronously: {stats}")
        busy = sum(1 for n in samples if n > 0)
        assert busy > 0, (f"{label}: rank {r} never had a collective in flight when a unit's "
                          f"compute started ({len(samples)} samples, all 0)")
    by_phase = async_by_phase(trace_path)
    for phase in OVERLAPPED_PHASES:
        asynchronous, _ = by_phase.get(phase, [0, 0])
        assert asynchronous > 0, f"{label}: no {phase} collective was asynchronous: {by_phase}"


def assert_no_overlap(ranks, trace_path, label):
    for r, res in enumerate(ranks):
        stats, samples = res.extra["comm_stats"], res.extra["overlap_samples"]
        assert (stats["async_issued"], stats["in_flight"], stats["max_in_flight"]) == (0, 0, 0), (
            f"{label}: rank {r} issued collectives asynchronously: {stats}")
        assert stats["sync_issued"] > 0 and samples and not any(samples), (
            f"{label}: rank {r}: {stats}, in flight at compute starts {samples}")
    by_phase = async_by_phase(trace_path)
    assert not any(a for a, _ in by_phase.values()), f"{label}: asynchronous collectives {by_phase}"


@pytest.fixture(scope="module")
def overlap(tmp_path_factory):
    """On, off and on-but-broken, each with rank 0's schedule trace."""
    train = TrainSpec(steps=4, micro_batches=2, bucket_size=20000)
    argv = PRESETS["lbp-P2-G4-O8"]
    traces = {name: str(tmp_path_factory.mktemp("trace") / "rank0.jsonl")
              for name in ("on", "off", OVERLAP_OFF_INSIDE)}
    configs = {"on": argv + ["--hier-overlap"], "off": argv + ["--no-hier-overlap"],
               OVERLAP_OFF_INSIDE: argv + ["--hier-overlap"]}
    configs = {name: a + ["--hier-trace", traces[name]] for name, a in configs.items()}
    ranks = run_all(SPEC, train, configs, {OVERLAP_OFF_INSIDE: broken_engine.overlap_off})
    return ranks, traces


def test_overlap_on_and_off_give_identical_results(overlap):
    ranks, _ = overlap
    on, off = trained(ranks[0], "on"), trained(ranks[0], "off")
    assert on.losses == off.losses, f"overlap changed the losses:\n on  {on.losses}\n off {off.losses}"
    assert on.grad_norms == off.grad_norms, f"overlap changed the grad norms:\n on  {on.grad_norms}\n off {off.grad_norms}"
    for name, w in off.params.items():
        assert torch.equal(on.params[name], w), f"overlap changed the final {name}"
    # Every step's bytes, the first included: overlap moves when the step's weight gathers
    # are issued, not which step's report they count in.
    for step, (a, b) in enumerate(zip(on.step_reports, off.step_reports, strict=True)):
        assert a["traffic_by_phase"] == b["traffic_by_phase"], (
            f"step {step}: bytes with overlap {a['traffic_by_phase']}\n"
            f" without {b['traffic_by_phase']}")


def test_overlap_on_has_collectives_in_flight_during_compute_and_off_has_none(overlap):
    ranks, traces = overlap
    assert_overlaps([trained(r, "on") for r in ranks], traces["on"], "--hier-overlap")
    assert_no_overlap([trained(r, "off") for r in ranks], traces["off"], "--no-hier-overlap")


def test_overlap_check_fails_when_the_engine_runs_synchronously(overlap):
    """The test of the test: --hier-overlap given, overlap switched off inside the engine."""
    ranks, traces = overlap
    broken = [trained(r, OVERLAP_OFF_INSIDE) for r in ranks]
    # Whichever check fires first (the counters, or the trace's per-phase split: the
    # step's weight gathers stay asynchronous), it names what was not asynchronous.
    with pytest.raises(AssertionError, match="asynchronous"):
        assert_overlaps(broken, traces[OVERLAP_OFF_INSIDE], OVERLAP_OFF_INSIDE)


# bf16 keeps 8 significant bits: one rounding step (ulp) of a value is 2^-8 to 2^-7 of it.
# See test_bf16_lbp_tracks_stock_bf16 for how each bound follows from that.
BF16_EPS = 2.0 ** -8
BF16_REL = BF16_EPS / 4          # ~1e-3: losses, per step
BF16_NORM_REL = BF16_EPS / 2     # ~2e-3: gradient norms, per step
BF16_MATRIX_ULPS = 2             # 2-D weights: in bf16 steps at the tensor's largest |w|
BF16_MODEL_REL = BF16_EPS / 2    # all weights together, relative L2 distance


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at |x| > 0: 2^(exponent - 7)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def assert_bf16_weights_close(got, ref, label):
    """Final bf16 weights: each matrix within BF16_MATRIX_ULPS bf16 steps of stock's at its
    largest element, and the whole model within BF16_MODEL_REL in relative L2 distance."""
    assert set(got.params) == set(ref.params) and ref.params, f"{label}: parameters differ"
    lines, sq_diff, sq_ref = [], 0.0, 0.0
    for name, ref_w in ref.params.items():
        diff = got.params[name] - ref_w
        sq_diff += diff.double().pow(2).sum().item()
        sq_ref += ref_w.double().pow(2).sum().item()
        if ref_w.dim() == 2:
            steps = diff.abs().max().item() / bf16_ulp(ref_w.abs().max().item())
            lines.append((steps, name))
    worst, name = max(lines)
    model_rel = math.sqrt(sq_diff / sq_ref)
    print(f"{label}: matrices at most {worst:g} bf16 steps from stock ({name}); model "
          f"{model_rel:.3g} relative L2")
    assert worst <= BF16_MATRIX_ULPS, (
        f"{label}: final {name} differs from stock by {worst:g} bf16 steps at its largest "
        f"element (> {BF16_MATRIX_ULPS})")
    assert model_rel <= BF16_MODEL_REL, (
        f"{label}: final weights {model_rel:.3g} relative L2 from stock (> {BF16_MODEL_REL:.3g})")


@pytest.fixture(scope="module")
def bf16():
    spec = TinyGPTSpec(params_dtype=torch.bfloat16)
    return run_all(spec, TRAIN, {"stock": None, "lbp": PRESETS["lbp-P2-G4-O8"],
                                 WRONG_SCALE: PRESETS["lbp-P2-G4-O8"]}, WRONG_SCALE_FAULT)[0]


def assert_bf16_tracks(got, ref, label):
    assert_same_losses(got, ref, BF16_REL, label)
    assert_same_grad_norms(got, ref, BF16_NORM_REL, label)
    assert_bf16_weights_close(got, ref, label)


@pytest.mark.slow
def test_bf16_lbp_tracks_stock_bf16(bf16):
    """bf16 weights, fp32 master and gradient reduction in both.

    The forward/backward math is the same, but the engine adds 1/W-scaled fp32
    gradients in a different order (G-group then inter-group) than Megatron's
    one reduce-scatter; a ~1e-7 difference in an fp32 master weight can flip
    the rounding of its bf16 copy (one bf16 step, 2^-8 to 2^-7 of the weight),
    and those flips compound over steps. So the bounds are in units of bf16's
    precision eps = 2^-8, not of the fp32 summation order:
    - losses per step within eps/4 (~1e-3) relative: a flipped element moves a
      mean over all tokens by far less than one bf16 step of it (measured
      2.6e-5);
    - gradient norms per step within eps/2 (~2e-3) relative: each gradient
      element comes out of bf16 arithmetic, rounded by up to eps/2, and a vector
      whose every element is within eps/2 relative has its norm within eps/2
      (measured 3.7e-4). A gradient-scale error c shows in the norm as c - 1 in
      full: x2 measured 1.0, while its losses moved by only 1.2e-4, inside the
      loss bound (test_bf16_checks_fail_on_a_wrong_gradient_scale);
    - every weight matrix within 2 bf16 steps (at its largest element) of
      stock's: an element either rounds like stock's or one step apart after a
      flip (measured: at most 1 step, 10-17 % of elements differ);
    - all weights together within eps/2 relative L2 distance, the most one
      rounding of the whole model to bf16 could move it (measured 3.3e-4). 1-D
      weights are held to this one only: Adam turns their near-zero gradients'
      rounding noise into lr-sized steps of either sign (the attention's key bias
      has no gradient at all and measured 5 % relative apart).
    """
    ref, got = trained(bf16, "stock"), trained(bf16, "lbp")
    assert_bf16_tracks(got, ref, "bf16 lbp")
    assert ref.losses[-1] < ref.losses[0] - 0.1


def test_bf16_checks_fail_on_a_wrong_gradient_scale(bf16):
    """The test of the test: gradients x2 pass a loss check at bf16's bound, not the norm check."""
    ref, bad = trained(bf16, "stock"), trained(bf16, WRONG_SCALE)
    assert_same_losses(bad, ref, 1.0, WRONG_SCALE)   # only prints how far the losses moved
    with pytest.raises(AssertionError, match="grad norms differ"):
        assert_same_grad_norms(bad, ref, BF16_NORM_REL, WRONG_SCALE)
    with pytest.raises(AssertionError):
        assert_bf16_tracks(bad, ref, WRONG_SCALE)
