"""Pre-flight check of a job's nodes: the torch build, the devices, one timed all-gather per link.

    python -m megatron_lbp.launch health --build-only --require-gpu rocm --devices-per-node 8
    srun ... lbp_task.sh python -m megatron_lbp.launch health --tasks-per-node 8 \\
        --gcds-per-package 2 --gpus-per-task 1 [--expect package=200,node=50,network=12.5] \\
        [--min-fraction 0.25] [--megabytes 64] [--skip-links]

A node whose slowest rank is under --min-fraction of --expect (GB/s per GCD, one
direction) on any link class is named and the check fails (exit 4).
--survey-out FILE runs the link survey after; --links-out FILE writes the
measured figures as JSON for the plan. See docs/frontier.md.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Any, Mapping, Sequence

PROG = "lbp_health"
CLASSES = ("package", "node", "network")
FRONTIER_BUS_IDS = "c1,c6,c9,ce,d1,d6,d9,de"
MiB = 1 << 20
GB = 1e9
LINKS_CONVENTION = ("GB/s (1e9 bytes) per GCD, one direction: bytes one rank sends / seconds, "
                    "every rank of the class sending at once")


class HealthError(RuntimeError):
    """The nodes cannot run this job as configured; the message is one line.

    ``own``: found by this rank alone (it says so itself); otherwise every rank found the
    same and rank 0 says it.
    """

    def __init__(self, message: str, own: bool = False):
        super().__init__(message)
        self.own = own


# --------------------------------------------------------------------------- torch build


def describe_build(torch) -> str:
    return (f"torch {torch.__version__} (torch.version.hip={getattr(torch.version, 'hip', None)}, "
            f"torch.version.cuda={getattr(torch.version, 'cuda', None)})")


def check_build(torch, require: str, devices_needed: int, where: str) -> str:
    """One line describing the build and devices; raises HealthError when they cannot serve."""
    hip, cuda = getattr(torch.version, "hip", None), getattr(torch.version, "cuda", None)
    build = describe_build(torch)
    if require == "none":
        return f"{build}: no GPU required"
    wanted = {"rocm": ("the ROCm build", hip), "cuda": ("the CUDA build", cuda),
              "any": ("a ROCm or CUDA build", hip or cuda)}[require]
    if not wanted[1]:
        kind = "a CPU build" if not (hip or cuda) else ("a CUDA build" if cuda else "a ROCm build")
        raise HealthError(f"{build} is {kind}, but this profile runs on GPUs and needs "
                          f"{wanted[0]}: activate an environment with it (LBP_ACTIVATE), or set "
                          "GPUS_PER_TASK=0 LBP_REQUIRE_GPU=none for a CPU run")
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen < devices_needed:
        raise HealthError(f"{build} sees {seen} GPU(s) on {where}, the job needs "
                          f"{devices_needed}: check the allocation (sbatch options) and the "
                          "visibility variables (ROCR_VISIBLE_DEVICES)")
    return f"{build} sees {seen} GPU(s) on {where}"


# --------------------------------------------------------------------------- groups


def package_groups(world: int, tasks_per_node: int, gcds_per_package: int) -> list[list[int]]:
    return [list(range(s, s + gcds_per_package)) for s in range(0, world, gcds_per_package)]


def node_groups(world: int, tasks_per_node: int) -> list[list[int]]:
    return [list(range(s, s + tasks_per_node)) for s in range(0, world, tasks_per_node)]


def network_rounds(nodes: int) -> list[list[tuple[int, int]]]:
    """Pairs of nodes: (0,1), (2,3), ... then (1,2), (3,4), ... (n-1, 0) so every node is in one or two."""
    if nodes < 2:
        return []
    first = [(a, a + 1) for a in range(0, nodes - 1, 2)]
    if nodes == 2:
        return [first]
    second = [(a, (a + 1) % nodes) for a in range(1, nodes, 2)]
    return [first, second]


def pair_groups(pairs: Sequence[tuple[int, int]], tasks_per_node: int) -> list[list[int]]:
    return [[a * tasks_per_node + loc, b * tasks_per_node + loc]
            for a, b in pairs for loc in range(tasks_per_node)]


# --------------------------------------------------------------------------- verdict


def parse_expect(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.replace(" ", ",").split(","))):
        name, _, value = part.partition("=")
        if name not in CLASSES:
            raise ValueError(f"--expect: {name!r} is not a link class ({', '.join(CLASSES)})")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--expect: {part!r}: give {name}=<GB/s per GCD>") from None
        if out[name] <= 0:
            raise ValueError(f"--expect: {part!r}: the bandwidth must be > 0")
    return out


def default_expect() -> dict[str, float]:
    from megatron_lbp.projection.project import LinkModel

    return {c: LinkModel().bandwidth[c] / GB for c in CLASSES}


def evaluate(samples: Mapping[str, Mapping[int, float]], hosts: Sequence[str],
             tasks_per_node: int, expect: Mapping[str, float], min_fraction: float,
             sizes: Mapping[str, str]) -> tuple[list[str], dict[str, list[str]]]:
    """(report lines, {slow node: [reasons]}).

    ``samples[cls][rank]``: GB/s that rank reached on class ``cls`` (network: "network0",
    "network1" for the two rounds of pairs); ``hosts[rank]``: its node's name.
    """
    lines, slow = [], {}
    nodes = len(hosts) // tasks_per_node
    node_name = [hosts[n * tasks_per_node] for n in range(nodes)]
    for cls in CLASSES:
        keys = [k for k in samples if k == cls or (cls == "network" and k.startswith("network"))]
        if not keys:
            continue
        floor = expect[cls] * min_fraction
        per_node: dict[int, list[float]] = {}
        values = []
        for k in keys:
            for rank, bw in samples[k].items():
                values.append(bw)
        if cls != "network":
            for rank, bw in samples[cls].items():
                per_node.setdefault(rank // tasks_per_node, []).append(bw)
            worst = {n: min(v) for n, v in per_node.items()}
            for n, bw in worst.items():
                if bw < floor:
                    slow.setdefault(node_name[n], []).append(f"{cls} {bw:.3g} GB/s")
            slowest = min(worst, key=worst.get)
            where = f"{worst[slowest]:.3g} GB/s on {node_name[slowest]}"
        else:
            pair_min: dict[tuple[int, int], float] = {}
            for k in keys:
                for rank, bw in samples[k].items():
                    pair_min[_pair_of(k, rank, nodes, tasks_per_node)] = min(
                        bw, pair_min.get(_pair_of(k, rank, nodes, tasks_per_node), float("inf")))
            for n in range(nodes):
                mine = {p: bw for p, bw in pair_min.items() if n in p}
                if mine and all(bw < floor for bw in mine.values()):
                    slow.setdefault(node_name[n], []).append(
                        f"network {max(mine.values()):.3g} GB/s with "
                        + "/".join(node_name[b if a == n else a] for a, b in mine))
            worst_pair = min(pair_min, key=pair_min.get)
            where = (f"{pair_min[worst_pair]:.3g} GB/s between {node_name[worst_pair[0]]} and "
                     f"{node_name[worst_pair[1]]}")
        lines.append(f"{cls}: {sizes[cls]}: median {statistics.median(values):.3g} GB/s, slowest "
                     f"{where}; expected {expect[cls]:g} GB/s per GCD, floor "
                     f"{min_fraction:g} x = {floor:.3g} GB/s")
    return lines, slow


def measured_links(samples: Mapping[str, Mapping[int, float]]) -> dict[str, float]:
    """{class: median GB/s over ranks} (network: both rounds of pairs together)."""
    out = {}
    for cls in CLASSES:
        values = [bw for k, by_rank in samples.items()
                  if k == cls or (cls == "network" and k.startswith("network"))
                  for bw in by_rank.values()]
        if values:
            out[cls] = statistics.median(values)
    return out


def write_links(path: str, samples: Mapping[str, Mapping[int, float]], detail: str) -> None:
    import json

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"convention": LINKS_CONVENTION, "GB_per_s_per_gcd": measured_links(samples),
                   "measured": detail}, f, indent=1)
    os.replace(tmp, path)


def read_links(path: str) -> dict[str, float]:
    """{class: bytes/s per GCD, one direction} from a --links-out file (ValueError if not one)."""
    import json

    with open(path) as f:
        data = json.load(f)
    figures = data.get("GB_per_s_per_gcd") if isinstance(data, dict) else None
    if not isinstance(figures, dict) or not figures or \
            data.get("convention") != LINKS_CONVENTION:
        raise ValueError("not a link file of the health check (--links-out): it needs "
                         '"convention" and "GB_per_s_per_gcd" {package, node, network}')
    out = {}
    for cls, value in figures.items():
        if cls not in CLASSES or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{cls}={value!r}: give a link class ({', '.join(CLASSES)}) and "
                             f"GB/s > 0")
        out[cls] = float(value) * GB
    return out


def _pair_of(key: str, rank: int, nodes: int, tasks_per_node: int) -> tuple[int, int]:
    node = rank // tasks_per_node
    for pair in network_rounds(nodes)[int(key[len("network"):])]:
        if node in pair:
            return pair
    raise KeyError(f"rank {rank} is in no pair of {key}")


def check_pci(records: Sequence[Mapping[str, Any]], tasks_per_node: int, gcds_per_package: int,
              bus_ids: Sequence[str]) -> str:
    """Each rank's GCD from its PCI bus against ROCR_VISIBLE_DEVICES and the package layout."""
    gcd_of_bus = {b.lower(): i for i, b in enumerate(bus_ids)}
    gcds = {}
    for r in records:
        bus = r.get("pci_bus")
        if bus is None:
            return "no PCI locations (CPU ranks): checked by ROCR_VISIBLE_DEVICES only"
        if bus not in gcd_of_bus:
            raise HealthError(f"rank {r['rank']} on {r['host']}: PCI bus {bus} is not in "
                              f"--gcd-bus-ids ({','.join(bus_ids)}): set LBP_GCD_BUS_IDS for "
                              "this node type")
        g = gcd_of_bus[bus]
        rocr = r.get("rocr")
        if rocr not in (None, "") and rocr.isdigit() and int(rocr) != g:
            raise HealthError(f"rank {r['rank']} on {r['host']}: ROCR_VISIBLE_DEVICES={rocr} but "
                              f"its device is on PCI bus {bus} = GCD {g}")
        gcds[r["rank"]] = g
    for group in package_groups(len(records), tasks_per_node, gcds_per_package):
        pk = {gcds[r] // gcds_per_package for r in group}
        if len(pk) != 1:
            raise HealthError(f"ranks {group} on {records[group[0]]['host']} form one package group "
                              f"but their GCDs {[gcds[r] for r in group]} (by PCI bus) are on "
                              "different packages: use --gpu-bind=closest")
    return f"PCI locations of all {len(records)} devices match ROCR_VISIBLE_DEVICES and the packages"


# --------------------------------------------------------------------------- the job step


def _timed_all_gather(torch, dist, group, chunk_bytes: int, device, reps: int = 3) -> float:
    """Median seconds of one all-gather of ``chunk_bytes`` per rank in ``group`` (None: idle)."""
    n = dist.get_world_size(group) if group is not None else 1
    elems = chunk_bytes // 4
    src = torch.ones(elems, dtype=torch.float32, device=device)
    out = torch.empty(elems * n, dtype=torch.float32, device=device)
    from megatron_lbp.engine.dist_api import all_gather_single

    gather = all_gather_single()
    times = []
    for i in range(reps + 1):        # the first is a warm-up (connection set-up)
        dist.barrier()
        t0 = time.perf_counter()
        if group is not None:
            gather(out, src, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _subgroup(dist, groups: list[list[int]], rank: int):
    """Every rank creates every group (torch.distributed's rule); returns this rank's or None."""
    mine = None
    for g in groups:
        pg = dist.new_group(g)
        if rank in g:
            mine = (pg, len(g))
    return mine


def run_step(a, env: Mapping[str, str]) -> int:
    import torch
    import torch.distributed as dist

    from megatron_lbp.launch.job_group import join_job

    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    T, P = a.tasks_per_node, a.gcds_per_package
    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    use_gpu = a.gpus_per_task > 0 and torch.cuda.is_available()
    if a.gpus_per_task > 0 and a.require_gpu != "none":
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if seen != a.gpus_per_task:
            raise HealthError(f"rank {rank} on {host}: {describe_build(torch)} sees {seen} "
                              f"device(s), expected {a.gpus_per_task} per task", own=True)
    device = join_job(rank, world, use_gpu)
    try:
        pci = None
        if use_gpu:
            bus = getattr(torch.cuda.get_device_properties(0), "pci_bus_id", None)
            pci = None if bus is None else f"{int(bus):02x}"
        record = {"rank": rank, "host": host, "pci_bus": pci,
                  "rocr": env.get("ROCR_VISIBLE_DEVICES")}
        records = [None] * world
        dist.all_gather_object(records, record)
        lines = [f"{world // T} node(s) x {T} ranks, {describe_build(torch)}, backend "
                 f"{dist.get_backend()}"]
        lines.append(check_pci(records, T, P, a.gcd_bus_ids.split(",")))
        verdict = ""
        if not a.skip_links:
            chunk = int(a.megabytes * MiB)
            nodes = world // T
            plan = {}
            if P > 1:
                plan["package"] = package_groups(world, T, P)
            if T > P:
                plan["node"] = node_groups(world, T)
            for i, pairs in enumerate(network_rounds(nodes)):
                plan[f"network{i}"] = pair_groups(pairs, T)
            mine = {}
            for key, groups in plan.items():
                g = _subgroup(dist, groups, rank)
                seconds = _timed_all_gather(torch, dist, g[0] if g else None, chunk, device)
                if g:
                    mine[key] = chunk * (g[1] - 1) / seconds / GB
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            samples: dict[str, dict[int, float]] = {}
            for r, m in enumerate(gathered):
                for key, bw in m.items():
                    samples.setdefault(key, {})[r] = bw
            sizes = {c: f"all-gather of {a.megabytes:g} MiB per rank, "
                        f"{sum(1 for k in plan if k.startswith(c))} round(s)"
                     for c in CLASSES}
            expect = {**default_expect(), **parse_expect(a.expect or "")}
            report, slow = evaluate(samples, [r["host"] for r in records], T, expect,
                                    a.min_fraction, sizes)
            lines += report
            if rank == 0 and a.links_out:
                write_links(a.links_out, samples, f"{sizes['package'].split(',')[0]}, "
                            f"{world // T} node(s) x {T} ranks, {dist.get_backend()}")
                lines.append(f"links: measured figures written to {a.links_out} (the estimate "
                             f"and plan --choose read them with --links / LBP_LINKS)")
            if slow:
                names = ",".join(slow)
                verdict = (f"slow links on {len(slow)} node(s): "
                           + "; ".join(f"{n} ({', '.join(why)})" for n, why in slow.items())
                           + f": leave them out (sbatch -x {names}), or lower "
                           f"LBP_HEALTH_MIN_FRACTION={a.min_fraction:g}, or LBP_HEALTH_CHECK=0")
        if rank == 0:
            for line in lines:
                print(f"[lbp health] {line}", flush=True)
            if verdict:
                print(f"{PROG}: error: {verdict}", file=sys.stderr, flush=True)
        if a.survey_out and not verdict:
            _survey(a, rank, device, env)
        dist.barrier()
        return 4 if verdict else 0
    finally:
        dist.destroy_process_group()


def _survey(a, rank: int, device, env: Mapping[str, str]) -> None:
    from megatron_lbp.launch import link_survey

    link_survey.run(out_path=a.survey_out, tasks_per_node=a.tasks_per_node,
                    gcds_per_package=a.gcds_per_package, sizes=a.survey_sizes,
                    reps=a.survey_reps, max_seconds=a.survey_max_seconds,
                    overlap_bytes=int(a.survey_overlap_mib * MiB), gemm_dim=a.survey_gemm_dim,
                    codec_elements=a.survey_codec_elements, device=device, env=env, command="python -m megatron_lbp.launch health",
                    log=(lambda line: print(f"[lbp survey] {line}", flush=True)) if rank == 0
                    else (lambda line: None))


def main(argv=None, env: Mapping[str, str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_lbp.launch health", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--require-gpu", choices=("rocm", "cuda", "any", "none"), default="any")
    ap.add_argument("--devices-per-node", type=int, default=0)
    ap.add_argument("--tasks-per-node", type=int, default=8)
    ap.add_argument("--gcds-per-package", type=int, default=2)
    ap.add_argument("--gpus-per-task", type=int, default=1)
    ap.add_argument("--expect", default="")
    ap.add_argument("--min-fraction", type=float, default=0.25)
    ap.add_argument("--megabytes", type=float, default=64.0)
    ap.add_argument("--gcd-bus-ids", default=FRONTIER_BUS_IDS)
    ap.add_argument("--skip-links", action="store_true")
    ap.add_argument("--links-out", default=None, metavar="FILE",
                    help="write the measured median GB/s per link class here (JSON)")
    ap.add_argument("--survey-out", default=None, metavar="FILE",
                    help="also run the link survey (megatron_lbp/launch/link_survey.py) and "
                         "write it here")
    from megatron_lbp.launch import link_survey

    link_survey.add_arguments(ap, prefix="survey-")
    a = ap.parse_args(argv)
    env = os.environ if env is None else env
    try:
        a.survey_sizes = link_survey.check_arguments(
            a.survey_sizes_mib, a.survey_reps, a.survey_max_seconds, a.survey_overlap_mib,
            a.survey_gemm_dim)
        a.survey_codec_elements = link_survey.parse_codec_elements(
            a.survey_codec_mi_elements)
        if a.survey_out and not os.path.isdir(os.path.dirname(os.path.abspath(a.survey_out))):
            raise ValueError(f"--survey-out {a.survey_out}: its directory does not exist")
        parse_expect(a.expect or "")
        if not 0 <= a.min_fraction <= 1 or a.megabytes <= 0:
            raise ValueError(f"LBP_HEALTH_MIN_FRACTION={a.min_fraction:g} must be in [0, 1] and "
                             f"LBP_HEALTH_MB={a.megabytes:g} > 0")
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        if a.build_only:
            import torch

            where = env.get("SLURMD_NODENAME") or socket.gethostname()
            print(f"[lbp] torch: {check_build(torch, a.require_gpu, a.devices_per_node, where)}",
                  flush=True)
            return 0
        return run_step(a, env)
    except HealthError as exc:
        if a.build_only or exc.own or env.get("RANK", "0") == "0":
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 4
