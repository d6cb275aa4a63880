"""Megatron's side of the Hugging Face round trips: the model the import's flags describe, its logits.

Runs inside a rank (megatron_lbp.testing.multirank) with torch.distributed up.
The model is built the way megatron.training builds it: the flags parsed and
validated by megatron.training itself (with the flags this environment needs
from megatron_lbp.capabilities), GPTModelConfig from them, the default layer
spec; the checkpoint is loaded by megatron-core's dist_checkpointing.
"""
from __future__ import annotations

import os
import sys

import torch


def parse_flags(flags: list[str], seq_length: int):
    """megatron.training's parsed and validated args for ``flags`` (plus a micro-batch) on this rank."""
    from megatron_lbp.integration import capabilities, compat

    compat.enable()
    compat.enable_training()
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args

    argv, _ = capabilities.resolve_training_argv(
        list(flags) + ["--micro-batch-size", "1", "--seq-length", str(seq_length)])
    saved = sys.argv
    sys.argv = ["hf_models"] + argv
    try:
        args = parse_args()
    finally:
        sys.argv = saved
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_args(args)
    set_args(args)
    return args


def build_from_flags(flags: list[str], seq_length: int, vocab_size: int):
    """(GPTModel, args): the model the flags describe, with megatron-core's padded vocabulary."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_lbp.integration.megatron_adapter import gpt_model_config

    from megatron_lbp.testing.tiny_gpt import init_megatron_state

    args = parse_flags(flags, seq_length)
    init_megatron_state(seed=args.seed)
    args.padded_vocab_size = _padded(vocab_size, args.make_vocab_size_divisible_by)
    cfg = gpt_model_config(args)
    cfg.finalize()
    model = GPTModelBuilder(cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
    return model, args


def _padded(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple


def load_into(model, ckpt_dir: str) -> None:
    """megatron-core's own load of the model's sharded state dict from a torch_dist directory."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    # the checkpoint's common state (args, iteration, scheduler, ...) comes back merged in
    keys = set(model.state_dict())
    model.load_state_dict({k: v for k, v in state.items() if k in keys}, strict=True)


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq, vocab] logits of ``tokens`` with causal attention (no labels: no loss)."""
    model.eval()
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    with torch.no_grad():
        out = model(tokens, pos, mask)
    return out.float()


def checkpoint_logits(flags: list[str], ckpt_dir: str, tokens: torch.Tensor, vocab_size: int):
    """Build from ``flags``, load ``ckpt_dir`` (a torch_dist iteration directory), return the logits."""
    model, _ = build_from_flags(flags, tokens.shape[1], vocab_size)
    load_into(model, ckpt_dir)
    return logits(model, tokens)


def checkpoint_logits_many(jobs: list[tuple[list[str], str]], tokens: torch.Tensor, vocab_size: int):
    """checkpoint_logits for several (flags, checkpoint) pairs in one rank (one start-up for all)."""
    return [checkpoint_logits(flags, ckpt, tokens, vocab_size) for flags, ckpt in jobs]
