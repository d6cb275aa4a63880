"""The DeepSpeed schemes the project compares lbp with, as DeepSpeed config dicts.

``ds-zero3`` (ZeRO stage 3), ``ds-hpz`` (ZeRO-3 with a node-sized secondary partition
the backward regathers from) and ``ds-zeropp`` (ZeRO++ as its paper configures it: hpZ +
qwZ int8 weight gathers + qgZ int4 gradient all-to-all). Every scheme sets
``stage3_param_persistence_threshold``, ``stage3_prefetch_bucket_size`` and
``stage3_max_reuse_distance`` to 0: DeepSpeed's defaults are sized for billion-parameter
models and would keep a small test model whole and never regathered, so with these a
small model sends what a large one sends per element.
"""
from __future__ import annotations

SCHEMES = ("ds-zero3", "ds-hpz", "ds-zeropp")

# What each scheme switches on beyond plain ZeRO-3.
_FEATURES = {
    "ds-zero3": dict(hpz=False, qwz=False, qgz=False),
    "ds-hpz": dict(hpz=True, qwz=False, qgz=False),
    "ds-zeropp": dict(hpz=True, qwz=True, qgz=True),
}

# Elements per gradient-reduce bucket when the caller gives none (DeepSpeed's default).
DEFAULT_REDUCE_BUCKET = 500_000_000


def features(scheme: str) -> dict[str, bool]:
    """{"hpz", "qwz", "qgz"} -> on/off for ``scheme``; a clear error for an unknown name."""
    if scheme not in _FEATURES:
        raise ValueError(f"unknown DeepSpeed scheme {scheme!r}: must be one of {', '.join(SCHEMES)}")
    return dict(_FEATURES[scheme])


def ds_config(scheme: str, *, micro_batch_size: int, micro_batches: int, dp_size: int,
              ranks_per_node: int, clip_grad: float, bf16: bool = False,
              reduce_bucket_size: int | None = None) -> dict:
    """The DeepSpeed config of ``scheme`` for this job shape (fp32 unless ``bf16``).

    ``ranks_per_node`` sizes hpZ's secondary partition (the ZeRO++ paper's choice:
    one node) and must divide ``dp_size``.
    """
    want = features(scheme)
    for name, value in (("micro_batch_size", micro_batch_size), ("micro_batches", micro_batches),
                        ("dp_size", dp_size), ("ranks_per_node", ranks_per_node)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dp_size % ranks_per_node:
        raise ValueError(f"ranks_per_node {ranks_per_node} does not divide the data-parallel "
                         f"size {dp_size}")
    if want["hpz"] and ranks_per_node == dp_size:
        raise ValueError(f"{scheme} needs more than one node: hpZ's node-sized secondary "
                         f"partition ({ranks_per_node} ranks) would be the whole job")
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0,
        "reduce_bucket_size": reduce_bucket_size or DEFAULT_REDUCE_BUCKET,
    }
    if want["hpz"]:
        zero["zero_hpz_partition_size"] = ranks_per_node
    if want["qwz"]:
        zero["zero_quantized_weights"] = True
    if want["qgz"]:
        zero["zero_quantized_gradients"] = True
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro_batch_size * micro_batches * dp_size,
        "gradient_clipping": clip_grad,
        "zero_optimization": zero,
        # The client optimizer (torch.optim.AdamW) is ours: no DeepSpeed CPU-Adam build.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_lbp.deepspeed_baseline.schemes --scheme S --micro-batch-size B --global-batch-size
    G --world-size W --ranks-per-node N [--clip-grad C] [--bf16]``: the config JSON the runner
    (megatron_lbp.deepspeed_baseline.pretrain) builds for that job shape, by the same function, without
    importing Megatron or DeepSpeed (the launcher's dry run prints it)."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m megatron_lbp.deepspeed_baseline.schemes")
    p.add_argument("--scheme", required=True, choices=SCHEMES)
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args(argv)
    per_step = a.micro_batch_size * a.world_size
    try:
        if a.global_batch_size % per_step:
            raise ValueError(f"global batch {a.global_batch_size} is not a multiple of micro-batch "
                             f"size x ranks = {per_step}")
        config = ds_config(a.scheme, micro_batch_size=a.micro_batch_size,
                           micro_batches=a.global_batch_size // per_step, dp_size=a.world_size,
                           ranks_per_node=a.ranks_per_node, clip_grad=a.clip_grad, bf16=a.bf16)
    except ValueError as err:
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"scheme": a.scheme, "deepspeed_config": config}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
