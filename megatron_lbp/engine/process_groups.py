"""The torch.distributed process groups of the hierarchy, built from where each rank really is.

``build_hier_groups`` is the only place that turns topology, config and layout
into live process groups: every rank resolves its location, one
``all_gather_object`` shares locations and errors, validation runs on that
shared picture, and only then are groups created.
Invariants: an error is raised on every rank before any hierarchy group exists;
every rank calls ``new_group`` in the same order; each family gets one
communicator per channel ("gather", "reduce"); nothing here imports megatron.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch.distributed as dist

from megatron_lbp.engine import faults
from megatron_lbp.core.config import (DEFAULT_GCDS_PER_PACKAGE, HierConfig, HierConfigError,
                                      hier_config_from_args, hierarchical_grad_reduce)
from megatron_lbp.core.layout import grad_reduce_order
from megatron_lbp.core.topology import (
    RankLocation,
    TopologyError,
    all_hierarchy_groups,
    check_colocation,
    dp_domain_sizes,
    launcher_info_from_env,
    link_class,
    location_of,
    resolve_gpus_per_node,
)


# The communicators each family's collectives run on. "inter" carries both the
# optimizer step's network reduce-scatter and the updated weights' all-gather.
CHANNELS = ("gather", "reduce")
FAMILY_CHANNELS = {
    "param": ("gather",),
    "secondary": ("gather",),
    "grad_cross": ("reduce",),
    "grad_to_param": ("gather",),
    "inter": ("gather", "reduce"),
    "grad": ("reduce",),
    "optim": ("reduce",),
    "replica": ("reduce",),
}


@dataclass
class HierGroups:
    """This rank's view of the hierarchy: its groups per family, as ranks and as process groups."""

    config: HierConfig
    dp_ranks: tuple[int, ...]              # global ranks of this rank's data-parallel group
    dp_index: int                          # this rank's index in it
    location: RankLocation
    locations: dict[int, RankLocation]     # every rank of the job
    ranks: dict[str, tuple[int, ...]]      # family -> this rank's group (global ranks, collective order)
    groups: dict[str, dict[str, Any]]      # family -> channel -> torch ProcessGroup
    link_classes: dict[str, str]           # family -> link class of this rank's group
    # family -> channel -> the communicator's name ("<family>_<channel>" of the first
    # family that created it): two collectives with one name queue behind each other.
    comm_names: dict[str, dict[str, str]] = field(default_factory=dict)
    dp_group: Any = None                   # the data-parallel process group (None: the world)
    # The G-group's reduce communicator has its members in chunk order (layout.grad_reduce_order):
    # its reduce-scatter needs no permutation of the gradient. False only where
    # torch.distributed sorted the group anyway (no new_group(sort_ranks=False)).
    grad_chunk_ordered: bool = True
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """Multi-line summary for the training log: sizes, then each family's ranks and link."""
        c = self.config
        lines = [
            f"megatron-lbp hierarchy ({c.preset}): W={c.world_size} P={c.param_group_size} "
            f"S={c.secondary_group_size or 'off'} G={c.grad_group_size} O={c.optim_group_size} "
            f"R={c.replicas}; rank {self.location.rank} on {self.location.host} "
            f"node {self.location.node} package {self.location.package}",
        ]
        for family, ranks in self.ranks.items():
            # Who is in the group (its collective order may differ: the G-group's).
            lines.append(f"  {family:<14} {self.link_classes[family]:<8} ranks {sorted(ranks)}")
        lines.extend(f"  warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def build_hier_groups(
    args: Any,
    *,
    dp_group: Any = None,
    tensor_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    env: Mapping[str, str] | None = None,
    host: str | None = None,
    peer_env: Callable[[int], Mapping[str, str]] | None = None,
) -> HierGroups:
    """Validate the ``--hier-*`` flags in ``args`` against the launch and create the groups.

    ``dp_group`` is the data-parallel process group the hierarchy lives in
    (default: the whole world). Raises HierConfigError or TopologyError, with
    the same one-line message on every rank, before creating any group.
    Every rank's :func:`local_view` is shared by one ``all_gather_object`` over the world;
    a world whose collectives move no data (torch's fake process group, one process posing
    as one rank of many) passes ``peer_env`` instead, each rank's launcher environment, and
    every rank's view is computed here from it (``host`` for all of them).
    """
    if not dist.is_initialized():
        raise RuntimeError("build_hier_groups needs torch.distributed to be initialized first")
    env = os.environ if env is None else env
    host = host or socket.gethostname()

    dp_ranks = tuple(dist.get_process_group_ranks(dp_group)) if dp_group is not None \
        else tuple(range(dist.get_world_size()))
    mine = local_view(args, env, host, dist.get_rank(), dist.get_world_size(), dp_ranks)
    if peer_env is None:
        shared = _all_gather_over_world(mine)
    else:
        shared = [mine if r == dist.get_rank() else
                  local_view(args, peer_env(r), host, r, dist.get_world_size(), dp_ranks)
                  for r in range(dist.get_world_size())]
    errors = [(r, s[2]) for r, s in enumerate(shared) if s[2]]
    if errors:
        rank, message = errors[0]
        raise TopologyError(message if rank == dist.get_rank() else f"rank {rank}: {message}")
    if len({(s[3], s[4]) for s in shared}) > 1:
        raise TopologyError(
            "ranks disagree on --hier-gpus-per-node/--hier-gcds-per-package "
            f"({sorted({(s[3], s[4]) for s in shared})}): pass the same flags to every rank")
    locations = {r: s[0] for r, s in enumerate(shared)}
    dp_groups = sorted({s[1] for s in shared})
    gpus_per_node, gcds_per_package = mine[3], mine[4]

    dp_per_node, dp_per_package = dp_domain_sizes(
        gpus_per_node, gcds_per_package, tensor_model_parallel_size, context_parallel_size)
    config = hier_config_from_args(args, world_size=len(dp_ranks), gpus_per_node=dp_per_node,
                                   gcds_per_package=dp_per_package)
    families = all_hierarchy_groups(dp_groups, config)
    warnings = check_colocation(families, locations,
                                allow=bool(getattr(args, "hier_allow_non_colocated", False)))

    families = _chunk_ordered_grad_groups(families, config)
    me = dist.get_rank()
    created: dict[tuple[tuple[int, ...], str], tuple[Any, str]] = {}
    mine_ranks: dict[str, tuple[int, ...]] = {}
    mine_groups: dict[str, dict[str, Any]] = {}
    mine_names: dict[str, dict[str, str]] = {}
    # Bounded waits: a stuck peer fails its groups after --hier-collective-timeout-s.
    timeout = faults.configure_from_args(args)
    # Every rank walks the same families, groups and channels in the same order.
    for family, groups in families.items():
        for members in groups:
            for channel in family_channels(family, config):
                key = (members, channel)
                if key not in created:
                    created[key] = (_new_group(members, timeout), f"{family}_{channel}")
                if me in members:
                    group, name = created[key]
                    mine_ranks[family] = members
                    mine_groups.setdefault(family, {})[channel] = group
                    mine_names.setdefault(family, {})[channel] = name
    order = grad_reduce_order(config.param_group_size, config.grad_group_size)
    in_chunk_order = tuple(sorted(mine_ranks["grad"])[i] for i in order)
    return HierGroups(
        # What the communicator really is, not what was asked for.
        grad_chunk_ordered=tuple(dist.get_process_group_ranks(
            mine_groups["grad"]["reduce"])) == in_chunk_order,
        config=config,
        dp_ranks=dp_ranks,
        dp_index=dp_ranks.index(me),
        location=locations[me],
        locations=locations,
        ranks=mine_ranks,
        groups=mine_groups,
        link_classes={f: link_class(r, locations) for f, r in mine_ranks.items()},
        comm_names=mine_names,
        dp_group=dp_group,
        warnings=warnings,
    )


def family_channels(family: str, config: HierConfig) -> tuple[str, ...]:
    """FAMILY_CHANNELS, plus a "reduce" communicator for the secondary group where the two-hop
    qgZ runs its first all-to-all there."""
    channels = FAMILY_CHANNELS[family]
    if family == "secondary" and hierarchical_grad_reduce(config):
        channels = channels + ("reduce",)
    return channels


def local_view(args: Any, env: Mapping[str, str], host: str, rank: int, world_size: int,
               dp_ranks: tuple[int, ...]) -> tuple:
    """What rank ``rank`` shares at step 2: (location, data-parallel ranks, its error or None,
    gpus per node, GCDs per package), from its launcher environment ``env`` and ``host``."""
    local_error, location = None, None
    try:
        info = launcher_info_from_env(env)
        if info.world_size != world_size or info.rank != rank:
            raise TopologyError(
                f"the launcher environment ({info.source}) says rank {info.rank} of "
                f"{info.world_size}, torch.distributed says rank {rank} of {world_size}")
        gpus_per_node = resolve_gpus_per_node(info, getattr(args, "hier_gpus_per_node", None))
        gcds_per_package = getattr(args, "hier_gcds_per_package", None)
        if gcds_per_package is None:
            # Frontier's 2 GCDs per package, unless the node size says packages of one.
            gcds_per_package = (DEFAULT_GCDS_PER_PACKAGE
                                if gpus_per_node % DEFAULT_GCDS_PER_PACKAGE == 0 else 1)
        location = location_of(info, gpus_per_node, gcds_per_package, host)
    except (TopologyError, HierConfigError) as err:
        local_error = str(err)
        gpus_per_node = gcds_per_package = None
    return location, dp_ranks, local_error, gpus_per_node, gcds_per_package


def _all_gather_over_world(mine: tuple) -> list[tuple]:
    shared: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shared, mine)
    return shared


def _chunk_ordered_grad_groups(families: dict[str, list[tuple[int, ...]]], config: HierConfig
                               ) -> dict[str, list[tuple[int, ...]]]:
    """Each G-group's members in chunk order (layout.grad_reduce_order), where torch keeps an order.

    Then G-group rank c owns bucket chunk c and the gradient reduce-scatter
    needs no transpose copy (megatron_lbp/core/layout.py, "Collective orders").
    """
    order = grad_reduce_order(config.param_group_size, config.grad_group_size)
    if order == tuple(range(len(order))) or not _keeps_rank_order():
        return families
    out = dict(families)
    out["grad"] = [tuple(members[i] for i in order) for members in families["grad"]]
    return out


def _keeps_rank_order() -> bool:
    """Whether ``dist.new_group`` can keep a given rank order (torch >= 2.13, not via torchcomms)."""
    import inspect

    if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
        return False
    use_torchcomms = getattr(dist.distributed_c10d, "_use_torchcomms_enabled", None)
    return not (use_torchcomms is not None and use_torchcomms())


def _new_group(members: tuple[int, ...], timeout):
    """A process group whose group rank i is ``members[i]`` (sorted members: any torch)."""
    if list(members) == sorted(members):
        return dist.new_group(list(members), timeout=timeout)
    return dist.new_group(list(members), timeout=timeout, sort_ranks=False)
