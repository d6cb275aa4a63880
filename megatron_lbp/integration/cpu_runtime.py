"""CPU ranks with gloo for stock megatron-core 0.19.2: the patches that run only without an accelerator.

:func:`activate` (called by ``compat.enable`` only when ``torch.cuda.is_available()``
is False; ROCm reports through ``torch.cuda`` too) and :func:`activate_training`
install them, each declared in ``PATCHES`` through megatron_lbp.core.patching with its
target and reason. The rule for every patch: without an accelerator the patched call
could only raise ("Torch not compiled with CUDA enabled"); the patch gives the CPU
equivalent (a CUDA device becomes CPU, device RNG is the CPU generator, streams and
events are synchronous no-ops, memory statistics are 0). Nothing that works without
a patch behaves differently with it, and on a GPU machine none is installed.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import types

from megatron_lbp.core import patching
from megatron_lbp.core.patching import CPU_RUNTIME

log = logging.getLogger("megatron_lbp.integration.compat")

_active = False


def active() -> bool:
    return _active


def _declare(name: str, target: str, why: str) -> patching.Patch:
    return patching.declare(__name__, name, target, CPU_RUNTIME, why)


_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
    "randint", "randperm", "linspace", "eye", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "empty_strided",
)
_TENSOR_NEW = ("new_tensor", "new_zeros", "new_ones", "new_empty", "new_full")
_DEVICE_KWARG = {
    f"device kwarg {owner}.{name}": (f"torch:{owner + '.' if owner != 'torch' else ''}{name}")
    for owner, names in (("torch", _FACTORIES), ("Tensor", _TENSOR_NEW)) for name in names
}
PATCHES = {name: _declare(name, target, "a CUDA device argument becomes CPU (literal device='cuda' "
                                         "call sites in megatron-core's optimizer, utils, masks)")
           for name, target in _DEVICE_KWARG.items()}

_CUDA_CONSTANT = {
    # name: (replacement, why)
    "current_device": (lambda: 0, "the device index megatron-core passes as a device"),
    "device_count": (lambda: 1, "one device per rank"),
    "set_device": (lambda device: None, "nothing to select"),
    "synchronize": (lambda device=None: None, "CPU work is synchronous"),
    "current_stream": (lambda device=None: _NoopStream(), "CPU work is synchronous"),
    "default_stream": (lambda device=None: _NoopStream(), "CPU work is synchronous"),
    "stream": (lambda stream=None: contextlib.nullcontext(), "CPU work is synchronous"),
    "memory_allocated": (lambda device=None: 0, "Megatron's log prints it; megatron-lbp reports its own"),
    "max_memory_allocated": (lambda device=None: 0, "Megatron's log prints it"),
    "memory_reserved": (lambda device=None: 0, "Megatron's log prints it"),
    "max_memory_reserved": (lambda device=None: 0, "Megatron's log prints it"),
    "memory_stats": (lambda device=None: {}, "Megatron's log prints it"),
    "reset_peak_memory_stats": (lambda device=None: None, "Megatron's log resets it"),
    "reset_max_memory_allocated": (lambda device=None: None, "Megatron's log resets it"),
    "empty_cache": (lambda: None, "no device cache"),
    "nvtx.range_push": (lambda msg: 0, "core/utils.py nvtx decorators"),
    "nvtx.range_pop": (lambda: 0, "core/utils.py nvtx decorators"),
}
PATCHES.update({f"torch.cuda.{name}": _declare(f"torch.cuda.{name}", f"torch:cuda.{name}", why)
                for name, (_, why) in _CUDA_CONSTANT.items()})

_RNG_WHY = ("device RNG acts on the CPU generator, so Megatron's CudaRNGStatesTracker forks the "
            "generator CPU dropout and init use")
PATCHES.update({
    "Tensor.to": _declare("Tensor.to", "torch:Tensor.to", "a CUDA device argument becomes CPU"),
    "Tensor.type": _declare("Tensor.type", "torch:Tensor.type",
                            "megatron.core.optimizer picks its branch by 'torch.cuda.<X>Tensor'"),
    "Tensor.cuda": _declare("Tensor.cuda", "torch:Tensor.cuda", "the tensor itself (nn.Module.cuda too)"),
    "torch.cuda.Stream": _declare("torch.cuda.Stream", "torch:cuda.Stream", "CPU work is synchronous"),
    "torch.cuda.Event": _declare("torch.cuda.Event", "torch:cuda.Event", "events report 0 ms"),
    "torch.cuda.manual_seed": _declare("torch.cuda.manual_seed", "torch:cuda.manual_seed", _RNG_WHY),
    "torch.cuda.get_rng_state": _declare("torch.cuda.get_rng_state", "torch:cuda.get_rng_state", _RNG_WHY),
    "torch.cuda.set_rng_state": _declare("torch.cuda.set_rng_state", "torch:cuda.set_rng_state", _RNG_WHY),
    "torch.cuda.random.get_rng_state": _declare(
        "torch.cuda.random.get_rng_state", "torch:cuda.random.get_rng_state", _RNG_WHY),
    "torch.cuda.random.set_rng_state": _declare(
        "torch.cuda.random.set_rng_state", "torch:cuda.random.set_rng_state", _RNG_WHY),
    "_get_cuda_rng_state": _declare(
        "_get_cuda_rng_state", "megatron.core.tensor_parallel.random:_get_cuda_rng_state", _RNG_WHY),
    "_set_cuda_rng_state": _declare(
        "_set_cuda_rng_state", "megatron.core.tensor_parallel.random:_set_cuda_rng_state", _RNG_WHY),
    # The function stays as it is: the logger it warns through gets a filter.
    "rng fork warning": _declare(
        "rng fork warning", "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork",
        "its 'CPU RNG state changed within GPU RNG context' is every device-path init here: "
        "that one message of its module's logger is filtered"),
    "torch.compile": _declare(
        "torch.compile", "torch:compile",
        "Dynamo/Inductor set up at a function's first call, not at megatron-core's import"),
    "checkpoint result queue": _declare(
        "checkpoint result queue",
        "megatron.core.dist_checkpointing.strategies.filesystem_async:get_write_results_queue",
        "the torch_dist writer's Manager forked, not spawned (~5 s per first save, ~3 s per exit)"),
    "allow_no_cuda": _declare(
        "allow_no_cuda", "megatron.training.training:initialize_megatron",
        "initialize_megatron asserts CUDA unless allow_no_cuda=True, its own switch for CPU"),
    "allow_no_cuda (initialize)": _declare(
        "allow_no_cuda (initialize)", "megatron.training.initialize:initialize_megatron",
        "the same, where megatron.training.initialize's own name is called"),
    "jit warm-up": _declare(
        "jit warm-up", "megatron.training.training:set_jit_fusion_options",
        "skipped when the model calls none of the warmed kernels (~4 s of CPU per rank)"),
})


def _cpu_device(device):
    """Map a CUDA device spec to CPU; anything else passes through untouched."""
    import torch

    if device is None:
        return None
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str):
        return torch.device("cpu") if device.startswith("cuda") else device
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _wrap_device_kwarg(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


def _tensor_to(orig):
    import torch

    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if args and not isinstance(args[0], (torch.dtype, torch.Tensor)):
            args = (_cpu_device(args[0]),) + args[1:]
        return orig(self, *args, **kwargs)

    return to


def _tensor_type(orig):
    import torch

    cuda_names = {
        torch.float32: "torch.cuda.FloatTensor",
        torch.float16: "torch.cuda.HalfTensor",
        torch.bfloat16: "torch.cuda.BFloat16Tensor",
    }

    @functools.wraps(orig)
    def type_(self, *args, **kwargs):
        if not args and not kwargs and self.device.type == "cpu":
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("megatron.core.optimizer") and self.dtype in cuda_names:
                return cuda_names[self.dtype]
        return orig(self, *args, **kwargs)

    return type_


class _NoopStream:
    """Stands in for torch.cuda.Stream: CPU kernels run synchronously in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NoopEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NoopEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _with(value):
    """``make`` for a patch whose replacement does not depend on the original."""
    return lambda _original: value


def activate() -> None:
    """Every torch and megatron-core patch of this module (idempotent), logged once."""
    global _active
    if _active:
        return
    import torch

    for name in _DEVICE_KWARG:
        patching.apply(PATCHES[name], _wrap_device_kwarg)
    patching.apply(PATCHES["Tensor.to"], _tensor_to)
    patching.apply(PATCHES["Tensor.type"], _tensor_type)
    patching.apply(PATCHES["Tensor.cuda"], _with(lambda self, *args, **kwargs: self))
    for name, (value, _) in _CUDA_CONSTANT.items():
        patching.apply(PATCHES[f"torch.cuda.{name}"], _with(value))
    patching.apply(PATCHES["torch.cuda.Stream"], _with(_NoopStream))
    patching.apply(PATCHES["torch.cuda.Event"], _with(_NoopEvent))

    # torch.manual_seed itself calls cuda.manual_seed_all (a queued no-op here), so
    # only the single-device call is redirected, straight to the CPU generator.
    patching.apply(PATCHES["torch.cuda.manual_seed"],
                   _with(lambda seed: torch.default_generator.manual_seed(int(seed))))
    for where in ("torch.cuda", "torch.cuda.random"):
        patching.apply(PATCHES[f"{where}.get_rng_state"],
                       _with(lambda device="cuda": torch.get_rng_state()))
        patching.apply(PATCHES[f"{where}.set_rng_state"],
                       _with(lambda new_state, device="cuda": torch.set_rng_state(new_state)))

    patching.apply(PATCHES["torch.compile"], _defer_torch_compile)
    patching.apply(PATCHES["checkpoint result queue"], _fork_checkpoint_result_queue)
    patching.apply(PATCHES["_get_cuda_rng_state"], _with(
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()))
    patching.apply(PATCHES["_set_cuda_rng_state"], _with(
        lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)))
    patching.apply(PATCHES["rng fork warning"], _filter_rng_fork_warning)
    _active = True
    import os

    if os.environ.get("RANK", "0") == "0":   # the same on every rank: said by rank 0
        log.warning(
            "megatron-lbp: no accelerator found; CPU runtime for megatron-core is active "
            "(CUDA device/RNG/stream calls mapped to CPU, see megatron_lbp/integration/cpu_runtime.py)"
        )


def activate_training() -> None:
    """The megatron.training patches of the module docstring (idempotent; after :func:`activate`)."""
    def allow_no_cuda(orig):
        @functools.wraps(orig)
        def initialize_megatron(*args, **kwargs):
            kwargs["allow_no_cuda"] = True
            return orig(*args, **kwargs)
        return initialize_megatron

    # training.py holds its own reference to initialize.initialize_megatron: both are wrapped.
    patching.apply(PATCHES["allow_no_cuda"], allow_no_cuda)
    patching.apply(PATCHES["allow_no_cuda (initialize)"], allow_no_cuda)
    patching.apply(PATCHES["jit warm-up"], _skip_unused_jit_warmup)


def _fork_checkpoint_result_queue(orig):
    """The torch_dist writer's result queue in a forked Manager (module docstring)."""
    @functools.wraps(orig)
    def get_write_results_queue(mp_mode: str = "spawn"):
        return orig("fork" if mp_mode == "spawn" else mp_mode)
    return get_write_results_queue


def _defer_torch_compile(real):
    """``torch.compile(fn)`` on a function sets up Dynamo and Inductor when first called, not before.

    megatron-core decorates its fusion kernels with ``torch.compile`` at import
    (core/jit.py ``jit_fuser``: fusions/fused_bias_geglu.py, fused_bias_gelu.py,
    ...), and that call alone imports torch._dynamo and torch._inductor: 1.3 s of
    CPU per process, x8 ranks per launch, for kernels that a CPU run never calls
    (its flags turn the fusions off). Deferring it changes nothing else: the real
    ``torch.compile`` runs, with the same arguments, on the first call. Modules
    and anything that is not a plain function are compiled at once as before.
    """
    def compile_when_called(model=None, **kwargs):
        if model is None:  # used as @torch.compile(mode=...)
            return lambda fn: compile_when_called(fn, **kwargs)
        if not isinstance(model, types.FunctionType):
            return real(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **kw)

        return call

    return compile_when_called


def _filter_rng_fork_warning(fork):
    logging.getLogger(fork.__module__).addFilter(_drop_rng_fork_warning)
    return fork


def _drop_rng_fork_warning(record: logging.LogRecord) -> bool:
    return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def _skip_unused_jit_warmup(orig):
    """``pretrain``'s JIT warm-up, skipped when the model will call none of the warmed kernels.

    ``set_jit_fusion_options`` runs bias+gelu (or bias+swiglu) and bias+dropout+add
    five times each so that torch.compile has compiled them before step 1. On
    CPU that is Dynamo and Inductor compiling two kernels in every rank (~4 s of
    CPU per rank per launch, measured with cProfile), and a CPU run turns both
    fusions off (megatron_lbp.capabilities adds ``--no-bias-*-fusion``), so the
    compiled kernels are never called. With any of those fusions on, the warm-up
    runs as before.
    """
    @functools.wraps(orig)
    def set_jit_fusion_options(*args, **kwargs):
        from megatron.training import get_args

        a = get_args()
        # The kernels it warms up, each with the flag under which the model calls it.
        used = ((a.swiglu and a.bias_swiglu_fusion) or (not a.swiglu and a.bias_gelu_fusion)
                or a.bias_dropout_fusion)
        if used:
            return orig(*args, **kwargs)
        return None

    return set_jit_fusion_options
