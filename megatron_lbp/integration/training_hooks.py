"""Where megatron.training hands over to megatron-lbp when ``--hier-partition`` is set.

The hand-over points, one function each: ``resolve_flags`` (the flags this environment
needs, added to sys.argv before Megatron's parser), ``add_arguments`` (the ``--hier-*``
group), ``validate_args`` (refusals and the hierarchy, before any rank allocates a
model), ``sharded_builder`` and ``wrap_model`` (the model built sharded, then
HierDataParallel where Megatron builds its DDP), ``build_optimizer``
(HierDistributedOptimizer) and ``after_training_log`` (bytes sent and held per interval).
``install()`` points an imported megatron.training at them; ``patches/`` inserts the same
calls into a Megatron-LM tree. Without ``--hier-partition`` every hook hands back to
Megatron's own path, except the added flags, the atomic checkpoint tracker and the
offline GPT-2 BPE tokenizer, which hold for every run.
"""
from __future__ import annotations

import functools
import os
from typing import Any

from megatron_lbp.integration import compat
from megatron_lbp.core import costs, patching

_state: dict[str, Any] = {"hier": None, "optimizers": [], "preflight": False}


class UsageError(ValueError):
    """A training flag or input that cannot work; the message is one line naming it."""


def enabled(args: Any) -> bool:
    return bool(getattr(args, "hier_partition", False))


def hierarchy() -> Any:
    """The engine's hierarchy once the model is wrapped (None before, and without the engine)."""
    return _state["hier"]


# 0 -------------------------------------------------------------------------------------
def resolve_flags() -> None:
    """What both training entries do before Megatron parses: sys.argv resolved in place.

    The flags this environment needs are added (megatron_lbp.capabilities, one
    line each from rank 0), flags the engine cannot serve and a given
    ``--tokenizer-type`` that cannot be built offline are refused, and on
    NCCL the fault environment is set before any process group exists. Raises
    CapabilityError (one line). Resolving a resolved argv adds nothing, so the
    entry and the parse_args hook may both call it.
    """
    import sys

    from megatron_lbp.integration import capabilities

    capabilities.refuse_unservable(sys.argv[1:])  # the argv alone: no torch import to refuse
    from megatron_lbp.integration import tokenizer_check

    try:  # likewise: local files and packages decide whether the tokenizer can be built offline
        tokenizer_check.check_argv(sys.argv[1:])
    except tokenizer_check.TokenizerInputError as err:
        raise capabilities.CapabilityError(str(err)) from None
    from megatron_lbp.engine import faults

    device = "gpu" if compat.accelerator_present() else "cpu"
    capabilities.check_device_matches(device)
    argv, reasons = capabilities.resolve_training_argv(sys.argv[1:], device=device)
    sys.argv[1:] = argv
    reasons += faults.prepare_backend_environment(argv, os.environ)
    if _is_rank0():
        for line in reasons:
            print(line, flush=True)


def _is_rank0() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _exit_one_line(prog: str, message: str) -> None:
    """Every rank finds the same problem; rank 0 says it in one line, every rank exits 2."""
    import sys

    if _is_rank0():
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# 1 -------------------------------------------------------------------------------------
def add_arguments(parser):
    from megatron_lbp.core.config import add_hier_arguments

    if any(a.dest == "hier_partition" for a in parser._actions):
        return parser  # both the patch and install() may ask; register once
    parser.error = functools.partial(_one_line_parser_error, parser)
    return add_hier_arguments(parser)


def _one_line_parser_error(parser, message: str) -> None:
    """argparse's error without the usage block (Megatron's runs to hundreds of lines), once per job."""
    _exit_one_line(parser.prog, message)


# 2 -------------------------------------------------------------------------------------
def validate_args(args: Any) -> None:
    """One-line errors (UsageError) for flags or inputs that cannot work, before any model exists."""
    from megatron_lbp.integration import preflight

    try:
        if _state["preflight"] or enabled(args):
            preflight.check(args)
        if enabled(args):
            _validate_hier_args(args)
    except UsageError:
        raise
    except ValueError as err:  # HierConfigError, TopologyError, PreflightError, refusals
        raise UsageError(str(err)) from None


def _validate_hier_args(args: Any) -> None:
    from megatron_lbp.integration import megatron_adapter
    from megatron_lbp.core.config import engine_options_from_args, hier_config_from_args
    from megatron_lbp.core.topology import dp_domain_sizes, launcher_info_from_env, resolve_gpus_per_node

    from megatron_lbp.engine import faults

    megatron_adapter.check_megatron_args(args)
    faults.check_timing(getattr(args, "distributed_backend", "nccl"),
                        args.hier_collective_timeout_s, args.hier_fault_checkin_s)
    if getattr(args, "use_distributed_optimizer", False):
        raise ValueError("--hier-partition replaces --use-distributed-optimizer (its optimizer "
                         "state is sharded by --hier-optim-group-size): drop one of them")
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        raise ValueError("--hier-partition does not support virtual pipeline stages "
                         "(--num-layers-per-virtual-pipeline-stage)")
    info = launcher_info_from_env(os.environ)
    gpus_per_node = resolve_gpus_per_node(info, args.hier_gpus_per_node)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    cp = getattr(args, "context_parallel_size", 1) or 1
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    dp = args.world_size // (tp * cp * pp)
    gpp = args.hier_gcds_per_package or (2 if gpus_per_node % 2 == 0 else 1)
    per_node, per_package = dp_domain_sizes(gpus_per_node, gpp, tp, cp)
    cfg = hier_config_from_args(args, world_size=dp, gpus_per_node=per_node, gcds_per_package=per_package)
    engine_options_from_args(args)
    if len(set(info.tasks_per_node or (info.local_world_size,))) == 1:
        # Block placement (torchrun, Slurm's default) is known now: refuse groups that straddle
        # nodes or packages with one line, before any process group; build_hier_groups repeats
        # the check on the placement the ranks report.
        from megatron_lbp.core.topology import check_colocation, emulated_locations, hierarchy_groups

        check_colocation(hierarchy_groups(range(dp), cfg), emulated_locations(dp, per_node, per_package),
                         allow=bool(getattr(args, "hier_allow_non_colocated", False)))


# 3 -------------------------------------------------------------------------------------
def sharded_builder(build, args: Any):
    """``build`` (a model provider: get_model's ``model_provider_func``, the config-container
    builder's ``build_model_func``) returning models that hold no weights until wrapped."""
    from megatron_lbp.integration import megatron_adapter

    @functools.wraps(build)
    def build_sharded(*a, **k):
        return megatron_adapter.build_sharded(lambda: build(*a, **k), args)

    return build_sharded


def _sharded_init(args: Any) -> bool:
    from megatron_lbp.core.config import engine_options_from_args

    return enabled(args) and engine_options_from_args(args).sharded_init


def wrap_model(model: list, args: Any) -> list:
    """HierDataParallel around each model chunk (one chunk: no virtual pipeline stages)."""
    from megatron_lbp.integration import megatron_adapter
    from megatron_lbp.core.config import engine_options_from_args
    from megatron_lbp.engine.process_groups import build_hier_groups
    from megatron.core.utils import get_model_config

    if len(model) != 1:
        raise ValueError(f"--hier-partition wraps one model chunk, got {len(model)}")
    hier = build_hier_groups(args, dp_group=megatron_adapter.data_parallel_group())
    _state["hier"] = hier
    from megatron_lbp.engine import faults

    faults.install_excepthook()  # a lost peer seen in Megatron's own collectives is named too
    if hier.location.rank == 0 or os.environ.get("LBP_LOG_ALL_RANKS"):
        print(hier.describe(), flush=True)
    for line in hier.warnings:
        print(f"[megatron-lbp] warning: {line}", flush=True)
    from megatron_lbp.engine import materialize

    options = engine_options_from_args(args)
    constructions = [c for c in map(materialize.construction_of, model) if c is not None]
    sharded = bool(constructions)
    if hier.location.rank == 0:
        # constructors that touched a weight after attaching its module (engine/materialize.py)
        for late in (lp for c in constructions for lp in c.late):
            print(f"[megatron-lbp] sharded initialization: {late.describe()}", flush=True)
    wrapped = [megatron_adapter.wrap_model(get_model_config(m), m, hier, options) for m in model]
    if sharded and hier.location.rank == 0:
        held = sum(m.memory_bytes()["primary"] for m in wrapped)
        print(f"[megatron-lbp] sharded initialization: the model was built one module at a time; "
              f"this rank keeps {_gb(held)} of primary weight slices", flush=True)
    if getattr(args, "data_parallel_random_init", False):
        for m in wrapped:
            m.broadcast_params()
    return wrapped


# 4 -------------------------------------------------------------------------------------
def build_optimizer(config: Any, model_chunks: list, args: Any):
    from megatron_lbp.integration import megatron_adapter
    from megatron_lbp.core.config import engine_options_from_args

    optimizer = megatron_adapter.build_optimizer(config, model_chunks, engine_options_from_args(args))
    # Megatron checks each rank's gradient in its DDP buckets; the engine checks the same
    # at the step, agreed on every rank: stop on inf/nan instead of skipping.
    optimizer.check_for_nan_in_grad = bool(getattr(args, "check_for_nan_in_loss_and_grad", False))
    _state["optimizers"].append(optimizer)
    return optimizer


# 5 -------------------------------------------------------------------------------------
def interval_line(iteration: int) -> str | None:
    """The per-interval log line from the last optimizer step's report, or None."""
    if not _state["optimizers"]:
        return None
    report = _state["optimizers"][-1].last_step_report
    if not report:
        return None
    t, m = report["traffic_bytes"], report["memory_bytes"]
    return (f" [megatron-lbp] iteration {iteration:8d} | bytes sent/step package {_gb(t['package'])} "
            f"node {_gb(t['node'])} network {_gb(t['network'])} | held primary {_gb(m['primary'])} "
            f"secondary {_gb(m['secondary'])} grad {_gb(m['grad'])} optimizer "
            f"{_gb(m['optimizer'])} peak transient {_gb(m['peak_transient'])} |")


def after_training_log(iteration: int, args: Any, loss_dict: dict | None = None) -> None:
    from megatron_lbp.engine import faults

    faults.TRACKER.iteration = iteration + 1  # fault messages count as Megatron does
    _record_losses(iteration, loss_dict)
    from megatron_lbp.integration import study_result as result

    report = _state["optimizers"][-1].last_step_report if _state["optimizers"] else None
    result.on_iteration(iteration, loss_dict, report)  # LBP_RESULT_FILE: the run's result file
    if not enabled(args) or iteration % max(args.log_interval, 1):
        return
    import torch.distributed as dist

    line = interval_line(iteration)
    from megatron_lbp.integration import tensorboard_scalars

    line = line and line + tensorboard_scalars.write(
        iteration, args, report, _state["optimizers"][-1] if _state["optimizers"] else None)
    # Megatron prints its iteration line on the last rank; this one follows it there.
    if line and dist.get_rank() == dist.get_world_size() - 1:
        print(line, flush=True)


def _record_losses(iteration: int, loss_dict: dict | None) -> None:
    """LBP_LOSS_LOG=PATH: every iteration's losses at full precision, one line each.

    Megatron prints losses rounded to 6 digits and, after a resume, can average
    the first logged value over iterations; bit-exact comparisons (resume,
    determinism) need the value each step computed, whatever --log-interval is.
    """
    path = os.environ.get("LBP_LOSS_LOG")
    if not path or not loss_dict:
        return
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != dist.get_world_size() - 1:
        return
    with open(path, "a") as f:
        for key, value in sorted(loss_dict.items()):
            value = value[0] / value[1] if getattr(value, "numel", lambda: 1)() == 2 else value
            f.write(f"{iteration}\t{key}\t{float(value)!r}\n")


_gb = functools.partial(costs.gb_text, digits=4, mb_below=1e7, mb_digits=3)


# --- installation: the same wrappers, applied at run time or by patches/ ---------------
# Each replaced name of megatron.training is a patch in megatron_lbp.core.patching's registry.
def _hook(target: str, why: str, when: str = "every run (each hook hands back without --hier-partition)"):
    module, _, name = target.partition(":")
    return patching.declare(__name__, f"{module.rsplit('.', 1)[-1]}.{name}", target, when, why)


HOOKS = {
    "add_megatron_arguments": _hook("megatron.training.arguments:add_megatron_arguments",
                                    "the --hier-* flags next to Megatron's own"),
    "parse_args": _hook("megatron.training.arguments:parse_args",
                        "the capability-resolved flags go into sys.argv before Megatron parses"),
    "validate_args": _hook("megatron.training.arguments:validate_args",
                           "our one-line checks after Megatron's own"),
    "build_virtual_pipeline_stages": _hook(
        "megatron.training.models.dist_utils:build_virtual_pipeline_stages",
        "the config-container builder's model built sharded (--hier-sharded-init)"),
    "_ddp_wrap": _hook("megatron.training.models.dist_utils:_ddp_wrap",
                       "HierDataParallel where the config-container builder wraps DDP"),
    "get_model": _hook("megatron.training.training:get_model",
                       "get_model's model built sharded (--hier-sharded-init)"),
    "wrap_model_chunks_with_ddp": _hook("megatron.training.training:wrap_model_chunks_with_ddp",
                                        "HierDataParallel where get_model wraps DDP"),
    "get_megatron_optimizer": _hook("megatron.training.training:get_megatron_optimizer",
                                    "HierDistributedOptimizer where Megatron builds its optimizer"),
    "training_log": _hook("megatron.training.training:training_log",
                          "the per-interval bytes line, the loss log and the result file"),
    "save_checkpoint": _hook("megatron.training.training:save_checkpoint",
                             "a resubmitted finished job does not rewrite the checkpoint it loaded"),
    "calc_params_l2_norm": _hook("megatron.training.training:calc_params_l2_norm",
                                 "--log-params-norm from the optimizer's master slices: a rank "
                                 "holds no whole weight between steps"),
    "train": _hook("megatron.training.training:train",
                   "the result file's start and end; the last step's gathers settled"),
    "maybe_msc": _hook("megatron.training.checkpointing:maybe_msc",
                       "the tracker file written atomically (a kill cannot leave it empty)"),
}


def _current_args():
    from megatron.training import get_args

    return get_args()


def hook_arguments_module(ns: dict) -> None:
    """megatron/training/arguments.py: our flags next to Megatron's; our checks after its own."""
    from megatron_lbp.integration import megatron_adapter

    # Every way of starting training imports arguments.py: GPT-2 BPE from its two files from here on.
    megatron_adapter.install_gpt2_bpe_from_files()
    patching.apply(HOOKS["add_megatron_arguments"],
                   lambda orig: functools.wraps(orig)(lambda parser: add_arguments(orig(parser))),
                   where=ns)

    def parse_args_hook(orig_parse):
        @functools.wraps(orig_parse)
        def parse_args(*a, **k):
            # Megatron's parser reads sys.argv: the capability-resolved flags go in first
            # (how a patched Megatron-LM tree's own pretrain_gpt.py gets them).
            import sys

            from megatron_lbp.integration.capabilities import CapabilityError

            try:
                resolve_flags()
            except CapabilityError as err:
                _exit_one_line(os.path.basename(sys.argv[0]), str(err))
            return orig_parse(*a, **k)
        return parse_args

    def validate_hook(orig_validate):
        @functools.wraps(orig_validate)
        def validate(args, defaults={}):
            # After Megatron's own checks: they derive values (query groups, data sizes) ours read.
            out = orig_validate(args, defaults)
            validate_args(args)
            start_clock_at_launch()
            return out
        return validate

    patching.apply(HOOKS["parse_args"], parse_args_hook, where=ns)
    patching.apply(HOOKS["validate_args"], validate_hook, where=ns)


def start_clock_at_launch() -> None:
    """LBP_LAUNCH_TIME (a Unix time the launchers set at srun): Megatron's clock starts there.

    ``--exit-duration-in-mins`` counts from Megatron's program start, which comes after
    the imports: minutes late at scale, or on a busy machine. The launchers compute the
    exit time from the job's remaining wall time at srun, so Megatron counts from then
    (pretrain() takes the earliest rank's value). Without the variable nothing changes.
    """
    import time

    try:
        launched = float(os.environ.get("LBP_LAUNCH_TIME", ""))
    except ValueError:
        return
    if 0 < launched <= time.time():
        from megatron.training import training

        training.set_startup_timestamps(program_start=launched)


def _building_sharded(orig):
    """``orig(build, ...)`` (get_model, build_virtual_pipeline_stages) with its model provider
    ``build`` made sharded when --hier-partition and --hier-sharded-init are on."""
    @functools.wraps(orig)
    def call(build, *a, **k):
        args = _current_args()
        if _sharded_init(args):
            build = sharded_builder(build, args)
        return orig(build, *a, **k)

    return call


def _ddp_wrap_hook(orig):
    """Megatron's DDP wrapping (dist_utils._ddp_wrap, training.wrap_model_chunks_with_ddp):
    the engine's wrapper under --hier-partition, Megatron's own otherwise."""
    @functools.wraps(orig)
    def ddp_wrap(model, *a, **k):
        args = _current_args()
        return wrap_model(model, args) if enabled(args) else orig(model, *a, **k)
    return ddp_wrap


def hook_dist_utils_module(ns: dict) -> None:
    """megatron/training/models/dist_utils.py: the config-container builder's model
    construction (``build_virtual_pipeline_stages``) and DDP wrapping."""
    patching.apply(HOOKS["build_virtual_pipeline_stages"], _building_sharded, where=ns)
    patching.apply(HOOKS["_ddp_wrap"], _ddp_wrap_hook, where=ns)


def hook_training_module(ns: dict) -> None:
    """megatron/training/training.py: get_model's model construction and DDP wrapping, the
    optimizer, the log line, the parameter norm, the end-of-training save and train itself."""
    def optimizer_hook(orig_opt):
        @functools.wraps(orig_opt)
        def get_optimizer(config, model_chunks, *a, **k):
            args = _current_args()
            if enabled(args):
                return build_optimizer(config, model_chunks, args)
            return orig_opt(config, model_chunks, *a, **k)
        return get_optimizer

    def log_hook(orig_log):
        @functools.wraps(orig_log)
        def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *a, **k):
            out = orig_log(loss_dict, total_loss_dict, learning_rate, iteration, *a, **k)
            after_training_log(iteration, _current_args(), loss_dict)
            return out
        return training_log

    def save_hook(orig_save):
        @functools.wraps(orig_save)
        def save_checkpoint(iteration, *a, **k):
            from megatron_lbp.integration import checkpoint_guard

            if not k.get("non_persistent_ckpt") and checkpoint_guard.resaves_loaded_checkpoint(
                    iteration, _current_args()):
                return None
            return orig_save(iteration, *a, **k)
        return save_checkpoint

    def params_norm_hook(orig_norm):
        @functools.wraps(orig_norm)
        def calc_params_l2_norm(model, *a, **k):
            if enabled(_current_args()):
                return _state["optimizers"][-1].params_norm()
            return orig_norm(model, *a, **k)
        return calc_params_l2_norm

    patching.apply(HOOKS["get_model"], _building_sharded, where=ns)
    patching.apply(HOOKS["calc_params_l2_norm"], params_norm_hook, where=ns)
    patching.apply(HOOKS["train"], _train_hook, where=ns)
    patching.apply(HOOKS["wrap_model_chunks_with_ddp"], _ddp_wrap_hook, where=ns)
    patching.apply(HOOKS["get_megatron_optimizer"], optimizer_hook, where=ns)
    patching.apply(HOOKS["training_log"], log_hook, where=ns)
    patching.apply(HOOKS["save_checkpoint"], save_hook, where=ns)
    # training.py saves through checkpointing.py; hooking it from here also covers patched trees.
    from megatron.training import checkpointing

    hook_checkpointing_module(vars(checkpointing))


def _train_hook(orig_train):
    @functools.wraps(orig_train)
    def train(forward_step_func, model, *a, **k):
        from megatron_lbp.integration import study_result as result

        args = _current_args()
        result.start(args)
        try:
            out = orig_train(forward_step_func, model, *a, **k)
            if enabled(args):
                # The last step's weight gathers run under a next forward that never comes:
                # wait for them before evaluation, the final save or the exit.
                for chunk in model:
                    if hasattr(chunk, "settle"):
                        chunk.settle()
        except SystemExit as err:
            # --exit-interval / --exit-duration-in-mins stop every rank with sys.exit(0) here.
            if err.code in (0, None):
                result.finish(args, _state["hier"])
            else:
                result.fail(args, err, _state["hier"])
            raise
        except BaseException as err:
            result.fail(args, err, _state["hier"])
            raise
        result.finish(args, _state["hier"])
        return out

    return train


def hook_checkpointing_module(ns: dict) -> None:
    """megatron/training/checkpointing.py: an atomic tracker write (every run, not only --hier-partition)."""
    from megatron_lbp.integration import checkpoint_guard

    patching.apply(HOOKS["maybe_msc"], checkpoint_guard.AtomicTrackerStorage, where=ns)
    if os.environ.get("LBP_TEST_STALL_SAVE"):
        from megatron_lbp.integration import save_stall  # test-only seam: loaded only when asked for

        save_stall.install()


def install() -> None:
    """Apply the hooks to an imported, unpatched megatron.training (a patched one has them)."""
    compat.enable()
    compat.enable_training()
    from megatron.training import arguments, training
    from megatron.training.models import dist_utils

    hook_arguments_module(vars(arguments))
    hook_dist_utils_module(vars(dist_utils))
    hook_training_module(vars(training))
