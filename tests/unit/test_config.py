"""Unit tests for megatron_lbp.core.config: presets, overrides, validation, argparse."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_lbp.core import config as C
from megatron_lbp.core.config import (
    PRESETS,
    SECONDARY_DTYPES,
    HierConfig,
    HierConfigError,
    add_hier_arguments,
    hier_config_from_args,
    resolve_hier_config,
)


def sizes(cfg: HierConfig) -> tuple[int, int, int, int]:
    return (cfg.param_group_size, cfg.secondary_group_size, cfg.grad_group_size,
            cfg.optim_group_size)


def expected_preset(preset: str, w: int, gpn: int, pkg: int = 2) -> tuple[int, int, int, int]:
    """(P, S, G, O) straight from docs/design.md §3, written out independently of the code."""
    node, pack = min(gpn, w), min(pkg, w)
    return {
        "lbp": (pack, 0, node, w),
        "zero3": (w, 0, w, w),
        "zeropp": (w, node, w, w),
        "zero2": (1, 0, w, w),
        "hsdp": (node, 0, node, node),
    }[preset]


def assert_one_line_naming(err: Exception, *needles: str) -> None:
    msg = str(err)
    assert "\n" not in msg, f"message spans lines: {msg!r}"
    for needle in needles:
        assert needle in msg, f"{needle!r} missing from message: {msg!r}"


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("world", [8, 16, 384])
@pytest.mark.parametrize("gpn", [8, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_table(preset, world, gpn):
    cfg = resolve_hier_config(world, gpus_per_node=gpn, preset=preset)
    want = expected_preset(preset, world, gpn)
    assert sizes(cfg) == want, f"{preset} W={world} gpn={gpn}: (P,S,G,O) {sizes(cfg)} != {want}"
    assert cfg.preset == preset
    assert cfg.world_size == world and cfg.gpus_per_node == gpn and cfg.gcds_per_package == 2
    assert cfg.replicas == world // want[3]


def test_default_preset_is_lbp_frontier_shape():
    cfg = resolve_hier_config(384)
    assert (cfg.preset, sizes(cfg), cfg.secondary_dtype, cfg.replicas) == \
        ("lbp", (2, 0, 8, 384), "int8", 1)


@pytest.mark.parametrize("world,want", [(1, (1, 0, 1, 1)), (2, (2, 0, 2, 2)), (4, (2, 0, 4, 4))])
def test_small_worlds_clamp_node_and_package(world, want):
    assert sizes(resolve_hier_config(world)) == want


def test_hsdp_replicas():
    cfg = resolve_hier_config(384, preset="hsdp")
    assert (cfg.optim_group_size, cfg.replicas) == (8, 48)


# --------------------------------------------------------------------------- overrides


@pytest.mark.parametrize("kwargs,want", [
    (dict(param_group_size=1), (1, 0, 8, 16)),
    (dict(secondary_group_size=2), (2, 2, 8, 16)),
    (dict(secondary_group_size=8), (2, 8, 8, 16)),
    (dict(optim_group_size=8), (2, 0, 8, 8)),
    (dict(param_group_size=4, grad_group_size=4, optim_group_size=4, secondary_group_size=16),
     (4, 16, 4, 4)),
    (dict(grad_group_size=16), (2, 0, 16, 16)),
])
def test_lbp_overrides(kwargs, want):
    cfg = resolve_hier_config(16, **kwargs)
    assert sizes(cfg) == want, f"{kwargs}: {sizes(cfg)} != {want}"
    assert cfg.replicas == 16 // want[3]


@pytest.mark.parametrize("s", [0, 2, 16])
def test_zeropp_secondary_may_be_overridden(s):
    assert resolve_hier_config(16, preset="zeropp", secondary_group_size=s).secondary_group_size == s


@pytest.mark.parametrize("preset", PRESETS)
def test_explicit_value_equal_to_preset_is_fine(preset):
    p, s, g, o = expected_preset(preset, 16, 8)
    cfg = resolve_hier_config(16, preset=preset, param_group_size=p, secondary_group_size=s,
                              grad_group_size=g, optim_group_size=o)
    assert sizes(cfg) == (p, s, g, o)


def test_secondary_dtype_bf16():
    assert resolve_hier_config(16, secondary_group_size=8, secondary_dtype="bf16").secondary_dtype == "bf16"


LOCKED = [
    # preset, keyword, contradicting value, description of the locked value
    ("zero3", "grad_group_size", 8, "the world size 16"),
    ("zero3", "param_group_size", 2, "the world size 16"),
    ("zero3", "optim_group_size", 8, "the world size 16"),
    ("zero3", "secondary_group_size", 8, "0"),
    ("zeropp", "param_group_size", 2, "the world size 16"),
    ("zeropp", "grad_group_size", 8, "the world size 16"),
    ("zeropp", "optim_group_size", 8, "the world size 16"),
    ("zero2", "param_group_size", 2, "1"),
    ("zero2", "grad_group_size", 8, "the world size 16"),
    ("zero2", "optim_group_size", 8, "the world size 16"),
    ("zero2", "secondary_group_size", 2, "0"),
    ("hsdp", "param_group_size", 2, "the GPUs per node 8"),
    ("hsdp", "grad_group_size", 16, "the GPUs per node 8"),
    ("hsdp", "optim_group_size", 16, "the GPUs per node 8"),
    ("hsdp", "secondary_group_size", 8, "0"),
]


@pytest.mark.parametrize("preset,field,value,fixed", LOCKED)
def test_locked_sizes_contradict(preset, field, value, fixed):
    with pytest.raises(HierConfigError) as info:
        resolve_hier_config(16, preset=preset, **{field: value})
    flag = C.FLAGS[field]
    assert_one_line_naming(info.value, f"{flag}={value}", f"--hier-preset {preset}",
                           "contradicts", f"fixes it to {fixed}")


def test_contradiction_message_reads_as_documented():
    with pytest.raises(HierConfigError) as info:
        resolve_hier_config(16, preset="zero3", grad_group_size=8)
    assert str(info.value) == ("--hier-grad-group-size=8 contradicts --hier-preset zero3 "
                               "(which fixes it to the world size 16)")


# --------------------------------------------------------------------------- bad input

BAD = [
    # kwargs, world, substrings the one-line message must contain
    (dict(), 0, ["--hier-world-size=0", ">= 1"]),
    (dict(), -3, ["--hier-world-size=-3", ">= 1"]),
    (dict(gpus_per_node=0), 16, ["--hier-gpus-per-node=0", ">= 1"]),
    (dict(gcds_per_package=0), 16, ["--hier-gcds-per-package=0", ">= 1"]),
    (dict(gpus_per_node=8, gcds_per_package=3), 16,
     ["--hier-gcds-per-package=3", "--hier-gpus-per-node=8", "must divide"]),
    (dict(param_group_size=0), 16, ["--hier-param-group-size=0", ">= 1"]),
    (dict(param_group_size=-2), 16, ["--hier-param-group-size=-2", ">= 1"]),
    (dict(grad_group_size=0), 16, ["--hier-grad-group-size=0", ">= 1"]),
    (dict(optim_group_size=0), 16, ["--hier-optim-group-size=0", ">= 1"]),
    (dict(secondary_group_size=-1), 16, ["--hier-secondary-group-size=-1", ">= 0"]),
    (dict(param_group_size=2.0), 16, ["--hier-param-group-size=2.0", "integer"]),
    (dict(grad_group_size="8"), 16, ["--hier-grad-group-size=8", "integer"]),
    (dict(optim_group_size=True), 16, ["--hier-optim-group-size=True", "integer"]),
    (dict(param_group_size=4, grad_group_size=6, optim_group_size=12), 24,
     ["--hier-param-group-size=4", "--hier-grad-group-size=6", "P | G"]),
    (dict(grad_group_size=8, optim_group_size=12), 24,
     ["--hier-grad-group-size=8", "--hier-optim-group-size=12", "G | O"]),
    (dict(optim_group_size=32), 16, ["--hier-optim-group-size=32", "world size 16", "O <= W"]),
    (dict(grad_group_size=4, optim_group_size=12), 16,
     ["--hier-optim-group-size=12", "world size 16", "O | W"]),
    (dict(secondary_group_size=3), 16, ["--hier-secondary-group-size=3", "world size 16", "S | W"]),
    (dict(preset="zero4"), 16, ["--hier-preset=zero4", "unknown", "lbp"]),
    (dict(secondary_dtype="fp8"), 16, ["--hier-secondary-dtype=fp8", "unknown", "int8"]),
    # Defaults that do not fit say where the value came from.
    (dict(), 12, ["--hier-grad-group-size=8", "preset lbp default", "G | O"]),
    (dict(preset="hsdp"), 12, ["--hier-optim-group-size=8", "preset hsdp default", "O | W"]),
]


@pytest.mark.parametrize("kwargs,world,needles", BAD,
                         ids=[f"{i}-{'-'.join(map(str, k.items()))}-W{w}"
                              for i, (k, w, _) in enumerate(BAD)])
def test_bad_input(kwargs, world, needles):
    with pytest.raises(HierConfigError) as info:
        resolve_hier_config(world, **kwargs)
    assert_one_line_naming(info.value, *needles)


def test_explicit_values_are_checked_before_the_preset_lock():
    # A negative size is reported as such, not as a contradiction of zero3.
    with pytest.raises(HierConfigError, match=r"--hier-grad-group-size=-8 is invalid"):
        resolve_hier_config(16, preset="zero3", grad_group_size=-8)


def test_error_is_a_value_error():
    assert issubclass(HierConfigError, ValueError)


@settings(max_examples=200, deadline=None)
@given(world=st.sampled_from([1, 2, 4, 6, 8, 12, 16, 24, 32, 48]),
       gpn=st.sampled_from([1, 2, 4, 8]),
       preset=st.sampled_from(PRESETS + (None,)),
       p=st.one_of(st.none(), st.integers(-1, 20)),
       g=st.one_of(st.none(), st.integers(-1, 50)),
       o=st.one_of(st.none(), st.integers(-1, 50)),
       s=st.one_of(st.none(), st.integers(-1, 50)))
def test_any_input_gives_a_valid_config_or_one_line_error(world, gpn, preset, p, g, o, s):
    try:
        cfg = resolve_hier_config(world, gpus_per_node=gpn, gcds_per_package=1, preset=preset,
                                  param_group_size=p, grad_group_size=g, optim_group_size=o,
                                  secondary_group_size=s)
    except HierConfigError as err:
        assert "\n" not in str(err) and "--hier-" in str(err), str(err)
        return
    P, S, G, O = sizes(cfg)
    assert G % P == 0 and O % G == 0 and world % O == 0, sizes(cfg)
    assert S == 0 or world % S == 0, sizes(cfg)
    for given_value, got in ((p, P), (g, G), (o, O), (s, S)):
        assert given_value is None or given_value == got, (given_value, got)


# --------------------------------------------------------------------------- dataclass


def test_config_is_frozen_and_round_trips():
    cfg = resolve_hier_config(16, secondary_group_size=8, optim_group_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.world_size = 8  # type: ignore[misc]
    d = cfg.as_dict()
    assert d == {"world_size": 16, "param_group_size": 2, "grad_group_size": 8,
                 "optim_group_size": 8, "secondary_group_size": 8, "secondary_dtype": "int8",
                 "gpus_per_node": 8, "gcds_per_package": 2, "preset": "lbp",
                 "quant_block_size": 256, "quantize_weight_gather": False,
                 "quantize_grad_reduce": False, "secondary_scope": "backward",
                 "grad_quant_scheme": "int8"}
    assert HierConfig(**d) == cfg and cfg.replicas == 2


def test_direct_construction_is_validated():
    d = resolve_hier_config(16).as_dict()
    with pytest.raises(HierConfigError, match="--hier-optim-group-size=12"):
        HierConfig(**{**d, "optim_group_size": 12})


# --------------------------------------------------------------------------- argparse


def parser(include_world: bool = False) -> argparse.ArgumentParser:
    return add_hier_arguments(argparse.ArgumentParser(prog="t", allow_abbrev=False),
                              include_world=include_world)


def test_argument_group_and_defaults():
    p = parser()
    titles = [g.title for g in p._action_groups]
    assert C.ARGUMENT_GROUP_TITLE in titles
    args = p.parse_args([])
    assert (args.hier_partition, args.hier_preset, args.hier_param_group_size,
            args.hier_grad_group_size, args.hier_optim_group_size,
            args.hier_secondary_group_size, args.hier_secondary_dtype, args.hier_gpus_per_node,
            args.hier_gcds_per_package, args.hier_allow_non_colocated) == \
        (False, None, None, None, None, None, None, None, None, False)   # dtype: the preset's
    assert not hasattr(args, "hier_world_size")
    for action in p._actions:
        if action.dest.startswith("hier_"):
            assert action.help, f"{action.dest} has no help"


def test_argparse_round_trip():
    args = parser().parse_args(
        ["--hier-partition", "--hier-param-group-size", "2", "--hier-grad-group-size", "4",
         "--hier-optim-group-size", "8", "--hier-secondary-group-size", "8",
         "--hier-secondary-dtype", "bf16", "--hier-gpus-per-node", "4",
         "--hier-gcds-per-package", "2", "--hier-allow-non-colocated"])
    cfg = hier_config_from_args(args, 16)
    assert cfg == HierConfig(world_size=16, param_group_size=2, grad_group_size=4,
                             optim_group_size=8, secondary_group_size=8, secondary_dtype="bf16",
                             gpus_per_node=4, gcds_per_package=2, preset="lbp")
    assert args.hier_partition and args.hier_allow_non_colocated


@pytest.mark.parametrize("preset", PRESETS)
def test_argparse_presets_match_resolve(preset):
    args = parser().parse_args(["--hier-preset", preset])
    assert hier_config_from_args(args, 384) == resolve_hier_config(384, preset=preset)


def test_argparse_contradiction_fails():
    args = parser().parse_args(["--hier-preset", "zero3", "--hier-grad-group-size", "8"])
    with pytest.raises(HierConfigError) as info:
        hier_config_from_args(args, 16)
    assert_one_line_naming(info.value, "--hier-grad-group-size=8", "--hier-preset zero3")


@pytest.mark.parametrize("argv,needle", [
    (["--hier-param-group-size", "two"], "invalid integer value: 'two'"),
    (["--hier-grad-group-size", "8.0"], "invalid integer value: '8.0'"),
    (["--hier-preset", "zero4"], "invalid choice"),
    (["--hier-secondary-dtype", "fp8"], "invalid choice"),
])
def test_argparse_rejects_non_integers_and_unknown_choices(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and argv[0] in err, err


def test_argparse_negative_integer_reaches_the_config_check():
    args = parser().parse_args(["--hier-param-group-size=-2"])
    with pytest.raises(HierConfigError, match="--hier-param-group-size=-2"):
        hier_config_from_args(args, 16)


def test_include_world_and_overrides():
    args = parser(include_world=True).parse_args(["--hier-world-size", "32",
                                                  "--hier-gpus-per-node", "8"])
    assert hier_config_from_args(args).world_size == 32
    # The caller's launcher-resolved (data-parallel) counts win over the flags.
    cfg = hier_config_from_args(args, gpus_per_node=4, gcds_per_package=1)
    assert (cfg.gpus_per_node, cfg.gcds_per_package, sizes(cfg)) == (4, 1, (1, 0, 4, 32))
    with pytest.raises(HierConfigError, match="--hier-world-size"):
        hier_config_from_args(parser().parse_args([]))


def test_from_plain_namespace_without_hier_attributes():
    # Megatron args built without our provider: everything falls back to defaults.
    assert hier_config_from_args(argparse.Namespace(), 16) == resolve_hier_config(16)


def test_secondary_dtypes_constant():
    assert SECONDARY_DTYPES == ("int8", "bf16", "param") and PRESETS[0] == "lbp"


def test_megatron_parser_accepts_our_flags():
    """add_hier_arguments as Megatron's extra_args_provider: no clash of names or dests."""
    import typing

    import typing_extensions

    typing.override = getattr(typing, "override", typing_extensions.override)
    arguments = pytest.importorskip("megatron.training.arguments")
    ddp_config = pytest.importorskip("megatron.core.distributed").DistributedDataParallelConfig

    megatron = arguments.add_megatron_arguments(
        argparse.ArgumentParser(prog="megatron", allow_abbrev=False))
    megatron_dests = {a.dest for a in megatron._actions}
    p = add_hier_arguments(megatron)  # argparse raises on a clashing option string
    ours = {a.dest for a in p._actions if a.dest.startswith("hier_")}
    # 25 + --hier-secondary-scope and --hier-grad-quant-scheme (ZeRO++'s hpZ scope and qgZ)
    assert len(ours) == 27 and not ours & megatron_dests, ours & megatron_dests
    clash = ours & {f.name for f in dataclasses.fields(ddp_config)}
    assert not clash, f"get_megatron_ddp_config would copy {clash}"
    args = p.parse_args(["--hier-partition", "--hier-preset", "hsdp",
                         "--tensor-model-parallel-size", "2"])
    assert args.tensor_model_parallel_size == 2
    assert hier_config_from_args(args, 16) == resolve_hier_config(16, preset="hsdp")
