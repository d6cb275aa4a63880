"""The commands of a launch, as words: srun's, the training entry's flags, the health check's,
and the dry run's printout of them (the job's resolved values in, nothing decided here).
"""
from __future__ import annotations

import re
import shutil

from megatron_lbp.core.config import default_secondary_dtype
from megatron_lbp.launch.rules import is_ds


def srun_words(v) -> list[str]:
    words = ["srun", "-N", v["NNODES_RESOLVED"], "-n", v["WORLD"],
             f"--ntasks-per-node={v['TASKS_PER_NODE']}", "-c", v["CPUS_PER_TASK"],
             "--kill-on-bad-exit=1", "--export=ALL"]
    if int(v["GPUS_PER_TASK"]) > 0:
        words += [f"--gpus-per-task={v['GPUS_PER_TASK']}", f"--gpu-bind={v['GPU_BIND']}"]
    words += v.get("SRUN_EXTRA_ARGS", "").split()
    return words + ["bash", f"{v['LBP_REPO']}/scripts/launch/lbp_task.sh"]


def train_args(v, start_flags: list[str], cli_extra: list[str]) -> list[str]:
    tok = ["--tokenizer-type", v["TOKENIZER_TYPE"]]
    if v["TOKENIZER_TYPE"] == "GPT2BPETokenizer":
        tok += ["--vocab-file", v["VOCAB_FILE"], "--merge-file", v["MERGE_FILE"]]
    elif v["TOKENIZER_TYPE"] == "NullTokenizer":
        tok += ["--vocab-size", v["VOCAB_SIZE_PADDED"]]
    else:
        tok += ["--tokenizer-model", v["TOKENIZER_MODEL"]]
    data = (["--mock-data"] if v["MOCK_DATA"] == "1"
            else ["--data-path", *v["DATA_PATH"].split(), "--split", v["SPLIT"]])
    if v["DATA_CACHE_PATH"]:
        data += ["--data-cache-path", v["DATA_CACHE_PATH"]]
    a = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
         "--num-layers", v["NUM_LAYERS"], "--hidden-size", v["HIDDEN_SIZE"],
         "--num-attention-heads", v["NUM_ATTENTION_HEADS"],
         "--seq-length", v["SEQ_LENGTH"], "--max-position-embeddings", v["SEQ_LENGTH"],
         "--position-embedding-type", "rope",
         "--micro-batch-size", v["MICRO_BATCH_SIZE"], "--global-batch-size", v["GLOBAL_BATCH_SIZE"],
         "--train-iters", v["TRAIN_ITERS"],
         "--lr", v["LR"], "--min-lr", v["MIN_LR"], "--lr-decay-style", "cosine",
         "--lr-warmup-iters", v["LR_WARMUP_ITERS"],
         "--weight-decay", v["WEIGHT_DECAY"], "--clip-grad", v["CLIP_GRAD"],
         "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", v["INIT_METHOD_STD"],
         "--attention-dropout", "0.0", "--hidden-dropout", "0.0", *data, *tok,
         "--log-interval", v["LOG_INTERVAL"], "--log-throughput",
         "--eval-interval", v["EVAL_INTERVAL"], "--eval-iters", v["EVAL_ITERS"],
         "--distributed-timeout-minutes", v["DIST_TIMEOUT_MINS"]]
    ds = is_ds(v)
    if not ds:
        a += ["--save", v["CHECKPOINT_DIR"], "--load", v["CHECKPOINT_DIR"], "--ckpt-format",
              "torch_dist", "--save-interval", v["SAVE_INTERVAL"], "--exit-signal-handler"]
    if ds:
        pass   # DeepSpeed partitions by its scheme (the entry's --ds-scheme)
    elif v["HIER_PRESET"] == "distopt":
        # Stock Megatron's distributed optimizer, the study's baseline (the estimate sized it as zero2).
        a.append("--use-distributed-optimizer")
    else:
        a += ["--hier-partition", "--hier-preset", v["HIER_PRESET"],
              "--hier-gpus-per-node", v["TASKS_PER_NODE"],
              "--hier-gcds-per-package", v["GCDS_PER_PACKAGE"],
              "--hier-secondary-group-size", v["HIER_SECONDARY_GROUP_SIZE"]]
        # An unset dtype is the preset's own, said (zeropp: the weights' dtype; an unset
        # gradient dtype stays unsaid: the engine picks it by the weights' dtype).
        if int(v["HIER_SECONDARY_GROUP_SIZE"]) > 0:
            a += ["--hier-secondary-dtype",
                  v["HIER_SECONDARY_DTYPE"] or default_secondary_dtype(v["HIER_PRESET"])]
        if v["HIER_GRAD_REDUCE_DTYPE"]:
            a += ["--hier-grad-reduce-dtype", v["HIER_GRAD_REDUCE_DTYPE"]]
        # The knobs the estimate resolved; the engine's defaults (1, 2) go unsaid.
        if v["HIER_PREFETCH_UNITS"] not in ("auto", "1"):
            a += ["--hier-prefetch-units", v["HIER_PREFETCH_UNITS"]]
        if v["HIER_MAX_PENDING_REDUCES"] not in ("auto", "2"):
            a += ["--hier-max-pending-reduces", v["HIER_MAX_PENDING_REDUCES"]]
        if v["HIER_EMBEDDING_BACKWARD_GATHER"] == "skip":
            a += ["--hier-embedding-backward-gather", "skip"]
        if v["HIER_LAYER_UNIT"] == "split":
            a += ["--hier-layer-unit", "split"]
    if v["PRECISION"] == "bf16":
        a.append("--bf16")
    if v["RECOMPUTE"] == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform",
              "--recompute-num-layers", "1"]
    elif v["RECOMPUTE"] == "selective":
        a += ["--recompute-granularity", "selective"]
    if v["FFN_HIDDEN_SIZE"]:
        a += ["--ffn-hidden-size", v["FFN_HIDDEN_SIZE"]]
    if v["TENSORBOARD_DIR"]:
        a += ["--tensorboard-dir", v["TENSORBOARD_DIR"]]
    if not ds:
        if v["LBP_RETAIN_BY"] == "megatron":
            a += ["--save-retain-interval", v["LBP_MILESTONE_EVERY"]]
        if v["EXIT_DURATION_MINS"] != "0":
            a += ["--exit-duration-in-mins", v["EXIT_DURATION_MINS"]]
    if v.get("START_FROM"):
        a += ["--pretrained-checkpoint", v["START_FROM"], *start_flags]
    return a + v.get("EXTRA_ARGS", "").split() + cli_extra


def health_words(v) -> tuple[list[str], str]:
    """(the health check's command after python -m megatron_lbp.launch, or a note when none runs)."""
    if v["LBP_HEALTH_CHECK"] == "none":
        return [], "health check: none (LBP_HEALTH_CHECK=none: an earlier run checked these nodes)"
    args = ["health", "--tasks-per-node", v["TASKS_PER_NODE"], "--gcds-per-package",
            v["GCDS_PER_PACKAGE"], "--gpus-per-task", v["GPUS_PER_TASK"], "--require-gpu",
            v["LBP_REQUIRE_GPU"], "--min-fraction", v["LBP_HEALTH_MIN_FRACTION"], "--megabytes",
            v["LBP_HEALTH_MB"], "--gcd-bus-ids", v["LBP_GCD_BUS_IDS"]]
    if v["LBP_HEALTH_EXPECT_GBPS"]:
        args += ["--expect", v["LBP_HEALTH_EXPECT_GBPS"]]
    ckpt = v["CHECKPOINT_DIR"]
    if v["LBP_HEALTH_CHECK"] == "1":
        # The measured figures and the survey, for the next estimate (LBP_LINKS, LBP_SURVEY).
        args += ["--links-out", f"{ckpt}/lbp_links.json"]
        if v["LBP_LINK_SURVEY"] == "1":
            args += ["--survey-out", f"{ckpt}/lbp_survey.json", "--survey-max-seconds",
                     v["LBP_SURVEY_MAX_S"]]
    else:
        if int(v["GPUS_PER_TASK"]) == 0:
            return [], "health check: off (LBP_HEALTH_CHECK=0)"
        args.append("--skip-links")
    return args, ""


def quote(words: list[str]) -> str:
    """Words as one shell line, quoting (as bash's printf %q) only those that need it."""
    def one(w):
        if re.fullmatch(r"[A-Za-z0-9_./=:,+@%-]+", w):
            return w
        return re.sub(r"([^A-Za-z0-9_./=:,+@%-])", r"\\\1", w) if w else "''"
    return " ".join(one(w) for w in words)


def command_lines(v, srun: list[str], entry_words: list[str], args: list[str], device: str,
                  line: str, notes: str) -> list[str]:
    """The dry run's and the job's account of what runs: where, how, and the two commands."""
    shown = "".join(f" {k}={x}" for k, x in v["SITE_EXPORTS"])
    users = "".join(f" {k}" for k in v["SITE_USER"])
    return [
        f"[lbp] profile: {v.get('LBP_PROFILE') or 'custom'}: {v['NNODES_RESOLVED']} node(s)"
        f"{v['NNODES_FROM']} x {v['TASKS_PER_NODE']} tasks = {v['WORLD']} ranks (one per GCD), "
        f"{v['GCDS_PER_PACKAGE']} GCDs per package",
        f"[lbp] entry: {v['ENTRY_DESC']}; python: {shutil.which(v['LBP_PYTHON']) or ''}",
        f"[lbp] rendezvous: MASTER_ADDR={v['MASTER_ADDR']} MASTER_PORT={v['MASTER_PORT']} (ranks "
        "from SLURM_PROCID per task, scripts/launch/lbp_task.sh)",
        f"[lbp] environment:{shown}" + (f" (yours:{users})" if users else ""),
        f"[lbp] caches: MIOpen and Triton per task under {v['LBP_NODE_LOCAL_ROOT']} (node-local), "
        f"data index cache {v['DATA_CACHE_PATH'] or '<next to the data>'}, TensorBoard "
        f"{v['TENSORBOARD_DIR'] or 'off'}",
        "[lbp] srun command:",
        f"  {quote(srun)} \\",
        f"    {quote(entry_words + args)}",
        f"[lbp] flags for a {device.upper()} run (python -m megatron_lbp.capabilities, "
        f"LBP_DEVICE={device}), as the entry adds them at start:",
        *(f"[lbp]   {n}" for n in notes.splitlines()),
        "[lbp] training command (each task):",
        f"  {quote(entry_words)} {line}",
    ]
