"""Training flags by capability: each GPU extension absent (this machine) and present by stand-in.

The stand-ins (tests/helpers/standins.py) are real modules under the extensions' real
names on sys.path, so detection imports them exactly as it would import the
real ones; GPU-run rules are resolved here with ``device="gpu"``.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lbp.integration import capabilities as caps
from megatron_lbp.integration.capabilities import (BIAS_FUSIONS, READS_RELEASED_WEIGHTS, CapabilityError,
                                                   resolve_training_argv)
from tests.helpers.standins import STANDINS, TOP_LEVEL, write_standins
from megatron_lbp.integration.megatron_adapter import CONFLICTING_FLAGS, check_megatron_args

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--num-layers", "2", "--position-embedding-type", "rope", "--bf16"]
EVERYTHING = tuple(STANDINS)
NO_GPU_EXTENSIONS = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion",
                     "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-persist-layer-norm"]
CPU_ONLY = [*BIAS_FUSIONS, "--distributed-backend", "gloo", "--use-cpu-initialization"]


def _forget_standins():
    for name in list(sys.modules):
        if name.split(".")[0] in TOP_LEVEL:
            del sys.modules[name]


@pytest.fixture
def present(tmp_path, monkeypatch):
    """present(*capabilities): stand-ins for them importable from now on in this test."""
    root = tmp_path / "standins"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv(caps.DEVICE_ENV, raising=False)
    _forget_standins()

    def make(*capabilities):
        write_standins(root, *capabilities)
        importlib.invalidate_caches()
        return root

    yield make
    _forget_standins()


def added(argv, device, extra=()):
    out, reasons = resolve_training_argv(argv + list(extra), device=device)
    n = len(out) - len(argv) - len(extra)
    assert out[n:] == argv + list(extra), "the user's arguments must stay, after the added flags"
    return out[:n], reasons


def test_nothing_importable_cpu_run(present):
    present()
    flags, reasons = added(ARGS, "cpu")
    assert flags == NO_GPU_EXTENSIONS + CPU_ONLY, flags
    assert len(reasons) == 7, reasons
    for line, names in zip(reasons, ("transformer_engine", "fused_weight_gradient_mlp_cuda",
                                     "scaled_upper_triang_masked_softmax_cuda",
                                     "transformer_engine", "apex", "torch.compile", "CPU run")):
        assert line.startswith("[megatron-lbp] adding --") and names in line, (names, line)


def test_nothing_importable_gpu_run_keeps_nccl_and_compiled_fusions(present):
    """The documented Frontier environment (no TE, no Apex): Megatron's local layers, no fused
    extension kernels, but NCCL, GPU initialisation and the Triton-compiled bias fusions."""
    present()
    flags, _ = added(ARGS, "gpu")
    assert flags == NO_GPU_EXTENSIONS, flags


def test_bias_fusions_follow_triton_on_a_gpu_run(present):
    present()
    env = caps.probe_environment("gpu")
    without = caps.Environment(**{**env.__dict__, "triton": "ImportError: no triton"})
    out, reasons = resolve_training_argv(ARGS, env=without)
    assert out[:len(NO_GPU_EXTENSIONS) + 3] == NO_GPU_EXTENSIONS + list(BIAS_FUSIONS)
    assert "Triton" in reasons[-1] and "no triton" in reasons[-1], reasons[-1]


def test_everything_present_by_stand_in(present):
    present(*EVERYTHING)
    assert added(ARGS, "gpu") == ([], [])
    # On CPU ranks only what a CPU needs: the extensions' fusions stay on (a CPU test can then
    # take Megatron's fused branches through stand-ins of the same signature).
    assert added(ARGS, "cpu")[0] == CPU_ONLY


def test_each_capability_decides_its_own_flag(present):
    present("transformer_engine")
    flags, _ = added(ARGS, "gpu")
    assert flags == ["--no-gradient-accumulation-fusion"], flags  # TE layers; output layer wgrad
    present("apex_wgrad")
    assert added(ARGS, "gpu")[0] == []
    flags, _ = added(ARGS, "gpu", ["--transformer-impl", "local"])
    assert flags == ["--no-masked-softmax-fusion", "--no-persist-layer-norm"], flags
    present("softmax_kernels", "apex_layer_norm")
    assert added(ARGS, "gpu", ["--transformer-impl", "local"])[0] == []
    # RMSNorm: Megatron's local layers use torch's norm whatever Apex offers.
    assert added(ARGS, "gpu", ["--transformer-impl", "local", "--normalization", "RMSNorm"])[0] == [
        "--no-persist-layer-norm"]


def test_rope_fusion_only_matters_for_rope(present):
    present()
    flags, _ = added(["--num-layers", "2"], "gpu")
    assert "--no-rope-fusion" not in flags


def test_resolving_twice_adds_nothing(present):
    for have in ((), ("transformer_engine",), EVERYTHING):
        _forget_standins()
        present(*have)
        for device in ("cpu", "gpu"):
            once, _ = resolve_training_argv(ARGS, device=device)
            assert resolve_training_argv(once, device=device) == (once, []), (have, device)


@pytest.mark.parametrize("argv, have, device, needle", [
    (["--transformer-impl", "transformer_engine"], (), "gpu", "--transformer-impl transformer_engine"),
    (["--transformer-impl=inference_optimized"], (), "gpu", "--transformer-impl inference_optimized"),
    (["--fp8-format", "hybrid"], (), "gpu", "--fp8-format"),
    (["--attention-backend", "flash"], (), "gpu", "--attention-backend flash"),
    (["--attention-backend", "flash"], ("transformer_engine",), "gpu", "flash-attn"),
    (["--transformer-impl", "local", "--attention-backend", "fused"], EVERYTHING, "gpu",
     "--attention-backend fused"),
    (["--flash-attention-version", "3"], (), "gpu", "--flash-attention-version 3"),
    (["--apply-layernorm-1p"], (), "gpu", "--apply-layernorm-1p"),
    (["--distributed-backend", "nccl"], EVERYTHING, "cpu", "--distributed-backend nccl"),
    ([], ("apex",), "gpu", "fused_layer_norm_cuda"),   # e.g. the unrelated PyPI package "apex"
])
def test_explicit_flags_that_cannot_work_are_one_line_errors(present, argv, have, device, needle):
    present(*have)
    with pytest.raises(CapabilityError) as err:
        resolve_training_argv(ARGS + argv, device=device)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg, msg


@pytest.mark.parametrize("argv, have", [
    (["--transformer-impl", "transformer_engine"], ("transformer_engine",)),
    (["--attention-backend", "flash"], ("transformer_engine", "flash_attn")),
    (["--transformer-impl", "local"], EVERYTHING),
    (["--distributed-backend", "gloo"], ()),
])
def test_explicit_flags_that_can_work_win(present, argv, have):
    present(*have)
    out, _ = resolve_training_argv(ARGS + argv, device="gpu")
    assert out[-len(argv):] == argv and len([a for a in out if a == argv[0]]) == 1, out


def test_device_comes_from_lbp_device_or_torch(monkeypatch):
    monkeypatch.setenv(caps.DEVICE_ENV, "gpu")
    assert caps.target_device() == "gpu"
    with pytest.raises(CapabilityError, match="LBP_DEVICE=gpu but this process sees no GPU"):
        caps.check_device_matches("cpu")
    monkeypatch.setenv(caps.DEVICE_ENV, "tpu")
    with pytest.raises(CapabilityError, match="LBP_DEVICE=tpu"):
        caps.target_device()
    monkeypatch.delenv(caps.DEVICE_ENV)
    import torch

    assert caps.target_device() == ("gpu" if torch.cuda.is_available() else "cpu")
    caps.check_device_matches(caps.target_device())


# --- what --hier-partition cannot serve ---------------------------------------------------------
def _megatron_options():
    import argparse

    import megatron_lbp  # noqa: F401  (Python 3.11 shim)
    from megatron.training import arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return [(o, a) for a in parser._actions for o in a.option_strings]


def _sample(action) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(c for c in action.choices if str(c) != "none"))]
    return ["2"] if action.type in (int, float) else ["attn"]


def test_every_cuda_graph_form_of_megatron_is_refused_under_hier_partition():
    forms = [(o, a) for o, a in _megatron_options() if "cuda-graph" in o or "cuda_graph" in o]
    assert len(forms) >= 10, forms  # the parser really was read
    passed = []
    for option, action in forms:
        argv = ["--hier-partition", option, *_sample(action)]
        try:
            caps.refuse_unservable(argv)
        except CapabilityError as err:
            assert option in str(err) and "CUDA graphs" in str(err), str(err)
            caps.refuse_unservable(argv[1:])  # stock Megatron runs keep them
            continue
        passed.append(option)
    assert all(o.startswith("--no-") for o in passed), f"not refused: {passed}"
    for off in (["--cuda-graph-impl", "none"], ["--cuda-graph-impl=none"],
                ["--inference-cuda-graph-scope", "none"]):
        caps.refuse_unservable(["--hier-partition", *off])


@pytest.mark.parametrize("argv, needle", [
    (["--fp8-param-gather"], "fp8 parameters"),
    (["--reuse-grad-buf-for-mxfp8-param-ag"], "fp8 parameters"),
    (["--overlap-grad-reduce"], "--hier-overlap"),
    (["--overlap-param-gather"], "--hier-overlap"),
    (["--overlap-param-gather-with-optimizer-step"], "--hier-overlap"),
    (["--use-torch-fsdp2"], "--use-torch-fsdp2: both replace"),
    (["--use-megatron-fsdp"], "--use-megatron-fsdp: both replace"),
    (["--init-model-with-meta-device"], "leave the weights uninitialized"),
    # features that read whole weights (or main_grad) between steps
    (["--check-weight-hash-across-dp-replicas-interval", "5"], "hashes each rank's whole weights"),
    (["--save-params-interval", "5"], "saves each parameter's whole weights"),
    (["--save-wgrads-interval", "5"], "saves each parameter's whole main_grad"),
    (["--qk-clip"], "rescales the whole query and key weights"),
    (["--log-max-attention-logit"], "reads the whole query and key weights"),
])
def test_flags_the_engine_cannot_serve_are_refused(argv, needle):
    with pytest.raises(CapabilityError) as err:
        caps.refuse_unservable(["--hier-partition", *argv])
    assert needle in str(err.value) and argv[0] in str(err.value), str(err.value)
    caps.refuse_unservable(argv)
    options = {o for o, _ in _megatron_options()}
    assert argv[0] in options, f"{argv[0]} is not a megatron-core 0.19.2 flag"


@pytest.mark.parametrize("attr,flag", [*CONFLICTING_FLAGS,
                                       ("init_model_with_meta_device", "--init-model-with-meta-device"),
                                       ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                                       ("num_experts", "--num-experts"),
                                       *[(f[2:].replace("-", "_"), f) for f in READS_RELEASED_WEIGHTS]])
def test_megatron_args_the_engine_cannot_serve_are_refused_by_name(attr, flag):
    """check_megatron_args on parsed arguments (the form that reaches Megatron another way than
    the command line); gradient-accumulation fusion is served (tests/engine/test_fused_wgrad.py trains
    with it) and so is not refused beside any of them."""
    import argparse

    value = 2 if attr.endswith(("_size", "_interval")) or attr == "num_experts" else True
    with pytest.raises(ValueError) as err:
        check_megatron_args(argparse.Namespace(**{attr: value}))
    assert flag in str(err.value), str(err.value)
    check_megatron_args(argparse.Namespace(gradient_accumulation_fusion=True))


# --- the CLI the launchers' dry run calls ---------------------------------------------------------
def _cli(args, tmp_path, have=()):
    env = dict(os.environ, PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(write_standins(tmp_path / "s", *have)), str(REPO)]))
    env.pop(caps.DEVICE_ENV, None)
    return subprocess.run([sys.executable, "-m", "megatron_lbp.capabilities", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def test_cli_prints_one_quoted_line_and_the_reasons(tmp_path):
    args = ["--hier-partition", "--data-path", "a path/with space", "--position-embedding-type",
            "rope"]
    r = _cli(args, tmp_path, have=("transformer_engine", "apex_wgrad"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    out = shlex.split(lines[0])
    assert out == CPU_ONLY + args, out  # a CPU machine: TE and Apex stand-ins keep the rest on
    assert r.stderr.splitlines() == [l for l in r.stderr.splitlines()
                                     if l.startswith("[megatron-lbp] adding --")], r.stderr
    assert len(r.stderr.splitlines()) == 2, r.stderr


def test_cli_refusal_is_one_line_exit_2(tmp_path):
    r = _cli(["--hier-partition", "--external-cuda-graph"], tmp_path)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("python -m megatron_lbp.capabilities: error: --hier-partition "
                               "cannot run CUDA graphs (--external-cuda-graph)"), r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr


def test_train_iters_without_eval_interval_gets_one_past_the_last_iteration(present):
    """megatron-core 0.19.2 has no --eval-interval default and divides by it with --train-iters
    (the first Megatron-defaults run of issue 25 died there, stock or not)."""
    present(*EVERYTHING)
    flags, reasons = added(["--train-iters", "3"], "gpu")
    assert flags == ["--eval-interval", "4"], flags
    assert len(reasons) == 1 and "no default" in reasons[0], reasons
    assert added(["--train-iters", "3", "--eval-interval", "2"], "gpu") == ([], [])
    assert added(["--train-samples", "48"], "gpu") == ([], [])


SELECTIVE = ["--recompute-granularity", "selective"]


def test_recompute_modules_megatron_core_cannot_run_here_are_refused(present):
    """``mlp`` with linear biases (the backward re-enters megatron-core's checkpoint without
    end) and ``layernorm`` without Transformer Engine (a NameError at the first forward):
    tests/multirank/test_recompute_modules.py shows both failures in stock megatron-core."""
    taken = "torch X makes a parameter returned by a custom autograd Function that Function's output"
    env = dataclasses.replace(caps.probe_environment("cpu"), mlp_recompute_with_bias=taken)

    def refusal(argv, env=env):
        try:
            resolve_training_argv(ARGS + argv, env=env)
        except CapabilityError as err:
            assert "\n" not in str(err), str(err)
            return str(err)
        return None

    for mods in (["core_attn", "mlp"], ["mlp", "core_attn"]):
        why = refusal(SELECTIVE + ["--recompute-modules", *mods])
        assert why and why.startswith("--recompute-modules mlp with linear biases") and taken in why, why
    assert refusal(SELECTIVE + ["--recompute-modules=mlp"]), "the --flag=value spelling"
    for argv in (SELECTIVE + ["--recompute-modules", "mlp", "--disable-bias-linear"],
                 ["--recompute-granularity", "full", "--recompute-modules", "mlp"],
                 SELECTIVE + ["--recompute-modules", "mlp", "--recompute-modules", "core_attn"],
                 SELECTIVE + ["--recompute-modules", "core_attn", "moe_act"]):
        assert refusal(argv) is None, argv
    assert refusal(SELECTIVE + ["--recompute-modules", "mlp"],
                   dataclasses.replace(env, mlp_recompute_with_bias=None)) is None

    norm = SELECTIVE + ["--recompute-modules", "core_attn", "layernorm"]
    why = refusal(norm)
    assert why and why.startswith("--recompute-modules layernorm needs Transformer Engine"), why
    present("transformer_engine")
    assert refusal(norm, caps.probe_environment("gpu")) is None

