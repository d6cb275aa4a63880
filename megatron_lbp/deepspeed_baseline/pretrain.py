"""``python -m megatron_lbp.deepspeed_baseline.pretrain --ds-scheme ds-zeropp <pretrain_gpt flags>``: the DeepSpeed baseline.

Takes what ``python -m megatron_lbp.pretrain_gpt`` takes without ``--hier-*``, resolved
and parsed as that entry does; builds the model with megatron.training's GPT builder (same
seed, same initial weights), reads the same data through that entry's dataset provider
and loss, trains under ``deepspeed.initialize`` with the named scheme and Megatron's LR
scheduler, and prints Megatron's iteration line so the same log readers work. With
``LBP_RESULT_FILE`` it writes the study's result file. Own flags: ``--ds-scheme``,
``--ds-ranks-per-node`` (hpZ's partition, qgZ's node), ``--ds-print-config``. Not served:
model parallelism, checkpoints, evaluation. Details: docs/deepspeed-baseline.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from megatron_lbp.deepspeed_baseline.schemes import SCHEMES, ds_config, features

PROG = "python -m megatron_lbp.deepspeed_baseline.pretrain"


def _own_args(argv: list[str]):
    parser = argparse.ArgumentParser(prog=PROG, add_help=False)
    parser.add_argument("--ds-scheme", choices=SCHEMES)
    parser.add_argument("--ds-ranks-per-node", type=int, default=None)
    parser.add_argument("--ds-print-config", action="store_true")
    return parser.parse_known_args(argv)


def _usage_error(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _check_megatron_args(args) -> None:
    for name, flag in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                       ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                       ("context_parallel_size", "--context-parallel-size")):
        if getattr(args, name, 1) != 1:
            _usage_error(f"{flag} must be 1: DeepSpeed ZeRO partitions over data parallelism only here")
    if args.train_iters is None:
        _usage_error("--train-iters is required (sample-based schedules are not served)")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = _own_args(argv)
    if own.ds_scheme is None:
        _usage_error(f"--ds-scheme is required: one of {', '.join(SCHEMES)}")
    if any(a.startswith("--hier-") for a in rest):
        _usage_error("--hier-* flags belong to python -m megatron_lbp.pretrain_gpt; the DeepSpeed "
                     "baseline partitions with DeepSpeed (--ds-scheme)")
    sys.argv = [sys.argv[0]] + rest

    from megatron_lbp.integration import capabilities, compat, pretrain_gpt, training_hooks

    pretrain_gpt._env_rank_from_slurm()
    try:
        training_hooks.resolve_flags()
    except capabilities.CapabilityError as err:
        _usage_error(str(err))
    compat.enable()
    compat.enable_training()
    # --tokenizer-type GPT2BPETokenizer from --vocab-file/--merge-file offline, as pretrain_gpt
    # builds it (megatron-core's own path asks transformers' AutoTokenizer for the hub's gpt2)
    from megatron_lbp.integration import megatron_adapter

    megatron_adapter.install_gpt2_bpe_from_files()

    from megatron.training.arguments import parse_and_validate_args

    try:
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    except AssertionError as err:
        _usage_error(str(err).strip().splitlines()[0] if str(err).strip()
                     else "Megatron's argument checks failed without a message")
    _check_megatron_args(args)
    node = own.ds_ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dp_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = ds_config(own.ds_scheme, micro_batch_size=args.micro_batch_size,
                           micro_batches=args.global_batch_size // (args.micro_batch_size * dp_size),
                           dp_size=dp_size, ranks_per_node=node, clip_grad=args.clip_grad,
                           bf16=bool(args.bf16))
    except ValueError as err:
        _usage_error(str(err))
    if args.fp16:
        _usage_error("--fp16 is not served by the DeepSpeed baseline (use --bf16 or fp32)")
    if own.ds_print_config:
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps({"scheme": own.ds_scheme, "deepspeed_config": config}, indent=1))
        return
    from megatron_lbp.integration import study_result as result

    try:
        train(args, own.ds_scheme, config, node)
    except BaseException as err:  # LBP_RESULT_FILE: a failed run leaves a failed result
        if not isinstance(err, SystemExit) or err.code not in (0, None):
            result.fail(_result_args(), err)
        raise


def _result_args():
    """Megatron's args once initialize_megatron has run, else None (a failure before it)."""
    try:
        from megatron.training import get_args

        return get_args()
    except Exception:
        return None


def _result_start(args, scheme: str, config: dict, local_rank: int | None) -> None:
    """Open the run's result file (megatron_lbp/integration/study_result.py: the same file as
    pretrain_gpt's, so the study's report puts DeepSpeed beside lbp)."""
    from megatron_lbp.integration import study_result as result

    zero = config["zero_optimization"]
    result.start(args, scheme=scheme,
                 group_sizes={"hpz_partition_size": zero.get("zero_hpz_partition_size", 0),
                              "qwz": bool(zero.get("zero_quantized_weights")),
                              "qgz": bool(zero.get("zero_quantized_gradients"))},
                 unmeasured="DeepSpeed", local_rank=local_rank)


def _deepspeed_local_rank() -> int:
    """This rank's index in its node; and LOCAL_RANK set for DeepSpeed where it is unset.

    DeepSpeed takes LOCAL_RANK as its device index and reads it throughout (its engine
    refuses to start without it). Under srun the launcher's task wrapper
    (scripts/launch/lbp_task.sh) leaves it unset on purpose (each task sees its one GCD as
    device 0; the topology reads Slurm's variables), so here it becomes the device Megatron
    selected (0 on CPU ranks); the index in the node (SLURM_LOCALID) is returned for the
    result file, which would otherwise read LOCAL_RANK."""
    import torch

    local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return local


def _config_container(args):
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args

    return pretrain_cfg_container_from_args(args, gpt_config_from_args(args))


def _model(cfg):
    from megatron.core.process_groups_config import ProcessGroupCollection

    builder = cfg.model.get_builder_cls()(cfg.model)
    (model,) = builder.build_distributed_models(
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(), ddp_config=cfg.ddp,
        wrap_with_ddp=False, data_parallel_random_init=cfg.rng.data_parallel_random_init)
    return model


def _param_groups(model, weight_decay: float) -> list[dict]:
    """Megatron's rule (no decay on biases and 1-D parameters) with its scheduler's multipliers."""
    from megatron_lbp.deepspeed_baseline.trainer import megatron_param_groups

    decay, no_decay = megatron_param_groups(model, weight_decay)
    return [dict(decay, wd_mult=1.0, lr_mult=1.0), dict(no_decay, wd_mult=0.0, lr_mult=1.0)]


def train(args, scheme: str, config: dict, node: int) -> None:
    import torch
    import torch.distributed as dist

    from megatron_lbp.deepspeed_baseline.trainer import import_deepspeed, tie_output_to_embedding
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import (build_train_valid_test_data_iterators,
                                            get_optimizer_param_scheduler)
    from megatron_lbp.integration import pretrain_gpt

    deepspeed = import_deepspeed(node)
    if features(scheme)["qwz"] or features(scheme)["qgz"]:
        from megatron_lbp.deepspeed_baseline import cpu_quantizer

        if cpu_quantizer.needed():
            cpu_quantizer.install()
    # Built before initialize_megatron, as megatron_lbp.pretrain_gpt builds it (the initial
    # weights depend on it: built afterwards they differ).
    cfg = _config_container(args)
    initialize_megatron()
    args = get_args()
    local_rank = _deepspeed_local_rank()   # after Megatron selected the device
    _result_start(args, scheme, config, local_rank)  # a failure from here on names its scheme
    # No set_jit_fusion_options: its warm-up draws random numbers, and with it here the
    # initial weights differ from megatron_lbp.pretrain_gpt's (measured: their sum 314.65
    # against 347.67 on the tiny GPT); the fusions it warms up are off on CPU anyway.
    model = _model(cfg)
    optimizer = torch.optim.AdamW(_param_groups(model, args.weight_decay), lr=args.lr,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    tie_output_to_embedding(deepspeed, model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           dist_init_required=False)
    scheduler = get_optimizer_param_scheduler(optimizer)
    args.iteration, args.consumed_train_samples = 0, 0
    setattr(pretrain_gpt.train_valid_test_datasets_provider, "is_distributed", True)
    train_iter, _, _ = build_train_valid_test_data_iterators(
        pretrain_gpt.train_valid_test_datasets_provider)
    rank0 = dist.get_rank() == 0
    if rank0:  # what this job runs (the launcher's dry run prints the same, from schemes.ds_config)
        print(f"[{scheme}] DeepSpeed config: {json.dumps(config, sort_keys=True)}", flush=True)
    micro_batches = get_num_microbatches()
    if micro_batches != config["gradient_accumulation_steps"]:
        raise RuntimeError(f"Megatron counts {micro_batches} micro-batches per step, the DeepSpeed "
                           f"config {config['gradient_accumulation_steps']}")
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    rerun = get_rerun_state_machine()
    engine.train()
    from megatron_lbp.integration import study_result as result

    _result_start(args, scheme, config, local_rank)  # the clock of the first iteration starts here
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        totals = torch.zeros(2, dtype=torch.float64)   # summed token losses, tokens
        # The loss function validates its result through Megatron's rerun state machine,
        # which accepts that only inside its forward-backward window (as train_step opens it).
        while rerun.should_run_forward_backward(train_iter):
            for _ in range(micro_batches):
                output, loss_fn = pretrain_gpt.forward_step(train_iter, engine)
                loss_sum, tokens, _ = loss_fn(output)
                # Megatron's default (not per-token) reduction: this micro-batch's mean token
                # loss, averaged over micro-batches (engine.backward's 1/K) and ranks.
                engine.backward(loss_sum / tokens.clamp(min=1))
                engine.step()
                totals += torch.stack([loss_sum.detach().double(), tokens.detach().double()])
        if not engine.was_step_applied():
            raise RuntimeError(f"iteration {iteration}: DeepSpeed did not apply the optimizer step")
        scheduler.step(increment=args.global_batch_size)
        dist.all_reduce(totals)
        grad_norm = float(engine.get_global_grad_norm())
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        result.on_iteration(iteration, {"lm loss": (totals[0] / totals[1]).item()}, None)
        if rank0 and iteration % args.log_interval == 0:
            lr = optimizer.param_groups[0]["lr"]
            print(f" [{scheme}] iteration {iteration:8d}/{args.train_iters:8d} | elapsed time per "
                  f"iteration (ms): {elapsed_ms:.1f} | learning rate: {lr:.6E} | global batch size: "
                  f"{args.global_batch_size:5d} | lm loss: {(totals[0] / totals[1]).item():.6E} | "
                  f"grad norm: {grad_norm:.3f} |", flush=True)
    result.finish(args)  # a collective, every rank; the last writes LBP_RESULT_FILE
    dist.barrier()
    if rank0:
        print(f"[{scheme}] training done: {args.train_iters} iterations", flush=True)


if __name__ == "__main__":
    main()
