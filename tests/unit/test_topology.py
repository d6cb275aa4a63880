"""Unit tests for megatron_lbp.core.topology: launchers, locations, link classes, groups."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_lbp.core.config import resolve_hier_config
from megatron_lbp.core.topology import (
    GROUP_FAMILIES,
    LINK_CLASSES,
    LauncherInfo,
    RankLocation,
    TopologyError,
    all_hierarchy_groups,
    check_colocation,
    dp_domain_sizes,
    dp_groups_from_layout,
    emulated_locations,
    hierarchy_groups,
    launcher_info_from_env,
    link_class,
    location_of,
    parse_slurm_tasks_per_node,
    resolve_gpus_per_node,
)


def assert_one_line_naming(err: Exception, *needles: str) -> None:
    msg = str(err)
    assert "\n" not in msg, f"message spans lines: {msg!r}"
    for needle in needles:
        assert needle in msg, f"{needle!r} missing from message: {msg!r}"


def slurm_env(procid, ntasks, localid, nodeid, tasks_per_node=None, ntasks_per_node=None, **extra):
    env = {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
           "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid)}
    if tasks_per_node is not None:
        env["SLURM_TASKS_PER_NODE"] = tasks_per_node
    if ntasks_per_node is not None:
        env["SLURM_NTASKS_PER_NODE"] = str(ntasks_per_node)
    env.update(extra)
    return env


def torchrun_env(rank, world, local_rank, local_world, group_rank=None, **extra):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
           "LOCAL_WORLD_SIZE": str(local_world)}
    if group_rank is not None:
        env["GROUP_RANK"] = str(group_rank)
    env.update(extra)
    return env


def fields(info: LauncherInfo) -> tuple:
    return (info.rank, info.world_size, info.local_rank, info.local_world_size,
            info.node_rank, info.source)


# --------------------------------------------------------------------------- launcher


@pytest.mark.parametrize("text,want", [
    ("4", (4,)),
    ("4(x2)", (4, 4)),
    ("8(x3),7", (8, 8, 8, 7)),
    ("2,4(x2),1", (2, 4, 4, 1)),
    (" 8(x1) ", (8,)),
])
def test_parse_slurm_tasks_per_node(text, want):
    assert parse_slurm_tasks_per_node(text) == want


@pytest.mark.parametrize("text", ["", "x", "4(x)", "4(2)", "4x2", "0", "4(x0)", "4,,2", "-1"])
def test_parse_slurm_tasks_per_node_rejects(text):
    with pytest.raises(TopologyError) as info:
        parse_slurm_tasks_per_node(text)
    assert_one_line_naming(info.value, "SLURM_TASKS_PER_NODE", repr(text))


@pytest.mark.parametrize("env,want", [
    (slurm_env(13, 16, 5, 1, tasks_per_node="8(x2)"), (13, 16, 5, 8, 1, "slurm")),
    (slurm_env(5, 8, 1, 1, ntasks_per_node=4), (5, 8, 1, 4, 1, "slurm")),
    (slurm_env(0, 4, 0, 0, tasks_per_node="4"), (0, 4, 0, 4, 0, "slurm")),
    # Heterogeneous: the last node has 7 tasks; SLURM_NODEID picks the entry.
    (slurm_env(30, 31, 6, 3, tasks_per_node="8(x3),7"), (30, 31, 6, 7, 3, "slurm")),
    (slurm_env(17, 31, 1, 2, tasks_per_node="8(x3),7"), (17, 31, 1, 8, 2, "slurm")),
    (slurm_env(3, 6, 1, 1, tasks_per_node="2,4"), (3, 6, 1, 4, 1, "slurm")),
    # SLURM_NPROCS is the older spelling of SLURM_NTASKS.
    ({"SLURM_PROCID": "1", "SLURM_NPROCS": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
      "SLURM_TASKS_PER_NODE": "2"}, (1, 2, 1, 2, 0, "slurm")),
])
def test_slurm(env, want):
    assert fields(launcher_info_from_env(env)) == want


def test_slurm_records_per_node_counts_and_variable():
    info = launcher_info_from_env(slurm_env(30, 31, 6, 3, tasks_per_node="8(x3),7"))
    assert info.tasks_per_node == (8, 8, 8, 7)
    assert info.local_world_size_env == "SLURM_TASKS_PER_NODE=8(x3),7"
    info = launcher_info_from_env(slurm_env(5, 8, 1, 1, ntasks_per_node=4))
    assert (info.tasks_per_node, info.local_world_size_env) == ((), "SLURM_NTASKS_PER_NODE=4")


def test_slurm_prefers_the_step_layout_over_the_request():
    # SLURM_NTASKS_PER_NODE may be inherited from sbatch; srun's per-step list wins.
    env = slurm_env(9, 12, 1, 1, tasks_per_node="8,4", ntasks_per_node=8)
    assert launcher_info_from_env(env).local_world_size == 4


@pytest.mark.parametrize("env,want", [
    (torchrun_env(5, 8, 1, 4, group_rank=1), (5, 8, 1, 4, 1, "torchrun")),
    (torchrun_env(6, 8, 2, 4), (6, 8, 2, 4, 1, "torchrun")),  # GROUP_RANK fallback
    (torchrun_env(3, 4, 3, 4, group_rank=0), (3, 4, 3, 4, 0, "torchrun")),
    # Hand-rolled env:// launch (RANK/WORLD_SIZE only): one host.
    ({"RANK": "5", "WORLD_SIZE": "8"}, (5, 8, 5, 8, 0, "torchrun")),
    ({}, (0, 1, 0, 1, 0, "single")),
    ({"PATH": "/usr/bin"}, (0, 1, 0, 1, 0, "single")),
])
def test_torchrun_and_single(env, want):
    assert fields(launcher_info_from_env(env)) == want


def test_precedence_between_slurm_and_torchrun():
    # srun torchrun: SLURM_PROCID counts agents; torchrun's RANK + LOCAL_RANK win.
    env = {**slurm_env(1, 2, 0, 1, tasks_per_node="1(x2)"), **torchrun_env(13, 16, 5, 8, 1)}
    assert fields(launcher_info_from_env(env)) == (13, 16, 5, 8, 1, "torchrun")
    # A stale RANK exported by the batch script (no LOCAL_RANK): Slurm wins.
    env = {**slurm_env(13, 16, 5, 1, tasks_per_node="8(x2)"), "RANK": "0", "WORLD_SIZE": "16"}
    assert fields(launcher_info_from_env(env)) == (13, 16, 5, 8, 1, "slurm")


@pytest.mark.parametrize("env,needles", [
    (slurm_env("x", 16, 0, 0, tasks_per_node="8(x2)"), ["SLURM_PROCID", "'x'"]),
    (slurm_env(0, "16.0", 0, 0, tasks_per_node="8(x2)"), ["SLURM_NTASKS", "'16.0'"]),
    (slurm_env(0, 16, "", 0, tasks_per_node="8(x2)"), ["SLURM_LOCALID", "''"]),
    (slurm_env(0, 16, 0, "-1", tasks_per_node="8(x2)"), ["SLURM_NODEID", "'-1'"]),
    (slurm_env(0, 16, 0, 0, tasks_per_node="8 x2"), ["SLURM_TASKS_PER_NODE", "'8 x2'"]),
    (slurm_env(0, 16, 0, 0, ntasks_per_node="eight"), ["SLURM_NTASKS_PER_NODE", "'eight'"]),
    (slurm_env(0, 16, 0, 0, ntasks_per_node=0), ["SLURM_NTASKS_PER_NODE", "'0'"]),
    (slurm_env(16, 16, 0, 1, tasks_per_node="8(x2)"), ["SLURM_PROCID=16", "SLURM_NTASKS=16"]),
    (slurm_env(0, 16, 8, 0, tasks_per_node="8(x2)"), ["SLURM_LOCALID=8", "SLURM_TASKS_PER_NODE"]),
    (slurm_env(0, 16, 0, 2, tasks_per_node="8(x2)"), ["SLURM_NODEID=2", "2 nodes"]),
    (slurm_env(0, 16, 0, 0), ["SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "missing"]),
    ({"SLURM_PROCID": "0"}, ["SLURM_NTASKS", "missing"]),
    (torchrun_env("a", 8, 0, 4), ["RANK", "'a'"]),
    (torchrun_env(0, 0, 0, 4), ["WORLD_SIZE", "'0'"]),
    (torchrun_env(0, 8, "one", 4), ["LOCAL_RANK", "'one'"]),
    (torchrun_env(0, 8, 0, "4x"), ["LOCAL_WORLD_SIZE", "'4x'"]),
    (torchrun_env(0, 8, 0, 4, group_rank="?"), ["GROUP_RANK", "'?'"]),
    (torchrun_env(8, 8, 0, 4), ["RANK=8", "WORLD_SIZE=8"]),
    (torchrun_env(0, 8, 4, 4), ["LOCAL_RANK=4", "LOCAL_WORLD_SIZE"]),
    (torchrun_env(0, 4, 0, 8), ["LOCAL_WORLD_SIZE", "WORLD_SIZE=4"]),
    ({"RANK": "3"}, ["WORLD_SIZE", "missing", "RANK=3"]),
    ({"WORLD_SIZE": "3"}, ["RANK", "missing", "WORLD_SIZE=3"]),
])
def test_malformed_launcher_env(env, needles):
    with pytest.raises(TopologyError) as info:
        launcher_info_from_env(env)
    assert_one_line_naming(info.value, *needles)


# --------------------------------------------------------------------------- gpus per node


def info_from(env) -> LauncherInfo:
    return launcher_info_from_env(env)


def test_gpus_per_node_defaults():
    assert resolve_gpus_per_node(info_from(slurm_env(0, 16, 0, 0, "8(x2)")), None) == 8
    assert resolve_gpus_per_node(info_from(torchrun_env(0, 8, 0, 4)), None) == 4
    assert resolve_gpus_per_node(info_from({}), None) == 8  # single: Frontier default
    assert resolve_gpus_per_node(info_from({}), 4) == 4  # single: nothing to disagree with


def test_gpus_per_node_emulation():
    # 8 ranks on one host as 2 "nodes" of 4, as the CPU tests and the demo do.
    assert resolve_gpus_per_node(info_from(torchrun_env(0, 8, 0, 8)), 4) == 4
    assert resolve_gpus_per_node(info_from({"RANK": "0", "WORLD_SIZE": "8"}), 2) == 2
    assert resolve_gpus_per_node(info_from(slurm_env(0, 16, 0, 0, "8(x2)")), 8) == 8


def test_gpus_per_node_disagreement_message():
    info = info_from(slurm_env(0, 8, 0, 0, ntasks_per_node=4))
    with pytest.raises(TopologyError) as err:
        resolve_gpus_per_node(info, 8)
    assert str(err.value) == ("--hier-gpus-per-node=8 disagrees with the launcher: "
                              "SLURM_NTASKS_PER_NODE=4 places 4 ranks per node "
                              "(the flag must divide it)")


@pytest.mark.parametrize("env,flag,needles", [
    (torchrun_env(0, 8, 0, 4), 3, ["--hier-gpus-per-node=3", "LOCAL_WORLD_SIZE=4"]),
    ({"RANK": "0", "WORLD_SIZE": "6"}, 4, ["--hier-gpus-per-node=4", "WORLD_SIZE=6"]),
    (slurm_env(0, 31, 0, 0, "8(x3),7"), 8, ["--hier-gpus-per-node=8", "8(x3),7", "8, 7",
                                           "divide each"]),
    (slurm_env(0, 16, 0, 0, "8(x2)"), 0, ["--hier-gpus-per-node=0", ">= 1"]),
])
def test_gpus_per_node_rejects(env, flag, needles):
    with pytest.raises(TopologyError) as info:
        resolve_gpus_per_node(info_from(env), flag)
    assert_one_line_naming(info.value, *needles)


def test_uneven_nodes_need_an_explicit_flag():
    info = info_from(slurm_env(0, 12, 0, 0, "8,4"))
    with pytest.raises(TopologyError) as err:
        resolve_gpus_per_node(info, None)
    assert_one_line_naming(err.value, "SLURM_TASKS_PER_NODE=8,4", "8, 4", "--hier-gpus-per-node")
    assert resolve_gpus_per_node(info, 4) == 4


# --------------------------------------------------------------------------- locations


FRONTIER_PACKAGES = [0, 0, 1, 1, 2, 2, 3, 3]


def test_frontier_locations_from_slurm():
    """srun -N2 --ntasks-per-node=8: local pairs share an MI250X, nodes follow SLURM_NODEID."""
    locs = []
    for rank in range(16):
        env = slurm_env(rank, 16, rank % 8, rank // 8, tasks_per_node="8(x2)")
        info = info_from(env)
        locs.append(location_of(info, resolve_gpus_per_node(info, None), 2,
                                f"frontier{rank // 8:05d}"))
    assert [loc.node for loc in locs] == [0] * 8 + [1] * 8
    assert [loc.package for loc in locs] == FRONTIER_PACKAGES * 2
    assert [loc.local_rank for loc in locs] == list(range(8)) * 2
    assert locs == [RankLocation(r.rank, r.node, r.package, r.local_rank, f"frontier{r.node:05d}")
                    for r in emulated_locations(16, 8, 2)]


def test_emulated_nodes_on_one_host_get_distinct_ids():
    locs = [location_of(info_from(torchrun_env(r, 8, r, 8, group_rank=0)), 4, 2, "host")
            for r in range(8)]
    assert [(l.node, l.package, l.local_rank) for l in locs] == \
        [(0, 0, 0), (0, 0, 1), (0, 1, 2), (0, 1, 3), (1, 0, 4), (1, 0, 5), (1, 1, 6), (1, 1, 7)]
    # Second real node of 8, emulated as 2 x 4: ids 2 and 3.
    loc = location_of(info_from(torchrun_env(13, 16, 5, 8, group_rank=1)), 4, 2, "h1")
    assert (loc.node, loc.package) == (3, 0)


def test_uneven_slurm_nodes_get_consecutive_ids():
    # "4,8" emulated as nodes of 4: real node 1 holds emulated nodes 1 and 2.
    loc = location_of(info_from(slurm_env(10, 12, 6, 1, "4,8")), 4, 2, "b")
    assert (loc.node, loc.package, loc.local_rank) == (2, 1, 6)


def test_single_process_location():
    assert location_of(info_from({}), 8, 2, "me") == RankLocation(0, 0, 0, 0, "me")


@pytest.mark.parametrize("gpn,pkg,needles", [
    (3, 1, ["--hier-gpus-per-node=3", "LOCAL_WORLD_SIZE=8"]),
    (8, 3, ["--hier-gcds-per-package=3", "--hier-gpus-per-node=8"]),
    (0, 1, ["--hier-gpus-per-node=0"]),
])
def test_location_rejects(gpn, pkg, needles):
    with pytest.raises(TopologyError) as info:
        location_of(info_from(torchrun_env(0, 8, 0, 8)), gpn, pkg, "h")
    assert_one_line_naming(info.value, *needles)


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(1, 4), real=st.sampled_from([1, 2, 4, 8]),
       split=st.sampled_from([1, 2, 4, 8]), pkg=st.sampled_from([1, 2, 4]))
def test_location_of_matches_emulated_locations(nodes, real, split, pkg):
    """Consecutive torchrun placement with emulation = emulated_locations."""
    gpn = real // split if real % split == 0 else real
    if gpn % pkg:
        return
    world = nodes * real
    got = [location_of(info_from(torchrun_env(r, world, r % real, real)), gpn, pkg, "h")
           for r in range(world)]
    want = emulated_locations(world, gpn, pkg)
    assert [(l.node, l.package) for l in got] == [(l.node, l.package) for l in want]


def test_emulated_locations_hosts():
    locs = emulated_locations(8, 4, 2, host_prefix="vm")
    assert [l.host for l in locs] == ["vm0"] * 4 + ["vm1"] * 4


# --------------------------------------------------------------------------- link class


@pytest.mark.parametrize("ranks,want", [
    ([0, 1], "package"),
    ([2, 3], "package"),
    ([1, 2], "node"),
    ([0, 2, 4, 6], "node"),
    (list(range(8)), "node"),
    ([7, 8], "network"),
    (list(range(16)), "network"),
    ([5], "package"),
    ([9, 8], "package"),
])
def test_link_class(ranks, want):
    locs = emulated_locations(16, 8, 2)
    assert link_class(ranks, locs) == want
    assert link_class(ranks, {l.rank: l for l in locs}) == want


def test_link_class_errors():
    locs = emulated_locations(4, 4, 2)
    with pytest.raises(TopologyError, match="rank 9"):
        link_class([0, 9], locs)
    with pytest.raises(TopologyError, match="empty"):
        link_class([], locs)
    with pytest.raises(TopologyError, match=r"locations\[0\] describes rank 3"):
        link_class([0], list(reversed(locs)))
    assert LINK_CLASSES == ("package", "node", "network")


# --------------------------------------------------------------------------- co-location


def test_colocation_tp2_param_groups_straddle_packages():
    """TP=2 takes both GCDs of a package: DP ranks 0 and 2 sit on different MI250Xs."""
    dp = dp_groups_from_layout(16, tensor_model_parallel_size=2)
    groups = all_hierarchy_groups(dp, resolve_hier_config(8, gpus_per_node=4))
    locs = emulated_locations(16, 8, 2, host_prefix="frontier")
    with pytest.raises(TopologyError) as info:
        check_colocation(groups, locs)
    assert_one_line_naming(info.value, "param", "--hier-param-group-size=2", "package",
                           "0 (host frontier0, node 0, package 0)",
                           "2 (host frontier0, node 0, package 1)",
                           "--hier-allow-non-colocated")
    warnings = check_colocation(groups, locs, allow=True)
    assert len(warnings) == 1 and "--hier-allow-non-colocated" in warnings[0], warnings


def test_colocation_tp2_fixed_by_data_parallel_domain_sizes():
    dp = dp_groups_from_layout(16, tensor_model_parallel_size=2)
    node, pkg = dp_domain_sizes(8, 2, tensor_model_parallel_size=2)
    cfg = resolve_hier_config(8, gpus_per_node=node, gcds_per_package=pkg)
    assert (node, pkg, cfg.param_group_size, cfg.grad_group_size) == (4, 1, 1, 4)
    assert check_colocation(all_hierarchy_groups(dp, cfg), emulated_locations(16, 8, 2)) == []


def test_colocation_grad_group_across_nodes():
    locs = emulated_locations(16, 8, 2)
    cfg = resolve_hier_config(16, grad_group_size=16)  # lbp with G = W: fine (too big to fit)
    assert check_colocation(hierarchy_groups(range(16), cfg), locs) == []
    # A grad group of 8 that straddles two nodes (misaligned placement).
    shifted = [(r + 4) % 16 for r in range(16)]
    with pytest.raises(TopologyError) as info:
        check_colocation(hierarchy_groups(shifted, resolve_hier_config(16)), locs)
    assert_one_line_naming(info.value, "grad", "--hier-grad-group-size=8", "one node",
                           "network", "host node1")


def test_colocation_secondary_and_param_families():
    locs = emulated_locations(16, 8, 2)
    bad = {"secondary": [(1, 2)], "param": [(0, 1)]}
    with pytest.raises(TopologyError, match="secondary group of --hier-secondary-group-size=2"):
        check_colocation(bad, locs)
    # Families other than param/secondary/grad are never checked.
    assert check_colocation({"inter": [(0, 8)], "optim": [tuple(range(16))],
                             "replica": [(0, 15)]}, locs) == []


@pytest.mark.parametrize("world,gpn,preset,extra", [
    (16, 8, "lbp", {}),
    (16, 8, "lbp", dict(secondary_group_size=2)),
    (16, 8, "lbp", dict(secondary_group_size=8)),   # S = node: the paper's other choice
    (16, 8, "lbp", dict(param_group_size=1, optim_group_size=8)),
    (16, 8, "zero3", {}),                            # P = G = W cannot fit in a node
    (16, 8, "zeropp", {}),
    (16, 8, "zero2", {}),
    (16, 8, "hsdp", {}),                             # P = node
    (384, 8, "lbp", dict(secondary_group_size=8)),
    (8, 4, "hsdp", {}),
])
def test_presets_are_colocated_with_consecutive_placement(world, gpn, preset, extra):
    cfg = resolve_hier_config(world, gpus_per_node=gpn, preset=preset, **extra)
    groups = hierarchy_groups(range(world), cfg)
    assert check_colocation(groups, emulated_locations(world, gpn, 2)) == []
    assert link_class(groups["param"][0], emulated_locations(world, gpn, 2)) == \
        {1: "package", 2: "package", gpn: "node"}.get(cfg.param_group_size, "network")


# --------------------------------------------------------------------------- DP groups


def test_dp_groups_hand_computed():
    """Order tp-cp-ep-dp-pp, W=16, TP=2, PP=2 (DP=4): TP fastest, PP slowest."""
    assert dp_groups_from_layout(16, tensor_model_parallel_size=2,
                                 pipeline_model_parallel_size=2) == \
        [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert dp_groups_from_layout(8, context_parallel_size=2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dp_groups_from_layout(8, tensor_model_parallel_size=2, context_parallel_size=2,
                                 with_context_parallel=True) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dp_groups_from_layout(4) == [[0, 1, 2, 3]]


@pytest.fixture(scope="module")
def rank_generator():
    import typing

    import typing_extensions

    # megatron.core needs typing.override (Python 3.12); shim it on 3.11.
    typing.override = getattr(typing, "override", typing_extensions.override)
    return pytest.importorskip("megatron.core.parallel_state").RankGenerator


LAYOUTS = [(w, tp, pp, cp) for w in (8, 16, 24, 48)
           for tp, pp, cp in itertools.product((1, 2, 4, 8), (1, 2, 3), (1, 2))
           if w % (tp * pp * cp) == 0]


@pytest.mark.parametrize("with_cp", [False, True])
def test_dp_groups_match_megatron_rank_generator(rank_generator, with_cp):
    mismatches = []
    for w, tp, pp, cp in LAYOUTS:
        dp = w // (tp * pp * cp)
        gen = rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        want = sorted(gen.get_ranks("dp-cp" if with_cp else "dp"))
        got = dp_groups_from_layout(w, tp, pp, cp, with_context_parallel=with_cp)
        if got != want:
            mismatches.append(f"W={w} TP={tp} PP={pp} CP={cp}: ours {got} vs Megatron {want}")
    assert not mismatches, "; ".join(mismatches[:3]) + f" ({len(mismatches)} layouts differ)"
    assert len(LAYOUTS) > 40


@pytest.mark.parametrize("args,needles", [
    ((16, 3), ["world_size=16", "3 x 1 x 1"]),
    ((16, 2, 3), ["world_size=16", "2 x 3 x 1"]),
    ((0,), ["world_size=0"]),
    ((8, 0), ["tensor_model_parallel_size=0"]),
])
def test_dp_groups_reject(args, needles):
    with pytest.raises(TopologyError) as info:
        dp_groups_from_layout(*args)
    assert_one_line_naming(info.value, *needles)


@pytest.mark.parametrize("gpn,pkg,tp,cp,with_cp,want", [
    (8, 2, 1, 1, False, (8, 2)),
    (8, 2, 2, 1, False, (4, 1)),
    (8, 2, 2, 2, False, (2, 1)),
    (8, 2, 2, 2, True, (4, 1)),
    (8, 2, 8, 1, False, (1, 1)),
    (8, 2, 16, 1, False, (1, 1)),
])
def test_dp_domain_sizes(gpn, pkg, tp, cp, with_cp, want):
    assert dp_domain_sizes(gpn, pkg, tp, cp, with_context_parallel=with_cp) == want


def test_dp_domain_sizes_rejects_straddling():
    with pytest.raises(TopologyError, match="--hier-gpus-per-node=8"):
        dp_domain_sizes(8, 2, tensor_model_parallel_size=3)


# --------------------------------------------------------------------------- hierarchy groups


def cfg_of(w, p, g, o, s=0):
    return SimpleNamespace(world_size=w, param_group_size=p, grad_group_size=g,
                           optim_group_size=o, secondary_group_size=s)


def test_hierarchy_groups_hand_computed():
    """W=16, P=2, S=8, G=4, O=8 over DP ranks mapped to global ranks 100..115."""
    got = hierarchy_groups(list(range(100, 116)), cfg_of(16, 2, 4, 8, 8))
    b = 100
    want = {
        "param": [(b + i, b + i + 1) for i in range(0, 16, 2)],
        "secondary": [tuple(range(b, b + 8)), tuple(range(b + 8, b + 16))],
        "grad": [tuple(range(b + i, b + i + 4)) for i in range(0, 16, 4)],
        "optim": [tuple(range(b, b + 8)), tuple(range(b + 8, b + 16))],
        "inter": [(b + 0, b + 4), (b + 1, b + 5), (b + 2, b + 6), (b + 3, b + 7),
                  (b + 8, b + 12), (b + 9, b + 13), (b + 10, b + 14), (b + 11, b + 15)],
        "grad_to_param": [(b + 0, b + 2), (b + 1, b + 3), (b + 4, b + 6), (b + 5, b + 7),
                          (b + 8, b + 10), (b + 9, b + 11), (b + 12, b + 14), (b + 13, b + 15)],
        "replica": [(b + i, b + i + 8) for i in range(8)],
    }
    assert list(got) == list(want), f"family order {list(got)} != {list(want)}"
    for family in want:
        assert got[family] == want[family], f"{family}: {got[family]} != {want[family]}"


def test_secondary_omitted_when_off_and_family_order():
    got = hierarchy_groups(range(8), cfg_of(8, 2, 8, 8))
    assert list(got) == [f for f in GROUP_FAMILIES if f not in ("secondary", "grad_cross")]
    assert list(hierarchy_groups(range(8), cfg_of(8, 2, 8, 8, 2))) == [
        f for f in GROUP_FAMILIES if f != "grad_cross"]
    # the second hop of the int4 qgZ only where it runs (zeropp across two nodes of 4)
    zeropp = hierarchy_groups(range(8), resolve_hier_config(8, gpus_per_node=4, preset="zeropp"))
    assert list(zeropp) == list(GROUP_FAMILIES)
    assert zeropp["grad_cross"] == [(0, 4), (1, 5), (2, 6), (3, 7)], zeropp["grad_cross"]


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def shapes(draw):
    w = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64]))
    o = draw(st.sampled_from(divisors(w)))
    g = draw(st.sampled_from(divisors(o)))
    p = draw(st.sampled_from(divisors(g)))
    s = draw(st.sampled_from([0] + divisors(w)))
    return w, p, g, o, s


@settings(max_examples=150, deadline=None)
@given(shape=shapes(), offset=st.integers(0, 3), stride=st.integers(1, 3))
def test_hierarchy_families_partition_and_nest(shape, offset, stride):
    w, p, g, o, s = shape
    ranks = [offset + stride * i for i in range(w)]  # any global ranks, e.g. TP-strided
    got = hierarchy_groups(ranks, cfg_of(w, p, g, o, s))
    index = {r: i for i, r in enumerate(ranks)}
    sizes = {"param": p, "secondary": s, "grad": g, "optim": o, "inter": o // g,
             "grad_to_param": g // p, "replica": w // o}
    for family, groups in got.items():
        flat = sorted(r for grp in groups for r in grp)
        assert flat == sorted(ranks), f"{family} does not partition the DP group: {groups}"
        assert {len(grp) for grp in groups} == {sizes[family]}, f"{family}: {groups}"
        for grp in groups:
            assert list(grp) == sorted(grp, key=index.get), f"{family} group not in DP order"
    block = {f: {r: index[r] // sizes[f] for r in ranks} for f in ("param", "grad", "optim")}
    for grp in got["inter"]:
        # One rank per grad group of one optim group, same offset inside its grad group.
        assert len({block["optim"][r] for r in grp}) == 1
        assert len({block["grad"][r] for r in grp}) == len(grp)
        assert len({index[r] % g for r in grp}) == 1
    for grp in got["grad_to_param"]:
        assert len({block["grad"][r] for r in grp}) == 1
        assert len({block["param"][r] for r in grp}) == len(grp)
        assert len({index[r] % p for r in grp}) == 1
    for grp in got["replica"]:
        assert len({block["optim"][r] for r in grp}) == len(grp)
        assert len({index[r] % o for r in grp}) == 1
    # Nesting: every grad group is a union of param groups, every optim group of grad groups.
    for inner, outer in (("param", "grad"), ("grad", "optim")):
        outer_of = {r: i for i, grp in enumerate(got[outer]) for r in grp}
        for grp in got[inner]:
            assert len({outer_of[r] for r in grp}) == 1, f"{inner} group {grp} splits"


def test_all_hierarchy_groups_cover_the_world():
    dp = dp_groups_from_layout(32, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    cfg = resolve_hier_config(8, gpus_per_node=4, gcds_per_package=1, secondary_group_size=4)
    merged = all_hierarchy_groups(dp, cfg)
    assert list(merged) == [f for f in GROUP_FAMILIES if f != "grad_cross"]
    for family, groups in merged.items():
        assert sorted(r for grp in groups for r in grp) == list(range(32)), family
    assert merged["param"][:4] == [(0,), (2,), (4,), (6,)]
    assert merged["grad"][0] == (0, 2, 4, 6) and merged["grad"][2] == (1, 3, 5, 7)


@pytest.mark.parametrize("ranks,cfg,needles", [
    (range(8), cfg_of(16, 2, 8, 16), ["8 ranks", "cfg.world_size=16"]),
    ([0, 1, 1, 2], cfg_of(4, 1, 2, 4), ["repeats a rank"]),
    (range(8), cfg_of(8, 4, 2, 8), ["grad_group_size=2", "multiple of param_group_size=4"]),
    (range(8), cfg_of(8, 2, 4, 8, 3), ["world_size=8", "multiple of secondary_group_size=3"]),
    (range(8), cfg_of(8, 0, 4, 8), ["param_group_size=0"]),
])
def test_hierarchy_groups_reject(ranks, cfg, needles):
    with pytest.raises(TopologyError) as info:
        hierarchy_groups(ranks, cfg)
    assert_one_line_naming(info.value, *needles)
