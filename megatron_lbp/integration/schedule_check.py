"""Whether a resumed run's learning-rate schedule agrees with its checkpoint's.

megatron-core's scheduler, loading a checkpoint, asserts that every schedule
value of the command (learning rates, warm-up, decay and weight-decay lengths,
styles) equals the saved one unless ``--override-opt_param-scheduler`` (take
the command's) or ``--use-checkpoint-opt_param-scheduler`` (keep the
checkpoint's) is given. Continuing a finished run with a larger
``--train-iters`` changes the decay length, so it needs one of the two: this
names them, from the checkpoint's common state, before anything is built.
"""
from __future__ import annotations

from typing import Any

# The checkpoint's key, what Megatron's assertion calls it.
LABELS = {"max_lr": "learning rate", "min_lr": "minimum learning rate",
          "lr_warmup_steps": "warm-up samples", "lr_decay_steps": "decay samples",
          "lr_decay_style": "decay style", "start_wd": "start weight decay",
          "end_wd": "end weight decay", "wd_incr_steps": "weight-decay samples",
          "wd_incr_style": "weight-decay style"}


def command_schedule(args: Any) -> dict[str, Any] | None:
    """The values megatron.training's get_optimizer_param_scheduler would give the scheduler."""
    gbs = getattr(args, "global_batch_size", None)
    if getattr(args, "train_iters", None) and gbs:
        decay = (getattr(args, "lr_decay_iters", None) or args.train_iters) * gbs
        wd_steps = args.train_iters * gbs
        warmup = getattr(args, "lr_warmup_iters", 0) * gbs
    elif getattr(args, "train_samples", None):
        decay = getattr(args, "lr_decay_samples", None) or args.train_samples
        wd_steps = args.train_samples
        warmup = getattr(args, "lr_warmup_samples", 0)
    else:
        return None
    if getattr(args, "lr_warmup_fraction", None) is not None:
        warmup = args.lr_warmup_fraction * decay
    return {"max_lr": args.lr, "min_lr": args.min_lr, "lr_warmup_steps": warmup,
            "lr_decay_steps": decay, "lr_decay_style": args.lr_decay_style,
            "start_wd": args.start_weight_decay, "end_wd": args.end_weight_decay,
            "wd_incr_steps": wd_steps, "wd_incr_style": args.weight_decay_incr_style}


def conflicts(args: Any, saved: dict | None) -> list[str]:
    """'name: checkpoint vs now' for each value Megatron's scheduler would assert on; [] if it would not."""
    if not saved or getattr(args, "override_opt_param_scheduler", False) \
            or getattr(args, "use_checkpoint_opt_param_scheduler", False) \
            or getattr(args, "finetune", False) or getattr(args, "no_load_optim", False):
        return []
    now = command_schedule(args)
    if now is None:
        return []
    saved = dict(saved)
    saved.setdefault("max_lr", saved.get("start_lr"))
    out = []
    for key, label in LABELS.items():
        if key in saved and saved[key] is not None and now[key] is not None and saved[key] != now[key]:
            out.append(f"{label} {saved[key]} (checkpoint) vs {now[key]} (now)")
    return out


def message(load: str, diffs: list[str]) -> str:
    return (f"--load {load}: this command's learning-rate schedule differs from the checkpoint's "
            f"({'; '.join(diffs)}): add --override-opt_param-scheduler to continue on this "
            "command's schedule, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")
