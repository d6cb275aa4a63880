"""The quantization flags: semantics, presets, bad input, and what the plan charges for them.

Flags: --hier-quant-block-size B, --hier-quantize-weight-gather (qwZ),
--hier-quantize-grad-reduce (qgZ), plus --hier-secondary-dtype for the
secondary copy. Every refusal is one line naming the flag, raised before
anything trains (the plan tool exits 2 with it).
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from megatron_lbp.core import costs
from megatron_lbp.launch import plan
from megatron_lbp.core.config import (
    DEFAULT_QUANT_BLOCK_SIZE,
    QUANT_KERNEL_ALIGN,
    HierConfig,
    HierConfigError,
    add_hier_arguments,
    check_quantized_grad_families,
    check_training_dtypes,
    hier_config_from_args,
    resolve_hier_config,
)


def one_line(err, *needles):
    msg = str(err)
    assert "\n" not in msg, f"message spans lines: {msg!r}"
    for n in needles:
        assert n in msg, f"{n!r} missing from: {msg!r}"


def parse(argv, world=16):
    args = add_hier_arguments(argparse.ArgumentParser()).parse_args(argv)
    return hier_config_from_args(args, world)


# --------------------------------------------------------------------------- semantics


def test_constants_mirror_the_kernels():
    quant = pytest.importorskip("megatron_lbp.quant")
    assert DEFAULT_QUANT_BLOCK_SIZE == quant.DEFAULT_BLOCK_SIZE == costs.DEFAULT_QUANT_BLOCK
    assert QUANT_KERNEL_ALIGN == quant.KERNEL_ALIGN


def test_defaults_off_and_zeropp_implies_qwz():
    lbp = parse([])
    assert (lbp.quant_block_size, lbp.quantize_weight_gather, lbp.quantize_grad_reduce) == \
        (256, False, False)
    assert parse(["--hier-preset", "zeropp"]).quantize_weight_gather is True
    off = parse(["--hier-preset", "zeropp", "--no-hier-quantize-weight-gather"])
    assert off.quantize_weight_gather is False and off.secondary_group_size == 8
    on = parse(["--hier-quantize-weight-gather", "--hier-quantize-grad-reduce",
                "--hier-quant-block-size", "128"])
    assert (on.preset, on.quant_block_size, on.quantize_weight_gather,
            on.quantize_grad_reduce) == ("lbp", 128, True, True)
    assert HierConfig(**on.as_dict()) == on


def test_zeropp_on_one_rank_has_nothing_to_gather_and_no_qwz():
    assert resolve_hier_config(1, preset="zeropp").quantize_weight_gather is False


# --------------------------------------------------------------------------- bad input

BAD = [
    # (argv, world, needles in the one-line message)
    (["--hier-quant-block-size", "0"], 16, ["--hier-quant-block-size=0", "multiple of 64"]),
    (["--hier-quant-block-size", "-64"], 16, ["--hier-quant-block-size=-64", "positive"]),
    (["--hier-quant-block-size", "100"], 16, ["--hier-quant-block-size=100", "multiple of 64"]),
    (["--hier-quant-block-size", "32"], 16, ["--hier-quant-block-size=32", "wavefront"]),
    (["--hier-preset", "zero2", "--hier-quantize-weight-gather"], 16,
     ["--hier-quantize-weight-gather", "--hier-param-group-size=1 (preset zero2"]),
    (["--hier-param-group-size", "1", "--hier-quantize-weight-gather"], 16,
     ["--hier-quantize-weight-gather", "--hier-param-group-size=1"]),
    (["--hier-secondary-group-size", "3"], 16, ["--hier-secondary-group-size=3", "S | W"]),
]


@pytest.mark.parametrize("argv,world,needles", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_flags_fail_in_one_line(argv, world, needles):
    with pytest.raises(HierConfigError) as err:
        parse(argv, world)
    one_line(err.value, *needles)


def test_direct_construction_checks_block_size_and_bools():
    d = resolve_hier_config(16).as_dict()
    with pytest.raises(HierConfigError, match="--hier-quant-block-size=96"):
        HierConfig(**{**d, "quant_block_size": 96})
    with pytest.raises(HierConfigError, match="--hier-quantize-grad-reduce=1"):
        HierConfig(**{**d, "quantize_grad_reduce": 1})


@pytest.mark.parametrize("S,sdt,dtype,refused", [
    (2, "int8", "fp32", True), (8, "int8", "fp32", True),
    (2, "bf16", "fp32", False), (2, "int8", "bf16", False), (2, "int8", "fp16", False),
    (0, "int8", "fp32", False),
])
def test_int8_secondary_of_fp32_weights_is_refused(S, sdt, dtype, refused):
    cfg = resolve_hier_config(16, secondary_group_size=S, secondary_dtype=sdt)
    if not refused:
        check_training_dtypes(cfg, dtype)
        return
    with pytest.raises(HierConfigError) as err:
        check_training_dtypes(cfg, dtype)
    one_line(err.value, "--hier-secondary-dtype=int8", "fp32", "halve", "bf16")


def test_qgz_without_a_cross_node_reduce_is_refused():
    cfg = resolve_hier_config(8, gpus_per_node=8, quantize_grad_reduce=True)  # one node
    links = {"param": "package", "grad": "node", "inter": None}
    families = costs.quantized_grad_families(cfg, links)
    assert families == ()
    with pytest.raises(HierConfigError) as err:
        check_quantized_grad_families(cfg, families)
    one_line(err.value, "--hier-quantize-grad-reduce", "nothing to quantize",
             "--hier-grad-group-size=8", "O/G=1")
    check_quantized_grad_families(resolve_hier_config(8, gpus_per_node=8), ())  # off: fine


# --------------------------------------------------------------------------- costs


def ns(W, P, G, O, S=0, sdt="int8", qwz=False, qgz=False, block=256):
    return SimpleNamespace(world_size=W, param_group_size=P, grad_group_size=G,
                           optim_group_size=O, secondary_group_size=S, secondary_dtype=sdt,
                           quantize_weight_gather=qwz, quantize_grad_reduce=qgz,
                           quant_block_size=block)


def q(n, block=256):
    """int8 payload, written out: a byte per element and a 4-byte scale per started block."""
    return n + 4 * ((n + block - 1) // block)


NET = dict.fromkeys(costs.TRAFFIC_FAMILIES, "network")
LBP_LINKS = {"param": "package", "secondary": "package", "grad": "node", "inter": "network",
             "grad_to_param": "node", "replica": None}


def test_qwz_charges_p_minus_1_quantized_slices_forward_and_backward():
    N = 16 * 128 * 5  # no padding for W=16
    plain = costs.traffic_bytes(ns(16, 16, 16, 16), [N], NET, param_dtype="bf16")[1]
    quant = costs.traffic_bytes(ns(16, 16, 16, 16, qwz=True), [N], NET, param_dtype="bf16")[1]
    assert plain["forward_gather"]["network"] == 2 * N * 15 // 16
    assert quant["forward_gather"]["network"] == 15 * q(N // 16)
    assert quant["backward_gather"] == quant["forward_gather"]  # S = 0: regathered with qwZ
    with_s = costs.traffic_bytes(ns(16, 16, 16, 16, S=8, qwz=True), [N], NET)[1]
    assert with_s["backward_gather"]["network"] == 7 * q(N // 8)  # secondary, not qwZ


@pytest.mark.parametrize("block", [64, 256, 1024])
def test_qgz_charges_n_minus_1_quantized_chunks_on_cross_node_families(block):
    N = 16 * 128 * 7
    cfg = ns(16, 2, 8, 16, qgz=True, block=block)
    assert costs.quantized_grad_families(cfg, LBP_LINKS) == ("inter",)
    ph = costs.traffic_bytes(cfg, [N], LBP_LINKS)[1]
    assert ph["step_reduce"]["network"] == 1 * q(N // 16, block)    # O/G = 2: one peer
    assert ph["grad_reduce"]["node"] == 4 * N * 7 // 8                # in-node: fp32 as before
    zpp = ns(16, 16, 16, 16, qgz=True, block=block)
    assert costs.quantized_grad_families(zpp, NET) == ("grad",)
    ph = costs.traffic_bytes(zpp, [N], NET, micro_batches=3)[1]
    assert ph["grad_reduce"]["network"] == 3 * 15 * q(N // 16, block)


def test_quantization_does_not_change_persistent_memory():
    N = 16 * 128 * 3
    for cfg in (ns(16, 2, 8, 16, qwz=True, qgz=True), ns(16, 2, 8, 16)):
        mem = costs.memory_bytes(cfg, [N])
        assert mem["secondary"] == 0 and mem["primary"] == 2 * N // 2
    assert costs.memory_bytes(ns(16, 2, 8, 16, S=8, block=64), [N])["secondary"] == q(N // 8, 64)


# --------------------------------------------------------------------------- plan tool


def run_plan(argv, capsys):
    rc = plan.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,needles", [
    (["--quant-block-size", "100"], ["--quant-block-size=100", "multiple of 64"]),
    (["--hier-quant-block-size", "0"], ["--hier-quant-block-size=0"]),
    (["--hier-secondary-group-size", "8", "--params-dtype", "fp32"],
     ["--hier-secondary-dtype=int8", "--params-dtype bf16"]),
    (["--hier-quantize-grad-reduce", "--world-size", "8"], ["--hier-quantize-grad-reduce"]),
    (["--preset", "zero2", "--hier-quantize-weight-gather"], ["--hier-quantize-weight-gather"]),
])
def test_plan_refuses_bad_quantization_in_one_line(argv, needles, capsys):
    full = ["--world-size", "16", "--params", "1e9", *argv]
    rc, out, err = run_plan(full, capsys)
    assert rc == 2 and out == "", (rc, out)
    line = err.strip()
    assert "\n" not in line, err
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"


def test_plan_reports_quantization_and_its_bytes(capsys):
    M = 16 * 128 * 1000
    argv = ["--world-size", "16", "--params", str(M), "--hier-quantize-weight-gather",
            "--hier-quantize-grad-reduce", "--hier-quant-block-size", "128", "--json"]
    rc, out, err = run_plan(argv, capsys)
    assert rc == 0, err
    import json

    got = json.loads(out)
    assert (got["quant_block_size"], got["quantize_weight_gather"],
            got["quantize_grad_reduce"]) == (128, True, ["inter"])
    ph = got["traffic_by_phase"]
    assert ph["forward_gather"]["package"] == q(M // 2, 128)           # P = 2: one peer
    assert ph["step_reduce"]["network"] == q(M // 16, 128)             # O/G = 2: one peer
    rc, text, _ = run_plan(argv[:-1], capsys)
    assert "int8 weight gathers (qwZ)" in text and "qgZ) in inter" in text, text
