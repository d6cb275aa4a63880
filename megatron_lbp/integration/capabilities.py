"""The training flags this environment needs, decided by what is importable, not by the device.

:func:`resolve_training_argv` adds the flag that switches off each megatron-core default
whose module does not import, one reason line per flag; keeps a flag the user gives when
it can work and refuses it with one line (:class:`CapabilityError`) when it cannot; under
``--hier-partition`` refuses what the engine cannot serve (:data:`UNSERVABLE`,
:data:`READS_RELEASED_WEIGHTS`). It imports torch and probes the extensions, never
Megatron or torch.distributed. The rules: docs/training.md, "Flags by capability".
``python -m megatron_lbp.capabilities [training args...]`` prints the resolved argument
list on stdout, the reasons on stderr, and exits 2 on a refusal.
"""
from __future__ import annotations

import importlib
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from megatron_lbp.core.argv import flag_value, flag_values, given  # noqa: F401 - callers read them here too

DEVICE_ENV = "LBP_DEVICE"
PROG = "python -m megatron_lbp.capabilities"
SOFTMAX_KERNELS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
                   "scaled_softmax_cuda")
BIAS_FUSIONS = ("--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion")


class CapabilityError(ValueError):
    """A flag (or this environment) cannot work here; the message is one line naming it."""


# --- what imports ---------------------------------------------------------------------------
def _probe(*statements: Callable[[], object]) -> str | None:
    """None when every import works, else why the first failing one did (one line)."""
    for statement in statements:
        try:
            statement()
        except Exception as err:  # noqa: BLE001 - ImportError, OSError of a broken .so, ...
            text = str(err).strip().splitlines()[0] if str(err).strip() else ""
            return f"{type(err).__name__}: {text}"[:160]
    return None


def _imports(name: str) -> Callable[[], object]:
    return lambda: importlib.import_module(name)


def _has(module: str, attr: str) -> Callable[[], object]:
    return lambda: getattr(importlib.import_module(module), attr)


def _te_rope() -> object:
    # TE >= 2.3 moved it; megatron/core/extensions/transformer_engine.py tries the same two homes.
    attention = "transformer_engine.pytorch.attention"
    try:
        return importlib.import_module(attention + ".rope").apply_rotary_pos_emb
    except (ImportError, AttributeError):
        return importlib.import_module(attention).apply_rotary_pos_emb


@dataclass(frozen=True)
class Environment:
    """Why each capability is missing (None: present), probed the way megatron-core imports it."""

    device: str                   # "gpu" | "cpu"
    te: str | None
    te_rope: str | None
    apex_wgrad: str | None
    apex: str | None
    apex_layer_norm: str | None
    softmax_kernels: str | None
    triton: str | None
    flash_attn: str | None
    torch_build: str
    # Why megatron-core's MLP recomputation cannot run with linear biases here (None: it can):
    # see _parameter_taken_by_function.
    mlp_recompute_with_bias: str | None = None


def probe_environment(device: str | None = None) -> Environment:
    import torch  # first: the CUDA extensions below link against it

    device = device or target_device()
    return Environment(
        device=device,
        te=_probe(_imports("transformer_engine"),
                  _has("transformer_engine.pytorch.fp8", "FP8GlobalStateManager")),
        te_rope=_probe(_imports("transformer_engine"), _te_rope),
        apex_wgrad=_probe(_imports("fused_weight_gradient_mlp_cuda")),
        apex=_probe(_imports("apex")),
        apex_layer_norm=_probe(_imports("apex"),
                               _has("apex.normalization.fused_layer_norm",
                                    "FusedLayerNormAffineFunction"),
                               _imports("fused_layer_norm_cuda")),
        softmax_kernels=_probe(*(_imports(k) for k in SOFTMAX_KERNELS)),
        # Only a GPU run's bias fusions depend on it (and importing it costs seconds).
        triton=_probe(_imports("triton")) if device == "gpu" else "not needed on a CPU run",
        flash_attn=_first_of(_probe(_imports("flash_attn")),          # FlashAttention-2
                             _probe(_imports("flash_attn_interface"))),  # FlashAttention-3
        torch_build=(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                     f"ROCm {getattr(torch.version, 'hip', None)}"),
        mlp_recompute_with_bias=_parameter_taken_by_function(),
    )


def _parameter_taken_by_function() -> str | None:
    """Whether a parameter that a custom autograd Function's forward returns becomes that
    Function's output (a non-leaf with its grad_fn), as torch 2.13 does.

    megatron-core 0.19.2 recomputes the MLP (``--recompute-modules mlp``) through
    tensor_parallel.checkpoint, whose forward returns what the MLP returns: with linear
    biases that includes linear_fc2's bias parameter itself (skip_bias_add). Taken over
    like this, the bias's later uses, the recomputation inside the checkpoint's own
    backward among them, lead back into that backward: it re-enters itself until the
    stack or the memory runs out (stock Megatron as well as the engine).
    """
    import torch

    param = torch.nn.Parameter(torch.zeros(1))

    class ReturnsParameter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            with torch.no_grad():
                return x * 2, param

        @staticmethod
        def backward(ctx, grad, grad_param):
            return grad * 2

    ReturnsParameter.apply(torch.ones(1, requires_grad=True))
    if param.is_leaf:
        return None
    return (f"torch {torch.__version__} makes a parameter returned by a custom autograd "
            "Function that Function's output")


def _first_of(*missing: str | None) -> str | None:
    """Present when any alternative is (None), else why the first one is missing."""
    return None if any(m is None for m in missing) else missing[0]


def target_device() -> str:
    """The device the run is resolved for: LBP_DEVICE, else what torch sees here."""
    want = os.environ.get(DEVICE_ENV, "").strip().lower()
    if want:
        if want not in ("gpu", "cpu"):
            raise CapabilityError(f"{DEVICE_ENV}={want}: use gpu or cpu (or unset it to use "
                                  "what torch sees)")
        return want
    return "gpu" if _accelerator_present() else "cpu"


def _accelerator_present() -> bool:
    import torch

    return torch.cuda.is_available()  # ROCm builds report through torch.cuda too


def check_device_matches(actual: str) -> None:
    """A training entry has the device it has: LBP_DEVICE may not promise another one."""
    want = target_device() if os.environ.get(DEVICE_ENV, "").strip() else actual
    if want != actual:
        import torch

        seen = "no GPU" if actual == "cpu" else "a GPU"
        raise CapabilityError(
            f"{DEVICE_ENV}={want} but this process sees {seen} (torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, ROCm {getattr(torch.version, 'hip', None)}): the flags "
            f"were meant for a {want.upper()} run; fix the allocation or unset {DEVICE_ENV}")


# --- the user's argument list ---------------------------------------------------------------
def _options(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """(option, its value or None) for every ``--option`` in argv."""
    out = []
    for i, tok in enumerate(argv):
        if not tok.startswith("--"):
            continue
        name, eq, value = tok.partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            value = nxt if nxt is not None and not nxt.startswith("--") else None
        out.append((name, value))
    return out


# --- what --hier-partition cannot serve -----------------------------------------------------
@dataclass(frozen=True)
class Unservable:
    """Megatron flags the engine refuses; ``matches(option, value)`` says whether a given one is."""

    matches: Callable[[str, str | None], bool]
    why: Callable[[str], str]       # of the option as given (with its value)


def _cuda_graph(option: str, value: str | None) -> bool:
    # Every form megatron-core 0.19.2 has (--cuda-graph-impl/-modules/-scope/-warmup-steps,
    # --enable-/--external-cuda-graph, --optimizer-cuda-graph, the RL and inference ones);
    # only the spellings that turn them off pass.
    return ("cuda-graph" in option and not option.startswith("--no-")
            and not (value is not None and value.strip().lower() == "none"))


META_DEVICE_MESSAGE = (
    "--hier-partition builds the model without holding it whole (each rank keeps only its "
    "slices, --hier-sharded-init); --init-model-with-meta-device would leave the weights "
    "uninitialized: drop it")


# Megatron features that read every parameter's weights (or main_grad) between steps, where a
# rank holds only its slices (engine/buckets.py frees the gathered copy after its last use):
# flag -> what it reads. --log-params-norm and --log-num-zeros-in-grad are served instead, from
# the optimizer's fp32 master slices and gradient slices (engine/optimizer.py).
READS_RELEASED_WEIGHTS = {
    "--check-weight-hash-across-dp-replicas-interval": "hashes each rank's whole weights",
    "--save-params-interval": "saves each parameter's whole weights after the step",
    "--save-wgrads-interval": "saves each parameter's whole main_grad after the backward",
    "--qk-clip": "rescales the whole query and key weights after the step",
    "--log-max-attention-logit": "reads the whole query and key weights after the step",
}


def released_weights_message(flag: str, what: str) -> str:
    """Also megatron_adapter.check_megatron_args' message for the parsed flag."""
    return (f"--hier-partition cannot serve {flag}: it {what}, and between steps a rank holds "
            "only its slices of them; drop it")


def conflicting_flag_message(flag: str) -> str:
    """Also megatron_adapter.check_megatron_args' message for the parsed flag."""
    return (f"--hier-partition cannot be combined with {flag}: both replace Megatron's "
            "data-parallel wrapper; drop one of them")


UNSERVABLE = (
    Unservable(_cuda_graph, lambda o: (
        f"--hier-partition cannot run CUDA graphs ({o}): a graph replays the addresses it "
        "captured, and the engine gathers each bucket's weights into freshly allocated memory "
        "at every forward and backward; drop it")),
    Unservable(lambda o, v: o in ("--fp8-param-gather", "--reuse-grad-buf-for-mxfp8-param-ag"),
               lambda o: (f"--hier-partition cannot gather fp8 parameters ({o}): its weight "
                          "gathers move the bf16/fp32 primary shards (and the int8 secondary "
                          "copy, --hier-secondary-dtype); drop it")),
    Unservable(lambda o, v: o in ("--overlap-grad-reduce", "--overlap-param-gather",
                                  "--overlap-param-gather-with-optimizer-step"),
               lambda o: (f"{o} is Megatron DDP's overlap and is not mapped: under "
                          "--hier-partition the engine overlaps its own weight gathers and "
                          "gradient reduce-scatters (--hier-overlap, on by default); drop it")),
    Unservable(lambda o, v: o in ("--use-torch-fsdp2", "--use-megatron-fsdp"),
               lambda o: conflicting_flag_message(o.split()[0])),
    Unservable(lambda o, v: o == "--init-model-with-meta-device", lambda o: META_DEVICE_MESSAGE),
    Unservable(lambda o, v: o in READS_RELEASED_WEIGHTS,
               lambda o: released_weights_message(o, READS_RELEASED_WEIGHTS[o.split()[0]])),
)


def _as_given(argv: Sequence[str], option: str) -> str:
    i = next(i for i, tok in enumerate(argv) if tok == option or tok.startswith(option + "="))
    if "=" in argv[i] or i + 1 == len(argv) or argv[i + 1].startswith("--"):
        return argv[i]
    return f"{option} {argv[i + 1]}"


def refuse_unservable(argv: Sequence[str]) -> None:
    """Under --hier-partition: a CapabilityError for the first flag the engine cannot serve."""
    if not given(argv, "--hier-partition"):
        return
    for option, value in _options(argv):
        for rule in UNSERVABLE:
            if rule.matches(option, value):
                raise CapabilityError(rule.why(_as_given(argv, option)))


# --- the resolution -------------------------------------------------------------------------
def resolve_training_argv(argv: Sequence[str], *, device: str | None = None,
                          env: Environment | None = None) -> tuple[list[str], list[str]]:
    """(the arguments the training entry runs with, one reason line per added flag).

    Added flags go first, so that anything the user wrote stays last; a flag is
    only added when the user gave none for the same setting, so resolving an
    already resolved list adds nothing.
    """
    argv = list(argv)
    refuse_unservable(argv)
    env = env or probe_environment(device)
    added: list[tuple[list[str], str]] = []

    def add(flags: list[str], why: str) -> None:
        added.append((flags, why))

    impl = _transformer_impl(argv, env, add)
    if not given(argv, "--no-gradient-accumulation-fusion") and env.apex_wgrad:
        add(["--no-gradient-accumulation-fusion"],
            "Apex's fused_weight_gradient_mlp_cuda is not importable, and Megatron's linear "
            "layers (GPT's output layer whatever --transformer-impl) need it for fused "
            f"weight-gradient accumulation ({env.apex_wgrad})")
    if impl == "local" and not given(argv, "--no-masked-softmax-fusion") and env.softmax_kernels:
        add(["--no-masked-softmax-fusion"],
            "Megatron's fused softmax kernels are not importable; its local attention would call "
            f"them for fp16/bf16 scores ({env.softmax_kernels})")
    if _uses_rope(argv) and not given(argv, "--no-rope-fusion") and env.te_rope:
        add(["--no-rope-fusion"], "Transformer Engine's fused RoPE is not importable, and "
            f"Megatron refuses apply_rope_fusion without it ({env.te_rope})")
    _layer_norm(argv, env, impl, add)
    _bias_fusions(argv, env, add)
    _attention(argv, env, impl)
    _recompute_modules(argv, env)
    _cpu_only(argv, env, add)
    _eval_interval(argv, add)
    from megatron_lbp.integration import run_defaults
    run_defaults.add_defaults(argv, add)   # --save-interval for --save

    flags = [f for fs, _ in added for f in fs]
    reasons = [f"[megatron-lbp] adding {' '.join(fs)}: {why}" for fs, why in added]
    return flags + argv, reasons


def _transformer_impl(argv, env: Environment, add) -> str:
    impl = flag_value(argv, "--transformer-impl")
    if impl in ("transformer_engine", "inference_optimized") and env.te:
        raise CapabilityError(f"--transformer-impl {impl} needs Transformer Engine, which is not "
                              f"importable here ({env.te}): use --transformer-impl local, or "
                              "install Transformer Engine")
    if given(argv, "--fp8-format") and env.te:
        raise CapabilityError(f"--fp8-format needs Transformer Engine's fp8 layers, which are not "
                              f"importable here ({env.te}): drop it, or install Transformer Engine")
    if impl is None and env.te:
        add(["--transformer-impl", "local"],
            "Transformer Engine is not importable, so Megatron's default TE layers cannot be "
            f"built ({env.te})")
        return "local"
    return impl or "transformer_engine"


def _eval_interval(argv, add) -> None:
    """megatron-core 0.19.2 has no default --eval-interval, yet with --train-iters it divides by
    it while sizing the validation set (training.get_train_valid_test_num_samples) and dies
    with "unsupported operand type(s) for //: 'int' and 'NoneType'", stock or not. Its
    training loop reads None as no periodic evaluation; one past the last iteration says the
    same to both places (the evaluation after training, if any, still runs)."""
    iters = flag_value(argv, "--train-iters")
    if iters is None or given(argv, "--eval-interval") or not iters.isdigit():
        return
    add(["--eval-interval", str(int(iters) + 1)],
        "megatron-core 0.19.2 has no default for it and divides by it when --train-iters is "
        "given; one past the last iteration means no evaluation during training, as its "
        "training loop reads the missing value")


def _uses_rope(argv) -> bool:
    # arguments.py turns apply_rope_fusion off itself for any other position embedding.
    return flag_value(argv, "--position-embedding-type") == "rope" or given(
        argv, "--use-rotary-position-embeddings")


def _layer_norm(argv, env: Environment, impl: str, add) -> None:
    if impl != "local":
        return
    rms = flag_value(argv, "--normalization") == "RMSNorm"
    if not rms and env.apex is None and env.apex_layer_norm:
        raise CapabilityError(
            "apex imports, so Megatron's local layers use Apex's FusedLayerNorm, but its "
            f"fused_layer_norm_cuda extension does not ({env.apex_layer_norm}): the first "
            "forward would fail; install "
            "Apex with its CUDA extensions, uninstall the package named apex, or use Transformer "
            "Engine")
    torch_norm = rms or env.apex is not None
    if torch_norm and given(argv, "--apply-layernorm-1p"):
        raise CapabilityError("--apply-layernorm-1p needs Apex's or Transformer Engine's layer "
                              "norm; Megatron's local layers here use torch's, which refuses it: "
                              "drop it")
    if torch_norm and not given(argv, "--no-persist-layer-norm"):
        why = "for --normalization RMSNorm" if rms else f"without Apex, {env.apex}"
        add(["--no-persist-layer-norm"], f"Megatron's local layers normalise with torch's "
            f"LayerNorm/RMSNorm ({why}), which has no persistent kernel")


def _bias_fusions(argv, env: Environment, add) -> None:
    missing = [f for f in BIAS_FUSIONS if not given(argv, f)]
    if not missing:
        return
    if env.device == "cpu":
        add(missing, f"{_cpu_run()}: Megatron compiles these with torch.compile (core/jit.py), "
            "which on a CPU builds C++ kernels in every rank at their first use")
    elif env.triton:
        add(missing, "Triton, torch.compile's GPU code generator that Megatron's bias fusions "
            f"use (core/jit.py), is not importable ({env.triton})")


def _attention(argv, env: Environment, impl: str) -> None:
    backend = flag_value(argv, "--attention-backend")
    version = flag_value(argv, "--flash-attention-version")
    asked = backend if backend in ("flash", "fused") else (
        "flash" if version is not None else None)
    if asked is None:
        return
    what = f"--attention-backend {backend}" if backend in ("flash", "fused") else \
        f"--flash-attention-version {version}"
    if impl == "local":
        why = f"Transformer Engine is not importable ({env.te})" if env.te else \
            "--transformer-impl local"
        raise CapabilityError(f"{what} chooses among Transformer Engine's attention kernels, but "
                              f"this run builds Megatron's local layers ({why}): drop it")
    if asked == "flash" and env.flash_attn:
        raise CapabilityError(f"{what} needs a flash-attn package for Transformer Engine's "
                              f"FlashAttention backend, and none imports ({env.flash_attn}): use "
                              "--attention-backend auto, or install flash-attn")


def _recompute_modules(argv, env: Environment) -> None:
    """Selective recomputation modules whose megatron-core 0.19.2 code path cannot run here
    (stock Megatron fails the same way; refused before any process starts)."""
    if flag_value(argv, "--recompute-granularity") != "selective":
        return
    modules = flag_values(argv, "--recompute-modules")
    if "layernorm" in modules and env.te:
        # CheckpointWithoutOutput sets ``self.fp8 = fp8 is not None`` (always true) and its
        # forward then reads TE's FP8GlobalStateManager: a NameError at the first forward.
        raise CapabilityError(
            "--recompute-modules layernorm needs Transformer Engine in megatron-core 0.19.2 "
            "(its CheckpointWithoutOutput reads TE's fp8 state whether or not fp8 is on), and "
            f"it is not importable here ({env.te}): leave layernorm out of --recompute-modules")
    if ("mlp" in modules and not given(argv, "--disable-bias-linear")
            and not given(argv, "--num-experts") and env.mlp_recompute_with_bias):
        raise CapabilityError(
            "--recompute-modules mlp with linear biases (Megatron's default): megatron-core "
            "0.19.2 recomputes the MLP through a checkpoint function that returns "
            f"linear_fc2's bias parameter, and {env.mlp_recompute_with_bias}, so the backward "
            "re-enters the checkpoint without end: add --disable-bias-linear, or leave mlp out "
            "of --recompute-modules")


def _cpu_only(argv, env: Environment, add) -> None:
    if env.device != "cpu":
        return
    flags = []
    backend = flag_value(argv, "--distributed-backend")
    if backend == "nccl":
        raise CapabilityError("--distributed-backend nccl needs a GPU, and this is a CPU run "
                              f"({env.torch_build}): use --distributed-backend gloo, or run on "
                              "GPUs")
    if backend is None:
        flags += ["--distributed-backend", "gloo"]
    if not given(argv, "--use-cpu-initialization"):
        flags.append("--use-cpu-initialization")
    if flags:
        add(flags, f"{_cpu_run()}: gloo collectives, weights initialised on the CPU")


def _cpu_run() -> str:
    return f"CPU run ({DEVICE_ENV}=cpu)" if os.environ.get(DEVICE_ENV, "").strip() else \
        "CPU run (torch sees no GPU)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        resolved, reasons = resolve_training_argv(argv)
    except CapabilityError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return 2
    for line in reasons:
        print(line, file=sys.stderr)
    print(shlex.join(resolved), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
