"""The launcher's edge into the planner: the job its resolved environment describes, typed once
(the estimate's command line is the other edge, estimate.py). Each value obeys the rules the
estimate's flags obey (job_values.py); a refusal names the environment variable."""
from __future__ import annotations

from typing import Callable, Mapping

from megatron_lbp.launch import model_flags
from megatron_lbp.launch.job import Job
from megatron_lbp.launch.job_values import (EMBEDDING_GATHERS, FILES_AS_ENV, GRAD_REDUCE_DTYPES,
                                            LAYER_UNIT_SETTINGS, PARAMS_DTYPES, RECOMPUTES,
                                            auto_or_int, checked, integer, number, one_of)
from megatron_lbp.launch.rules import estimate_as, is_ds, log

# The engine's defaults: what a scheme without the engine's knobs (DeepSpeed's, stock
# Megatron's distributed optimizer) is costed at.
ENGINE_KNOBS = ("1", "2", "gather", "whole")


def job_from_env(v: Mapping[str, str], words: list[str],
                 say: Callable[[str], None] = log) -> Job:
    """The job of ``v`` (rules.settings' values with NNODES_RESOLVED) and the model flags of
    the training command's ``words`` (START_FROM's, EXTRA_ARGS, the command line's extras;
    ``say`` takes a warning). EstimateError (exit 2) names the variable."""
    preset, secondary, secondary_dtype = estimate_as(v)
    knobs = (v["HIER_PREFETCH_UNITS"], v["HIER_MAX_PENDING_REDUCES"],
             v["HIER_EMBEDDING_BACKWARD_GATHER"], v["HIER_LAYER_UNIT"])
    if is_ds(v) or v["HIER_PRESET"] == "distopt":
        knobs = ENGINE_KNOBS
    choose = v["LBP_CHOOSE"] == "1"   # by projected step time (launch/choose.py)
    if choose and v.get("LBP_CHOOSE_SCHEME") == "1":   # the profile left the scheme open
        preset = "auto"
    shape = {"--num-layers": "NUM_LAYERS", "--hidden-size": "HIDDEN_SIZE",
             "--num-attention-heads": "NUM_ATTENTION_HEADS", "--ffn-hidden-size": "FFN_HIDDEN_SIZE",
             "--max-position-embeddings": "SEQ_LENGTH"}
    model = model_flags.read({f: (name, v[name]) for f, name in shape.items()}, words, say)
    grad_reduce = v["HIER_GRAD_REDUCE_DTYPE"]
    job = Job(
        nodes=integer("NNODES", v["NNODES_RESOLVED"]),
        tasks_per_node=integer("TASKS_PER_NODE", v["TASKS_PER_NODE"]),
        gcds_per_package=integer("GCDS_PER_PACKAGE", v["GCDS_PER_PACKAGE"]),
        gcd_memory_gb=number("GCD_MEMORY_GB", v["GCD_MEMORY_GB"]),
        reserve_gb=number("LBP_MEMORY_RESERVE_GB", v["LBP_MEMORY_RESERVE_GB"]),
        **model,
        seq_length=integer("SEQ_LENGTH", v["SEQ_LENGTH"]),
        vocab_size=integer("VOCAB_SIZE_PADDED", v["VOCAB_SIZE_PADDED"]),
        params_dtype=one_of("PRECISION", v["PRECISION"], PARAMS_DTYPES),
        preset=preset,
        hier_secondary_group_size=integer("HIER_SECONDARY_GROUP_SIZE", secondary),
        hier_secondary_dtype=secondary_dtype or None,
        hier_grad_reduce_dtype=(one_of("HIER_GRAD_REDUCE_DTYPE", grad_reduce, GRAD_REDUCE_DTYPES)
                                if grad_reduce else None),
        global_batch_size=integer("GLOBAL_BATCH_SIZE", v["GLOBAL_BATCH_SIZE"]),
        micro_batch_size=auto_or_int("MICRO_BATCH_SIZE", v["MICRO_BATCH_SIZE"]),
        recompute=one_of("RECOMPUTE", v["RECOMPUTE"], RECOMPUTES),
        hier_prefetch_units=auto_or_int("HIER_PREFETCH_UNITS", knobs[0], 0),
        hier_max_pending_reduces=auto_or_int("HIER_MAX_PENDING_REDUCES", knobs[1]),
        hier_embedding_backward_gather=one_of("HIER_EMBEDDING_BACKWARD_GATHER", knobs[2],
                                              EMBEDDING_GATHERS),
        hier_layer_unit=one_of("HIER_LAYER_UNIT", knobs[3], LAYER_UNIT_SETTINGS),
        step_seconds=number("LBP_STEP_SECONDS", v.get("LBP_STEP_SECONDS") or "0"),
        train_iters=integer("TRAIN_ITERS", v["TRAIN_ITERS"]),
        save_interval=auto_or_int("SAVE_INTERVAL", v["SAVE_INTERVAL"]),
        save_minutes=number("LBP_SAVE_MINUTES", v["LBP_SAVE_MINUTES"]),
        milestone_every=integer("LBP_MILESTONE_EVERY", v["LBP_MILESTONE_EVERY"]),
        write_gbps_per_node=number("LBP_WRITE_GBPS", v["LBP_WRITE_GBPS"]),
        save_fixed_s=number("LBP_SAVE_FIXED_S", v["LBP_SAVE_FIXED_S"]),
        compare=v["LBP_COMPARE_SCHEMES"] == "1", choose=choose,
        verbose=v.get("LBP_VERBOSE") == "1")
    return checked(job, v.get("LBP_LINKS") or None, v.get("LBP_SURVEY") or None, FILES_AS_ENV)
