"""Everything megatron-lbp does to run stock megatron-core 0.19.2 where it was not built to run.

Two independent parts, both applied by :func:`enable` (idempotent):

1. Python 3.11 (``_install_python_shims``), applied on import of ``megatron_lbp``.
   megatron-core 0.19.2 declares Python >= 3.12 but ships cp311 wheels
   (scripts/install.sh installs them without the metadata check). The only
   3.12-only construct that is reached is ``from typing import override`` in
   ``megatron/training/models/{gpt,hybrid}.py``; ``typing.override`` is set to
   ``typing_extensions.override`` (identical semantics: it only marks a method).
   Nothing is changed on Python >= 3.12.

2. CPU ranks with gloo (``_activate_cpu_runtime``), only when
   ``torch.cuda.is_available()`` is False (ROCm builds report through
   ``torch.cuda`` too), logged once when it switches on. The rule for every patch
   below: on a machine without an accelerator the patched call can only raise
   ("Torch not compiled with CUDA enabled" / "no CUDA GPUs"); the patch turns that
   failure into the CPU equivalent. Nothing that works without the patch behaves
   differently with it, and on a GPU machine none of it is installed.

   Patched spots (megatron-core 0.19.2 call sites that need them):

   - ``torch.cuda.current_device`` -> 0, ``device_count`` -> 1, ``set_device`` no-op:
     buffers and modules pass ``torch.cuda.current_device()`` as a device
     (distributed/param_and_grad_buffer.py, transformer/module.py,
     models/common/embeddings/rotary_pos_embedding.py, transformer/*attention*.py,
     core/utils.py global memory buffer, training/training.py).
   - device arguments of the tensor factories (``torch.tensor``, ``zeros``, ``ones``,
     ``empty``, ``full``, ``arange``, ``rand``, ``randn``, ``randint``, ``*_like``,
     ``Tensor.new_*``) and of ``Tensor.to``: a CUDA device ("cuda", "cuda:N",
     ``torch.device('cuda', N)`` or a bare int) becomes CPU. Call sites with a literal
     ``device='cuda'``: optimizer/optimizer.py (found_inf, dummy overflow buf,
     scale one, _get_param_groups' flag), optimizer/clip_grads.py (norm tensors),
     optimizer/grad_scaler.py, transformer/utils.py (causal mask),
     tensor_parallel/data.py, core/utils.py (param hashes, l2 norms),
     dist_checkpointing/strategies/state_dict_saver.py and exchange_utils.py,
     rerun_state_machine.py.
   - ``Tensor.cuda`` -> the tensor itself (so ``nn.Module.cuda`` too):
     optimizer/grad_scaler.py load_state_dict, optimizer/optimizer.py state
     reload, models/common/embeddings/rope_utils.py, core/utils.py,
     dist_checkpointing/exchange_utils.py, training/training.py (get_batch, get_model).
   - device RNG: ``torch.cuda.manual_seed``/``get_rng_state``/
     ``set_rng_state`` and tensor_parallel/random.py's ``_get_cuda_rng_state`` /
     ``_set_cuda_rng_state`` act on the CPU generator, so Megatron's
     ``CudaRNGStatesTracker`` (model-parallel, data-parallel and expert RNG
     streams, ``model_parallel_cuda_manual_seed``) forks and restores the generator
     that CPU dropout and init actually use.
   - ``Tensor.type()`` without arguments, *only when called from
     megatron.core.optimizer*: answers ``torch.cuda.<X>Tensor`` for a CPU tensor.
     optimizer/optimizer.py (Float16OptimizerWithFloat16Params),
     optimizer/distrib_optimizer.py (_build_model_and_main_param_groups and the
     param-group copy) and optimizer/clip_grads.py (fp32 grad assertion) select
     their branch by that string and raise for "torch.FloatTensor".
   - CUDA streams and events (``torch.cuda.Stream``, ``Event``, ``stream``,
     ``current_stream``, ``default_stream``, ``synchronize``): CPU work is
     synchronous, so they become no-op objects; events report 0 ms elapsed.
     Used by distributed/param_and_grad_buffer.py (communication stream),
     core/utils.py timers and straggler detector, training/training.py.
   - memory statistics (``memory_allocated``, ``max_memory_allocated``,
     ``memory_reserved``, ``max_memory_reserved``, ``reset_peak_memory_stats``,
     ``empty_cache``, ``memory_stats``): report 0 / empty, since Megatron prints
     them in its iteration log; megatron-lbp reports its own per-state bytes.
   - ``torch.cuda.nvtx`` range push/pop: no-ops (core/utils.py nvtx decorators).
   - ``torch.compile`` of a plain function defers its Dynamo/Inductor set-up to
     the first call (``_defer_torch_compile``): megatron-core's fusion kernels
     are decorated at import, which otherwise imports Inductor in every rank
     for kernels a CPU run never calls.
   - tensor_parallel/random.py's ``fork`` warns "CPU RNG state changed within GPU
     RNG context" whenever the forked (device) generator draws: with the device
     generator mapped onto the CPU one that is every device-path weight init, so
     that one message of that logger is filtered out.

3. megatron.training (``enable_training``, called by the training entry point
   after ``enable``):

   - any machine: Megatron's argument parser reads the field docstrings of each
     config dataclass (TransformerConfig and its bases) from the class's source
     with ``inspect.getsource`` and ``ast`` on every parse, the largest single
     cost of a rank's argument parsing; ``memoize_argument_help`` keeps them per
     class (they are a pure function of the installed source). The test harness's
     forkserver fills that memo once, so its forked ranks skip the work
     (megatron_lbp/testing/_preload.py).

   - any machine, only when the wheel's layout calls for it: training/initialize.py
     runs ``make -C megatron/core/datasets`` to build the dataset index helpers,
     but the megatron-core wheel ships them prebuilt (``helpers_cpp``) and without
     the Makefile, so the build fails and the job exits; when ``helpers_cpp``
     imports and no Makefile is there, ``datasets.utils.compile_helpers`` is
     skipped.
   - CPU runtime only: training/initialize.py ``initialize_megatron`` asserts CUDA unless
     ``allow_no_cuda=True`` (its own documented switch "for cpu only"); the
     reference that training/training.py's ``pretrain`` calls passes it.
   - CPU runtime only: ``pretrain``'s JIT warm-up (``set_jit_fusion_options``)
     compiles bias+gelu and bias+dropout+add with Inductor in every rank even when
     the flags turn those fusions off; it is skipped when the model calls none
     of the warmed kernels (``_skip_unused_jit_warmup``).

4. Megatron-FSDP on gloo (``megatron_fsdp_on_gloo``, called where the benchmarks
   build their Megatron-FSDP baseline; the hierarchy itself refuses
   ``--use-megatron-fsdp``), only when the default process group is plain gloo:
   its parameter all-gathers take its own synchronous branch
   (``async_param_gather=False``: each coalesced block of gathers is waited for
   as it closes), so no coalesced gloo collective is ever in flight beside
   another. Asynchronous, they corrupt the heap now and then ("malloc():
   unaligned tcache chunk detected", SIGABRT or SIGSEGV inside
   ``_coalescing_manager``). ``bench overhead --schemes megatron-fsdp`` on 2 ranks,
   60 steps, 2-4 runs side by side: 2 of 16 runs crashed; 1 of 24 with its bucket
   frees turned off (so it is not Megatron-FSDP freeing a bucket early); 1 of 45
   when only whole calls were waited for (coalesced blocks still overlapping one
   another); 0 of 69 on this branch. The rank stacks come from
   megatron_lbp.testing.multirank. Plain torch shows the same fault
   (tests/gloo_coalesced_repro.py: an asynchronous coalesced all-gather left in
   flight across a coalesced reduce-scatter aborted with the same malloc message
   or hung in 2 of 18 runs of 3000 iterations, 0 of 10 waited for first), and
   pytorch/pytorch#65231 records aborts of gloo's coalesced all-gather.
   NCCL/RCCL runs are untouched. Cost: the CPU benchmarks' Megatron-FSDP no
   longer overlaps its gathers with compute.

5. CPU runtime only, Megatron's torch_dist checkpoint writer
   (``_fork_checkpoint_result_queue``): the queue its writer threads report into
   lives in a ``multiprocessing`` Manager that megatron-core starts with the
   *spawn* method (dist_checkpointing/strategies/filesystem_async.py,
   ``get_write_results_queue``), a fresh interpreter that imports torch to
   unpickle the first write result. On a 2-core machine that made each rank's
   first save wait ~5 s and its exit ~3 s more (py-spy of a 4-rank, 3-iteration
   run: 6.1 s save, 3.2 s from the end of training to exit). Spawn is there to
   keep a CUDA context out of the child; without an accelerator there is none, so
   on the CPU runtime the Manager is forked instead. With an accelerator the
   spawn path is untouched.

6. A megatron-core 0.19.2 bug, on every device (``xavier_init_flag``, applied by
   :func:`enable_training`): ``--init-method-xavier-uniform`` passes a
   TransformerConfig field that no longer exists and kills every run that uses it.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
import typing

log = logging.getLogger("megatron_lbp.compat")

_python_shims_done = False
_cpu_runtime_active = False


def _install_python_shims() -> None:
    global _python_shims_done
    if _python_shims_done:
        return
    _python_shims_done = True
    if sys.version_info < (3, 12) and not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


# --- notices: known and expected ones of others, said once -------------------------------

# megatron-core's notices that are expected wherever this project runs on CPU (and several
# on GPU too: GPTModel is what 0.19.2's pretrain_gpt builds), each printed by every rank or
# every model build: one line names them all instead, on rank 0, the first time one comes.
KNOWN_NOTICES = (
    ("Transformer Engine and Apex are not installed", "Transformer Engine/Apex absent (torch "
     "fallbacks)"),
    ("Apex is not installed", None),
    ("Only transformer-engine>=", None),
    ("absl.logging is not installed", None),
    ("full scope is deprecated", "cuda_graph_scope 'full' deprecated"),
    ("GPTModel IS DEPRECATED", "GPTModel deprecated for HybridModel"),
)
KNOWN_NOTICES_LINE = ("megatron-lbp: expected megatron-core notices not shown: "
                      + "; ".join(w for _, w in KNOWN_NOTICES if w)
                      + " (megatron_lbp/compat.py KNOWN_NOTICES)")
_notices_said = False
_notices_quiet = False


def _known(message: str) -> bool:
    return any(message.startswith(k) or k in message[:200] for k, _ in KNOWN_NOTICES)


def _say_notices_once() -> None:
    global _notices_said
    if _notices_said:
        return
    _notices_said = True   # inherited by forked ranks: their parent has said it
    import os

    if os.environ.get("RANK", "0") == "0":
        print(KNOWN_NOTICES_LINE, file=sys.stderr, flush=True)


class _KnownNoticeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if _known(record.getMessage()):
            _say_notices_once()
            return False
        return True


def quiet_known_notices() -> None:
    """megatron-core's KNOWN_NOTICES (warnings and log records) become one line on rank 0
    (idempotent; run on import of megatron_lbp, before megatron-core's import-time ones)."""
    global _notices_quiet
    if _notices_quiet:
        return
    _notices_quiet = True
    import warnings

    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if _known(str(message)):
            _say_notices_once()
            return
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_KnownNoticeFilter())


def accelerator_present() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_runtime_active() -> bool:
    return _cpu_runtime_active


def enable() -> bool:
    """Apply every compatibility step this machine needs; returns True when the CPU runtime is on."""
    _install_python_shims()
    if not accelerator_present():
        _activate_cpu_runtime()
    return _cpu_runtime_active


# --- CPU runtime -------------------------------------------------------------------------

_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
    "randint", "randperm", "linspace", "eye", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "empty_strided",
)
_TENSOR_NEW = ("new_tensor", "new_zeros", "new_ones", "new_empty", "new_full")


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

    wrapper.__lbp_wrapped__ = fn
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

    to.__lbp_wrapped__ = orig
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

    type_.__lbp_wrapped__ = orig
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


def _activate_cpu_runtime() -> None:
    global _cpu_runtime_active
    if _cpu_runtime_active:
        return
    import torch

    for name in _FACTORIES:
        fn = getattr(torch, name, None)
        if fn is not None and not hasattr(fn, "__lbp_wrapped__"):
            setattr(torch, name, _wrap_device_kwarg(fn))
    for name in _TENSOR_NEW:
        setattr(torch.Tensor, name, _wrap_device_kwarg(getattr(torch.Tensor, name)))
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    torch.Tensor.type = _tensor_type(torch.Tensor.type)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _NoopStream
    cuda.Event = _NoopEvent
    cuda.current_stream = lambda device=None: _NoopStream()
    cuda.default_stream = lambda device=None: _NoopStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(cuda, stat, lambda device=None: 0)
    cuda.memory_stats = lambda device=None: {}
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.reset_max_memory_allocated = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.nvtx.range_push = lambda msg: 0
    cuda.nvtx.range_pop = lambda: 0

    # torch.manual_seed itself calls cuda.manual_seed_all (a queued no-op here), so
    # only the single-device call is redirected, straight to the CPU generator.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state

    _defer_torch_compile(torch)
    _fork_checkpoint_result_queue()
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = (
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    )
    mcore_random._set_cuda_rng_state = (
        lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    )

    logging.getLogger(mcore_random.__name__).addFilter(_drop_rng_fork_warning)
    _cpu_runtime_active = True
    import os

    if os.environ.get("RANK", "0") == "0":   # the same on every rank: said by rank 0
        log.warning(
            "megatron-lbp: no accelerator found; CPU runtime for megatron-core is active "
            "(CUDA device/RNG/stream calls mapped to CPU, see megatron_lbp/compat.py)"
        )


def _replace_once(owner: typing.Any, name: str,
                  make: typing.Callable[[typing.Callable], typing.Callable]) -> None:
    """``owner.name = make(original)``, marked so that applying it again changes nothing."""
    orig = getattr(owner, name)
    if getattr(orig, "__lbp_wrapped__", False):
        return
    new = functools.wraps(orig)(make(orig))
    new.__lbp_wrapped__ = True
    setattr(owner, name, new)


def _fork_checkpoint_result_queue() -> None:
    """Part 5 of the module docstring: the torch_dist writer's result queue in a forked Manager."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def make(orig):
        def get_write_results_queue(mp_mode: str = "spawn"):
            return orig("fork" if mp_mode == "spawn" else mp_mode)
        return get_write_results_queue

    _replace_once(filesystem_async, "get_write_results_queue", make)


def _defer_torch_compile(torch) -> None:
    """``torch.compile(fn)`` on a function sets up Dynamo and Inductor when first called, not before.

    megatron-core decorates its fusion kernels with ``torch.compile`` at import
    (core/jit.py ``jit_fuser``: fusions/fused_bias_geglu.py, fused_bias_gelu.py,
    ...), and that call alone imports torch._dynamo and torch._inductor: 1.3 s of
    CPU per process, x8 ranks per launch, for kernels that a CPU run never calls
    (its flags turn the fusions off). Deferring it changes nothing else: the real
    ``torch.compile`` runs, with the same arguments, on the first call. Modules
    and anything that is not a plain function are compiled at once as before.
    """
    import functools
    import types

    real = torch.compile
    if getattr(real, "__lbp_wrapped__", False):
        return

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

    compile_when_called.__lbp_wrapped__ = True
    torch.compile = compile_when_called


def _drop_rng_fork_warning(record: logging.LogRecord) -> bool:
    return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def xavier_init_flag() -> None:
    """``--init-method-xavier-uniform`` builds a TransformerConfig (megatron-core 0.19.2 bug).

    ``core_transformer_config_from_args`` answers the flag with
    ``kw_args['scaled_init_method'] = xavier_uniform_``, a field TransformerConfig
    no longer has (it is ``output_layer_init_method``), so every run with the
    flag, stock or not, dies in ``TransformerConfig(**kw_args)`` with "unexpected
    keyword argument 'scaled_init_method'". The flag is handed over as what it
    means: ``init_method`` and ``output_layer_init_method`` both xavier-uniform
    (the embedding then follows ``init_method``, as TransformerConfig decides).
    Applies on every device; a config class without those fields is left alone.
    """
    import argparse

    import torch
    from megatron.training import argument_utils

    def make(orig):
        def core_transformer_config_from_args(args, config_class=None):
            if getattr(args, "init_method_xavier_uniform", False):
                args = argparse.Namespace(**{
                    **vars(args), "init_method_xavier_uniform": False,
                    "init_method": torch.nn.init.xavier_uniform_,
                    "output_layer_init_method": torch.nn.init.xavier_uniform_})
            return orig(args, config_class)
        return core_transformer_config_from_args

    _replace_once(argument_utils, "core_transformer_config_from_args", make)


def enable_training() -> None:
    """The megatron.training spots of part 3 of the module docstring (idempotent)."""
    _skip_helper_build_if_prebuilt()
    memoize_argument_help()
    xavier_init_flag()
    if not _cpu_runtime_active:
        return
    import functools

    from megatron.training import initialize, training

    if getattr(training.initialize_megatron, "__lbp_wrapped__", False):
        return
    orig = training.initialize_megatron

    @functools.wraps(orig)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return orig(*args, **kwargs)

    initialize_megatron.__lbp_wrapped__ = True
    training.initialize_megatron = initialize_megatron
    initialize.initialize_megatron = initialize_megatron
    training.set_jit_fusion_options = _skip_unused_jit_warmup(training.set_jit_fusion_options)


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
    import functools

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


def memoize_argument_help() -> None:
    """Part 3: each config class's field docstrings parsed from its source once per process."""
    from megatron.training import argument_utils

    memo: dict[type, dict[str, str]] = {}

    def make(orig):
        def _get_field_docstrings(self, src_cfg_class):
            if src_cfg_class not in memo:
                memo[src_cfg_class] = orig(self, src_cfg_class)  # recurses through this memo
            return dict(memo[src_cfg_class])
        return _get_field_docstrings

    _replace_once(argument_utils.ArgumentGroupFactory, "_get_field_docstrings", make)


def megatron_fsdp_on_gloo() -> None:
    """Part 4 of the module docstring: Megatron-FSDP's parameter all-gathers synchronous on gloo."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer

    def make(orig):
        def all_gather_params(self, *args, **kwargs):
            import torch.distributed as dist

            if dist.get_backend() == "gloo":
                kwargs["async_param_gather"] = False
            return orig(self, *args, **kwargs)
        return all_gather_params

    _replace_once(param_and_grad_buffer.AllGatherPipeline, "all_gather_params", make)


def _skip_helper_build_if_prebuilt() -> None:
    import importlib.util
    import os

    from megatron.core.datasets import utils as dataset_utils

    here = os.path.dirname(dataset_utils.__file__)
    prebuilt = importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None
    if prebuilt and not os.path.exists(os.path.join(here, "Makefile")):
        dataset_utils.compile_helpers = lambda: None
