"""The Frontier projection from the engine's real schedule: its trace replayed at Frontier figures.

Takes one rank's program order from a schedule trace recorded on CPU with the
target GPT's units and replays it (megatron_lbp.projection.replay) with each
collective's bytes from ``costs.unit_collective_bytes`` at the real shape and
each compute interval's FLOPs at peak x MFU. Nothing about overlap is assumed.
Invariant: the replayed bytes per phase and link class equal the plan's
(``bytes_match_plan``). Stored traces live in megatron_lbp/projection/traces
(``record_traces`` makes them). See docs/schedule-trace.md, docs/frontier.md.
"""
from __future__ import annotations

import gzip
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

from megatron_lbp.core.plan import Plan
from megatron_lbp.core import costs
from megatron_lbp.projection import project as pj
from megatron_lbp.projection.replay import ReplayError, explain, replay

TRACES_DIR = Path(__file__).resolve().parent / "traces"
INDEX = "index.json"
REPO = Path(__file__).resolve().parents[2]
RECORD_COMMAND = "python -m megatron_lbp.projection --record-traces megatron_lbp/projection/traces"
RECORD_MINUTES = "~8 min on the 2-core machine when quiet, 13 min under heavy load"
# A compute pass's time in forwards of its unit (backward: data and weight gradients).
PASS_FORWARDS = {"forward": 1.0, "recompute": 1.0, "backward": 2.0}
RECORD_DEFAULTS = {"layers": (44, 32), "schemes": pj.DEFAULT_SCHEMES, "ranks": 16,
                   "gpus_per_node": 8, "hidden": 64, "heads": 4, "vocab": 512, "seq": 32,
                   "micro_batch_size": 1, "micro_batches": 2, "steps": 3, "prefetch_units": 1}
# The reference trace: the committed traces' settings on 2 nodes of 4 GCDs and 2 layers, which
# tests/engine/test_schedule.py records afresh in the ranks it starts anyway (seconds, not minutes).
REFERENCE = {"file": "reference-L2-lbp.jsonl.gz", "scheme": "lbp", "layers": 2, "ranks": 8,
             "gpus_per_node": 4}


# --------------------------------------------------------------------------- traces


def read_index(directory: Path = TRACES_DIR) -> dict[str, Any]:
    try:
        return json.loads((directory / INDEX).read_text())
    except (OSError, ValueError) as err:
        raise ReplayError(f"{directory / INDEX}: {err}") from None


def default_traces(directory: Path = TRACES_DIR) -> dict[str, dict[int, Path]]:
    """scheme -> layer count -> committed trace file."""
    out: dict[str, dict[int, Path]] = {}
    for entry in read_index(directory)["traces"]:
        out.setdefault(entry["scheme"], {})[int(entry["layers"])] = directory / entry["file"]
    return out


def load(path: str | os.PathLike, rank: int = 0) -> list[dict[str, Any]]:
    """One rank's step records from a trace file (or ``{rank}`` pattern), in step order."""
    from megatron_lbp.projection.trace_records import TraceError, read_records

    try:
        records = [r for r in read_records([str(path)]) if r["rank"] == rank]
    except TraceError as err:
        raise ReplayError(str(err)) from None
    if not records:
        raise ReplayError(f"{path}: no records of rank {rank}")
    return sorted(records, key=lambda r: r["step"])


def layer_count(records: Sequence[dict[str, Any]]) -> int:
    return sum(1 for u in records[-1]["units"] if u["kind"] == "layer")


def check_units(records: Sequence[dict[str, Any]], model: Mapping[str, int], where: str) -> None:
    """The trace's units must be the model's: embedding, its layers in order, output."""
    kinds = [u["kind"] for u in records[-1]["units"]]
    want = [k for k, _ in costs.gpt_units(model["num_layers"], model["hidden_size"],
                                          model["vocab_size"])]
    if kinds != want:
        raise ReplayError(
            f"{where}: the trace's units ({_kinds_text(kinds)}) are not the model's "
            f"({_kinds_text(want)}); record a trace with --num-layers {model['num_layers']} "
            f"(bench project --record-traces DIR --record-layers {model['num_layers']})")


def _kinds_text(kinds: Sequence[str]) -> str:
    return ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))


# --------------------------------------------------------------------------- durations


def config_of(plan: Plan) -> SimpleNamespace:
    """The HierConfig fields costs reads, from a plan (core.plan.Plan)."""
    g = plan.group_sizes
    return SimpleNamespace(
        world_size=plan.world_size, param_group_size=g.param, grad_group_size=g.grad,
        optim_group_size=g.optim, secondary_group_size=g.secondary or 0,
        secondary_dtype=plan.secondary_dtype or "int8",
        quant_block_size=plan.quant_block_size,
        quantize_weight_gather=plan.quantize_weight_gather,
        quantize_grad_reduce=bool(plan.quantize_grad_reduce),
        secondary_scope=plan.secondary_scope, grad_quant_scheme=plan.grad_quant_scheme)


class FrontierDurations:
    """collective_s and compute_s for replay.replay: one plan at the real shape."""

    def __init__(self, records: Sequence[dict[str, Any]], plan: Plan,
                 model: Mapping[str, int], links: pj.LinkModel, compute: pj.ComputeModel):
        self.plan, self.model, self.links, self.compute = plan, model, links, compute
        cfg = config_of(plan)
        self.units = costs.gpt_units(model["num_layers"], model["hidden_size"],
                                     model["vocab_size"])
        self.unit_bytes = [
            costs.unit_collective_bytes(cfg, numel, plan.link_classes,
                                        param_dtype=plan.params_dtype,
                                        grad_dtype=plan.grad_dtype,
                                        quant_block_size=plan.quant_block_size)
            for _, numel in self.units]
        # Recorded bytes of every (record, unit, phase, family, micro-batch): the share
        # each collective of a unit takes when the engine splits one into several.
        self._recorded: dict[tuple, float] = {}
        for index, record in enumerate(records):
            for c in record["collectives"]:
                key = (index, c["unit"], c["phase"], self.family_of(c), c["micro_batch"])
                self._recorded[key] = self._recorded.get(key, 0.0) + float(c["bytes"])
        self._index = {id(r): i for i, r in enumerate(records)}
        self._records = records
        tokens = compute.micro_batch_size * compute.seq_length
        self._seconds_per_flop_token = tokens / (compute.peak_flops * compute.mfu)
        optim = plan.padded_params / plan.group_sizes.optim
        self.adam_s = optim * compute.adam_bytes_per_element / compute.hbm_bytes_per_s
        self._numel = sum(numel for _, numel in self.units)

    def family_of(self, c: dict[str, Any]) -> str:
        """The plan's family of trace collective ``c``: its own, except the two hops of
        zeropp's qgZ (traced across nodes) where the plan's world is one node and reduces
        in one "grad" collective, whose bytes the hops then share."""
        family = c["family"]
        if (c["phase"] == "grad_reduce" and family in ("secondary", "grad_cross")
                and c["unit"] is not None
                and ("grad_reduce", family) not in self.unit_bytes[c["unit"]]
                and ("grad_reduce", "grad") in self.unit_bytes[c["unit"]]):
            return "grad"
        return family

    def real_bytes(self, record: dict[str, Any], c: dict[str, Any]) -> float:
        """Bytes this rank sends in trace collective ``c`` at the real shape."""
        if c["phase"] == "control" or c["unit"] is None:
            return float(c["bytes"])
        family = self.family_of(c)
        total = self.unit_bytes[c["unit"]].get((c["phase"], family))
        if total is None:
            raise ReplayError(f"{c['phase']} collective of family {c['family']} (unit "
                              f"{c['unit']}): not a collective the cost model knows")
        key = (self._index.get(id(record), -1), c["unit"], c["phase"], family,
               c["micro_batch"])
        recorded = self._recorded.get(key)
        share = float(c["bytes"]) / recorded if recorded else 1.0
        return float(total) * share

    def family_size(self, family: str) -> int:
        try:
            return pj._family_size(self.plan, family)
        except KeyError:
            return self.plan.world_size

    def collective_s(self, record: dict[str, Any], c: dict[str, Any]) -> float:
        family = self.family_of(c)
        n = self.family_size(family)
        if n <= 1:
            return 0.0
        cls = self.plan.link_classes.get(family) or c["link"]
        return (self.real_bytes(record, c) / self.links.bandwidth[cls]
                + self.links.latency[cls] * math.ceil(math.log2(n)))

    def forward_flops_per_token(self, unit: int) -> float:
        kind, numel = self.units[unit]
        h, V = self.model["hidden_size"], self.model["vocab_size"]
        if kind == "embedding":
            return 0.0
        if kind == "layer":
            return 2.0 * numel + 4.0 * h * self.compute.seq_length
        if kind == "output":
            return 2.0 * (numel + V * h)
        return 2.0 * numel

    def compute_s(self, record: dict[str, Any], interval: dict[str, Any]) -> float:
        if interval["pass"] == "optimizer":
            return self._adam_share(record, interval)
        times = PASS_FORWARDS.get(interval["pass"])
        if times is None:
            raise ReplayError(f"compute pass {interval['pass']!r} (unit {interval['unit']}): "
                              f"not one the replay can time ({', '.join(PASS_FORWARDS)}, "
                              f"optimizer)")
        return times * self.forward_flops_per_token(interval["unit"]) * \
            self._seconds_per_flop_token

    def _adam_share(self, record: dict[str, Any], interval: dict[str, Any]) -> float:
        """Adam over the whole 1/O shard, split between the step's optimizer intervals: a
        unit's interval takes its unit's share, the unit-less ones what is left, equally."""
        if interval["unit"] is not None:
            return self.adam_s * self.units[interval["unit"]][1] / self._numel
        optimizer = [i for i in record["compute"] if i["pass"] == "optimizer"]
        own = {i["unit"] for i in optimizer if i["unit"] is not None}
        rest = 1.0 - sum(self.units[u][1] for u in own) / self._numel
        return self.adam_s * rest / sum(1 for i in optimizer if i["unit"] is None)


def _coverage(records, durations: FrontierDurations, where: str) -> None:
    """Every collective the real plan has must be in the trace (else the replay drops it)."""
    present = {(c["unit"], c["phase"], durations.family_of(c))
               for c in records[-1]["collectives"]}
    for unit, by_key in enumerate(durations.unit_bytes):
        for (phase, family), nbytes in by_key.items():
            if nbytes and durations.family_size(family) > 1 and \
                    (unit, phase, family) not in present:
                raise ReplayError(
                    f"{where}: the trace has no {phase} collective of family {family} for unit "
                    f"{unit}, which the plan sends; record the trace on a world where that "
                    f"group has more than one rank")


def replay_one(records: Sequence[dict[str, Any]], plan: Plan,
               model: Mapping[str, int], links: pj.LinkModel, compute: pj.ComputeModel,
               where: str = "") -> dict[str, Any]:
    """The last record's step replayed at ``plan``'s shape: times, exposure, TFLOPS/GCD."""
    check_units(records, model, where)
    d = FrontierDurations(records, plan, model, links, compute)
    _coverage(records, d, where)
    steps, _ = replay(records, d.collective_s, d.compute_s)
    last = steps[-1].as_json()
    k = records[-1]["micro_batches"]
    per_token = pj.model_flops_per_token(plan.params, model["num_layers"],
                                         model["hidden_size"], compute.seq_length)
    useful = per_token * compute.micro_batch_size * compute.seq_length * k
    last["tflops_per_gcd"] = useful / last["step_s"] / 1e12
    last["micro_batches"] = k
    last["explain"] = explain(last["phases"])
    # The bytes the last step issued, per phase and link class, are the plan's: counted
    # over what its record issued, waited for in it or not (with the optimizer step's
    # all-gathers overlapped into the next forward, the last step's are never waited for).
    moved: dict[str, dict[str, float]] = {ph: dict.fromkeys(costs.LINK_CLASS_ORDER, 0.0)
                                          for ph in costs.PHASES}
    for c in records[-1]["collectives"]:
        if c["phase"] in moved and d.family_size(d.family_of(c)) > 1:
            cls = plan.link_classes.get(d.family_of(c)) or c["link"]
            moved[c["phase"]][cls] += d.real_bytes(records[-1], c)
    last["bytes_match_plan"] = all(
        math.isclose(moved[ph][cls], float(plan.traffic_by_phase[ph][cls]), rel_tol=1e-9,
                     abs_tol=1e-6) for ph in costs.PHASES for cls in costs.LINK_CLASS_ORDER)
    return last


def replay_projection(models: Sequence[str], gcds: Sequence[int], schemes: Sequence[str],
                      traces: Mapping[str, Mapping[int, Path]], links: pj.LinkModel,
                      compute: pj.ComputeModel, rank: int = 0) -> dict[str, Any]:
    """Every (model, scheme with a trace, GCD count) replayed; ratios; the idealised ones beside."""
    results: dict[str, Any] = {}
    used: dict[str, dict[str, Any]] = {}
    missing: dict[str, str] = {}
    settings: set[tuple[int, bool, int]] = set()
    for name in models:
        model = pj.MODELS[name]
        results[name] = {}
        for scheme in schemes:
            path = traces.get(scheme, {}).get(model["num_layers"])
            if path is None:
                missing[f"{name} {scheme}"] = (
                    f"no trace of {scheme} with {model['num_layers']} layers")
                continue
            records = load(path, rank)
            k = records[-1]["micro_batches"]
            recompute = any(i["pass"] == "recompute" for i in records[-1]["compute"])
            depth = records[-1].get("prefetch_units")
            settings.add((k, recompute, depth))
            used.setdefault(scheme, {})[name] = {
                "path": _shown(path), "steps": [r["step"] for r in records], "rank": rank,
                "micro_batches": k, "recompute": recompute, "prefetch_units": depth}
            rows = {}
            for n in gcds:
                plan = pj.plan_for(model, n, scheme, k)
                rows[str(n)] = replay_one(records, plan, model, links, compute,
                                          f"{name} {scheme} at {n} GCDs ({_shown(path)})")
            base = rows[str(min(gcds))]["tflops_per_gcd"]
            for row in rows.values():
                row["scaling_efficiency"] = row["tflops_per_gcd"] / base
            results[name][scheme] = rows
    if len(settings) > 1:
        raise ReplayError(f"the traces were recorded with different (micro-batches, "
                          f"recompute, prefetch) settings {sorted(settings)}: compare like "
                          f"with like")
    k, recompute, depth = settings.pop() if settings else (1, False, None)
    ratios = pj.ratios_of(results, gcds)
    idealised = pj.project(models, gcds, [s for s in schemes if s in used] or schemes, k,
                           links=links, compute=replace(compute, recompute=recompute))
    return {"assumptions": {
                "rules": "program order of rank 0's last traced step; a collective starts when "
                         "issued and its communicator is free; compute serial; a wait blocks "
                         "until done (megatron_lbp/projection/replay.py)",
                "durations": "each unit's bytes from the cost model at the real shape and "
                             "GCD count, link figures as in the idealised model; each unit's "
                             "compute from its FLOPs at the assumed MFU "
                             "(megatron_lbp/projection/project_replay.py)",
                "micro_batches": k, "recompute": recompute, "prefetch_units": depth,
                "not_modelled": "bandwidth shared by concurrent collectives on one link class "
                                "(each runs at full speed on its own communicator), host work "
                                "outside the traced compute intervals, GPU stream semantics "
                                "(the trace's order is the host's)"},
            "traces": used, "missing": missing, "results": results, "ratios": ratios,
            "idealised": {"micro_batches": k, "recompute": recompute,
                          "ratios": idealised["ratios"]},
            "stale": stale_traces(used)}


def _shown(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def stale_traces(used: Mapping[str, Mapping[str, Any]]) -> str:
    """'' when the committed traces used are in the trace format this reader reads."""
    from megatron_lbp.projection.trace_records import TRACE_FORMAT_VERSION

    committed = [t["path"] for by_model in used.values() for t in by_model.values()
                 if (REPO / t["path"]).parent == TRACES_DIR]
    if not committed:
        return ""
    recorded = read_index().get("trace_format_version")
    if recorded == TRACE_FORMAT_VERSION:
        return ""
    return (f"the committed traces are in trace format {recorded}, this reader's is "
            f"{TRACE_FORMAT_VERSION}: re-record with `{RECORD_COMMAND}` ({RECORD_MINUTES}) and "
            f"commit {_shown(TRACES_DIR)}")


# --------------------------------------------------------------------------- output


def render(rep: Mapping[str, Any], paper: Mapping[str, Any],
           above: Mapping[str, Any] | None = None) -> list[str]:
    """The replay's lines; ``above``: the idealised projection printed before it (its
    ``ratios`` and ``assumptions``), whose ratios stand beside the replayed ones."""
    a = rep["assumptions"]
    lines = ["", "Replayed schedule (the engine's traced program order at Frontier's figures; "
             "megatron_lbp/projection/project_replay.py):",
             f"  traces: {a['micro_batches']} micro-batch(es), "
             f"{'full recomputation' if a['recompute'] else 'no recomputation'}, prefetch "
             f"{a['prefetch_units']} unit(s) ahead: " + "; ".join(
                 f"{s} {t['path']}" for s, by_model in rep["traces"].items()
                 for t in by_model.values())]
    for key in ("rules", "durations", "not_modelled"):
        lines.append(f"  {key}: {a[key]}")
    if rep.get("stale"):
        lines.append(f"  WARNING: {rep['stale']}")
    for why in rep["missing"].values():
        lines.append(f"  not replayed: {why}")
    for name, per_scheme in rep["results"].items():
        if not per_scheme:
            continue
        gcds = list(next(iter(per_scheme.values())))
        lines.append(f"\n{name}, replayed: TFLOPS/GCD (scaling efficiency)")
        lines += pj.tflops_lines(per_scheme)
        top = gcds[-1]
        for scheme, rows in per_scheme.items():
            r = rows[top]
            lines.append(f"  {scheme} at {top} GCDs: step {r['step_s']:.2f} s = compute "
                         f"{r['compute_s']:.2f} + exposed {r['exposed_s']:.2f} (link time "
                         f"{r['link_s']:.2f}); bytes as the plan's: "
                         f"{'yes' if r['bytes_match_plan'] else 'NO'}")
            lines += [f"    {line}" for line in r["explain"]]
    refs = {"lbp/zeropp TFLOPS": paper["lbp_over_zeropp_tflops_20B_384"],
            "zeropp/zero3 TFLOPS": paper["zeropp_over_zero3_tflops"],
            "lbp scaling efficiency": paper["lbp_scaling_efficiency"]}
    old = (above or {}).get("ratios", {})
    lines.append(f"\nratios: replayed vs idealised (same settings: {a['micro_batches']} "
                 f"micro-batch(es), {'full recomputation' if a['recompute'] else 'none'})"
                 + (f" vs idealised as above ({settings_text(above['assumptions'])})"
                    if old else "") + " vs paper:")
    ideal = rep["idealised"]["ratios"]
    for key, value in rep["ratios"].items():
        ref = next((v for k, v in refs.items() if k in key), None)
        lines.append(f"  {key:<44} replayed {value:.3f}   idealised "
                     f"{ideal.get(key, float('nan')):.3f}"
                     + (f"   as above {old[key]:.3f}" if key in old else "")
                     + (f"   paper {ref}" if ref else ""))
    return lines


def settings_text(assumptions: Mapping[str, Any]) -> str:
    """The idealised projection's micro-batches and recomputation, as its assumptions say."""
    recompute = (assumptions.get("compute") or {}).get("recompute")
    return (f"{assumptions.get('micro_batches')} micro-batch(es), "
            f"{'full recomputation' if recompute else 'no recomputation'}")


# --------------------------------------------------------------------------- recording


TIME_KEYS = ("issued", "wait", "done", "start", "end", "t_end", "clock")


def _rounded(value: Any) -> Any:
    """A trace record with its times to the microsecond: the replay reads only the order,
    and the committed files are a tenth the size."""
    if isinstance(value, dict):
        return {k: round(v, 6) if k in TIME_KEYS and isinstance(v, float) else _rounded(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _record_on_rank(runs: list[dict[str, Any]], micro_batch_size: int, micro_batches: int,
                    steps: int) -> None:
    """Train each run's tiny GPT through the engine with the trace on (rank 0 writes it)."""
    import gc

    import torch

    from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, setup_hier

    train = TrainSpec(steps=steps, micro_batch_size=micro_batch_size, micro_batches=micro_batches)
    for run in runs:
        spec = TinyGPTSpec(num_layers=run["layers"], hidden_size=run["hidden"],
                           num_attention_heads=run["heads"], vocab_size=run["vocab"],
                           seq_length=run["seq"], params_dtype=torch.bfloat16, recompute=True)
        trainer = setup_hier(spec, train, run["argv"] + ["--hier-trace", run["tmp_path"]])
        trainer.run(range(steps))
        del trainer
        gc.collect()


def _engine_argv(scheme: str, cfg: Mapping[str, Any]) -> list[str]:
    from megatron_lbp.projection.schemes import ENGINE_SCHEMES, GCDS_PER_PACKAGE

    return ENGINE_SCHEMES[scheme] + ["--hier-gpus-per-node", str(cfg["gpus_per_node"]),
                                     "--hier-gcds-per-package", str(GCDS_PER_PACKAGE),
                                     "--hier-prefetch-units", str(cfg["prefetch_units"])]


def _run(cfg: Mapping[str, Any], tmp: Path, n_layers: int, scheme: str, name: str) -> dict:
    path = tmp / name
    if path.exists():
        path.unlink()  # the trace appends
    return {"layers": n_layers, "scheme": scheme, "hidden": cfg["hidden"], "heads": cfg["heads"],
            "vocab": cfg["vocab"], "seq": cfg["seq"], "file": name + ".gz",
            "tmp_path": str(path), "argv": _engine_argv(scheme, cfg)}


def _record_runs(runs: Sequence[dict[str, Any]], cfg: Mapping[str, Any], out: Path) -> None:
    """Train ``runs`` on cfg's ranks; rank 0's records, rounded and gzipped, into ``out``."""
    from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks

    run_on_ranks(_record_on_rank, cfg["ranks"], list(runs), cfg["micro_batch_size"],
                 cfg["micro_batches"], cfg["steps"],
                 rank_env=rank_location_env(cfg["gpus_per_node"]), timeout=3600)
    for run in runs:
        lines = Path(run["tmp_path"]).read_text().splitlines()
        data = "".join(json.dumps(_rounded(json.loads(line))) + "\n" for line in lines if line)
        # mtime 0: the same trace gives the same bytes
        with gzip.GzipFile(out / run["file"], "wb", mtime=0) as f:
            f.write(data.encode())
        Path(run["tmp_path"]).unlink()


def _reference() -> tuple[dict[str, Any], str]:
    cfg = {**RECORD_DEFAULTS, **{k: REFERENCE[k] for k in ("ranks", "gpus_per_node")}}
    return cfg, REFERENCE["file"].removesuffix(".gz")


def record_reference_on_rank(trace_path: str | os.PathLike) -> None:
    """On each of REFERENCE's ranks (already started, placed as its nodes): train the
    reference run with its trace into ``trace_path`` (rank 0 writes; plain JSON lines)."""
    cfg, _ = _reference()
    path = Path(trace_path)
    run = _run(cfg, path.parent, REFERENCE["layers"], REFERENCE["scheme"], path.name)
    _record_on_rank([run], cfg["micro_batch_size"], cfg["micro_batches"], cfg["steps"])


def record_reference(out_dir: str | os.PathLike) -> Path:
    """The reference trace (REFERENCE: the committed traces' settings on 8 ranks, 2 layers)
    into ``out_dir``; its path."""
    cfg, name = _reference()
    out = Path(out_dir)
    tmp = out / ".recording"
    tmp.mkdir(parents=True, exist_ok=True)
    _record_runs([_run(cfg, tmp, REFERENCE["layers"], REFERENCE["scheme"], name)], cfg, out)
    tmp.rmdir()
    return out / REFERENCE["file"]


def record_traces(out_dir: str | os.PathLike, *, layers: Sequence[int] = RECORD_DEFAULTS["layers"],
                  schemes: Sequence[str] = RECORD_DEFAULTS["schemes"], command: str = "",
                  log=print, **overrides) -> dict[str, Any]:
    """Record one trace per (layer count, scheme) into ``out_dir``, the reference trace beside
    them, and write its index.json.

    Each is a tiny megatron-core GPT (bf16, full recomputation) trained through
    the engine on gloo ranks of this machine placed as Frontier nodes (8 GCDs
    in packages of 2, two nodes by default, so every group family of 384 GCDs
    has more than one rank); rank 0's records, gzip-compressed.
    """
    from megatron_lbp.projection.schemes import ENGINE_SCHEMES, GCDS_PER_PACKAGE
    from megatron_lbp.projection.trace_records import TRACE_FORMAT_VERSION

    cfg = {**RECORD_DEFAULTS, **overrides, "layers": tuple(layers), "schemes": tuple(schemes)}
    bad = [s for s in schemes if s not in ENGINE_SCHEMES]
    if bad:
        raise ReplayError(f"cannot record {', '.join(bad)}: not an engine scheme")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".recording"
    tmp.mkdir(exist_ok=True)
    runs = [_run(cfg, tmp, n_layers, scheme, f"L{n_layers}-{scheme}.jsonl")
            for n_layers in layers for scheme in schemes]
    log(f"[record] {len(runs)} trace(s) on {cfg['ranks']} gloo ranks "
        f"({cfg['ranks'] // cfg['gpus_per_node']} nodes of {cfg['gpus_per_node']})")
    _record_runs(runs, cfg, out)
    tmp.rmdir()
    log(f"[record] the reference trace on {REFERENCE['ranks']} ranks")
    record_reference(out)
    entries = [{k: run[k] for k in ("file", "scheme", "layers", "hidden", "heads", "vocab", "seq")}
               | {"engine_argv": run["argv"]} for run in runs]
    index = {"command": command, "trace_format_version": TRACE_FORMAT_VERSION,
             "ranks": cfg["ranks"], "gpus_per_node": cfg["gpus_per_node"],
             "gcds_per_package": GCDS_PER_PACKAGE, "micro_batch_size": cfg["micro_batch_size"],
             "micro_batches": cfg["micro_batches"], "steps": cfg["steps"], "recompute": True,
             "prefetch_units": cfg["prefetch_units"], "params_dtype": "bf16", "rank": 0,
             "reference": REFERENCE, "traces": entries}
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    log(f"[record] wrote {len(entries)} trace(s), the reference and {INDEX} to {out}")
    return index
