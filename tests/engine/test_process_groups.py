"""Hierarchy process groups on real gloo ranks, placed as emulated nodes and packages."""
import argparse

import pytest

from megatron_lbp.testing.multirank import MultiRankError, rank_location_env, run_on_ranks


def _parse(argv):
    from megatron_lbp.core.config import add_hier_arguments

    return add_hier_arguments(argparse.ArgumentParser()).parse_args(argv)


def _build_and_exercise(argv, tp=1):
    """Build the groups, then all-reduce (rank + 1) on each communicator: proves its membership."""
    import torch
    import torch.distributed as dist

    from megatron_lbp.engine.process_groups import build_hier_groups

    dp_group = None
    if tp > 1:
        from megatron_lbp.testing.tiny_gpt import init_megatron_state
        from megatron.core import parallel_state

        init_megatron_state(tp=tp)
        dp_group = parallel_state.get_data_parallel_group()
    try:
        h = build_hier_groups(_parse(argv), dp_group=dp_group, tensor_model_parallel_size=tp)
    except (ValueError, RuntimeError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    sums = {}
    for family, by_channel in h.groups.items():
        for channel, group in by_channel.items():
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t, group=group)
            sums.setdefault(family, set()).add(t.item())
    sums = {f: v.pop() if len(v) == 1 else sorted(v) for f, v in sums.items()}
    g = h.groups
    return {"ranks": h.ranks, "links": h.link_classes, "sums": sums, "warnings": h.warnings,
            "sizes": (h.config.param_group_size, h.config.grad_group_size,
                      h.config.optim_group_size, h.config.replicas),
            "channels": {f: sorted(c) for f, c in g.items()}, "names": h.comm_names,
            "gather_is_reduce": g["param"]["gather"] is g["grad"]["reduce"],
            "grad_is_optim": g["grad"]["reduce"] is g["optim"]["reduce"],
            "secondary_is_grad": "secondary" in g and g["secondary"]["gather"] is g["grad"]["reduce"],
            "describe": h.describe()}


TWO_NODES = rank_location_env(4)  # 8 ranks = 2 emulated nodes x 2 packages x 2 GCDs


def test_lbp_groups_on_two_nodes_of_two_packages():
    out = run_on_ranks(_build_and_exercise, 8, ["--hier-preset", "lbp", "--hier-optim-group-size", "8"],
                       rank_env=TWO_NODES)
    expect_links = {"param": "package", "grad": "node", "optim": "network", "inter": "network",
                    "grad_to_param": "node", "replica": "package"}
    for rank, got in enumerate(out):
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["sizes"] == (2, 4, 8, 1), f"rank {rank} resolved P,G,O,R = {got['sizes']}"
        base2, base4 = rank - rank % 2, rank - rank % 4
        want = {
            "param": tuple(range(base2, base2 + 2)),
            # In chunk order (layout.grad_reduce_order): group rank c owns bucket chunk c.
            "grad": (base4, base4 + 2, base4 + 1, base4 + 3),
            "optim": tuple(range(8)),
            "inter": (rank % 4, rank % 4 + 4),
            "grad_to_param": (base4 + rank % 2, base4 + rank % 2 + 2),
            "replica": (rank,),
        }
        assert got["ranks"] == want, f"rank {rank}: groups {got['ranks']} != {want}"
        assert got["links"] == expect_links, f"rank {rank}: link classes {got['links']}"
        for family, members in want.items():
            assert got["sums"][family] == sum(m + 1 for m in members), (
                f"rank {rank}: all-reduce over the {family} group summed {got['sums'][family]}, "
                f"members {members}")
    assert "grad           node     ranks [0, 1, 2, 3]" in out[0]["describe"], out[0]["describe"]


def test_emulated_nodes_on_one_host_match_real_placement():
    # One host with 8 local ranks, told its nodes hold 4: the same groups as two real nodes.
    out = run_on_ranks(_build_and_exercise, 8, ["--hier-gpus-per-node", "4"])
    assert [tuple(sorted(o["ranks"]["grad"])) for o in out] == \
        [(0, 1, 2, 3)] * 4 + [(4, 5, 6, 7)] * 4, out
    assert out[0]["links"]["grad"] == "node" and out[0]["links"]["optim"] == "network"


def test_zero3_gathers_and_reductions_run_on_separate_communicators():
    # P = G = O = W: one member list, but a weight gather must never queue behind a
    # gradient reduce-scatter, so gathers get a communicator of their own.
    out = run_on_ranks(_build_and_exercise, 4, ["--hier-preset", "zero3"], rank_env=rank_location_env(2))
    for rank, got in enumerate(out):
        assert got["sizes"] == (4, 4, 4, 1), got
        assert not got["gather_is_reduce"], f"rank {rank}: gathers share the reduce communicator"
        assert got["grad_is_optim"], f"rank {rank}: identical reduce groups were not shared"
        assert got["names"]["param"] == {"gather": "param_gather"}, got["names"]
        assert got["names"]["grad"] == got["names"]["optim"] == {"reduce": "grad_reduce"}, got["names"]
        assert got["names"]["inter"] == {"gather": "inter_gather", "reduce": "inter_reduce"}
        assert got["sums"]["param"] == got["sums"]["grad"] == 10, got["sums"]
    assert out[0]["links"]["param"] == "network"
    assert out[0]["channels"] == {"param": ["gather"], "grad": ["reduce"], "optim": ["reduce"],
                                  "inter": ["gather", "reduce"], "grad_to_param": ["gather"],
                                  "replica": ["reduce"]}, out[0]["channels"]


def test_secondary_gather_equal_to_the_grad_group_has_its_own_communicator():
    # S = G (Frontier's lbp with S = 8): the backward gather and the reduce-scatter of
    # the layer after it would otherwise queue on one communicator.
    out = run_on_ranks(_build_and_exercise, 8, ["--hier-grad-group-size", "4",
                                                "--hier-secondary-group-size", "4"],
                       rank_env=TWO_NODES)
    for rank, got in enumerate(out):
        assert got["ranks"]["secondary"] == tuple(sorted(got["ranks"]["grad"])), got["ranks"]
        assert not got["secondary_is_grad"], f"rank {rank}: one communicator for both"
        assert got["names"]["secondary"] == {"gather": "secondary_gather"}, got["names"]


def test_hsdp_replicas_cross_the_network():
    out = run_on_ranks(_build_and_exercise, 8, ["--hier-preset", "hsdp"], rank_env=TWO_NODES)
    assert out[1]["sizes"] == (4, 4, 4, 2) and out[1]["ranks"]["replica"] == (1, 5), out[1]
    assert out[1]["links"]["replica"] == "network"


def test_flag_that_disagrees_with_launcher_fails_on_every_rank():
    out = run_on_ranks(_build_and_exercise, 8, ["--hier-gpus-per-node", "8"], rank_env=TWO_NODES)
    for rank, got in enumerate(out):
        assert "--hier-gpus-per-node=8 disagrees with the launcher" in got.get("error", ""), (
            f"rank {rank}: {got}")
        assert "LOCAL_WORLD_SIZE" in got["error"], got["error"]


def test_tensor_parallel_shifts_dp_ranks_off_the_package():
    # TP=2: DP group {0,2,4,6}; P=2 would pair GCDs of two packages.
    bad = run_on_ranks(_build_and_exercise, 8, ["--hier-param-group-size", "2"], tp=2, rank_env=TWO_NODES)
    for rank, got in enumerate(bad):
        err = got.get("error", "")
        assert err.startswith("TopologyError") and "--hier-param-group-size=2" in err, f"rank {rank}: {got}"
        assert "--hier-allow-non-colocated" in err and "\n" not in err, err
        assert "package" in err and ("0" in err and "2" in err), err
    # Default under TP=2: one DP rank per package, P=1 and G = 2 DP ranks per node.
    ok = run_on_ranks(_build_and_exercise, 8, [], tp=2, rank_env=TWO_NODES)
    assert ok[0]["sizes"] == (1, 2, 4, 1) and ok[0]["ranks"]["grad"] == (0, 2), ok[0]
    assert ok[1]["ranks"]["grad"] == (1, 3) and ok[1]["links"]["grad"] == "node", ok[1]
    # Opt-out: the groups are built and the problem is reported, not hidden.
    forced = run_on_ranks(_build_and_exercise, 8, ["--hier-param-group-size", "2", "--hier-allow-non-colocated"],
                          tp=2, rank_env=TWO_NODES)
    assert forced[0]["links"]["param"] == "node" and forced[0]["warnings"], forced[0]


def test_requires_an_initialized_process_group():
    with pytest.raises(MultiRankError, match="needs torch.distributed to be initialized"):
        run_on_ranks(_uninitialized, 1, init_process_group=False)


def _uninitialized():
    from megatron_lbp.engine.process_groups import build_hier_groups

    build_hier_groups(_parse([]))
