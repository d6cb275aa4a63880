"""GPT pretraining on megatron.training's own ``pretrain()`` loop, with ``--hier-partition``.

    torchrun --nproc-per-node 8 -m megatron_lbp.pretrain_gpt <Megatron-LM pretrain_gpt.py flags> \
        --hier-partition [--hier-preset lbp ...]

Megatron-LM's ``pretrain_gpt.py`` arguments plus the ``--hier-*`` group, one process per
GPU/GCD (torchrun, or srun: ranks from ``SLURM_*``). The hooks are installed into the
imported megatron.training at start-up (``training_hooks.install``; with
``LBP_RUNTIME_HOOKS=0`` they must come from a tree patched by scripts/apply_patches.sh).
Plain GPT pretraining with data parallelism, hierarchical or stock; SFT, FIM and model
parallelism are Megatron-LM's own script's (patches/). Details: docs/training.md.
"""
from __future__ import annotations

import os
import sys
from functools import partial

import megatron_lbp  # noqa: F401  (Python 3.11 shim before megatron.training)
from megatron_lbp.integration import capabilities, compat, training_hooks

def _env_rank_from_slurm() -> None:
    """One process per Slurm task: torch.distributed's env:// needs RANK/WORLD_SIZE/LOCAL_RANK."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def get_batch(data_iterator):
    """tokens, labels, loss_mask, attention_mask, position_ids of one micro-batch (TP = 1)."""
    import torch

    batch = next(data_iterator)
    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    device = torch.cuda.current_device() if not compat.cpu_runtime_active() else "cpu"
    return [batch[k].to(device, non_blocking=True) if batch.get(k) is not None else None for k in keys]


def loss_func(loss_mask, output_tensor):
    """Sum of the masked token losses and their count, the form Megatron's schedules expect."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        machine = get_rerun_state_machine()
        machine.validate_result(result=loss, rejection_func=torch.isnan,
                                message="found NaN in local forward loss calculation",
                                tolerance=0.0, fatal=True)
        machine.validate_result(result=loss, rejection_func=torch.isinf,
                                message="found Inf in local forward loss calculation",
                                tolerance=0.0, fatal=True)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPTDataset (or its mock) over --data-path, built on every rank (TP = 1)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, lambda: True, config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


def _usage_error(message: str) -> None:
    # Every rank finds the same problem; one line from rank 0 says it.
    if os.environ.get("RANK", "0") == "0":
        print(f"python -m megatron_lbp.pretrain_gpt: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _bare_assert(err: BaseException) -> str:
    """A message-less assert named by its own source line: the check a user has to satisfy."""
    import linecache
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return f"Megatron's argument checks failed ({type(err).__name__})"
    last = frames[-1]
    line = (linecache.getline(last.filename, last.lineno) or last.line or "").strip()
    where = last.filename.split("site-packages/")[-1]
    return f"Megatron's argument check `{line}` failed ({where}:{last.lineno})"


def _refuse_unpatched_megatron() -> None:
    """LBP_RUNTIME_HOOKS=0 trusts the megatron on the path to carry the hooks; say so if it does not."""
    from megatron.training import arguments

    from megatron_lbp.core import patching

    if not patching.is_applied(training_hooks.HOOKS["parse_args"], where=vars(arguments)):
        tree = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(arguments.__file__))))
        _usage_error(f"LBP_RUNTIME_HOOKS=0 but the Megatron-LM tree {tree} is not patched: run "
                     f"scripts/apply_patches.sh {tree}, or unset LBP_RUNTIME_HOOKS")


def main(argv: list[str] | None = None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    _env_rank_from_slurm()
    # Before Megatron is imported: a flag that cannot work here costs one line, not a start-up.
    try:
        training_hooks.resolve_flags()
    except capabilities.CapabilityError as err:
        _usage_error(str(err))
    compat.enable()
    if os.environ.get("LBP_RUNTIME_HOOKS", "1") == "1":
        training_hooks.install()
    else:
        # A patched megatron/ (scripts/apply_patches.sh) carries the hooks itself.
        compat.enable_training()
        _refuse_unpatched_megatron()

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_lbp.integration.megatron_adapter import gpt_model_config

    setattr(train_valid_test_datasets_provider, "is_distributed", True)
    training_hooks._state["preflight"] = True
    try:
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    except (training_hooks.UsageError, AssertionError) as err:
        # Megatron's own argument checks are asserts; like ours, one line, not a traceback.
        _usage_error(str(err).strip().splitlines()[0] if str(err).strip() else _bare_assert(err))
    from megatron_lbp.integration import study_result as result

    try:
        full_config = pretrain_cfg_container_from_args(args, gpt_model_config(args))
        pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
                 forward_step)
    except BaseException as err:
        # LBP_RESULT_FILE: a run that dies in its setup leaves a failed result too (the train
        # loop records its own failures first; fail() keeps the first reason).
        if not (isinstance(err, SystemExit) and err.code in (0, None)):
            result.fail(args, err, training_hooks.hierarchy())
        raise


if __name__ == "__main__":
    main()
