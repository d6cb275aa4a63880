"""What megatron-lbp changes in stock megatron-core 0.19.2 on every device, and the entry points.

:func:`enable` (idempotent) applies what this machine needs: the Python 3.11 shim
(``typing.override`` for megatron.training's 3.12-only import) and, only without an
accelerator, megatron_lbp.integration.cpu_runtime. :func:`enable_training` adds the
megatron.training patches (argument-help memo, prebuilt dataset helpers, the
``--init-method-xavier-uniform`` bug). :func:`megatron_fsdp_on_gloo` makes the
benchmarks' Megatron-FSDP gather synchronously on gloo, where asynchronous coalesced
gathers beside other collectives corrupt the heap now and then
(tests/helpers/gloo_coalesced_repro.py; pytorch/pytorch#65231). Every patch is declared
in megatron_lbp.core.patching's registry (owner, target, when, why), above.
"""
from __future__ import annotations

import functools
import logging
import sys
import typing

from megatron_lbp.core import patching
from megatron_lbp.core.patching import EVERY_DEVICE

PYTHON_311 = patching.declare(
    __name__, "python 3.11 typing.override", "typing:override", "Python < 3.12",
    "megatron/training/models/{gpt,hybrid}.py import typing.override (3.12); "
    "typing_extensions.override is the same marker", missing_ok=True)
ARGUMENT_HELP = patching.declare(
    __name__, "argument help memo", "megatron.training.argument_utils:ArgumentGroupFactory._get_field_docstrings",
    EVERY_DEVICE, "each config class's field docstrings parsed from its source once per process")
HELPER_BUILD = patching.declare(
    __name__, "prebuilt dataset helpers", "megatron.core.datasets.utils:compile_helpers",
    "the wheel ships helpers_cpp and no Makefile", "make -C megatron/core/datasets fails without "
    "its Makefile; the helpers are prebuilt")
FSDP_ON_GLOO = patching.declare(
    __name__, "megatron-fsdp synchronous gathers on gloo",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer:AllGatherPipeline.all_gather_params",
    "the benchmarks' Megatron-FSDP baseline, default group on gloo",
    "asynchronous coalesced gloo gathers in flight beside others corrupt the heap now and then")
XAVIER = patching.declare(
    __name__, "xavier init flag", "megatron.training.argument_utils:core_transformer_config_from_args",
    EVERY_DEVICE, "--init-method-xavier-uniform passes a TransformerConfig field that no longer exists")


def _install_python_shims() -> None:
    if sys.version_info >= (3, 12) or hasattr(typing, "override"):
        return

    def make(_absent):
        import typing_extensions

        @functools.wraps(typing_extensions.override)
        def override(method):
            return typing_extensions.override(method)
        return override

    patching.apply(PYTHON_311, make)


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
                      + " (megatron_lbp/integration/compat.py KNOWN_NOTICES)")
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
    from megatron_lbp.integration import cpu_runtime

    return cpu_runtime.active()


def enable() -> bool:
    """Apply every compatibility step this machine needs; returns True when the CPU runtime is on."""
    _install_python_shims()
    if not accelerator_present():
        from megatron_lbp.integration import cpu_runtime

        cpu_runtime.activate()
    return cpu_runtime_active()


def enable_training() -> None:
    """The megatron.training patches: parts 2, 3 and 5 here, and the CPU runtime's (idempotent)."""
    _skip_helper_build_if_prebuilt()
    memoize_argument_help()
    xavier_init_flag()
    if cpu_runtime_active():
        from megatron_lbp.integration import cpu_runtime

        cpu_runtime.activate_training()


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

    def make(orig):
        @functools.wraps(orig)
        def core_transformer_config_from_args(args, config_class=None):
            if getattr(args, "init_method_xavier_uniform", False):
                args = argparse.Namespace(**{
                    **vars(args), "init_method_xavier_uniform": False,
                    "init_method": torch.nn.init.xavier_uniform_,
                    "output_layer_init_method": torch.nn.init.xavier_uniform_})
            return orig(args, config_class)
        return core_transformer_config_from_args

    patching.apply(XAVIER, make)


def memoize_argument_help() -> None:
    """Part 2: each config class's field docstrings parsed from its source once per process."""
    memo: dict[type, dict[str, str]] = {}

    def make(orig):
        @functools.wraps(orig)
        def _get_field_docstrings(self, src_cfg_class):
            if src_cfg_class not in memo:
                memo[src_cfg_class] = orig(self, src_cfg_class)  # recurses through this memo
            return dict(memo[src_cfg_class])
        return _get_field_docstrings

    patching.apply(ARGUMENT_HELP, make)


def megatron_fsdp_on_gloo() -> None:
    """Part 4 of the module docstring: Megatron-FSDP's parameter all-gathers synchronous on gloo."""
    def make(orig):
        @functools.wraps(orig)
        def all_gather_params(self, *args, **kwargs):
            import torch.distributed as dist

            if dist.get_backend() == "gloo":
                kwargs["async_param_gather"] = False
            return orig(self, *args, **kwargs)
        return all_gather_params

    patching.apply(FSDP_ON_GLOO, make)



def _skip_helper_build_if_prebuilt() -> None:
    """Part 3 of the module docstring."""
    import importlib.util
    import os

    from megatron.core.datasets import utils as dataset_utils

    here = os.path.dirname(dataset_utils.__file__)
    prebuilt = importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None
    if prebuilt and not os.path.exists(os.path.join(here, "Makefile")):
        patching.apply(HELPER_BUILD, lambda _orig: lambda: None)
