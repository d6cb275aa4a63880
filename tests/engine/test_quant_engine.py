"""The engine with int8 weights and gradients on the wire: bytes, memory, freshness, refusals.

8 gloo ranks as 2 emulated nodes x 2 packages x 2 GCDs, the tiny megatron-core
GPT in bf16 (Float16Module, fp32 master). What is checked:

- bytes per phase and link and bytes held per state equal the plan (costs)
  exactly for every quantized mode, and the secondary copy is N/S codes plus
  one fp32 scale per block of its slice, measured from its storage;
- the secondary copy is never stale: a bf16 copy of bf16 weights is exact, so
  training through it must be bit-identical to regathering the primary; an
  int8 copy is rebuilt from the weights every forward, including after a
  checkpoint load; a backward without its forward is refused;
- activation recomputation (forward pre-hooks firing inside backward) regathers
  from the secondary;
- bad settings fail on every rank, in one line, before training.

The long real-text comparison of losses lives in tests/multirank/test_quant_training.py.
"""
import contextlib
import dataclasses
import threading

import pytest
import torch

from megatron_lbp.testing.multirank import MultiRankError, rank_location_env, run_on_ranks
from megatron_lbp.testing.tiny_gpt import TinyGPTSpec, TrainSpec, setup_hier, train_hier
from tests.engine.test_engine_accounting import predicted

WORLD = 8
TOPOLOGY = rank_location_env(4)
BF16 = TinyGPTSpec(params_dtype=torch.bfloat16)
LBP = ["--hier-param-group-size", "2", "--hier-grad-group-size", "4"]


def S(n, dtype="int8"):
    return ["--hier-secondary-group-size", str(n), "--hier-secondary-dtype", dtype]


def q(n, block=256):
    """Blockwise int8 bytes, written out: one code per element, one fp32 scale per started block."""
    return n + 4 * ((n + block - 1) // block)


# P = G = O = W with an int8 secondary copy per node read only by the backward, and qwZ.
ZERO3_INT8_S4_QWZ = ["--hier-param-group-size", "8", "--hier-grad-group-size", "8",
                     "--hier-optim-group-size", "8"] + S(4) + ["--hier-quantize-weight-gather"]

MODES = {
    "lbp-S2-int8": LBP + S(2),
    "lbp-S8-int8": LBP + S(8),
    "lbp-S2-bf16": LBP + S(2, "bf16"),
    # ZeRO++: qwZ, S = node (4) in bf16 read from the step's second forward on, int4 qgZ
    "zeropp": ["--hier-preset", "zeropp"],
    # the engine's earlier zeropp, spelled out: int8 S = node for the backward, qwZ, no qgZ
    "zero3-int8-S4-qwz": ZERO3_INT8_S4_QWZ,
    "lbp-qwz-qgz": LBP + ["--hier-quantize-weight-gather", "--hier-quantize-grad-reduce"],
    "zeropp-int8-qgz-b64": ["--hier-preset", "zeropp", "--hier-grad-quant-scheme", "int8",
                            "--hier-quant-block-size", "64"],
    "lbp-S8-qwz-qgz-b128": LBP + S(8) + ["--hier-quantize-weight-gather",
                                         "--hier-quantize-grad-reduce",
                                         "--hier-quant-block-size", "128"],
}


# --------------------------------------------------------------------------- bytes and memory


# The engine's quantizer entry points: (module, name) -> (codec, direction, the argument
# whose elements are coded).
CODEC_ENTRIES = {
    ("megatron_lbp.engine.quantized", "quantize_into"): ("int8", "encode", 0),
    ("megatron_lbp.engine.buckets", "quantize_into"): ("int8", "encode", 0),
    ("megatron_lbp.engine.quantized", "quantize_int4_into"): ("int4", "encode", 0),
    ("megatron_lbp.engine.quantized", "dequantize_from"): ("int8", "decode", 1),
    ("megatron_lbp.engine.quantized", "dequantize_int4_from"): ("int4", "decode", 1),
}


@contextlib.contextmanager
def counting_codec_calls(tally: dict):
    """``tally[(codec, direction, elements)]`` += 1 for every quantizer call in the block (from
    any thread: the streams' workers code too)."""
    import importlib

    lock = threading.Lock()
    saved = []
    for (module, name), (codec, direction, arg) in CODEC_ENTRIES.items():
        mod = importlib.import_module(module)
        real = getattr(mod, name)

        def counted(*a, _real=real, _key=(codec, direction), _arg=arg, **kw):
            with lock:
                key = (*_key, a[_arg].numel())
                tally[key] = tally.get(key, 0) + 1
            return _real(*a, **kw)

        saved.append((mod, name, real))
        setattr(mod, name, counted)
    try:
        yield tally
    finally:
        for mod, name, real in saved:
            setattr(mod, name, real)


def train_modes(spec, train, modes):
    """Several configurations one after another in the same ranks (saves process start-ups);
    the quantizer calls of each one's last step in ``extra["codec_calls"]``."""
    out = {}
    for name, argv in modes.items():
        trainer = setup_hier(spec, train, argv)
        res = trainer.run(range(train.steps - 1))
        with counting_codec_calls({}) as tally:
            res = trainer.run([train.steps - 1], None, res)
            trainer.model.settle()
        res.extra.update({"bucket_numels": trainer.model.bucket_numels(),
                          "config": trainer.hier.config.as_dict(),
                          "codec_calls": tally})
        out[name] = res
    return out


@pytest.fixture(scope="module")
def accounted():
    train = TrainSpec(steps=2, micro_batches=2, bucket_size=20000)
    return run_on_ranks(train_modes, WORLD, BF16, train, MODES, rank_env=TOPOLOGY, timeout=300)


@pytest.mark.parametrize("mode", list(MODES))
def test_bytes_and_memory_equal_the_plan(mode, accounted):
    for rank, results in enumerate(accounted):
        res = results[mode]
        plan = predicted(res, "bf16", 2)
        report = res.step_reports[-1]
        measured = {ph: v for ph, v in report["traffic_by_phase"].items() if ph != "control"}
        bad = [f"{ph}[{c}]: measured {measured[ph][c]}, plan {plan['traffic_by_phase'][ph][c]}"
               for ph in measured for c in measured[ph]
               if measured[ph][c] != plan["traffic_by_phase"][ph][c]]
        assert not bad, f"{mode} rank {rank}: " + "; ".join(bad)
        for state in ("primary", "secondary", "grad", "optimizer", "total"):
            assert report["memory_bytes"][state] == plan["memory_bytes"][state], (
                f"{mode} rank {rank}: {state} holds {report['memory_bytes'][state]} bytes, "
                f"plan says {plan['memory_bytes'][state]}")


@pytest.mark.parametrize("mode", list(MODES))
def test_quantizer_calls_equal_the_plan(mode, accounted):
    """Every encode and decode of a step, by codec and elements per call, counted at the
    engine's quantizer entry points: the plan's codec_calls (what the step model charges the
    device for coding) must list the same."""
    for rank, results in enumerate(accounted):
        res = results[mode]
        plan = predicted(res, "bf16", 2)
        want: dict = {}
        for rows in plan["codec_calls"].values():
            for r in rows:
                key = (r["codec"], r["direction"], r["elements"])
                want[key] = want.get(key, 0) + r["calls"]
        got = res.extra["codec_calls"]
        assert got == want, (f"{mode} rank {rank}: quantizer calls (codec, direction, "
                             f"elements): calls\n measured {sorted(got.items())}\n plan     "
                             f"{sorted(want.items())}")
    if mode not in ("lbp-S2-bf16",):
        assert want, f"{mode}: a quantized mode the plan counts no quantizer call for"


@pytest.mark.parametrize("mode,s,dtype,block", [("lbp-S2-int8", 2, "int8", 256),
                                                ("lbp-S8-int8", 8, "int8", 256),
                                                ("lbp-S2-bf16", 2, "bf16", 256),
                                                ("lbp-S8-qwz-qgz-b128", 8, "int8", 128)])
def test_secondary_memory_is_m_over_s_plus_scales(mode, s, dtype, block, accounted):
    """Measured from the buffers' storages, against N/S + 4 bytes per block of the slice."""
    res = accounted[0][mode]
    unit = 8 * 128 * s // __import__("math").gcd(8, s)   # lcm(O*128, S*128), O = 8
    padded = [-(-n // unit) * unit for n in res.extra["bucket_numels"]]
    want = sum(q(n // s, block) if dtype == "int8" else 2 * n // s for n in padded)
    got = res.step_reports[-1]["memory_bytes"]["secondary"]
    assert got == want, f"{mode}: secondary holds {got} bytes, N/S + scales = {want}"
    model_bytes = 2 * sum(padded)  # the bf16 weights
    if dtype == "int8":
        assert model_bytes / (2 * s) < got <= model_bytes / (2 * s) * (1 + 4 / block) + 4 * len(padded)


def test_int8_secondary_halves_the_backward_gather_plus_scales(accounted):
    """Bytes on the secondary link: int8 = (1 + 4/B)/2 of the bf16 secondary's, up to partial blocks."""
    for s in (2,):
        int8 = accounted[0][f"lbp-S{s}-int8"].step_reports[-1]["traffic_by_phase"]["backward_gather"]
        bf16 = accounted[0][f"lbp-S{s}-bf16"].step_reports[-1]["traffic_by_phase"]["backward_gather"]
        ratio = int8["package"] / bf16["package"]
        assert 0.5 < ratio <= 0.5 * (1 + 4 / 256) * 1.01, (
            f"S={s}: int8 backward gather {int8} vs bf16 {bf16}: ratio {ratio:.4f}")


def test_qwz_and_qgz_cut_the_bytes_they_cover(accounted):
    plain_lbp = accounted[0]["lbp-S2-bf16"].step_reports[-1]["traffic_by_phase"]
    quant_lbp = accounted[0]["lbp-qwz-qgz"].step_reports[-1]["traffic_by_phase"]
    fwd = quant_lbp["forward_gather"]["package"] / plain_lbp["forward_gather"]["package"]
    inter = quant_lbp["step_reduce"]["network"] / plain_lbp["step_reduce"]["network"]
    assert 0.5 < fwd < 0.51, f"qwZ forward gather is {fwd:.4f} of bf16"
    assert 0.25 < inter < 0.26, f"qgZ step reduce is {inter:.4f} of fp32"
    assert quant_lbp["grad_reduce"] == plain_lbp["grad_reduce"], "in-node reduce must stay fp32"


# --------------------------------------------------------------------------- never stale


def test_bf16_secondary_is_exact_so_training_is_bit_identical():
    """Any staleness (a copy from before the last step or load) would change a gradient."""
    train = TrainSpec(steps=5, micro_batches=2, bucket_size=20000)
    modes = {"none": LBP, "S2": LBP + S(2, "bf16"), "S8": LBP + S(8, "bf16")}
    got = run_on_ranks(train_modes, WORLD, BF16, train, modes, rank_env=TOPOLOGY)[0]
    for name in ("S2", "S8"):
        assert got[name].losses == got["none"].losses, (
            f"bf16 secondary {name} changed the losses:\n {got[name].losses}\n "
            f"{got['none'].losses}")
        assert got[name].grad_norms == got["none"].grad_norms, name
        assert got[name].step_reports[-1]["memory_bytes"]["secondary"] > 0, name
    # S = 8 spans both emulated nodes: the backward gather moved off the package link.
    back = got["S8"].step_reports[-1]["traffic_by_phase"]["backward_gather"]
    assert back["package"] == 0 and back["network"] > 0, back


def _secondary_probe(model, optimizer, step, micro):
    """After a backward: the int8 copy dequantizes to exactly the quantized current weights."""
    from megatron_lbp.engine.quantized import dequantize_from, quantize_into
    from megatron_lbp.quant import quantized_nbytes

    worst, current = 0.0, True
    for b in model.buckets:
        # P = S = 2: this rank's secondary slice is its primary slice.
        assert b.secondary_range == b.primary_range
        mine = torch.empty(b.secondary_range.size, dtype=torch.float32)
        dequantize_from(b.secondary, mine, b.quant_block_size)
        fresh = torch.empty(quantized_nbytes(b.primary.numel(), b.quant_block_size), dtype=torch.uint8)
        quantize_into(b.primary, fresh, b.quant_block_size)
        expect = torch.empty_like(mine)
        dequantize_from(fresh, expect, b.quant_block_size)
        worst = max(worst, (mine - expect).abs().max().item())
        current = current and b.secondary_is_current()
    return {"worst": worst, "current": current,
            "checksum": sum(b.secondary.double().sum().item() for b in model.buckets)}


def test_int8_secondary_is_rebuilt_from_the_weights_of_every_step():
    train = TrainSpec(steps=3, micro_batches=2, bucket_size=20000)
    res = run_on_ranks(train_hier, WORLD, BF16, train, LBP + S(2), rank_env=TOPOLOGY,
                       probe=_secondary_probe)
    for rank, r in enumerate(res):
        probes = r.extra["probes"]
        assert all(p["worst"] == 0.0 and p["current"] for p in probes), (
            f"rank {rank}: secondary differs from the quantized current weights: {probes}")
        sums = [p["checksum"] for p in probes]
        # Two micro-batches of one step see the same weights; each step changes them.
        assert sums[0] == sums[1] and sums[2] == sums[3] and sums[4] == sums[5], sums
        assert len({sums[0], sums[2], sums[4]}) == 3, f"rank {rank}: copy not rebuilt {sums}"


def _resume_with_int8_secondary(split):
    spec, train = BF16, TrainSpec(steps=6, micro_batches=2, bucket_size=20000)
    straight = setup_hier(spec, train, LBP + S(2))
    straight.run(range(split))
    sds = (straight.model.state_dict(), straight.optimizer.state_dict(),
           straight.scheduler.state_dict())
    expected = straight.run(range(split, 6)).losses

    # Other initial weights, and one step on them: its secondary copy now holds
    # weights the checkpoint does not, and the backward must not see them.
    resumed = setup_hier(dataclasses.replace(spec, seed=4321), train, LBP + S(2))
    resumed.run(range(1))
    resumed.model.load_state_dict(sds[0])
    resumed.optimizer.load_state_dict(sds[1])
    resumed.scheduler.load_state_dict(sds[2])
    return expected, resumed.run(range(split, 6)).losses


def test_after_a_checkpoint_load_the_backward_uses_the_loaded_weights():
    expected, got = run_on_ranks(_resume_with_int8_secondary, WORLD, 3, rank_env=TOPOLOGY)[0]
    assert got == expected, f"resumed losses {got} != uninterrupted {expected}"


def _backward_gather_after_step():
    trainer = setup_hier(BF16, TrainSpec(steps=1, bucket_size=20000), S(2))
    trainer.run(range(1))  # forward, backward, step: the weights changed after the copy was made
    unit = trainer.model.units[0]
    try:
        unit.unshard("backward_gather", async_op=False)
    except RuntimeError as err:
        return str(err)
    return None


def test_a_backward_without_its_forward_is_refused_not_served_stale():
    for msg in run_on_ranks(_backward_gather_after_step, 2):
        assert msg and "secondary weight copy" in msg and "current weights" in msg, msg


# --------------------------------------------------------------------------- recomputation


def _recompute_runs():
    """(losses, last step report, the first layer's forward calls) of three set-ups."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    out = {}
    for name, argv, recompute in (("plain", LBP, False), ("bf16", LBP + S(2, "bf16"), True),
                                  ("int8", LBP + S(2), True)):
        spec = TinyGPTSpec(params_dtype=torch.bfloat16, recompute=recompute)
        train = TrainSpec(steps=3, micro_batches=2, bucket_size=20000)
        trainer = setup_hier(spec, train, argv)
        layer = next(m for m in trainer.inner.modules() if isinstance(m, TransformerLayer))
        calls = []
        layer.register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled()))
        res = trainer.run(range(train.steps))
        out[name] = (res.losses, res.step_reports[-1], calls)
    return out


def test_activation_recomputation_regathers_from_the_secondary():
    runs = run_on_ranks(_recompute_runs, WORLD, rank_env=TOPOLOGY)[0]
    plain = runs["plain"]
    losses, report, calls = runs["bf16"]
    # Megatron's full recomputation: the layer runs without grad, then again with it in backward.
    assert plain[2] == [True] * 6, plain[2]
    assert calls == [False, True] * 6, f"layer forward calls (grad enabled?): {calls}"
    assert losses == plain[0], f"recompute through the bf16 copy changed losses {losses} vs {plain[0]}"
    back = report["traffic_by_phase"]["backward_gather"]
    assert back["package"] > 0 and back == plain[1]["traffic_by_phase"]["backward_gather"], back

    int8 = runs["int8"]
    assert int8[2] == [False, True] * 6, int8[2]
    worst = max(abs(a - b) / b for a, b in zip(int8[0], plain[0]))
    assert worst < 0.01, f"recompute with the int8 copy: losses {int8[0]} vs {plain[0]}"
    ratio = int8[1]["traffic_by_phase"]["backward_gather"]["package"] / back["package"]
    assert 0.5 < ratio < 0.51, f"int8 regather for recomputation is {ratio:.4f} of bf16"


# --------------------------------------------------------------------------- refusals


def _setup(spec, argv, gpus_per_node):
    setup_hier(spec, TrainSpec(steps=1), argv + ["--hier-gpus-per-node", str(gpus_per_node)])


REFUSALS = [
    # (spec, flags, gpus per node, needles of the one-line message)
    (TinyGPTSpec(), S(2), 2, ["--hier-secondary-dtype=int8 with fp32 weights", "bf16"]),
    (BF16, ["--hier-quantize-grad-reduce"], 2,
     ["--hier-quantize-grad-reduce has nothing to quantize", "cross nodes"]),
    (BF16, ["--hier-quant-block-size", "100"], 2, ["--hier-quant-block-size=100", "64"]),
    (BF16, ["--hier-quant-block-size", "0"], 2, ["--hier-quant-block-size=0"]),
    (BF16, ["--hier-param-group-size", "1", "--hier-quantize-weight-gather"], 2,
     ["--hier-quantize-weight-gather", "--hier-param-group-size=1"]),
    (BF16, S(3), 2, ["--hier-secondary-group-size=3", "S | W"]),
]


@pytest.mark.parametrize("spec,argv,gpn,needles", REFUSALS,
                         ids=[" ".join(r[1]) + (" fp32" if r[0].params_dtype == torch.float32
                                                else "") for r in REFUSALS])
def test_bad_settings_fail_on_every_rank_in_one_line(spec, argv, gpn, needles):
    with pytest.raises(MultiRankError) as err:
        run_on_ranks(_setup, 2, spec, argv, gpn)
    msg = str(err.value)
    assert "2 rank(s) raised" in msg, msg
    last = [line for line in msg.splitlines() if "Error: " in line][-1]
    for n in needles:
        assert n in last, f"{n!r} not in {last!r}"

