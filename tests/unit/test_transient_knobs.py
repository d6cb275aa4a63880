"""The transient knobs in the plan and the launcher's choice (engine side: tests/engine/test_transient_model.py).

The plan's knob table against the formulas it quotes (costs.transient_bytes for the bytes,
projection/knobs.py for the exposed time), that exposure model against a schedule worked by
hand, and the choice: a row the engine's defaults do not fit takes a knob setting, and the
setting reaches the training command.
"""
from __future__ import annotations

import pytest

from megatron_lbp.core import costs, program
from megatron_lbp.launch import plan
from megatron_lbp.launch import candidates, estimate
from megatron_lbp.projection import knobs
from megatron_lbp.projection.project import ComputeModel
from tests.launch.test_launch_campaign import _shape


def _pass(segment, d, r=2, tied=False):
    """One pass of the step's program over three units (the embedding first when tied)."""
    kinds = ("embedding", "layer", "output") if tied else ("layer",) * 3
    spec = program.ProgramSpec(unit_kinds=kinds, group_sizes={"param": 2, "grad": 2},
                               tied_embedding=tied, prefetch_units=d, max_pending_reduces=r)
    return {seg: ops for seg, _, ops in program.step_program(spec).segments()}[segment]


def test_one_pass_by_hand():
    """Three units, gathers of 1 s, compute of 2 s each, one link: the program walked."""
    gathers = {"forward_gather": ("node", [1.0] * 3), "backward_gather": ("node", [1.0] * 3)}
    # depth 1: only the first gather is exposed (the next lands under the compute)
    assert knobs._walk(_pass(program.FORWARD, 1), gathers, [2.0] * 3) == 1.0
    # depth 0: every gather waits for its need
    assert knobs._walk(_pass(program.FORWARD, 0), gathers, [2.0] * 3) == 3.0
    # backward with reduce-scatters of 3 s on their own link, one in flight: they queue,
    # so the pass ends with the last one at 12 s against 6 s of compute
    reduces = {**gathers, "grad_reduce": ("grad", [3.0] * 3)}
    assert knobs._walk(_pass(program.BACKWARD, 1, r=1), reduces, [2.0] * 3) == 6.0
    # the tied output layer (unit 2) also needs unit 0: both gathered at its need
    assert knobs._walk(_pass(program.BACKWARD, 0, tied=True), gathers, [2.0] * 3) == 2.0 + 1.0


SHAPE = ["--world-size", "64", "--num-layers", "6", "--hidden-size", "1024",
         "--vocab-size", "8192", "--seq-length", "512", "--hier-secondary-group-size", "8",
         "--micro-batches", "2", "--micro-batch-size", "2", "--json"]


def _typed(argv):
    """The plan command's plan for ``argv``, typed (core.plan.Plan), with its knob table."""
    return plan.plan_from_args(plan.build_parser().parse_args(argv))


def test_the_plans_knob_table_is_the_formula():
    got = _typed(SHAPE)
    rows = got.transient_knobs
    first = rows[0]
    assert (first["prefetch_units"], first["max_pending_reduces"], first["note"]) == (1, 2, "as given")
    assert first["transient_peak"] == got.transient_bytes.peak
    assert {(r["prefetch_units"], r["max_pending_reduces"]) for r in rows} >= {
        (1, 1), (0, 2), (0, 1), (2, 2)}
    units = costs.gpt_units(6, 1024, 8192, 512, position_embedding_type="rope")
    compute = ComputeModel(micro_batch_size=2, seq_length=512, recompute=True)
    for r in rows:
        # each setting planned on its own: the table's bytes are that plan's transient peak
        own = _typed(SHAPE + ["--hier-prefetch-units", str(r["prefetch_units"]),
                              "--hier-max-pending-reduces", str(r["max_pending_reduces"]),
                              "--grad-dtype", r["grad_reduce_dtype"],
                              "--hier-embedding-backward-gather",
                              r["embedding_backward_gather"]])
        assert r["transient_peak"] == own.transient_bytes.peak, r
        assert r["saves_bytes"] == first["transient_peak"] - r["transient_peak"], r
        want = knobs.exposed_s(own, units, {"hidden_size": 1024},
                               knobs.Knobs(r["prefetch_units"], r["max_pending_reduces"],
                                           r["embedding_backward_gather"]),
                               compute=compute)["step"]
        assert r["exposed_s"] == pytest.approx(want, rel=1e-12), r
        assert r["cost_s"] == pytest.approx(want - first["exposed_s"], abs=1e-12), r
    by = {(r["prefetch_units"], r["max_pending_reduces"], r["grad_reduce_dtype"]): r
          for r in rows if r["embedding_backward_gather"] == "gather"}
    assert by[(1, 1, "fp32")]["saves_bytes"] > 0 and by[(0, 1, "fp32")]["saves_bytes"] > \
        by[(1, 1, "fp32")]["saves_bytes"], "fewer buffers in flight hold less"
    assert by[(2, 2, "fp32")]["saves_bytes"] < 0, "a deeper prefetch holds more"
    assert by[(0, 2, "fp32")]["cost_s"] > 0, "without prefetch every gather is exposed"
    assert by[(1, 2, "bf16")]["saves_bytes"] > 0, "bf16 gradient buffers are half the bytes"
    text = plan.render(got)
    assert "transient knobs" in text and "as given" in text, text
    # A model given by --params has no compute to time: bytes only.
    bare = plan.plan_json(["--world-size", "8", "--params", "1e8", "--json"])
    assert all(r["exposed_s"] is None and r["cost_s"] is None for r in bare["transient_knobs"])


def _row(options):
    return next(c for c in options if (c.recompute, c.micro_batch_size) == ("selective", 1))


def test_the_choice_takes_a_knob_where_the_defaults_do_not_fit():
    """20B, lbp without a secondary copy, 48 nodes, selective recomputation at micro-batch 1:
    the engine's defaults leave it over the GCD; one reduce-scatter in flight fits it, at no
    exposed time (a layer's reduce-scatter is shorter than its backward), and the resolved
    settings carry the knob to the launcher."""
    a = _shape(preset="lbp", hier_secondary_group_size=0, recompute="selective",
               micro_batch_size=1)
    row = _row(candidates.choices(a)[0])
    assert row.fits and row.knobs == (1, 1) and row.knob_cost_s == 0.0, row
    default = candidates.plan_of(a, 384, row.micro_batches)
    over = (row.state_bytes + default.transient_bytes.peak + row.activation_bytes
            + row.margin_bytes)
    assert over > 64e9 >= row.total_bytes, (over, row.total_bytes)
    _, resolved, refusal = estimate.report(a)
    assert refusal is None and (resolved["HIER_PREFETCH_UNITS"],
                                resolved["HIER_MAX_PENDING_REDUCES"]) == (1, 1), resolved
    # An explicit setting is kept: the defaults, which do not fit, are refused.
    kept = _row(candidates.choices(_shape(**{**vars(a), "hier_max_pending_reduces": 2,
                                           "hier_prefetch_units": 1}))[0])
    assert kept.knobs == (1, 2) and not kept.fits


def test_embedding_backward_skip_saves_the_tied_weights_and_only_removes_traffic():
    """--hier-embedding-backward-gather skip in the plan: tied, the V*h weights gathered for the
    output layer no longer live across every layer's backward (bf16: 2 bytes each) and the
    collectives are the default's; untied, one backward gather fewer. Never more exposed."""
    tied = plan.plan_json(SHAPE)
    skip = plan.plan_json(SHAPE + ["--hier-embedding-backward-gather", "skip"])
    embedding = costs.padded_numel(8192 * 1024, _hier(tied))
    saved = tied["transient_bytes"]["backward"] - skip["transient_bytes"]["backward"]
    assert saved == 2 * embedding, (saved, 2 * embedding)
    assert skip["traffic_by_phase"] == tied["traffic_by_phase"], "tied: the same collectives"
    row = next(r for r in tied["transient_knobs"] if r["embedding_backward_gather"] == "skip")
    assert (row["saves_bytes"], row["cost_s"]) == (saved, 0.0), row
    assert skip["embedding_backward_gather"] == "skip"

    untied_flags = SHAPE + ["--untie-embeddings-and-output-weights"]
    gather = plan.plan_json(untied_flags)
    skip = plan.plan_json(untied_flags + ["--hier-embedding-backward-gather", "skip"])
    one = costs.unit_collective_bytes(_hier(gather), 8192 * 1024, gather["link_classes"])
    fewer = {c: gather["traffic_by_phase"]["backward_gather"][c]
             - skip["traffic_by_phase"]["backward_gather"][c] for c in costs.LINK_CLASS_ORDER}
    cls = gather["link_classes"]["secondary"]
    assert fewer[cls] == 2 * one[("backward_gather", "secondary")] and sum(fewer.values()) == \
        fewer[cls], f"untied skip: backward gather bytes fewer by {fewer}, want 2 micro-batches x {one}"
    assert skip["transient_bytes"]["backward"] <= gather["transient_bytes"]["backward"]
    row = next(r for r in gather["transient_knobs"] if r["embedding_backward_gather"] == "skip")
    assert row["cost_s"] <= 0.0, row


def _hier(p):
    """The plan's hierarchy (SHAPE: lbp, nodes of 8, packages of 2)."""
    from megatron_lbp.core.config import resolve_hier_config

    return resolve_hier_config(p["world_size"], gpus_per_node=8, gcds_per_package=2,
                               secondary_group_size=p["group_sizes"]["secondary"])


def test_embedding_backward_gather_refuses_other_values():
    from megatron_lbp.core.config import EngineOptions, HierConfigError

    with pytest.raises(HierConfigError, match="--hier-embedding-backward-gather"):
        EngineOptions(embedding_backward_gather="never")
    with pytest.raises(ValueError, match="embedding_backward_gather"):
        costs.transient_bytes(_hier(plan.plan_json(SHAPE)), [10, 10],
                              embedding_backward_gather="never")
    assert plan.main(SHAPE + ["--hier-embedding-backward-gather", "never"]) == 2


@pytest.mark.parametrize("micro_batches", [4, 7])
def test_walking_three_micro_batches_gives_the_peaks_of_all(micro_batches, monkeypatch):
    """transient_bytes walks min(K, WALKED_MICRO_BATCHES) micro-batches: the same peaks as
    walking all K, over hierarchies, knobs, tied/split units and quantized reductions."""
    from types import SimpleNamespace
    import itertools

    def hier(W, P, G, O, S):
        return SimpleNamespace(world_size=W, param_group_size=P, grad_group_size=G,
                               optim_group_size=O, secondary_group_size=S,
                               secondary_dtype="int8")

    units = costs.gpt_units(4, 256, 1024, 128, position_embedding_type="rope")
    numels = [n for _, n in units]
    split = ("embedding",) + ("attention", "mlp") * 4 + ("output",)
    cases = itertools.product(
        [hier(16, 2, 8, 16, 0), hier(16, 2, 8, 16, 8), hier(16, 2, 4, 8, 2)],
        [(1, 2), (0, 1), (2, 1)], [False, True], [(), ("grad", "inter")],
        ["gather", "skip"])
    checked = 0
    for h, (d, r), tied, families, emb in cases:
        kw = dict(prefetch_units=d, max_pending_reduces=r, tied_embedding=tied,
                  quantized_grad_families=families, micro_batches=micro_batches,
                  embedding_backward_gather=emb)
        capped = costs.transient_bytes(h, numels, **kw)
        monkeypatch.setattr(costs, "WALKED_MICRO_BATCHES", micro_batches)
        full = costs.transient_bytes(h, numels, **kw)
        monkeypatch.undo()
        assert capped == full, (h, kw, capped, full)
        checked += 1
    split_numels = [numels[0]] + [n // 2 for n in numels[1:-1] for _ in (0, 1)] + [numels[-1]]
    kw = dict(micro_batches=micro_batches, unit_kinds=split, tied_embedding=True)
    capped = costs.transient_bytes(hier(16, 2, 8, 16, 8), split_numels, **kw)
    monkeypatch.setattr(costs, "WALKED_MICRO_BATCHES", micro_batches)
    assert capped == costs.transient_bytes(hier(16, 2, 8, 16, 8), split_numels, **kw)
    assert checked == 72
