"""Exhaustive-style tests of megatron_lbp.core.layout (pure Python, no torch).

Collectives are modelled with plain lists: reduce-scatter = elementwise sum of
the group's inputs, chunk i to group rank i; all-gather = concatenation in
group-rank order. Each test checks that the layout's ranges and chunk orders
make those plain collectives land every element where the layout says.
"""

import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from megatron_lbp.core.layout import (
    LEVELS,
    BucketLayout,
    LayoutError,
    Range,
    all_groups,
    group_ranks,
    inverse_order,
    permute_chunks,
    plan_bucket,
)

# (W, P, G, O, S): the shapes the brief and the presets care about.
CONFIGS = [
    (8, 2, 4, 8, 0),        # docstring example
    (8, 2, 4, 8, 2),
    (16, 1, 8, 16, 0),      # P=1 (zero2-like)
    (16, 4, 4, 16, 8),      # P=G
    (16, 16, 16, 16, 0),    # P=W (zero3)
    (16, 16, 16, 16, 8),    # zeropp: P=W, S=node
    (16, 2, 8, 8, 2),       # G=O, R=2 (hsdp-like)
    (24, 2, 4, 12, 24),     # odd multiples, S=W
    (32, 2, 8, 8, 8),       # R=4
    (1, 1, 1, 1, 1),        # single rank
    (384, 2, 8, 384, 0),    # lbp at paper scale
    (384, 2, 8, 384, 8),
    (384, 2, 8, 48, 8),     # R=8
    (384, 2, 8, 48, 384),   # S=W
]
CONFIG_IDS = [f"W{w}-P{p}-G{g}-O{o}-S{s}" for w, p, g, o, s in CONFIGS]

RANGE_OF = {
    "param": BucketLayout.primary_range,
    "grad": BucketLayout.grad_range,
    "optim": BucketLayout.optim_range,
    "secondary": BucketLayout.secondary_range,
}


# ------------------------------------------------------------------ helpers

def groups(L, level):
    return all_groups(level, L.world_size, L.param_group_size, L.grad_group_size,
                      L.optim_group_size, L.secondary_group_size)


def ranks_of(L, level, rank):
    return group_ranks(level, rank, L.world_size, L.param_group_size, L.grad_group_size,
                       L.optim_group_size, L.secondary_group_size)


def levels_of(L):
    S, G = L.secondary_group_size, L.grad_group_size
    present = {"secondary": bool(S), "grad_cross": bool(S) and G % S == 0}
    return [lv for lv in LEVELS if present.get(lv, True)]


def first_diff(expected, actual):
    """Short description of where two lists differ (they may be long)."""
    if len(expected) != len(actual):
        return f"length {len(actual)} != expected {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e != a:
            return f"first difference at element {i}: expected {e}, got {a}"
    return "equal"


def reduce_scatter(inputs, order=None):
    """reduce_scatter_tensor over lists: sum, then chunk i to group rank i."""
    if order is not None:
        inputs = [permute_chunks(x, order) for x in inputs]
    summed = [sum(col) for col in zip(*inputs)]
    c = len(summed) // len(inputs)
    return [summed[i * c:(i + 1) * c] for i in range(len(inputs))]


def all_gather(shards):
    return [x for s in shards for x in s]


def grad_bucket(rank, N, rng=None):
    """Rank's full gradient bucket (or just its ``rng`` part).

    Distinct per rank and per position, so a misplaced chunk changes the sum.
    """
    rng = rng or Range(0, N)
    return [(rank + 1) * 1_000_003 + e for e in range(rng.start, rng.stop)]


def sample_ranks(L):
    W = L.world_size
    return sorted({0, W - 1, (W // 2 + L.param_group_size // 2) % W})


# ------------------------------------------------------------ range checks

def check_padding(L):
    N = L.padded_numel
    assert N >= L.numel, f"padded_numel {N} < numel {L.numel}"
    assert L.padding == N - L.numel >= 0
    for name, size in [("P", L.param_group_size), ("G", L.grad_group_size),
                       ("O", L.optim_group_size), ("O*align", L.optim_group_size * L.align)]:
        assert N % size == 0, f"padded_numel {N} not divisible by {name}={size}"
    if L.secondary_group_size:
        assert N % (L.secondary_group_size * L.align) == 0
        assert L.secondary_size * L.secondary_group_size == N
    else:
        assert L.secondary_size == 0
    unit = math.lcm(L.optim_group_size * L.align, (L.secondary_group_size or 1) * L.align)
    assert N - L.numel < unit, f"padded_numel {N} is not the smallest multiple of {unit}"
    assert L.optim_size % L.align == 0
    assert L.replicas * L.optim_group_size == L.world_size


def check_tiling(L):
    """Within one group of each level the ranges tile [0, N).

    param and secondary must also be in group-rank order (one contiguous
    all-gather), grad in grad_scatter_chunk_order. The O-group itself runs no
    order-sensitive collective (inter and replica do), so optim only tiles.
    """
    N = L.padded_numel
    order = L.grad_scatter_chunk_order
    for level, fn in RANGE_OF.items():
        if level == "secondary" and not L.secondary_group_size:
            assert all(L.secondary_range(r) is None for r in range(L.world_size))
            continue
        for g in groups(L, level):
            rs = [fn(L, r) for r in g]
            c = N // len(g)
            for i, (r, actual) in enumerate(zip(g, rs)):
                if level == "optim":
                    break
                # chunk the collective hands to group rank i
                k = order[i] if level == "grad" else i
                expected = Range(k * c, (k + 1) * c)
                assert actual == expected, (
                    f"level {level} rank {r} (group index {i}): expected {expected}, got {actual}")
            covered = sorted((x.start, x.stop) for x in rs)
            assert covered[0][0] == 0 and covered[-1][1] == N and all(
                a[1] == b[0] for a, b in zip(covered, covered[1:])), (
                f"level {level} group {g[:8]}...: ranges {covered[:8]}... do not tile [0, {N})")


def check_nesting(L):
    for r in range(L.world_size):
        pr, gr, orr = L.primary_range(r), L.grad_range(r), L.optim_range(r)
        assert pr.contains(gr) and gr.contains(orr), (
            f"rank {r}: optim {orr} in grad {gr} in primary {pr} violated")
        assert (pr.size, gr.size, orr.size) == (L.primary_size, L.grad_size, L.optim_size)
        gip, oig, oip = L.grad_in_primary(r), L.optim_in_grad(r), L.optim_in_primary(r)
        assert Range(pr.start + gip.start, pr.start + gip.stop) == gr, (
            f"rank {r}: grad_in_primary {gip} + primary start {pr.start} != grad {gr}")
        assert Range(gr.start + oig.start, gr.start + oig.stop) == orr, (
            f"rank {r}: optim_in_grad {oig} + grad start {gr.start} != optim {orr}")
        assert Range(pr.start + oip.start, pr.start + oip.stop) == orr, (
            f"rank {r}: optim_in_primary {oip} + primary start {pr.start} != optim {orr}")


def check_replicas(L):
    for g in groups(L, "replica"):
        expected = L.optim_range(g[0])
        for r in g:
            assert L.optim_range(r) == expected, (
                f"level replica rank {r}: expected optim {expected}, got {L.optim_range(r)}")


def check_groups(L):
    W = L.world_size
    for level in levels_of(L):
        gs = groups(L, level)
        flat = sorted(itertools.chain.from_iterable(gs))
        assert flat == list(range(W)), f"level {level}: groups do not partition range({W})"
        assert len({len(g) for g in gs}) == 1, f"level {level}: unequal group sizes"
        for g in gs:
            for i, r in enumerate(g):
                assert ranks_of(L, level, r) == g, (
                    f"level {level} rank {r}: group_ranks {ranks_of(L, level, r)} != {g}")
                assert L.group_index(level, r) == i, (
                    f"level {level} rank {r}: group_index {L.group_index(level, r)} != position {i}")


def check_all_ranges(L):
    check_padding(L)
    check_tiling(L)
    check_nesting(L)
    check_replicas(L)
    check_groups(L)


# ------------------------------------------------------- collective models

def check_grad_reduce_scatter(L, rank):
    N, g = L.padded_numel, ranks_of(L, "grad", rank)
    inputs = [grad_bucket(r, N) for r in g]
    outputs = reduce_scatter(inputs, L.grad_scatter_chunk_order)
    for r, out in zip(g, outputs):
        rng = L.grad_range(r)
        expected = [sum(x[e] for x in inputs) for e in range(rng.start, rng.stop)]
        assert out == expected, (
            f"G reduce-scatter, rank {r}, grad_range {rng}: {first_diff(expected, out)}")


def check_param_all_gather(L, rank):
    bucket = list(range(L.padded_numel))
    g = ranks_of(L, "param", rank)
    got = all_gather([bucket[L.primary_range(r).slice] for r in g])
    assert got == bucket, f"P all-gather for group of rank {rank}: {first_diff(bucket, got)}"


def check_secondary_all_gather(L, rank):
    if not L.secondary_group_size:
        return
    bucket = list(range(L.padded_numel))
    g = ranks_of(L, "secondary", rank)
    got = all_gather([bucket[L.secondary_range(r).slice] for r in g])
    assert got == bucket, f"S all-gather for group of rank {rank}: {first_diff(bucket, got)}"


def check_inter(L, rank):
    """Grad shards -> optimizer shards over the inter group, and back."""
    N, g = L.padded_numel, ranks_of(L, "inter", rank)
    grng = L.grad_range(rank)
    for r in g:
        assert L.grad_range(r) == grng, (
            f"inter rank {r}: grad_range {L.grad_range(r)} != {grng} of rank {rank}")
    shards = [grad_bucket(r, N, grng) for r in g]  # the members' 1/G grad shards
    outputs = reduce_scatter(shards)
    for r, out in zip(g, outputs):
        orng = L.optim_range(r)
        expected = [sum(col) for col in zip(*(grad_bucket(m, N, orng) for m in g))]
        assert out == expected, (
            f"inter reduce-scatter, rank {r}, optim_range {orng}: {first_diff(expected, out)}")
    bucket = list(range(N))
    got = all_gather([bucket[L.optim_range(r).slice] for r in g])
    assert got == bucket[grng.slice], (
        f"inter all-gather, rank {rank}, grad_range {grng}: {first_diff(bucket[grng.slice], got)}")


def check_grad_to_param(L, rank):
    bucket = list(range(L.padded_numel))
    g = ranks_of(L, "grad_to_param", rank)
    prng = L.primary_range(rank)
    got = all_gather([bucket[L.grad_range(r).slice] for r in g])
    assert got == bucket[prng.slice], (
        f"grad_to_param all-gather, rank {rank}, primary_range {prng}: "
        f"{first_diff(bucket[prng.slice], got)}")


def check_collectives(L, ranks):
    for r in ranks:
        check_grad_reduce_scatter(L, r)
        check_param_all_gather(L, r)
        check_secondary_all_gather(L, r)
        check_inter(L, r)
        check_grad_to_param(L, r)


def check_end_to_end(L):
    """Whole optimizer-step data flow: G RS, inter RS, replica all-reduce, then back up."""
    N, W = L.padded_numel, L.world_size
    buckets = {r: grad_bucket(r, N) for r in range(W)}
    total = [sum(col) for col in zip(*buckets.values())]
    grad_shard = {}
    for g in groups(L, "grad"):
        for r, out in zip(g, reduce_scatter([buckets[r] for r in g], L.grad_scatter_chunk_order)):
            grad_shard[r] = out
    opt_shard = {}
    for g in groups(L, "inter"):
        for r, out in zip(g, reduce_scatter([grad_shard[r] for r in g])):
            opt_shard[r] = out
    for g in groups(L, "replica"):
        reduced = [sum(col) for col in zip(*(opt_shard[r] for r in g))]
        for r in g:
            rng = L.optim_range(r)
            assert reduced == total[rng.slice], (
                f"end-to-end rank {r}, optim_range {rng}: {first_diff(total[rng.slice], reduced)}")
    # Updated weights back up: 1/O -> 1/G (inter) -> 1/P (grad_to_param) -> full (param).
    weights = list(range(N))
    shard = {r: weights[L.optim_range(r).slice] for r in range(W)}
    for level in ("inter", "grad_to_param", "param"):
        shard = {r: all_gather([shard[m] for m in ranks_of(L, level, r)]) for r in range(W)}
    for r in range(W):
        assert shard[r] == weights, f"end-to-end gather rank {r}: {first_diff(weights, shard[r])}"


# ---------------------------------------------------------- explicit cases

@pytest.mark.parametrize("numel", [1, 7, 1000, 1_000_003])
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_ranges(cfg, numel):
    check_all_ranges(plan_bucket(numel, *cfg))


@pytest.mark.parametrize("numel", [1, 7, 1000])
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_collectives(cfg, numel):
    L = plan_bucket(numel, *cfg)
    check_collectives(L, sample_ranks(L))


def test_collectives_large_odd_bucket():
    L = plan_bucket(1_000_003, 8, 2, 4, 8, 2)
    assert L.padded_numel == 1_000_448 and L.padding == 445
    check_grad_reduce_scatter(L, 7)
    check_param_all_gather(L, 0)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c[0] <= 32], ids=lambda c: str(c))
def test_end_to_end(cfg):
    check_end_to_end(plan_bucket(1000, *cfg, align=4))


def test_docstring_example():
    L = plan_bucket(16, 8, 2, 4, 8, align=1)
    assert L.padded_numel == 16 and L.padding == 0
    table = {0: (0, 0, 0), 1: (8, 8, 8), 2: (0, 4, 4), 3: (8, 12, 12),
             4: (0, 0, 2), 5: (8, 8, 10), 6: (0, 4, 6), 7: (8, 12, 14)}
    for r, (p, g, o) in table.items():
        actual = (L.primary_range(r), L.grad_range(r), L.optim_range(r))
        expected = (Range(p, p + 8), Range(g, g + 4), Range(o, o + 2))
        assert actual == expected, f"rank {r}: expected {expected}, got {actual}"
    assert L.grad_scatter_chunk_order == (0, 2, 1, 3)
    assert ranks_of(L, "inter", 1) == (1, 5)
    assert ranks_of(L, "grad_to_param", 5) == (5, 7)
    assert ranks_of(L, "replica", 3) == (3,)


@pytest.mark.parametrize("W,P,G,O,S,numel,align,expected", [
    (384, 2, 8, 384, 0, 1, 128, 49152),
    (384, 2, 8, 48, 8, 1, 128, 6144),
    (384, 2, 8, 48, 384, 1, 128, 49152),
    (16, 2, 8, 16, 0, 2048, 128, 2048),
    (16, 2, 8, 16, 0, 2049, 128, 4096),
    (12, 1, 4, 4, 3, 1, 1, 12),           # lcm(4, 3)
    (8, 2, 4, 8, 0, 7, 1, 8),
])
def test_padding_values(W, P, G, O, S, numel, align, expected):
    L = plan_bucket(numel, W, P, G, O, S, align)
    assert L.padded_numel == expected, f"padded_numel: expected {expected}, got {L.padded_numel}"
    assert L.padding == expected - numel


@pytest.mark.parametrize("P,G,expected", [
    (1, 8, tuple(range(8))),
    (8, 8, tuple(range(8))),
    (2, 8, (0, 4, 1, 5, 2, 6, 3, 7)),
    (4, 8, (0, 2, 4, 6, 1, 3, 5, 7)),
    (2, 6, (0, 3, 1, 4, 2, 5)),
])
def test_grad_scatter_chunk_order_values(P, G, expected):
    L = plan_bucket(1, G, P, G, G, align=1)
    assert L.grad_scatter_chunk_order == expected
    assert L.grad_scatter_is_identity == (expected == tuple(range(G)))


@pytest.mark.parametrize("P,G", [(1, 4), (2, 4), (2, 8), (4, 8), (3, 12), (8, 8)])
def test_grad_scatter_order_is_the_transpose(P, G):
    """permute_chunks(order) == view(P, G/P, N/G).transpose(0, 1).flatten()."""
    L = plan_bucket(5, G, P, G, G, align=2)
    c, Q = L.grad_size, G // P
    bucket = list(range(L.padded_numel))
    view = [[bucket[(p * Q + q) * c:(p * Q + q + 1) * c] for q in range(Q)] for p in range(P)]
    transposed = [x for q in range(Q) for p in range(P) for x in view[p][q]]
    got = permute_chunks(bucket, L.grad_scatter_chunk_order)
    assert got == transposed, first_diff(transposed, got)


def test_range_basics():
    r = Range(3, 10)
    assert r.size == len(r) == 7 and r.slice == slice(3, 10)
    assert r.contains(Range(3, 3)) and r.contains(r) and not r.contains(Range(2, 4))
    with pytest.raises(LayoutError):
        Range(5, 4)


def test_permute_chunks_errors():
    with pytest.raises(LayoutError, match="len\\(items\\)=5"):
        permute_chunks(list(range(5)), (1, 0))
    with pytest.raises(LayoutError, match="permutation"):
        permute_chunks(list(range(4)), (0, 0))
    with pytest.raises(LayoutError, match="permutation"):
        inverse_order((0, 2))


# ------------------------------------------------------------- validation

BASE = dict(numel=100, world_size=16, param_group_size=2, grad_group_size=8,
            optim_group_size=16, secondary_group_size=0, align=128)

BAD_PLANS = [
    (dict(numel=0), "numel=0 must be >= 1"),
    (dict(numel=-5), "numel=-5"),
    (dict(numel=1.5), "numel=1.5 must be an int"),
    (dict(world_size=0), "world_size=0 must be >= 1"),
    (dict(param_group_size=0), "param_group_size=0 must be >= 1"),
    (dict(param_group_size=True), "param_group_size=True must be an int"),
    (dict(grad_group_size=0), "grad_group_size=0"),
    (dict(optim_group_size=-16), "optim_group_size=-16"),
    (dict(secondary_group_size=-1), "secondary_group_size=-1 must be >= 0"),
    (dict(align=0), "align=0 must be >= 1"),
    (dict(param_group_size=4, grad_group_size=6),
     "grad_group_size=6 must be a multiple of param_group_size=4"),
    (dict(optim_group_size=12), "optim_group_size=12 must be a multiple of grad_group_size=8"),
    (dict(world_size=24), "world_size=24 must be a multiple of optim_group_size=16"),
    (dict(param_group_size=32, grad_group_size=32, optim_group_size=32),
     "world_size=16 must be a multiple of optim_group_size=32"),
    (dict(secondary_group_size=3), "world_size=16 must be a multiple of secondary_group_size=3"),
    (dict(secondary_group_size=32), "world_size=16 must be a multiple of secondary_group_size=32"),
]


@pytest.mark.parametrize("bad,message", BAD_PLANS, ids=[m for _, m in BAD_PLANS])
def test_plan_bucket_errors(bad, message):
    with pytest.raises(LayoutError) as info:
        plan_bucket(**{**BASE, **bad})
    text = str(info.value)
    assert message in text, f"expected message containing {message!r}, got {text!r}"
    assert "\n" not in text, f"message is not one line: {text!r}"
    assert isinstance(info.value, ValueError)


BAD_GROUPS = [
    (dict(level="bogus"), "level='bogus' must be one of"),
    (dict(level="secondary"), "secondary_group_size=0"),
    (dict(rank=16), "rank=16 must be in [0, world_size=16)"),
    (dict(rank=-1), "rank=-1"),
    (dict(grad_group_size=3), "grad_group_size=3 must be a multiple of param_group_size=2"),
]


@pytest.mark.parametrize("bad,message", BAD_GROUPS, ids=[m for _, m in BAD_GROUPS])
def test_group_ranks_errors(bad, message):
    args = dict(level="param", rank=0, world_size=16, param_group_size=2, grad_group_size=8,
                optim_group_size=16, secondary_group_size=0)
    with pytest.raises(LayoutError) as info:
        group_ranks(**{**args, **bad})
    text = str(info.value)
    assert message in text, f"expected message containing {message!r}, got {text!r}"
    assert "\n" not in text


def test_layout_method_errors():
    L = plan_bucket(100, 16, 2, 8, 16)
    with pytest.raises(LayoutError, match="rank=16"):
        L.grad_range(16)
    with pytest.raises(LayoutError, match="secondary_group_size=0"):
        L.group_index("secondary", 0)
    with pytest.raises(LayoutError, match="padded_numel=100 must be a multiple"):
        BucketLayout(100, 100, 16, 2, 8, 16, 0, 128)
    with pytest.raises(LayoutError, match="all_groups|level='x'"):
        all_groups("x", 16, 2, 8, 16)


# --------------------------------------------------------------- properties

@st.composite
def layouts(draw, max_p=4, max_mult=3, max_numel=3000, max_align=4):
    P = draw(st.integers(1, max_p))
    G = P * draw(st.integers(1, 4))
    O = G * draw(st.integers(1, max_mult))
    W = O * draw(st.integers(1, max_mult))
    S = draw(st.sampled_from([0] + [d for d in range(1, W + 1) if W % d == 0]))
    numel = draw(st.integers(1, max_numel))
    align = draw(st.integers(1, max_align))
    return plan_bucket(numel, W, P, G, O, S, align)


@settings(deadline=None, max_examples=150)
@given(layouts(max_align=128, max_numel=10**7))
def test_ranges_property(L):
    check_all_ranges(L)


@settings(deadline=None, max_examples=100)
@given(layouts(), st.integers(0, 10**6))
def test_collectives_property(L, seed):
    check_collectives(L, [seed % L.world_size])


@settings(deadline=None, max_examples=40)
@given(layouts(max_p=3, max_mult=2, max_numel=300, max_align=2))
def test_end_to_end_property(L):
    check_end_to_end(L)


@settings(deadline=None, max_examples=100)
@given(st.integers(1, 12), st.integers(1, 6), st.randoms(use_true_random=False))
def test_permute_roundtrip(n, chunk, rnd):
    order = list(range(n))
    rnd.shuffle(order)
    items = list(range(n * chunk))
    permuted = permute_chunks(items, order)
    for i, k in enumerate(order):
        assert permuted[i * chunk:(i + 1) * chunk] == items[k * chunk:(k + 1) * chunk]
    assert permute_chunks(permuted, inverse_order(order)) == items
    assert inverse_order(inverse_order(order)) == tuple(order)
