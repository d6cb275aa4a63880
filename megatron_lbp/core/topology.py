"""Where each rank runs, and which ranks form each LBP communication group.

Pure Python, no torch: the engine gathers every rank's ``RankLocation`` once and calls
these functions with plain data, so the same code serves the CPU tests, the cost model
and a Frontier job. ``launcher_info_from_env`` reads Slurm or torchrun variables from the
mapping it is given; ``location_of`` turns them into (node, package), emulated nodes
included; ``dp_groups_from_layout`` reproduces Megatron's data-parallel groups,
``hierarchy_groups`` splits one into the group families, and ``check_colocation`` refuses
a group that crosses a slower link than its size requires.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from megatron_lbp.core.layout import LayoutError, all_groups

__all__ = [
    "LINK_CLASSES",
    "GROUP_FAMILIES",
    "COLOCATED_FAMILIES",
    "TopologyError",
    "RankLocation",
    "LauncherInfo",
    "launcher_info_from_env",
    "parse_slurm_tasks_per_node",
    "resolve_gpus_per_node",
    "location_of",
    "emulated_locations",
    "link_class",
    "check_colocation",
    "dp_groups_from_layout",
    "dp_domain_sizes",
    "hierarchy_groups",
    "all_hierarchy_groups",
]

LINK_CLASSES = ("package", "node", "network")  # fastest to slowest
# Order of the families in hierarchy_groups' result (a contract with the layout code).
GROUP_FAMILIES = ("param", "secondary", "grad", "optim", "inter", "grad_to_param", "replica")
# Family -> (tightest link its groups must stay on, flag that sizes it).
COLOCATED_FAMILIES = {
    "param": ("package", "--hier-param-group-size"),
    "secondary": ("package", "--hier-secondary-group-size"),
    "grad": ("node", "--hier-grad-group-size"),
}
OPT_OUT_FLAG = "--hier-allow-non-colocated"


class TopologyError(ValueError):
    """Launcher, placement or group inconsistency; the message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class RankLocation:
    """Physical place of one rank.

    ``node`` is a job-wide node id (emulated nodes inside one host get distinct
    ids); ``package`` is the node-local package index; ``local_rank`` is the
    launcher's local rank (what selects the device), not the emulated one.
    """

    rank: int
    node: int
    package: int
    local_rank: int
    host: str


@dataclass(frozen=True)
class LauncherInfo:
    """What the launcher told this process.

    ``tasks_per_node`` lists every node's rank count when the launcher says
    (Slurm's SLURM_TASKS_PER_NODE), else is empty; ``local_world_size_env``
    records which variable gave ``local_world_size``, for error messages.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    source: str  # "slurm" | "torchrun" | "single"
    tasks_per_node: tuple[int, ...] = ()
    local_world_size_env: str = ""


# --------------------------------------------------------------------------- launcher


def _env_int(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = env[name]
    try:
        value = int(str(raw).strip(), 10)
    except ValueError:
        raise TopologyError(f"{name}={raw!r} is malformed: expected an integer") from None
    if value < minimum:
        raise TopologyError(f"{name}={raw!r} is malformed: expected an integer >= {minimum}")
    return value


_TASKS_ENTRY = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_slurm_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> tuple[int, ...]:
    """Expand Slurm's compressed per-node list: "8(x3),7" -> (8, 8, 8, 7)."""
    counts: list[int] = []
    for entry in str(text).strip().split(","):
        match = _TASKS_ENTRY.match(entry.strip())
        if not match or int(match.group(1)) < 1 or (match.group(2) and int(match.group(2)) < 1):
            raise TopologyError(
                f"{name}={text!r} is malformed: expected entries like 8, 8(x3) or 8(x3),7")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return tuple(counts)


def _check_ranges(info: LauncherInfo, names: tuple[str, str, str, str]) -> LauncherInfo:
    rank_n, world_n, local_n, local_world_n = names
    if info.rank >= info.world_size:
        raise TopologyError(
            f"{rank_n}={info.rank} is out of range: {world_n}={info.world_size}")
    if info.local_rank >= info.local_world_size:
        raise TopologyError(
            f"{local_n}={info.local_rank} is out of range: {local_world_n} gives "
            f"{info.local_world_size} ranks on this node")
    if info.local_world_size > info.world_size:
        raise TopologyError(
            f"{local_world_n} gives {info.local_world_size} ranks per node, more than "
            f"{world_n}={info.world_size}")
    return info


def _slurm_info(env: Mapping[str, str]) -> LauncherInfo:
    world_var = "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS"
    for name in ("SLURM_PROCID", world_var, "SLURM_LOCALID", "SLURM_NODEID"):
        if name not in env:
            shown = "SLURM_NTASKS (or SLURM_NPROCS)" if name == world_var else name
            raise TopologyError(f"{shown} is missing although SLURM_PROCID is set")
    node_rank = _env_int(env, "SLURM_NODEID")
    # SLURM_TASKS_PER_NODE is what srun sets for the step (and it carries
    # uneven layouts); SLURM_NTASKS_PER_NODE is only the uniform request and
    # may be inherited from sbatch, so it is the fallback.
    tasks: tuple[int, ...] = ()
    if "SLURM_TASKS_PER_NODE" in env:
        raw = env["SLURM_TASKS_PER_NODE"]
        tasks = parse_slurm_tasks_per_node(raw)
        if node_rank >= len(tasks):
            raise TopologyError(
                f"SLURM_NODEID={node_rank} is out of range: SLURM_TASKS_PER_NODE={raw} "
                f"lists {len(tasks)} nodes")
        local_world, used = tasks[node_rank], f"SLURM_TASKS_PER_NODE={raw}"
    elif "SLURM_NTASKS_PER_NODE" in env:
        local_world = _env_int(env, "SLURM_NTASKS_PER_NODE", 1)
        used = f"SLURM_NTASKS_PER_NODE={env['SLURM_NTASKS_PER_NODE']}"
    else:
        raise TopologyError(
            "SLURM_TASKS_PER_NODE and SLURM_NTASKS_PER_NODE are both missing: "
            "cannot tell how many ranks share a node")
    info = LauncherInfo(
        rank=_env_int(env, "SLURM_PROCID"), world_size=_env_int(env, world_var, 1),
        local_rank=_env_int(env, "SLURM_LOCALID"), local_world_size=local_world,
        node_rank=node_rank, source="slurm", tasks_per_node=tasks, local_world_size_env=used)
    return _check_ranges(info, ("SLURM_PROCID", world_var, "SLURM_LOCALID", used.split("=")[0]))


def _torchrun_info(env: Mapping[str, str]) -> LauncherInfo:
    for name in ("RANK", "WORLD_SIZE"):
        if name not in env:
            other = "WORLD_SIZE" if name == "RANK" else "RANK"
            raise TopologyError(f"{name} is missing although {other}={env[other]} is set")
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE", 1)
    if "LOCAL_WORLD_SIZE" in env:
        local_world = _env_int(env, "LOCAL_WORLD_SIZE", 1)
        used = f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']}"
    else:
        # A hand-rolled env:// launch (tests, mp.spawn) sets only RANK and
        # WORLD_SIZE: all ranks are on this host.
        local_world = world
        used = f"WORLD_SIZE={env['WORLD_SIZE']} (no LOCAL_WORLD_SIZE: one host assumed)"
    local_rank = _env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank % local_world
    node_rank = _env_int(env, "GROUP_RANK") if "GROUP_RANK" in env else rank // local_world
    info = LauncherInfo(rank=rank, world_size=world, local_rank=local_rank,
                        local_world_size=local_world, node_rank=node_rank, source="torchrun",
                        local_world_size_env=used)
    return _check_ranges(info, ("RANK", "WORLD_SIZE", "LOCAL_RANK", used.split("=")[0]))


def launcher_info_from_env(env: Mapping[str, str]) -> LauncherInfo:
    """Rank, world and node placement from the launcher's variables.

    Precedence (why): torchrun always sets RANK *and* LOCAL_RANK, so that pair
    wins even inside a Slurm job (``srun torchrun``, where SLURM_PROCID counts
    the agents, not the workers). A RANK without LOCAL_RANK next to
    SLURM_PROCID is most likely the classic mistake of exporting
    RANK=$SLURM_PROCID in the batch script (every task then reads 0), so Slurm's
    own per-task variables win. Without either launcher, RANK/WORLD_SIZE
    (env:// convention) are used if set, else this is a single process.
    """
    if "RANK" in env and "LOCAL_RANK" in env:
        return _torchrun_info(env)
    if "SLURM_PROCID" in env:
        return _slurm_info(env)
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun_info(env)
    return LauncherInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                        source="single", tasks_per_node=(1,),
                        local_world_size_env="single process")


def resolve_gpus_per_node(info: LauncherInfo, flag_value: int | None) -> int:
    """Ranks per (possibly emulated) node: --hier-gpus-per-node or the launcher's count.

    This is the *physical* count of ranks per node, used for locations. A
    flag smaller than the launcher's count emulates several nodes per host;
    it must divide every node's count so that all ranks agree on the layout.
    A single process has nothing to disagree with (default 8, Frontier).
    """
    counts = info.tasks_per_node or (info.local_world_size,)
    if flag_value is None:
        if info.source == "single":
            return 8
        if len(set(counts)) > 1:
            # Each rank would otherwise pick its own node's count and build
            # different groups from everyone else: a silent hang.
            raise TopologyError(
                f"{info.local_world_size_env} places {_join(counts)} ranks on the nodes "
                "(uneven): pass --hier-gpus-per-node with a value that divides each count")
        return info.local_world_size
    if not isinstance(flag_value, int) or isinstance(flag_value, bool) or flag_value < 1:
        raise TopologyError(
            f"--hier-gpus-per-node={flag_value} is invalid: it must be an integer >= 1")
    if info.source == "single":
        return flag_value
    if any(count % flag_value for count in counts):
        each = "it" if len(set(counts)) == 1 else "each"
        raise TopologyError(
            f"--hier-gpus-per-node={flag_value} disagrees with the launcher: "
            f"{info.local_world_size_env} places {_join(sorted(set(counts), reverse=True))} "
            f"ranks per node (the flag must divide {each})")
    return flag_value


def _join(values: Iterable[Any]) -> str:
    return ", ".join(str(v) for v in values)


# --------------------------------------------------------------------------- locations


def _check_domains(gpus_per_node: int, gcds_per_package: int) -> None:
    for name, value in (("--hier-gpus-per-node", gpus_per_node),
                        ("--hier-gcds-per-package", gcds_per_package)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TopologyError(f"{name}={value} is invalid: it must be an integer >= 1")
    if gpus_per_node % gcds_per_package:
        raise TopologyError(
            f"--hier-gcds-per-package={gcds_per_package} must divide "
            f"--hier-gpus-per-node={gpus_per_node} (a node holds whole packages)")


def location_of(info: LauncherInfo, gpus_per_node: int, gcds_per_package: int,
                host: str) -> RankLocation:
    """This rank's (node, package); ``gpus_per_node`` from resolve_gpus_per_node."""
    _check_domains(gpus_per_node, gcds_per_package)
    counts = info.tasks_per_node or (info.local_world_size,)
    if info.source != "single" and any(c % gpus_per_node for c in counts):
        raise TopologyError(
            f"--hier-gpus-per-node={gpus_per_node} must divide the ranks per node "
            f"({info.local_world_size_env})")
    if info.tasks_per_node and len(info.tasks_per_node) > info.node_rank:
        # Uneven Slurm nodes: count the emulated nodes of all earlier nodes.
        first = sum(info.tasks_per_node[:info.node_rank]) // gpus_per_node
    else:
        first = info.node_rank * (info.local_world_size // gpus_per_node)
    return RankLocation(
        rank=info.rank,
        node=first + info.local_rank // gpus_per_node,
        package=(info.local_rank % gpus_per_node) // gcds_per_package,
        local_rank=info.local_rank,
        host=host,
    )


def emulated_locations(world_size: int, gpus_per_node: int, gcds_per_package: int,
                       host_prefix: str = "node") -> list[RankLocation]:
    """Consecutive placement (Slurm's block distribution): rank r on node r // gpus_per_node."""
    _check_domains(gpus_per_node, gcds_per_package)
    if not isinstance(world_size, int) or world_size < 1:
        raise TopologyError(f"world_size={world_size} is invalid: it must be an integer >= 1")
    return [
        RankLocation(rank=r, node=r // gpus_per_node,
                     package=(r % gpus_per_node) // gcds_per_package,
                     local_rank=r % gpus_per_node, host=f"{host_prefix}{r // gpus_per_node}")
        for r in range(world_size)
    ]


def _as_mapping(locations: Mapping[int, RankLocation] | Sequence[RankLocation]
                ) -> Mapping[int, RankLocation]:
    if isinstance(locations, Mapping):
        return locations
    mapping = {}
    for index, loc in enumerate(locations):
        if loc.rank != index:
            # A list is read as "index = rank"; a shuffled gather would
            # silently misplace every rank.
            raise TopologyError(
                f"locations[{index}] describes rank {loc.rank}: a sequence must be ordered by rank")
        mapping[index] = loc
    return mapping


def _lookup(mapping: Mapping[int, RankLocation], rank: int) -> RankLocation:
    try:
        return mapping[rank]
    except KeyError:
        raise TopologyError(f"rank {rank} has no known location") from None


def _link_class_of(locs: Sequence[RankLocation]) -> str:
    if len({(loc.node, loc.package) for loc in locs}) <= 1:
        return "package"
    if len({loc.node for loc in locs}) == 1:
        return "node"
    return "network"


def link_class(ranks: Sequence[int],
               locations: Mapping[int, RankLocation] | Sequence[RankLocation]) -> str:
    """Slowest link a collective over ``ranks`` crosses: package, node or network."""
    if len(ranks) == 0:
        raise TopologyError("link_class of an empty group is undefined")
    mapping = _as_mapping(locations)
    return _link_class_of([_lookup(mapping, r) for r in ranks])


def family_link_classes(groups: Mapping[str, Sequence[Sequence[int]]],
                        locations: Mapping[int, RankLocation] | Sequence[RankLocation]
                        ) -> dict[str, str | None]:
    """Slowest link class over each family's groups; None when every group is one rank.

    Shared by the plan tool and the engine (which picks qgZ's families from it),
    so both read one answer from the same placement.
    """
    out: dict[str, str | None] = {}
    for family, fam_groups in groups.items():
        if all(len(g) <= 1 for g in fam_groups):
            out[family] = None
            continue
        out[family] = max((link_class(g, locations) for g in fam_groups),
                          key=LINK_CLASSES.index)
    return out


def _capacities(mapping: Mapping[int, RankLocation]) -> dict[str, int]:
    """Most ranks any one package / node holds (how big a group can fit in one)."""
    per_package: dict[tuple[int, int], int] = {}
    per_node: dict[int, int] = {}
    for loc in mapping.values():
        per_package[(loc.node, loc.package)] = per_package.get((loc.node, loc.package), 0) + 1
        per_node[loc.node] = per_node.get(loc.node, 0) + 1
    return {"package": max(per_package.values(), default=1),
            "node": max(per_node.values(), default=1)}


def _required_class(family: str, size: int, capacity: Mapping[str, int]) -> str | None:
    """Tightest class the family asks for, loosened when the group cannot fit in it.

    zero3's P = W or hsdp's P = node are legitimate; only groups small enough
    to sit in one package (node) are required to.
    """
    floor = COLOCATED_FAMILIES[family][0]
    for cls in LINK_CLASSES[LINK_CLASSES.index(floor):]:
        if cls == "network":
            return None
        if size <= capacity[cls]:
            return cls
    return None


def _describe_group(ranks: Sequence[int], mapping: Mapping[int, RankLocation],
                    limit: int = 8) -> str:
    parts = [f"{r} (host {loc.host}, node {loc.node}, package {loc.package})"
             for r, loc in ((r, _lookup(mapping, r)) for r in ranks[:limit])]
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return ", ".join(parts) + more


def _family_violation(family: str, groups: Sequence[Sequence[int]],
                      mapping: Mapping[int, RankLocation], capacity: Mapping[str, int]
                      ) -> str | None:
    bad = []
    for group in groups:
        required = _required_class(family, len(group), capacity)
        if required is None:
            continue
        actual = link_class(group, mapping)
        if LINK_CLASSES.index(actual) > LINK_CLASSES.index(required):
            bad.append((group, required, actual))
    if not bad:
        return None
    group, required, actual = bad[0]
    flag = COLOCATED_FAMILIES[family][1]
    return (f"{family} group of {flag}={len(group)} crosses the {actual} link but must lie "
            f"in one {required}: ranks {_describe_group(list(group), mapping)} "
            f"({len(bad)} of {len(groups)} {family} groups affected; tensor or context "
            f"parallelism leaves fewer data-parallel ranks per {required})")


def check_colocation(groups: Mapping[str, Sequence[Sequence[int]]],
                     locations: Mapping[int, RankLocation] | Sequence[RankLocation],
                     *, allow: bool = False) -> list[str]:
    """Refuse P/S groups outside one package and G groups outside one node.

    ``groups`` maps a family to its groups of *global* ranks; only "param",
    "secondary" and "grad" are checked. ``locations`` must cover whole nodes
    (normally every rank of the job): how many ranks fit in a package or node
    is read from it, and a group larger than that is not checked (zero3's
    P = W cannot help crossing the network). Raises TopologyError on the first
    bad family, or with ``allow`` returns one warning line per bad family.
    """
    mapping = _as_mapping(locations)
    capacity = _capacities(mapping)
    warnings = []
    for family, family_groups in groups.items():
        if family not in COLOCATED_FAMILIES:
            continue
        problem = _family_violation(family, family_groups, mapping, capacity)
        if problem is None:
            continue
        if not allow:
            raise TopologyError(f"{problem}; pass {OPT_OUT_FLAG} to run anyway")
        warnings.append(f"{problem}; running anyway because {OPT_OUT_FLAG} is set")
    return warnings


# --------------------------------------------------------------------------- groups


def _check_positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TopologyError(f"{name}={value} is invalid: it must be an integer >= 1")
    return value


def dp_groups_from_layout(world_size: int, tensor_model_parallel_size: int = 1,
                          pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1,
                          *, with_context_parallel: bool = False) -> list[list[int]]:
    """Megatron's data-parallel groups for its default order "tp-cp-ep-dp-pp".

    Global rank = tp + TP*(cp + CP*(dp + DP*pp)). Each group lists its ranks
    in data-parallel rank order; groups are sorted. ``with_context_parallel``
    gives the dp x cp groups instead, which is what Megatron's distributed
    optimizer shards over when CP > 1 (its rank order: cp fastest, then dp).
    """
    w = _check_positive("world_size", world_size)
    tp = _check_positive("tensor_model_parallel_size", tensor_model_parallel_size)
    pp = _check_positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
    cp = _check_positive("context_parallel_size", context_parallel_size)
    if w % (tp * pp * cp):
        raise TopologyError(
            f"world_size={w} is not divisible by tensor x pipeline x context parallel "
            f"size {tp} x {pp} x {cp} = {tp * pp * cp}")
    dp = w // (tp * pp * cp)

    def rank(tp_i: int, cp_i: int, dp_i: int, pp_i: int) -> int:
        return tp_i + tp * (cp_i + cp * (dp_i + dp * pp_i))

    if with_context_parallel:
        groups = [[rank(t, c, d, p) for d in range(dp) for c in range(cp)]
                  for p in range(pp) for t in range(tp)]
    else:
        groups = [[rank(t, c, d, p) for d in range(dp)]
                  for p in range(pp) for c in range(cp) for t in range(tp)]
    return sorted(groups)


def dp_domain_sizes(gpus_per_node: int, gcds_per_package: int,
                    tensor_model_parallel_size: int = 1, context_parallel_size: int = 1,
                    *, with_context_parallel: bool = False) -> tuple[int, int]:
    """(data-parallel ranks per node, per package) for HierConfig's gpus_per_node/gcds_per_package.

    In the order "tp-cp-ep-dp-pp" consecutive members of one DP group are TP x CP
    global ranks apart (TP apart for dp x cp groups), so a node of 8 GCDs with
    TP=2 holds 4 ranks of each DP group and a package of 2 holds 1.
    """
    _check_domains(gpus_per_node, gcds_per_package)
    tp = _check_positive("tensor_model_parallel_size", tensor_model_parallel_size)
    cp = _check_positive("context_parallel_size", context_parallel_size)
    stride = tp if with_context_parallel else tp * cp

    def per(domain: int, name: str) -> int:
        if domain % stride == 0:
            return domain // stride
        if stride % domain == 0:
            return 1  # each model-parallel group fills whole domains
        raise TopologyError(
            f"{name}={domain} and the model-parallel stride {stride} (TP x CP) do not "
            "divide one another: data-parallel groups would straddle domains unevenly")

    return per(gpus_per_node, "--hier-gpus-per-node"), per(gcds_per_package,
                                                           "--hier-gcds-per-package")


def hierarchy_groups(dp_group_ranks: Sequence[int], cfg: Any) -> dict[str, list[tuple[int, ...]]]:
    """Split one data-parallel group into LBP's group families (global ranks).

    The families and their members are defined once, in megatron_lbp.core.layout
    (``all_groups``), in DP-index space; this maps them onto the group's global
    ranks. Families come in GROUP_FAMILIES order ("secondary" only when S > 0),
    groups ordered by lowest member: the order new_group calls need.
    """
    ranks = list(dp_group_ranks)
    if len(set(ranks)) != len(ranks):
        raise TopologyError(f"the data-parallel group {ranks} repeats a rank")
    world = len(ranks)
    if cfg.world_size != world:
        raise TopologyError(
            f"the data-parallel group has {world} ranks but cfg.world_size={cfg.world_size}")
    sizes = (world, cfg.param_group_size, cfg.grad_group_size, cfg.optim_group_size,
             cfg.secondary_group_size)
    families = [f for f in GROUP_FAMILIES if f != "secondary" or cfg.secondary_group_size]
    try:
        by_index = {family: all_groups(family, *sizes) for family in families}
    except LayoutError as err:
        raise TopologyError(str(err)) from None
    return {family: [tuple(ranks[i] for i in group) for group in groups]
            for family, groups in by_index.items()}


def all_hierarchy_groups(dp_groups: Sequence[Sequence[int]], cfg: Any
                         ) -> dict[str, list[tuple[int, ...]]]:
    """hierarchy_groups for every DP group, concatenated per family.

    torch.distributed.new_group must be called by every rank for every group
    in the same order; iterating this result gives that order.
    """
    merged: dict[str, list[tuple[int, ...]]] = {}
    for dp_group in dp_groups:
        for family, groups in hierarchy_groups(dp_group, cfg).items():
            merged.setdefault(family, []).extend(groups)
    return merged
