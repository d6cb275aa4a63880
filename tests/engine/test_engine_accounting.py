"""What the engine holds and sends, measured, against the plan tool's formulas.

Bytes sent are counted by the engine's collective interface; bytes held are
read from the storages of the tensors themselves. Both must equal what
megatron_lbp.core.costs predicts for the same buckets and group layout, exactly.
"""
import pytest
import torch

from megatron_lbp.core import costs
from megatron_lbp.core.config import HierConfig, default_grad_reduce_dtype
from megatron_lbp.testing.multirank import rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, train_hier
from megatron_lbp.core.topology import all_hierarchy_groups, emulated_locations, family_link_classes
from tests.engine.test_engine_equivalence import PRESETS, TOPOLOGY, WORLD


def predicted(result, dtype, k):
    """The plan of the run's config; its gradients in the dtype the engine picks when
    --hier-grad-reduce-dtype is not given (bf16 for zeropp under bf16, else fp32)."""
    cfg = HierConfig(**result.extra["config"])
    groups = all_hierarchy_groups([list(range(WORLD))], cfg)
    links = {f: c or "package" for f, c in
             family_link_classes(groups, emulated_locations(WORLD, 4, 2)).items()}
    return costs.estimate(cfg, result.extra["bucket_numels"], links, param_dtype=dtype,
                          grad_dtype=default_grad_reduce_dtype(cfg.preset, dtype),
                          micro_batches=k)


def storage_probe(model, optimizer, step, micro):
    """After a micro-batch's backward: is any full weight still resident?"""
    return {
        "full_bytes": sum(b.full.untyped_storage().nbytes() for b in model.buckets),
        "param_bytes": sum(p.untyped_storage().nbytes() for p in model.module.parameters()),
        "grads_none": all(p.grad is None for p in model.module.parameters()),
    }


@pytest.mark.parametrize("preset", list(PRESETS))
def test_traffic_and_memory_equal_the_plan(preset):
    k = 2
    train = TrainSpec(steps=2, micro_batches=k, bucket_size=20000)
    ranks = run_on_ranks(train_hier, WORLD, TinyGPTSpec(), train, PRESETS[preset],
                         rank_env=TOPOLOGY, probe=storage_probe)
    for rank, res in enumerate(ranks):
        plan = predicted(res, "fp32", k)
        report = res.step_reports[-1]
        measured = {ph: v for ph, v in report["traffic_by_phase"].items() if ph != "control"}
        assert measured == plan["traffic_by_phase"], (
            f"{preset} rank {rank}: bytes per phase and link\n measured {measured}\n"
            f" plan     {plan['traffic_by_phase']}")
        assert report["traffic_bytes"] == plan["traffic_bytes"]
        for state in ("primary", "secondary", "grad", "optimizer", "total"):
            assert report["memory_bytes"][state] == plan["memory_bytes"][state], (
                f"{preset} rank {rank}: {state} holds {report['memory_bytes'][state]} bytes, "
                f"plan says {plan['memory_bytes'][state]}")
        # Scalars only (norm, inf flag): a few bytes, never bulk data.
        assert sum(report["traffic_by_phase"]["control"].values()) < 64
        for probe in res.extra["probes"]:
            assert probe == {"full_bytes": 0, "param_bytes": 0, "grads_none": True}, (
                f"{preset} rank {rank}: between uses {probe}")


def test_bf16_memory_has_a_separate_fp32_master():
    spec = TinyGPTSpec(params_dtype=torch.bfloat16)
    train = TrainSpec(steps=1, micro_batches=1, bucket_size=20000)
    res = run_on_ranks(train_hier, WORLD, spec, train, PRESETS["lbp-P2-G4-O8"], rank_env=TOPOLOGY)[3]
    plan = predicted(res, "bf16", 1)
    mem = res.step_reports[-1]["memory_bytes"]
    for state in ("primary", "grad", "optimizer", "total"):
        assert mem[state] == plan["memory_bytes"][state], (state, mem, plan["memory_bytes"])
    n = plan["padded_params"]
    assert mem["primary"] == 2 * n // 2 and mem["optimizer"] == 12 * n // 8, (mem, n)


def _peaks_by_prefetch_depth(depths):
    from megatron_lbp.testing.tiny_gpt import setup_hier

    out = {}
    for depth in depths:
        trainer = setup_hier(TinyGPTSpec(num_layers=4), TrainSpec(steps=2, micro_batches=1),
                             PRESETS["zero3"] + ["--hier-prefetch-units", str(depth)])
        report = trainer.run(range(2)).step_reports[-1]
        out[depth] = (report["memory_bytes"]["peak_transient"], trainer.model.bucket_numels(),
                      trainer.hier.config.as_dict())
    return out


def test_peak_transient_stays_within_the_plan_and_grows_with_prefetch_depth():
    out = run_on_ranks(_peaks_by_prefetch_depth, WORLD, (0, 1, 2), rank_env=TOPOLOGY)[0]
    peaks = {d: peak for d, (peak, _, _) in out.items()}
    for depth, (peak, numels, config) in out.items():
        bound = costs.transient_bytes(HierConfig(**config), numels, param_dtype="fp32",
                                      prefetch_units=depth, tied_embedding=True)
        assert 0 < peak <= bound["peak"], (
            f"depth {depth}: peak transient {peak} bytes above the plan's bound {bound}")
        # Look-ahead adds at most its gathers, plus one unit's gradient reduce-scatter
        # (full fp32 gradient and 1/G result) that happened to be still in flight at the
        # peak of one run and had landed by the peak of the other: when a collective
        # lands is the machine's timing, not the schedule's.
        cfg = HierConfig(**config)
        in_flight = max(4 * costs.padded_numel(n, cfg) * (1 + 1 / cfg.grad_group_size)
                        for n in numels)
        assert peak - peaks[0] <= bound["prefetch"] + in_flight, (
            f"depth {depth} holds {peak - peaks[0]} bytes more than depth 0, above its "
            f"prefetch {bound['prefetch']} + one reduce in flight {in_flight:.0f}", peaks, bound)
        whole_model = sum(costs.padded_numel(n, HierConfig(**config)) for n in numels) * 4 * 2
        # Weights and gradients of 6 units: units are being freed as the passes move on.
        assert peak < whole_model * 0.75, (depth, peak, whole_model)
    # Look-ahead holds more weights at once; where the peak falls late in the backward
    # (little left to prefetch) a second unit of it need not raise the peak further.
    assert peaks[0] < peaks[1] <= peaks[2], f"prefetching did not hold more: {peaks}"


def test_network_bytes_do_not_grow_with_gradient_accumulation():
    out = {}
    for k in (1, 4):
        train = TrainSpec(steps=1, micro_batches=k, bucket_size=20000)
        res = run_on_ranks(train_hier, WORLD, TinyGPTSpec(), train, PRESETS["lbp-P2-G4-O8"],
                           rank_env=TOPOLOGY)[0]
        out[k] = res.step_reports[-1]["traffic_bytes"]
    assert out[1]["network"] == out[4]["network"] > 0, out
    assert out[4]["node"] > out[1]["node"] and out[4]["package"] == 4 * out[1]["package"], out
