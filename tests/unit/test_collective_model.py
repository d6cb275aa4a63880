"""The link survey's reader, the collective-time model's interpolation and the step-time bands
(megatron_lbp/projection/survey_file.py, collectives.py): pure Python, real files."""
from __future__ import annotations

import json

import pytest

from megatron_lbp.projection import collectives as cm
from megatron_lbp.projection import project as pj
from megatron_lbp.projection import survey_file as sf


def _table(op="all_gather", dtype="bf16", shape="cross_node", n=4, points=((1e6, 1e-3), (4e6, 3e-3))):
    sent = [b for b, _ in points]
    sec = [t for _, t in points]
    return {"op": op, "dtype": dtype, "shape": shape, "group_size": n,
            "bytes": [b * n / (n - 1) for b in sent], "sent_bytes": sent, "seconds": sec,
            "seconds_min": [t * 0.9 for t in sec], "seconds_max": [t * 1.2 for t in sec]}


def _survey(tables=None, overlap=None, **shapes):
    shapes = shapes or {"cross_node": 4}
    return {"schema": sf.SCHEMA, "version": sf.VERSION, "complete": True,
            "convention": sf.CONVENTION,
            "machine": {"nodes": 4, "tasks_per_node": 8, "gcds_per_package": 2, "world": 32},
            "shapes": {s: {"group_size": n, "groups": 32 // n, "link": "network"}
                       for s, n in shapes.items()},
            "tables": tables if tables is not None else [_table()], "overlap": overlap,
            "skipped": []}


def _codecs(**int8):
    """A one-size codec probe of int8, its entries replaced by ``int8``'s."""
    cols = {"seconds": [1e-3], "seconds_min": [1e-3], "seconds_max": [1e-3]}
    return {"elements": [1024], "by_codec": {"int8": {
        "encode": cols, "decode": cols, "hidden_fraction": 0.0, "slowdown": 1.0, **int8}}}


def _write(tmp_path, data, name="s.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_a_good_survey_reads_back(tmp_path):
    data = _survey()
    assert sf.read(_write(tmp_path, data)) == data


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.pop("complete"), 'no "complete": true'),
    (lambda d: d.update(complete=False), 'no "complete": true'),
    (lambda d: d.update(version=2), '"version" is 2'),
    (lambda d: d.update(schema="x"), '"schema"'),
    (lambda d: d.update(tables=[]), '"tables" is empty'),
    (lambda d: d["tables"][0].update(op="gather"), "op, dtype or shape unknown"),
    (lambda d: d["tables"][0].update(shape="world"), "op, dtype or shape unknown"),
    (lambda d: d["tables"][0].update(group_size=8), "group_size differs"),
    (lambda d: d["tables"][0]["seconds"].pop(), "lists of one length"),
    (lambda d: d["tables"][0]["seconds"].__setitem__(0, -1.0), "a number > 0"),
    (lambda d: d["tables"][0]["seconds"].__setitem__(0, float("nan")), "a number > 0"),
    (lambda d: d["tables"][0]["bytes"].reverse(), "bytes must ascend"),
    (lambda d: d["tables"][0]["seconds_min"].__setitem__(0, 1.0), "seconds_min <= seconds"),
    (lambda d: d["tables"].append(_table()), "given twice"),
    (lambda d: d["shapes"].update(ring={"group_size": 2}), "unknown shape 'ring'"),
    (lambda d: d.update(overlap={"by_op": {"all_gather": {"slowdown": 1.0}}}), "overlap all_gather"),
    (lambda d: d["machine"].pop("world"), '"machine"'),
    (lambda d: d.update(codecs={"elements": [4096, 1024], "by_codec": {}}),
     '"codecs" needs "elements"'),
    (lambda d: d.update(codecs={"elements": [1024], "by_codec": {"int2": {}}}),
     "unknown codec 'int2'"),
    (lambda d: d.update(codecs=_codecs(decode={"seconds": [1e-3]})), "codecs int8 decode"),
    (lambda d: d.update(codecs=_codecs(hidden_fraction=None)), "hidden_fraction and slowdown"),
])
def test_a_malformed_survey_is_refused_in_one_line_naming_the_file(tmp_path, edit, needle):
    data = _survey()
    edit(data)
    path = _write(tmp_path, data)
    with pytest.raises(sf.SurveyError) as e:
        sf.read(path)
    msg = str(e.value)
    assert needle in msg and msg.startswith(path) and "\n" not in msg, msg


def test_a_cut_off_file_is_refused(tmp_path):
    text = json.dumps(_survey())
    path = _write(tmp_path, text[: len(text) // 2])
    with pytest.raises(sf.SurveyError, match="not JSON .*cut-off"):
        sf.read(path)


def test_interpolation_is_exact_at_the_sizes_linear_between_and_along_the_ends():
    xs, ys = [1.0, 2.0, 4.0], [10.0, 12.0, 20.0]
    f = cm.CollectiveModel.interpolate
    assert [f(xs, ys, x) for x in xs] == ys
    assert f(xs, ys, 3.0) == pytest.approx(16.0)
    assert f(xs, ys, 8.0) == pytest.approx(36.0)      # the last segment extended
    assert f(xs, ys, 0.5) == pytest.approx(9.0)       # the first extended
    assert f(xs, ys, -100.0) == 0.0                   # never below 0
    assert f([2.0], [4.0], 3.0) == pytest.approx(6.0)  # one point: through the origin


def test_below_the_smallest_size_a_message_moves_no_faster_per_byte():
    """The emulated survey's world all-to-all int4 (0.2437 s at 229,376 bytes, 1.0731 s at
    917,504): its first segment's line crosses 0 near 27 kB, where the engine's per-bucket qgZ
    of the tiny GPT sends 10 kB; read as the smallest size's time per byte there, not as 0."""
    xs, ys = [229376.0, 917504.0], [0.2437, 1.0731]
    f = cm.CollectiveModel.interpolate
    assert f(xs, ys, 10240.0) == pytest.approx(0.2437 * 10240 / 229376)
    assert f(xs, ys, 200000.0) == pytest.approx(0.2437 * 200000 / 229376)
    # with a fixed cost (the line's intercept above 0) the line stands
    assert f([2.0, 4.0], [10.0, 12.0], 1.0) == pytest.approx(9.0)
    reads = [f(xs, ys, x) for x in (0.0, 1e3, 1e4, 1e5, 2.3e5, 1e6)]
    assert reads == sorted(reads) and reads[0] == 0.0, reads


def test_every_phase_and_link_the_plan_sends_bytes_on_takes_time():
    """The collective model times each phase's families as the plan charges their bytes: where a
    phase sends bytes over a link class it takes time there and nowhere else (zeropp's two-hop
    qgZ in the node and across it, its forward gathers from the hpZ copy after the first
    micro-batch; lbp's int8 copy), at Frontier's shape and the emulated network's."""
    public = cm.CollectiveModel.public()
    for scheme in ("lbp", "lbp-int8-S8", "zeropp", "zero3", "zero2", "hsdp"):
        for gcds, gpn, k in ((384, 8, 2), (8, 4, 4)):
            plan = pj.plan_for(pj.MODELS["20B"], gcds, scheme, k, gpus_per_node=gpn)
            times = public.phase_times(plan, "mid")
            for phase, by_class in plan.traffic_by_phase.items():
                for cls, nbytes in by_class.items():
                    assert (nbytes > 0) == (times[phase][cls] > 0), (
                        f"{scheme} at {gcds} GCDs, {k} micro-batches: {phase} sends {nbytes} "
                        f"bytes over {cls} but is timed {times[phase][cls]} s")
            if scheme == "zeropp":
                fams = pj.phase_families(plan, "grad_reduce")
                assert fams == ("secondary", "grad_cross"), fams
                assert pj.phase_families(plan, "forward_gather") == ("param", "secondary")


def test_a_smaller_message_is_never_read_slower_than_a_larger_one():
    """A table whose smallest size took longer than the next (a stall on a loaded host: the
    world all-to-all int4 of an emulated survey, 1.85 s at 229 kB against 1.44 s at 918 kB) is
    read as the larger size's time there and below, not along its falling first segment, which
    put 1.98 s on a 10 kB message."""
    xs, ys = [229376.0, 917504.0, 3670016.0], [1.847, 1.44, 7.0]
    f = cm.CollectiveModel.interpolate
    assert f(xs, ys, 10240.0) == pytest.approx(1.44)
    assert f(xs, ys, 229376.0) == pytest.approx(1.44)
    assert f(xs, ys, 3670016.0) == pytest.approx(7.0)
    reads = [f(xs, ys, x) for x in (1e3, 1e5, 5e5, 1e6, 4e6, 1e7)]
    assert reads == sorted(reads), reads
    assert cm.CollectiveModel.monotone([1.0, 3.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0]


def test_survey_time_by_size_group_and_rate():
    """Time = the table at the bytes sent, the median / min / max column by rate; a group of
    another size adds (n - m) steps of the table's fitted latency."""
    m = cm.CollectiveModel(_survey([_table(points=((1e6, 1e-3), (4e6, 3e-3)))]))
    sec = lambda sent, n=4, rate="mid": m.seconds("all_gather", "bf16", "cross_node", sent, n, rate)
    assert sec(1e6) == pytest.approx(1e-3) and sec(4e6) == pytest.approx(3e-3)
    assert sec(2.5e6) == pytest.approx(2e-3)
    assert sec(1e6, rate="fast") == pytest.approx(0.9e-3)
    assert sec(1e6, rate="slow") == pytest.approx(1.2e-3)
    # intercept of the fit: t = a + b s through both points: b = 2e-3 / 3e6, a = 1e-3 - b*1e6
    a = 1e-3 - 2e-3 / 3e6 * 1e6
    assert sec(1e6, n=10) == pytest.approx(1e-3 + 6 * a / 3)
    assert not m.fallbacks


def test_a_missing_table_falls_back_and_says_so():
    m = cm.CollectiveModel(_survey([_table()]))
    assert m.seconds("all_gather", "int8", "cross_node", 1e6, 4) == pytest.approx(1e-3)
    assert m.seconds("reduce_scatter", "fp32", "cross_node", 1e6, 4) == pytest.approx(1e-3)
    want = cm.PUBLIC["node"]
    mid = 7 * (want["fast"][1] * want["slow"][1]) ** 0.5 + 1e6 / (want["fast"][0] * want["slow"][0]) ** 0.5
    assert m.seconds("all_gather", "bf16", "node", 1e6, 8) == pytest.approx(mid)
    assert m.fallbacks == {"all_gather int8 cross_node read from all_gather bf16",
                           "reduce_scatter fp32 cross_node read from all_gather bf16",
                           "node: not surveyed, public figures"}


def test_public_figures_charge_n_minus_1_ring_steps():
    m = cm.CollectiveModel.public()
    beta, alpha = cm.PUBLIC["world"]["slow"]
    assert m.seconds("all_gather", "bf16", "world", 1e8, 384, "slow") == pytest.approx(
        383 * alpha + 1e8 / beta)
    assert m.seconds("all_gather", "bf16", "world", 1e8, 1, "slow") == 0.0
    assert "OLCF Frontier User Guide" in m.source and "AMD MI250X" in m.source


def test_overlap_from_the_probe_or_none():
    probe = {"by_op": {op: {"gemm_alone_s": 1, "gemm_with_s": s, "comm_alone_s": 1,
                            "together_s": 1, "slowdown": s, "hidden_fraction": h}
                       for op, h, s in (("all_gather", 0.9, 1.1), ("reduce_scatter", 0.2, 1.3),
                                        ("all_to_all", 1.4, 0.9), ("all_reduce", 0.5, 1.0))}}
    m = cm.CollectiveModel(_survey(overlap=probe))
    assert m.overlap(True) == {"hidden_fraction": 0.2, "slowdown": 1.3}
    # medians (upper) of the clamped values: hidden [0.2, 0.5, 0.9, 1.0], slowdown [1, 1, 1.1, 1.3]
    assert m.overlap(False) == {"hidden_fraction": 0.9, "slowdown": 1.1}
    assert cm.CollectiveModel.public().overlap(True) == cm.NO_OVERLAP


PLAN = dict(model="20B", gcds=384, micro_batches=2)


def _plan(scheme):
    return pj.plan_for(pj.MODELS["20B"], 384, scheme, 2)


def test_the_band_spans_the_corners_and_holds_the_point():
    plan, compute = _plan("zeropp"), pj.ComputeModel(recompute=True)
    public = cm.CollectiveModel.public()
    point = pj.step_time(plan, pj.MODELS["20B"], compute=compute)["step_s"]
    band = cm.step_band(plan, pj.MODELS["20B"], compute, public, point=point)
    assert band.point == point and band.low <= point <= band.high
    assert set(band.corners) == {"fast, perfect overlap", "fast, no overlap",
                                 "slow, perfect overlap", "slow, no overlap"}
    ph = public.phase_times(plan, "slow")
    none = pj.step_time(plan, pj.MODELS["20B"], compute=compute, overlap=False, phase_times=ph)
    # ... plus the quantizers' time (zeropp: qwZ and qgZ), exposed at the pessimistic corners
    coding = public.codec_seconds(plan, "slow")
    assert coding > 0
    assert band.corners["slow, no overlap"] == pytest.approx(none["step_s"] + coding) == band.high
    fast = pj.step_time(plan, pj.MODELS["20B"], compute=compute, phase_times=public.phase_times(plan, "fast"))
    assert band.corners["fast, perfect overlap"] == pytest.approx(fast["step_s"])
    # no overlap adds every collective: the slow corner is the compute plus all phase times
    comm = sum(v for p in ph.values() for v in p.values())
    assert none["step_s"] == pytest.approx(none["compute_s"] + comm + none["adam_s"])


def test_coding_time_counts_the_plans_quantizer_calls_at_hbm_speed_or_the_probe():
    """Without a survey every element is read and written once at HBM speed; with the codec
    probe a call reads the probe's time at its size (fixed cost plus cost per element)."""
    plan = _plan("zeropp")
    calls = [r for rows in plan.codec_calls.values() for r in rows]
    assert {(r["codec"], r["direction"]) for r in calls} == {
        ("int8", "encode"), ("int8", "decode"), ("int4", "encode"), ("int4", "decode")}
    want = sum(r["calls"] * r["elements"] * cm.CODEC_BYTES_PER_ELEMENT[(r["codec"],
                                                                        r["direction"])]
               for r in calls) / cm.HBM_BYTES_PER_S["fast"]
    public = cm.CollectiveModel.public()
    assert public.codec_seconds(plan, "fast") == pytest.approx(want)
    assert public.codec_seconds(pj.plan_for(pj.MODELS["20B"], 384, "lbp", 2), "fast") == 0.0
    # a probe: 1 ms + 1 ns per element for every call
    data = _survey()
    per = {"seconds": [1e-3 + 1e-9 * 1024, 1e-3 + 1e-9 * 4096]}
    per.update(seconds_min=per["seconds"], seconds_max=per["seconds"])
    data["codecs"] = {"elements": [1024, 4096], "by_codec": {
        c: {"encode": per, "decode": per, "hidden_fraction": 0.25, "slowdown": 1.0}
        for c in ("int8", "int4")}}
    probed = cm.CollectiveModel(sf.check(data))
    n = sum(r["calls"] for r in calls)
    elems = sum(r["calls"] * r["elements"] for r in calls)
    assert probed.codec_seconds(plan, "mid") == pytest.approx(n * 1e-3 + elems * 1e-9)
    # each codec's own hidden fraction at the point, the least of them at the pessimistic end
    data["codecs"]["by_codec"]["int8"]["hidden_fraction"] = 0.75
    probed = cm.CollectiveModel(sf.check(data))
    seconds = {c: sum(r["calls"] * (1e-3 + 1e-9 * r["elements"]) for r in calls
                      if r["codec"] == c) for c in ("int8", "int4")}
    assert probed.codec_seconds(plan, "mid", exposed="point") == pytest.approx(
        0.25 * seconds["int8"] + 0.75 * seconds["int4"])
    assert probed.codec_seconds(plan, "mid", exposed="pessimistic") == pytest.approx(
        0.75 * (seconds["int8"] + seconds["int4"]))
    assert public.codec_hidden("int4", True) == 0.0


def test_partial_overlap_between_perfect_and_none():
    perfect, none = {"step_s": 10.0, "compute_s": 8.0}, {"step_s": 14.0, "compute_s": 8.0}
    assert cm.partial_overlap(perfect, none, 1.0, 1.0) == 10.0
    assert cm.partial_overlap(perfect, none, 0.0, 1.0) == 14.0
    assert cm.partial_overlap(perfect, none, 0.5, 1.0) == 12.0
    # half hidden with the compute slowed 10% while it overlaps (2 s of it): +0.2 s
    assert cm.partial_overlap(perfect, none, 0.5, 1.1) == pytest.approx(12.2)


def test_ratio_bands_and_ties_use_the_same_corners():
    a = cm.Band(10, 9, 20, {"x": 9, "y": 20})
    b = cm.Band(11, 10, 15, {"x": 10, "y": 15})
    assert cm.ratio_band(a, b) == (pytest.approx(0.9), pytest.approx(20 / 15))
    assert cm.ties(b, a)          # b is faster than a at corner y
    c = cm.Band(13, 12, 24, {"x": 12, "y": 24})
    assert cm.ratio_band(c, a) == (pytest.approx(1.2), pytest.approx(12 / 9))   # corners and point
    assert not cm.ties(c, a)


def test_a_survey_of_a_slower_network_slows_the_network_bound_scheme_most():
    """zero3's world gathers against lbp's once-per-step cross-node hop: with a survey whose
    world tables are 4x slower than another's, zero3's point grows more than lbp's."""
    def survey(world_scale):
        tables = []
        for shape, n in (("package", 2), ("node", 8), ("cross_node", 48), ("world", 384)):
            for op in sf.OPS:
                rate = {"package": 100e9, "node": 50e9, "cross_node": 12.5e9, "world": 25e9}[shape]
                rate /= world_scale if shape == "world" else 1
                pts = tuple((s, (n - 1) * 10e-6 + s / rate) for s in (1e6, 1e8, 1e9))
                tables.append(_table(op, "bf16", shape, n, pts))
        return cm.CollectiveModel(_survey(tables, package=2, node=8, cross_node=48, world=384))
    compute = pj.ComputeModel(recompute=True)
    pts = {}
    for scale in (1, 4):
        m = survey(scale)
        pts[scale] = {s: cm.step_band(_plan(s), pj.MODELS["20B"], compute, m).point
                      for s in ("lbp", "zero3")}
    assert pts[4]["lbp"] == pytest.approx(pts[1]["lbp"], rel=1e-9)   # lbp has no world collective per micro-batch
    assert pts[4]["zero3"] > pts[1]["zero3"] * 1.05, pts


def test_a_surveys_source_names_the_machine_it_was_taken_on(tmp_path):
    """A survey of another shape than the job's (an emulated 2-node survey for a 48-node job)
    is used scaled by group size, and every output that cites it says which machine it was."""
    data = _survey()
    data["machine"].update(backend="gloo", device="cpu")
    model = cm.CollectiveModel.from_file(_write(tmp_path, data))
    assert "(4 node(s) x 8 ranks, gloo on cpu; a group size other than the surveyed one adds" \
        in model.source, model.source


def test_zeropps_secondary_gathers_are_read_from_the_table_of_what_crosses_the_link():
    """hpZ's copy is in the parameter dtype ("param"), and qwZ sends it as int8 (as the engine
    does and the plan's bytes count it): its gathers are timed from the int8 all-gather table;
    without qwZ the copy crosses in its own dtype, bf16 under bf16."""
    import dataclasses

    plan = _plan("zeropp")
    assert plan.secondary_dtype == "param" and plan.params_dtype == "bf16"
    assert cm.phase_op(plan, "backward_gather", "secondary") == ("all_gather", "int8")
    assert cm.phase_op(plan, "forward_gather", "secondary") == ("all_gather", "int8")
    plain = dataclasses.replace(plan, quantize_weight_gather=False)
    assert cm.phase_op(plain, "backward_gather", "secondary") == ("all_gather", "bf16")
    tables = [_table("all_gather", d, "node", 8) for d in ("int8", "bf16")]
    model = cm.CollectiveModel(_survey(tables, node=8))
    model.phase_times(plan, "fast")
    assert not [f for f in model.fallbacks if "param" in f], model.fallbacks
