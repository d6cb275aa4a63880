"""Unit tests of megatron_lbp.core.costs: collective byte rules, memory and traffic per rank.

Configs are small stand-in objects (only the attributes costs.py reads), so these
tests do not depend on megatron_lbp.core.config or megatron_lbp.core.topology. The
end-to-end comparison against docs/design.md §2 lives in tests/launch/test_plan.py.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from megatron_lbp.core import costs

ALL_NETWORK = dict.fromkeys(costs.TRAFFIC_FAMILIES, "network")


def cfg(W, P, G, O, S=0, sdt="int8"):
    return SimpleNamespace(world_size=W, param_group_size=P, grad_group_size=G,
                           optim_group_size=O, secondary_group_size=S, secondary_dtype=sdt)


# --- collective rules --------------------------------------------------------------------


@pytest.mark.parametrize("total,n,expected", [(100, 1, 0), (100, 2, 50), (120, 4, 90),
                                              (0, 8, 0), (384, 384, 383)])
def test_allgather_and_reduce_scatter_send_t_times_n_minus_1_over_n(total, n, expected):
    assert costs.allgather_bytes(total, n) == expected
    assert costs.reduce_scatter_bytes(total, n) == expected


def test_uneven_allgather_is_an_error():
    with pytest.raises(AssertionError, match="not even"):
        costs.allgather_bytes(10, 3)


def test_allreduce_is_twice_reduce_scatter_and_exact_fraction():
    assert costs.allreduce_bytes(100, 1) == 0
    assert costs.allreduce_bytes(100, 2) == 100
    assert costs.allreduce_bytes(10, 3) == pytest.approx(2 * 10 * 2 / 3)


def test_secondary_slice_bytes_int8_carries_one_fp32_scale_per_block():
    assert costs.secondary_slice_bytes(256, "int8", 256) == 256 + 4
    assert costs.secondary_slice_bytes(257, "int8", 256) == 257 + 8
    assert costs.secondary_slice_bytes(1000, "bf16", 256) == 2000
    with pytest.raises(ValueError, match="secondary dtype"):
        costs.secondary_slice_bytes(10, "fp8")


# --- padding -----------------------------------------------------------------------------


@pytest.mark.parametrize("W,P,G,O,S,numel,expected", [
    (8, 2, 4, 8, 0, 1, 8 * 128),
    (8, 2, 4, 8, 0, 8 * 128, 8 * 128),
    (8, 2, 4, 8, 0, 8 * 128 + 1, 16 * 128),
    (16, 1, 16, 16, 8, 5, 16 * 128),          # lcm(16*128, 8*128)
    (24, 2, 8, 8, 3, 5, 24 * 128),            # lcm(8*128, 3*128)
    (384, 2, 8, 384, 8, 20_000_000_000, 20_000_047_104),
])
def test_padding_is_smallest_multiple_of_lcm(W, P, G, O, S, numel, expected):
    n = costs.padded_numel(numel, cfg(W, P, G, O, S))
    assert n == expected, f"padded_numel({numel}) for W={W} P={P} G={G} O={O} S={S}: {n} != {expected}"


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([(8, 1, 8, 8), (8, 2, 4, 8), (16, 2, 8, 16), (24, 2, 8, 8), (12, 3, 6, 12)]),
       st.sampled_from([0, 2, 3, 4, 8]), st.integers(1, 10**7), st.sampled_from([1, 64, 128]))
def test_padding_is_minimal_and_divides_every_level(sizes, S, numel, align):
    W, P, G, O = sizes
    if S and W % S:
        S = 0
    c = cfg(W, P, G, O, S)
    n = costs.padded_numel(numel, c, align)
    assert numel <= n < numel + math.lcm(O * align, S * align if S else 1)
    for d in (P, G, O, S or 1):
        assert n % d == 0


def test_split_buckets():
    assert costs.split_buckets(10) == [10]
    assert costs.split_buckets(10, 4) == [4, 4, 2]
    assert costs.split_buckets(8, 4) == [4, 4]
    assert costs.split_buckets(3, 100) == [3]
    with pytest.raises(ValueError):
        costs.split_buckets(0)


# --- memory ------------------------------------------------------------------------------


def test_memory_lbp_s8_exact():
    # W=16, P=2, G=8, O=16, S=8: unit lcm(16*128, 8*128) = 2048; N = 2048*1000.
    N = 2048 * 1000
    m = costs.memory_bytes(cfg(16, 2, 8, 16, 8), [N])
    expected = {"primary": 2 * N // 2, "secondary": N // 8 + 4 * math.ceil(N / 8 / 256),
                "grad": 4 * N // 8, "optimizer": 12 * N // 16}
    expected["total"] = sum(expected.values())
    assert m == expected


def test_memory_fp32_weights_have_no_separate_master_and_bf16_secondary():
    N = 2048 * 10
    m = costs.memory_bytes(cfg(16, 2, 8, 16, 8, "bf16"), [N], param_dtype="fp32", grad_dtype="bf16")
    assert m["primary"] == 4 * N // 2
    assert m["secondary"] == 2 * N // 8
    assert m["grad"] == 2 * N // 8
    assert m["optimizer"] == 8 * N // 16, "fp32 weights: only Adam m and v (8 bytes) per element"


def test_memory_sums_over_padded_buckets():
    c = cfg(8, 2, 4, 8)
    one = costs.memory_bytes(c, [1])
    assert one["primary"] == 2 * 1024 // 2  # one element pads to 8*128
    two = costs.memory_bytes(c, [1, 1])
    assert two == {k: 2 * v for k, v in one.items()}
    assert all(isinstance(v, int) for v in two.values())


def test_construction_peak_is_the_largest_of_its_three_moments():
    # W=8 zero3-like (P=G=O=8), bf16 weights, fp32 grads; unit 8*128 = 1024.
    c = cfg(8, 8, 8, 8)
    small, large = 1024 * 10, 1024 * 300
    m = costs.memory_bytes(c, [small, large])
    slices = m["primary"] + m["secondary"] + m["grad"]
    want = max(m["primary"] + 2 * large, slices + 4 * large, m["total"])
    assert costs.construction_peak_bytes(c, [small, large]) == want == slices + 4 * large
    # Many buckets: the optimizer slices outgrow one bucket's transient buffers.
    many = [large] * 40
    assert costs.construction_peak_bytes(c, many) == costs.memory_bytes(c, many)["total"]


# --- traffic -----------------------------------------------------------------------------


def test_traffic_lbp_every_phase_exact():
    W, P, G, O, S, k = 32, 2, 8, 32, 8, 3
    N = 4096 * 7  # unit lcm(32*128, 8*128) = 4096
    classes = {"param": "package", "secondary": "node", "grad": "node", "inter": "network",
               "grad_to_param": "node", "replica": "package"}
    by_class, by_phase = costs.traffic_bytes(cfg(W, P, G, O, S), [N], classes, micro_batches=k)
    slice_ = N // S + 4 * math.ceil(N / S / 256)
    exp_phase = {
        "forward_gather": {"package": k * 2 * N * (P - 1) // P},
        "backward_gather": {"node": k * slice_ * (S - 1)},
        "grad_reduce": {"node": k * 4 * N * (G - 1) // G},
        "step_reduce": {"network": (4 * N // G) * (O // G - 1) // (O // G)},
        "step_gather": {"network": (2 * N // G) * (O // G - 1) // (O // G),
                        "node": (2 * N // P) * (G // P - 1) // (G // P)},
    }
    for ph in costs.PHASES:
        for c in costs.LINK_CLASS_ORDER:
            want = exp_phase[ph].get(c, 0)
            assert by_phase[ph][c] == want, f"{ph}/{c}: {by_phase[ph][c]} != {want}"
    for c in costs.LINK_CLASS_ORDER:
        assert by_class[c] == sum(by_phase[ph][c] for ph in costs.PHASES)
        assert isinstance(by_class[c], int)


def test_traffic_without_secondary_regathers_primary_in_backward():
    N = 1024 * 5
    _, ph = costs.traffic_bytes(cfg(8, 2, 4, 8), [N], {"param": "package", "grad": "node",
                                                      "inter": "node", "grad_to_param": "node"},
                                micro_batches=2)
    assert ph["backward_gather"] == ph["forward_gather"] == {"package": 2 * N, "node": 0, "network": 0}


def test_single_rank_groups_cost_nothing_and_need_no_class():
    # zero2: P=1 (no weight gathers), G=O=W (inter and replica groups are single ranks).
    N = 1024
    by_class, ph = costs.traffic_bytes(cfg(8, 1, 8, 8), [N], {"grad": "network",
                                                              "grad_to_param": "network"})
    assert ph["forward_gather"] == ph["backward_gather"] == {"package": 0, "node": 0, "network": 0}
    assert ph["step_reduce"] == {"package": 0, "node": 0, "network": 0}
    # grad reduce-scatter + all-gather of the updated weights 1/G -> 1/P = full.
    assert by_class == {"package": 0, "node": 0, "network": 4 * N * 7 // 8 + 2 * N * 7 // 8}


def test_missing_link_class_is_reported():
    with pytest.raises(ValueError, match="family 'inter'"):
        costs.traffic_bytes(cfg(16, 2, 8, 16), [2048], {"param": "package", "grad": "node",
                                                        "grad_to_param": "node"})


def test_hsdp_replica_allreduce_and_fractional_result_is_float():
    # W=24, O=G=P=8 -> R=3: all-reduce of 4*N/8 bytes, 2*T*2/3 per rank.
    c = cfg(24, 8, 8, 8)
    N = 1024
    by_class, ph = costs.traffic_bytes(c, [N], {"param": "node", "grad": "node",
                                                "replica": "network"})
    T = 4 * N // 8
    assert ph["step_reduce"]["network"] == pytest.approx(2 * T * 2 / 3, rel=1e-15)
    assert isinstance(ph["step_reduce"]["network"], float)
    assert ph["step_gather"] == {"package": 0, "node": 0, "network": 0}


def test_micro_batches_scale_per_micro_batch_phases_only():
    c = cfg(16, 2, 8, 16, 2)
    classes = {"param": "package", "secondary": "package", "grad": "node", "inter": "network",
               "grad_to_param": "node"}
    _, one = costs.traffic_bytes(c, [10**6], classes, micro_batches=1)
    _, four = costs.traffic_bytes(c, [10**6], classes, micro_batches=4)
    for ph in costs.PHASES:
        f = 4 if ph in ("forward_gather", "backward_gather", "grad_reduce") else 1
        assert four[ph] == {k: f * v for k, v in one[ph].items()}, ph


def test_estimate_reports_padding():
    e = costs.estimate(cfg(8, 2, 4, 8), [1000, 5000], ALL_NETWORK)
    assert e["params"] == 6000
    assert e["padded_bucket_numels"] == [1024, 5120]
    assert e["padded_params"] == 6144
    assert set(e["memory_bytes"]) == set(costs.MEMORY_STATES)
    assert set(e["traffic_by_phase"]) == set(costs.PHASES)


def test_bad_sizes_and_dtypes():
    with pytest.raises(ValueError, match="grad_group_size=4 must be a multiple of param_group_size=3"):
        costs.memory_bytes(cfg(8, 3, 4, 8), [10])
    with pytest.raises(ValueError, match="param_dtype"):
        costs.memory_bytes(cfg(8, 2, 4, 8), [10], param_dtype="fp8")
    with pytest.raises(ValueError, match="micro_batches"):
        costs.traffic_bytes(cfg(8, 2, 4, 8), [10], ALL_NETWORK, micro_batches=0)


# --- model size --------------------------------------------------------------------------


# Counts of sum(p.numel() for p in GPTModel(...).parameters()) measured with
# megatron-core 0.19.2, get_gpt_layer_local_spec(), 4 attention heads.
@pytest.mark.parametrize("L,h,V,f,s,pe,tied,measured", [
    (2, 64, 128, None, 32, "learned_absolute", True, 110336),
    (3, 32, 100, 48, 16, "rope", False, 28976),
    (1, 16, 50, None, 8, "learned_absolute", False, 5040),
])
def test_gpt_param_count_matches_megatron_core(L, h, V, f, s, pe, tied, measured):
    got = costs.gpt_param_count(L, h, V, seq_length=s if pe == "learned_absolute" else None,
                                ffn_hidden_size=f, tied=tied)
    assert got == measured


def test_gpt_param_count_formula():
    L, h, V = 44, 6144, 51200
    assert costs.gpt_param_count(L, h, V) == L * (12 * h * h + 13 * h) + 2 * h + V * h
    assert costs.gpt_param_count(L, h, V, seq_length=2048) == \
        costs.gpt_param_count(L, h, V) + 2048 * h
    assert costs.gpt_param_count(L, h, V, seq_length=2048, position_embedding_type="rope") == \
        costs.gpt_param_count(L, h, V)
    assert costs.gpt_param_count(L, h, V, tied=False) == costs.gpt_param_count(L, h, V) + V * h
    with pytest.raises(ValueError, match="hidden_size"):
        costs.gpt_param_count(2, 0, 10)


def test_gb_text_keeps_the_three_formats_it_replaced():
    # The plan table, the checkpoint retention lines and the training log each printed GB
    # with their own f-string (issue 27 item 6): one formatter, the same text.
    for n in (0, 1, 999_999, 9_999_999, 10_000_000, 99_999_999, 100_000_000, 123_456_789,
              2.5e9, 64e9, 1.23456789e12):
        assert costs.gb_text(n, 3, width=10, unit=False) == f"{n / 1e9:10.3f}", n
        old_ckpt = f"{n / 1e9:.2f} GB" if n >= 0.1 * 1e9 else f"{n / 1e6:.2f} MB"
        assert costs.gb_text(n, 2, mb_below=0.1 * 1e9) == old_ckpt, n
        old_log = f"{n / 1e9:.4f} GB" if n >= 1e7 else f"{n / 1e6:.3f} MB"
        assert costs.gb_text(n, 4, mb_below=1e7, mb_digits=3) == old_log, n
