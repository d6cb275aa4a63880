"""python -m megatron_lbp.launch job STAGE --state DIR: the launch environment resolved into a job.

The launchers (scripts/launch/lbp_launch.sh) keep what only a shell can do (the #SBATCH
header, ``module load``, the Python environment, srun, the chain's sbatch); every rule of a
launch lives here, once: the defaults, what a preset implies, every refusal (one line,
``lbp_launch: error: ...``, before any work), the model flags the estimate counts, the
memory fit and the choice (through :func:`plan_job`, the one call into the planner), the
exit time, and the srun and training commands.

Stages, each reading the environment and ``DIR/job.json`` that the previous one wrote:
  resolve    settings, refusals, contents check, estimate; writes the job; a dry run goes on
             through ``commands`` and the checkpoint checks and stops there
  exit-time  the job's exit time from its remaining wall time (refuses a job too short)
  commands   the training command (capability-resolved), printed with the srun command
  implied-secondary PRESET TASKS_PER_NODE   the secondary group size a preset implies

What the shell reads back: ``DIR/job.env`` (KEY=VALUE) and NUL-separated word lists
(``DIR/srun``, ``DIR/train``, ``DIR/health``, ``DIR/build_check``, ``DIR/args0``,
``DIR/exports``, ``DIR/task_exports``).

Exit status: 0; 2 bad input; 3 does not fit in GCD memory; 4 the job cannot run it.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping

from megatron_lbp.launch import site
from megatron_lbp.launch._cli import PROG, write_resolved

REPO = Path(__file__).resolve().parents[2]

# The launcher's defaults; a profile's values (exported) and the user's win. Empty counts
# as unset, as in the shell's ${VAR:=default}.
DEFAULTS = {
    "LBP_DRY_RUN": "0", "TASKS_PER_NODE": "8", "GCDS_PER_PACKAGE": "2", "CPUS_PER_TASK": "7",
    "GPUS_PER_TASK": "1", "GPU_BIND": "closest", "MASTER_PORT": "3442",
    "TOKENIZER_TYPE": "GPT2BPETokenizer", "VOCAB_SIZE_PADDED": "50304", "SPLIT": "949,50,1",
    "FFN_HIDDEN_SIZE": "", "MICRO_BATCH_SIZE": "auto", "TRAIN_ITERS": "150000",
    "LR_WARMUP_ITERS": "1500", "WEIGHT_DECAY": "0.01", "CLIP_GRAD": "1.0",
    "INIT_METHOD_STD": "0.01", "SAVE_INTERVAL": "auto", "LOG_INTERVAL": "10",
    "EVAL_INTERVAL": "1000", "EVAL_ITERS": "10", "DIST_TIMEOUT_MINS": "30",
    "EXIT_DURATION_MINS": "auto", "RECOMPUTE": "full", "PRECISION": "bf16", "HIER_PRESET": "lbp",
    "HIER_SECONDARY_DTYPE": "int8", "GCD_MEMORY_GB": "64", "HIER_GRAD_REDUCE_DTYPE": "fp32",
    "HIER_PREFETCH_UNITS": "auto", "HIER_MAX_PENDING_REDUCES": "auto",
    "HIER_EMBEDDING_BACKWARD_GATHER": "auto", "HIER_LAYER_UNIT": "auto",
    "LBP_SAVE_MINUTES": "45", "LBP_WRITE_GBPS": "1", "LBP_SAVE_FIXED_S": "60",
    "LBP_EXIT_SLACK_S": "120", "LBP_KEEP_LAST": "2", "LBP_MILESTONE_EVERY": "10000",
    "LBP_PRUNE_EVERY_S": "600", "LBP_HEALTH_CHECK": "1", "LBP_HEALTH_MIN_FRACTION": "0.25",
    "LBP_HEALTH_MB": "64", "LBP_HEALTH_EXPECT_GBPS": "", "LBP_NODE_LOCAL_ROOT": "/tmp",
    "LBP_GCD_BUS_IDS": "c1,c6,c9,ce,d1,d6,d9,de", "LBP_LINK_SURVEY": "0",
    "LBP_SURVEY_MAX_S": "300", "LBP_SITE": "frontier", "LBP_CHAIN": "1", "LBP_PYTHON": "python",
    "LBP_CHECK_CONTENTS": "1", "LBP_CHOOSE": "1", "LBP_COMPARE_SCHEMES": "0", "MOCK_DATA": "0",
}
REQUIRED = ("NUM_LAYERS", "HIDDEN_SIZE", "NUM_ATTENTION_HEADS", "SEQ_LENGTH", "GLOBAL_BATCH_SIZE",
            "LR", "MIN_LR")
DS_SCHEMES = ("ds-zero3", "ds-hpz", "ds-zeropp")
# The values lbp_study.sh reads from a profile (LBP_SETTINGS_OUT=FILE: nothing else runs).
SETTINGS = ("NUM_LAYERS", "HIDDEN_SIZE", "NUM_ATTENTION_HEADS", "SEQ_LENGTH", "VOCAB_SIZE_PADDED",
            "GLOBAL_BATCH_SIZE", "MICRO_BATCH_SIZE", "TASKS_PER_NODE", "GCDS_PER_PACKAGE",
            "HIER_SECONDARY_GROUP_SIZE", "LBP_PROFILE")
# What the estimate resolves (python -m megatron_lbp.launch estimate --resolved).
ESTIMATED = ("MICRO_BATCH_SIZE", "RECOMPUTE", "SAVE_INTERVAL", "LBP_STEP_S", "LBP_CKPT_BYTES",
             "LBP_SAVE_S", "HIER_PRESET", "HIER_SECONDARY_GROUP_SIZE", "HIER_PREFETCH_UNITS",
             "HIER_MAX_PENDING_REDUCES", "HIER_LAYER_UNIT", "HIER_EMBEDDING_BACKWARD_GATHER")
# Megatron's model flags the estimate counts (the training command's, where it gives them),
# and those it does not (a warning line).
MODEL_VALUES = ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
                "--num-query-groups", "--kv-channels", "--normalization", "--position-embedding-type",
                "--max-position-embeddings")
MODEL_SWITCHES = ("--swiglu", "--group-query-attention", "--disable-bias-linear", "--add-qkv-bias",
                  "--untie-embeddings-and-output-weights")
MODEL_UNCOUNTED = ("--num-experts", "--qk-layernorm", "--multi-latent-attention", "--squared-relu",
                   "--quick-geglu")
NUM = r"[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?"


class Refusal(Exception):
    """A one-line refusal: ``lbp_launch: error: <message>``, exit ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Stop(Exception):
    """A stage ends with ``status`` after its own message (a command it ran said why)."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


def log(text: str) -> None:
    print(f"[lbp] {text}", flush=True)


def _uint(text) -> bool:
    return bool(re.fullmatch(r"[0-9]+", str(text or "")))


# --------------------------------------------------------------------------- settings


def implied_secondary(preset: str, tasks_per_node: str) -> str:
    """The secondary group size a preset implies: the node's copy for lbp (the profiles' choice,
    their "why S = 8") and zeropp (hpZ), none for the others."""
    return tasks_per_node if preset in ("lbp", "zeropp") else "0"


def sbatch_directive(script: str, opt: str) -> str:
    """The profile script's own ``#SBATCH opt`` value (dry runs outside an allocation)."""
    if not script or not os.path.isfile(script):
        return ""
    for line in Path(script).read_text().splitlines():
        if line.startswith(f"#SBATCH {opt} "):
            return line[len(f"#SBATCH {opt} "):]
        if line.startswith(f"#SBATCH {opt}="):
            return line[len(f"#SBATCH {opt}="):]
        if line.startswith("#") or not line:
            continue
        return ""
    return ""


def signal_lead(env: Mapping[str, str], script: str) -> str:
    """Seconds before the end at which Slurm signals the job (sbatch's --signal=[R:|B:]SIG[@S],
    60 without @), as SBATCH_SIGNAL or the script's #SBATCH --signal; 0 without one."""
    spec = env.get("SBATCH_SIGNAL") or sbatch_directive(script, "--signal")
    if not spec:
        return "0"
    return spec.rsplit("@", 1)[1] if "@" in spec else "60"


def settings(env: Mapping[str, str]) -> dict[str, str]:
    """The environment with the launcher's defaults and what they imply, validated."""
    v = {k: (env.get(k) or d) for k, d in DEFAULTS.items()}
    v.update({k: x for k, x in env.items() if k not in DEFAULTS})
    # Neither the scheme nor its secondary copy given: the estimate chooses the scheme.
    if not (env.get("HIER_PRESET") or env.get("HIER_SECONDARY_GROUP_SIZE")):
        v["LBP_CHOOSE_SCHEME"] = env.get("LBP_CHOOSE_SCHEME") or "1"
    v["HIER_SECONDARY_GROUP_SIZE"] = (env.get("HIER_SECONDARY_GROUP_SIZE")
                                      or implied_secondary(v["HIER_PRESET"], v["TASKS_PER_NODE"]))
    script = v.get("LBP_PROFILE_SCRIPT", "")
    v["LBP_SIGNAL_S"] = env.get("LBP_SIGNAL_S") or signal_lead(env, script)
    v["LBP_EXIT_AUTO"] = "1" if v["EXIT_DURATION_MINS"] == "auto" else "0"
    for name in REQUIRED:
        if not v.get(name):
            raise Refusal(2, f"{name} is not set (the profile script sets it)")

    def one_of(name, allowed, text):
        if v[name] not in allowed:
            raise Refusal(2, f"{name}={v[name]}: use {text}")

    one_of("RECOMPUTE", ("full", "selective", "none", "auto"), "full, selective, none or auto")
    one_of("PRECISION", ("bf16", "fp32"), "bf16 or fp32")
    if v["HIER_PREFETCH_UNITS"] != "auto" and not _uint(v["HIER_PREFETCH_UNITS"]):
        raise Refusal(2, f"HIER_PREFETCH_UNITS={v['HIER_PREFETCH_UNITS']}: use auto or a number "
                         "of units >= 0")
    pending = v["HIER_MAX_PENDING_REDUCES"]
    if pending != "auto" and not (_uint(pending) and int(pending) >= 1):
        raise Refusal(2, f"HIER_MAX_PENDING_REDUCES={pending}: use auto or a number >= 1")
    one_of("HIER_EMBEDDING_BACKWARD_GATHER", ("auto", "gather", "skip"), "auto, gather or skip")
    one_of("HIER_LAYER_UNIT", ("auto", "whole", "split"), "auto, whole or split")
    if v["HIER_LAYER_UNIT"] == "split" and v["RECOMPUTE"] == "full":
        raise Refusal(2, "HIER_LAYER_UNIT=split with RECOMPUTE=full: the recomputed layer needs "
                         "both halves gathered at once; use RECOMPUTE=selective, none or auto")
    if not _uint(v["GPUS_PER_TASK"]):
        raise Refusal(2, f"GPUS_PER_TASK={v['GPUS_PER_TASK']}: use 1 (GCD) or 0 (CPU)")
    gpu = int(v["GPUS_PER_TASK"]) > 0
    if not env.get("LBP_REQUIRE_GPU"):
        v["LBP_REQUIRE_GPU"] = ("rocm" if v["LBP_SITE"] == "frontier" else "any") if gpu else "none"
    one_of("LBP_REQUIRE_GPU", ("rocm", "cuda", "any", "none"), "rocm, cuda, any or none")
    if not env.get("LBP_MEMORY_RESERVE_GB"):
        v["LBP_MEMORY_RESERVE_GB"] = "4" if gpu else "0"
    if not _uint(v["LBP_SIGNAL_S"]):
        raise Refusal(2, f"LBP_SIGNAL_S={v['LBP_SIGNAL_S']}: the --signal lead (from LBP_SIGNAL_S, "
                         "SBATCH_SIGNAL or the script's #SBATCH --signal=SIG@SECONDS) must be "
                         "seconds >= 0")
    for name in ("LBP_KEEP_LAST", "LBP_MILESTONE_EVERY", "LBP_PRUNE_EVERY_S", "LBP_EXIT_SLACK_S"):
        if not _uint(v[name]):
            raise Refusal(2, f"{name}={v[name]} must be an integer >= 0")
    if int(v["LBP_KEEP_LAST"]) < 1:
        raise Refusal(2, f"LBP_KEEP_LAST={v['LBP_KEEP_LAST']}: keep at least the newest "
                         "checkpoint (1)")
    one_of("LBP_HEALTH_CHECK", ("0", "1", "none"), "1, 0 or none")
    if not re.fullmatch(rf"((package|node|network)={NUM},?)*", v["LBP_HEALTH_EXPECT_GBPS"]):
        raise Refusal(2, f"LBP_HEALTH_EXPECT_GBPS={v['LBP_HEALTH_EXPECT_GBPS']}: give "
                         "class=GB/s per GCD, e.g. package=200,node=50,network=12.5")
    if v["LBP_LINK_SURVEY"] not in ("0", "1"):
        raise Refusal(2, f"LBP_LINK_SURVEY={v['LBP_LINK_SURVEY']}: use 1 (the health check also "
                         "runs the link survey) or 0")
    for name in ("LBP_HEALTH_MIN_FRACTION", "LBP_HEALTH_MB", "LBP_SAVE_MINUTES", "LBP_WRITE_GBPS",
                 "LBP_SAVE_FIXED_S", "LBP_SURVEY_MAX_S"):
        if not re.fullmatch(NUM, v[name]):
            raise Refusal(2, f"{name}={v[name]} must be a number >= 0")
    if v.get("LBP_STEP_SECONDS") and not re.fullmatch(NUM, v["LBP_STEP_SECONDS"]):
        raise Refusal(2, f"LBP_STEP_SECONDS={v['LBP_STEP_SECONDS']} must be seconds per iteration")
    if v["LBP_SITE"] not in site.SITES:
        raise Refusal(2, f"LBP_SITE={v['LBP_SITE']}: use frontier or local")
    return v


def is_ds(v) -> bool:
    return v["HIER_PRESET"].startswith("ds-")


def check_deepspeed(v, words: list[str]) -> None:
    """Inputs a DeepSpeed run (HIER_PRESET=ds-*, megatron_lbp.deepspeed_baseline) cannot honour."""
    if not is_ds(v):
        return
    p = v["HIER_PRESET"]
    if p not in DS_SCHEMES:
        raise Refusal(2, f"HIER_PRESET={p}: the DeepSpeed schemes are {', '.join(DS_SCHEMES)}")
    if v["HIER_SECONDARY_GROUP_SIZE"] != "0":
        raise Refusal(2, f"HIER_SECONDARY_GROUP_SIZE={v['HIER_SECONDARY_GROUP_SIZE']} does not "
                         f"apply to HIER_PRESET={p} (DeepSpeed's hpZ partition is the node, set by "
                         "the scheme): unset it")
    if v["HIER_GRAD_REDUCE_DTYPE"] != "fp32":
        raise Refusal(2, f"HIER_GRAD_REDUCE_DTYPE={v['HIER_GRAD_REDUCE_DTYPE']} does not apply to "
                         f"HIER_PRESET={p} (DeepSpeed reduces gradients in the training dtype): "
                         "unset it")
    if v["HIER_EMBEDDING_BACKWARD_GATHER"] not in ("auto", "gather"):
        raise Refusal(2, f"HIER_EMBEDDING_BACKWARD_GATHER={v['HIER_EMBEDDING_BACKWARD_GATHER']} "
                         f"does not apply to HIER_PRESET={p} (a setting of the engine's schedule): "
                         "unset it")
    if v["HIER_LAYER_UNIT"] not in ("auto", "whole"):
        raise Refusal(2, f"HIER_LAYER_UNIT={v['HIER_LAYER_UNIT']} does not apply to "
                         f"HIER_PRESET={p} (the engine's gather units; DeepSpeed fetches by its "
                         "own config): unset it")
    for knob in ("HIER_PREFETCH_UNITS", "HIER_MAX_PENDING_REDUCES"):
        if v[knob] != "auto":
            raise Refusal(2, f"{knob}={v[knob]} does not apply to HIER_PRESET={p} (a transient "
                             "knob of the engine's schedule; DeepSpeed prefetches and reduces by "
                             "its own config): unset it")
    if v.get("MEGATRON_LM_DIR"):
        raise Refusal(2, f"MEGATRON_LM_DIR does not apply to HIER_PRESET={p} (the DeepSpeed "
                         "runner builds the model from the megatron-core in the Python env): "
                         "unset it")
    if v.get("START_FROM"):
        raise Refusal(2, f"START_FROM does not apply to HIER_PRESET={p} (the DeepSpeed runner "
                         "loads no checkpoint): unset it")
    if v["LBP_CHAIN"] != "1":
        raise Refusal(2, f"--chain {v['LBP_CHAIN']} does not apply to HIER_PRESET={p} (the "
                         "DeepSpeed runner saves no checkpoint to resume from): run one job")
    for w in words:
        if w.startswith("--hier-") or w == "--use-distributed-optimizer":
            raise Refusal(2, f"{w} does not apply to HIER_PRESET={p} (DeepSpeed partitions by its "
                             "scheme): drop it from EXTRA_ARGS / the command line")


def start_from(v) -> list[str]:
    """START_FROM's flags (an imported model's megatron_args.txt), and the model variables
    the estimate reads from them."""
    d = v.get("START_FROM")
    if not d:
        return []
    file = f"{d}/megatron_args.txt"
    if not (os.path.isfile(file) and os.path.isfile(f"{d}/latest_checkpointed_iteration.txt")):
        raise Refusal(2, f"START_FROM={d} is not an imported model (no megatron_args.txt or "
                         "checkpoint tracker): make it with python -m megatron_lbp.hf import "
                         f"<HF model dir> {d}")
    lines = Path(file).read_text().splitlines()
    flags = lines[0].split() if lines else []
    names = {"--num-layers": "NUM_LAYERS", "--hidden-size": "HIDDEN_SIZE",
             "--num-attention-heads": "NUM_ATTENTION_HEADS", "--ffn-hidden-size": "FFN_HIDDEN_SIZE",
             # the import pads to exactly this
             "--make-vocab-size-divisible-by": "VOCAB_SIZE_PADDED",
             "--tokenizer-type": "TOKENIZER_TYPE", "--tokenizer-model": "TOKENIZER_MODEL",
             "--vocab-file": "VOCAB_FILE", "--merge-file": "MERGE_FILE"}
    for i, f in enumerate(flags):
        if f in names:
            v[names[f]] = flags[i + 1] if i + 1 < len(flags) else ""
    log(f"start: the weights of {d} (--pretrained-checkpoint; flags from {file})")
    return flags


def resolve_nodes(v, env, script_arg: str) -> None:
    n = v.get("NNODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or ""
    frm = ""
    if not n and not env.get("SLURM_JOB_ID"):
        n = sbatch_directive(v.get("LBP_PROFILE_SCRIPT", ""), "-N")
        frm = " (the script's #SBATCH -N)" if n else ""
    if not n:
        raise Refusal(2, "node count unknown: submit with sbatch -N <nodes>, or set NNODES "
                         f"(e.g. NNODES=48 LBP_DRY_RUN=1 bash {script_arg})")
    if not _uint(n) or int(n) < 1:
        raise Refusal(2, f"NNODES={n} is not a node count >= 1")
    alloc = env.get("SLURM_JOB_NUM_NODES")
    if alloc and int(n) > int(alloc):
        raise Refusal(2, f"NNODES={n} but this allocation has {alloc} node(s): unset NNODES or "
                         f"submit with sbatch -N {n}")
    v["NNODES_RESOLVED"], v["NNODES_FROM"] = n, frm
    if is_ds(v) and v["HIER_PRESET"] != "ds-zero3" and int(n) < 2:
        raise Refusal(2, f"HIER_PRESET={v['HIER_PRESET']} needs at least 2 nodes (hpZ's "
                         f"node-sized secondary partition would be the whole job on {n}): use "
                         "NNODES >= 2 or HIER_PRESET=ds-zero3")


def check_hierarchy(v) -> None:
    """Node counts, batch sizes and group sizes that fit the hierarchy."""
    for name in ("TASKS_PER_NODE", "GCDS_PER_PACKAGE", "GLOBAL_BATCH_SIZE"):
        if not _uint(v[name]) or int(v[name]) < 1:
            raise Refusal(2, f"{name}={v[name]} must be an integer >= 1")
    mbs = "1" if v["MICRO_BATCH_SIZE"] == "auto" else v["MICRO_BATCH_SIZE"]
    if not _uint(mbs) or int(mbs) < 1:
        raise Refusal(2, f"MICRO_BATCH_SIZE={v['MICRO_BATCH_SIZE']} must be auto or an integer >= 1")
    s = v["HIER_SECONDARY_GROUP_SIZE"]
    if not _uint(s):
        raise Refusal(2, f"HIER_SECONDARY_GROUP_SIZE={s} must be 0 (off) or a group size")
    n, t, pk, s, mbs = (int(v["NNODES_RESOLVED"]), int(v["TASKS_PER_NODE"]),
                        int(v["GCDS_PER_PACKAGE"]), int(s), int(mbs))
    if t % pk:
        raise Refusal(2, f"GCDS_PER_PACKAGE={pk} must divide TASKS_PER_NODE={t} (a node holds "
                         "whole packages)")
    if s > 0 and (t % s or s % pk):
        raise Refusal(2, f"HIER_SECONDARY_GROUP_SIZE={s} must be a multiple of GCDS_PER_PACKAGE="
                         f"{pk} that divides TASKS_PER_NODE={t} (the secondary copy is gathered "
                         f"inside one node): set it to {t} (node) or {pk} (package), or 0 (off)")
    world = n * t
    v["WORLD"] = str(world)
    gbs = int(v["GLOBAL_BATCH_SIZE"])
    if gbs % (mbs * world):
        ok = " ".join(str(k) for k in range(1, 513) if gbs % (mbs * t * k) == 0)
        raise Refusal(2, f"{n} node(s) x {t} tasks = {world} data-parallel ranks do not fit "
                         f"GLOBAL_BATCH_SIZE={gbs} with MICRO_BATCH_SIZE={mbs} (needs a multiple "
                         f"of {mbs * world}): use NNODES in {{{ok}}} or set GLOBAL_BATCH_SIZE to "
                         f"a multiple of {mbs * world}")


def check_paths(v) -> None:
    """Required paths exist (stops before anything runs, naming what to set)."""
    if v["MOCK_DATA"] != "1":
        if not v.get("DATA_PATH"):
            raise Refusal(2, "DATA_PATH is not set: export DATA_PATH=<prefix of the .bin/.idx "
                             "files made by python -m megatron_lbp.preprocess_data> (or "
                             "MOCK_DATA=1 for synthetic data)")
        for w in v["DATA_PATH"].split():
            if re.fullmatch(r"[0-9.eE+-]+", w):
                continue   # a blend weight
            if not (os.path.isfile(f"{w}.bin") and os.path.isfile(f"{w}.idx")):
                raise Refusal(2, f"DATA_PATH: {w}.bin / {w}.idx not found: set DATA_PATH to an "
                                 "existing data prefix (python -m megatron_lbp.preprocess_data "
                                 "makes them)")
    tok = v["TOKENIZER_TYPE"]
    if tok == "GPT2BPETokenizer":
        for w in ("VOCAB_FILE", "MERGE_FILE"):
            if not v.get(w):
                raise Refusal(2, f"{w} is not set (TOKENIZER_TYPE=GPT2BPETokenizer needs "
                                 "VOCAB_FILE=gpt2-vocab.json and MERGE_FILE=gpt2-merges.txt)")
            if not os.path.isfile(v[w]):
                raise Refusal(2, f"{w}={v[w]} does not exist: set {w}")
    elif tok != "NullTokenizer":
        model = v.get("TOKENIZER_MODEL")
        if not model:
            raise Refusal(2, f"TOKENIZER_MODEL is not set (TOKENIZER_TYPE={tok} needs it)")
        if tok == "HuggingFaceTokenizer" and not os.path.isdir(model):
            raise Refusal(2, f"TOKENIZER_MODEL={model} is not a local directory: a hub name "
                             "cannot be fetched on compute nodes; save_pretrained the tokenizer "
                             "to a directory where there is network and set TOKENIZER_MODEL to it")
        if not os.path.exists(model):
            raise Refusal(2, f"TOKENIZER_MODEL={model} does not exist: set TOKENIZER_MODEL")
    if not v.get("CHECKPOINT_DIR"):
        raise Refusal(2, "CHECKPOINT_DIR is not set: export CHECKPOINT_DIR=<directory for "
                         "--save/--load> (a rerun resumes from it)")
    if v.get("LBP_SBCAST_ENV") and not os.path.isfile(v["LBP_SBCAST_ENV"]):
        raise Refusal(2, f"LBP_SBCAST_ENV={v['LBP_SBCAST_ENV']} does not exist: set it to a "
                         "conda-pack'd .tar.gz (conda pack --format tar.gz), or unset it")
    for name, sub in (("DATA_CACHE_PATH", "data_cache"), ("TENSORBOARD_DIR", "tensorboard")):
        if name not in v:   # set and empty: off
            v[name] = f"{v['CHECKPOINT_DIR']}/{sub}"


def entry(v, exports: list[tuple[str, str]]) -> tuple[list[str], str]:
    """Each task's entry (megatron_lbp, a patched Megatron-LM tree, or the DeepSpeed runner)."""
    py = v["LBP_PYTHON"]
    if is_ds(v):
        r = subprocess.run([sys.executable, "-c",
                            "from megatron_lbp.deepspeed_baseline import environment\n"
                            "environment.prepare()\nimport deepspeed\nprint(deepspeed.__version__)"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            last = ([l for l in r.stderr.splitlines() if l.strip()] or ["no message"])[-1]
            raise Refusal(2, f"HIER_PRESET={v['HIER_PRESET']} needs DeepSpeed, which {py} cannot "
                             f"import ({last}): it is a benchmark dependency, installed by bash "
                             "scripts/install.sh --test (or pip install -r requirements-test.txt)")
        version = r.stdout.strip().splitlines()[-1]
        return ([py, "-u", "-m", "megatron_lbp.deepspeed_baseline.pretrain", "--ds-scheme",
                 v["HIER_PRESET"], "--ds-ranks-per-node", v["TASKS_PER_NODE"]],
                f"python -m megatron_lbp.deepspeed_baseline.pretrain (DeepSpeed {version}, "
                f"{v['HIER_PRESET']}; megatron-core from the Python env)")
    tree = v.get("MEGATRON_LM_DIR")
    if not tree:
        return ([py, "-u", "-m", "megatron_lbp.pretrain_gpt"],
                "python -m megatron_lbp.pretrain_gpt (megatron-core from the Python env)")
    if not os.path.isfile(f"{tree}/pretrain_gpt.py"):
        raise Refusal(2, f"MEGATRON_LM_DIR={tree} has no pretrain_gpt.py: set it to a Megatron-LM "
                         "checkout (core_v0.19.0), or unset it to use python -m "
                         "megatron_lbp.pretrain_gpt")
    check = subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), "--check", tree],
                           capture_output=True)
    if check.returncode != 0:
        raise Refusal(2, f"MEGATRON_LM_DIR={tree} is not patched for megatron-lbp: run bash "
                         f"{REPO}/scripts/apply_patches.sh {tree} (or unset MEGATRON_LM_DIR to "
                         "use python -m megatron_lbp.pretrain_gpt)")
    path = os.environ.get("PYTHONPATH", "")
    exports.append(("PYTHONPATH", f"{tree}:{path}"))
    return [py, "-u", f"{tree}/pretrain_gpt.py"], f"{tree}/pretrain_gpt.py (patched Megatron-LM tree)"


# --------------------------------------------------------------------------- in-process commands


def _captured(fn: Callable[[], int], prefix: str = "[lbp] ", stderr_too: bool = False,
              rewrite: tuple[str, str] | None = None) -> int:
    """Run a launch command's main in this process, its stdout lines prefixed (and stderr's,
    rewritten, with ``stderr_too``); its refusals go to stderr as they are."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err if stderr_too else sys.stderr):
        try:
            status = fn()
        except SystemExit as exc:   # argparse's usage errors
            status = exc.code if isinstance(exc.code, int) else 2
    text = out.getvalue() + err.getvalue()
    for line in text.splitlines():
        if rewrite and line.startswith(rewrite[0]):
            line = rewrite[1] + line[len(rewrite[0]):]
        print(prefix + line, flush=True)
    return status


def check_contents(v) -> None:
    """The tokenizer builds here and the data is a readable indexed dataset that fits it."""
    if v["LBP_CHECK_CONTENTS"] != "1":
        log("contents: not checked (LBP_CHECK_CONTENTS=0)")
        return
    from megatron_lbp.launch import contents

    args = ["--tokenizer-type", v["TOKENIZER_TYPE"], "--vocab-size-padded", v["VOCAB_SIZE_PADDED"]]
    if v["TOKENIZER_TYPE"] == "GPT2BPETokenizer":
        args += ["--vocab-file", v["VOCAB_FILE"], "--merge-file", v["MERGE_FILE"]]
    elif v["TOKENIZER_TYPE"] != "NullTokenizer":
        args += ["--tokenizer-model", v["TOKENIZER_MODEL"]]
    args += ["--mock-data"] if v["MOCK_DATA"] == "1" else ["--data-path", *v["DATA_PATH"].split()]
    status = _captured(lambda: contents.main(args))
    if status:
        raise Stop(status)


def model_flags(v, words: list[str]) -> list[str]:
    """The model the training command builds, as the estimate's flags: the shape variables,
    then Megatron's model flags where the command gives them (START_FROM's, EXTRA_ARGS, the
    command line's extras; the last of a flag wins, as in Megatron's argparse);
    --num-query-groups counts only with --group-query-attention, as in Megatron."""
    val = {"--num-layers": v["NUM_LAYERS"], "--hidden-size": v["HIDDEN_SIZE"],
           "--num-attention-heads": v["NUM_ATTENTION_HEADS"],
           "--ffn-hidden-size": v["FFN_HIDDEN_SIZE"], "--position-embedding-type": "rope",
           "--max-position-embeddings": v["SEQ_LENGTH"]}
    on = set()
    for i, f in enumerate(words):
        x = words[i + 1] if i + 1 < len(words) else ""
        if f.startswith("--") and "=" in f:
            f, x = f.split("=", 1)
        if f in MODEL_VALUES:
            val[f] = x
        elif f in MODEL_SWITCHES:
            on.add(f)
        elif f in MODEL_UNCOUNTED:
            log(f"warning: {f}: the estimate does not count it (parameters, memory and step time "
                "are for the model without it)")
    out = []
    for f in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
              "--kv-channels", "--normalization", "--position-embedding-type",
              "--max-position-embeddings"):
        if val.get(f):
            out += [f, val[f]]
    out += [f for f in MODEL_SWITCHES if f in on]
    if "--group-query-attention" in on and val.get("--num-query-groups"):
        out += ["--num-query-groups", val["--num-query-groups"]]
    return out


def estimate_as(v) -> tuple[str, str, str]:
    """The engine scheme the estimate costs this job as (preset, secondary size and dtype): the
    cost model has no DeepSpeed scheme nor stock Megatron's; these are the nearest."""
    p = v["HIER_PRESET"]
    if p == "ds-zero3":
        return "zero3", "0", v["HIER_SECONDARY_DTYPE"]
    if p in ("ds-hpz", "ds-zeropp"):
        return "zeropp", v["TASKS_PER_NODE"], "bf16" if p == "ds-hpz" else "int8"
    return ("zero2" if p == "distopt" else p), v["HIER_SECONDARY_GROUP_SIZE"], v["HIER_SECONDARY_DTYPE"]


def plan_job(v, words: list[str], state: Path) -> dict[str, str]:
    """The one call into the planner: memory per choice, the choice, step time, save interval
    and checkpoint bytes for this job (megatron_lbp.launch.estimate); its lines printed."""
    from megatron_lbp.launch import estimate

    preset, secondary, secondary_dtype = estimate_as(v)
    knobs = [v["HIER_PREFETCH_UNITS"], v["HIER_MAX_PENDING_REDUCES"],
             v["HIER_EMBEDDING_BACKWARD_GATHER"], v["HIER_LAYER_UNIT"]]
    if is_ds(v) or v["HIER_PRESET"] == "distopt":   # no engine knobs: costed at its defaults
        knobs = ["1", "2", "gather", "whole"]
    args = ["--nodes", v["NNODES_RESOLVED"], "--tasks-per-node", v["TASKS_PER_NODE"],
            "--gcds-per-package", v["GCDS_PER_PACKAGE"], "--preset", preset,
            *model_flags(v, words), "--seq-length", v["SEQ_LENGTH"],
            "--vocab-size", v["VOCAB_SIZE_PADDED"], "--global-batch-size", v["GLOBAL_BATCH_SIZE"],
            "--micro-batch-size", v["MICRO_BATCH_SIZE"], "--recompute", v["RECOMPUTE"],
            "--hier-secondary-group-size", secondary, "--hier-secondary-dtype", secondary_dtype,
            "--params-dtype", v["PRECISION"], "--hier-grad-reduce-dtype", v["HIER_GRAD_REDUCE_DTYPE"],
            "--hier-prefetch-units", knobs[0], "--hier-max-pending-reduces", knobs[1],
            "--hier-embedding-backward-gather", knobs[2], "--hier-layer-unit", knobs[3],
            "--gcd-memory-gb", v["GCD_MEMORY_GB"], "--reserve-gb", v["LBP_MEMORY_RESERVE_GB"],
            "--train-iters", v["TRAIN_ITERS"], "--save-interval", v["SAVE_INTERVAL"],
            "--save-minutes", v["LBP_SAVE_MINUTES"], "--milestone-every", v["LBP_MILESTONE_EVERY"],
            "--write-gbps-per-node", v["LBP_WRITE_GBPS"], "--save-fixed-s", v["LBP_SAVE_FIXED_S"],
            "--resolved", str(state / "estimate")]
    if v.get("LBP_STEP_SECONDS"):
        args += ["--step-seconds", v["LBP_STEP_SECONDS"]]
    if v["LBP_COMPARE_SCHEMES"] == "1":
        args.append("--compare")
    # The configuration by projected step time (megatron_lbp/launch/choose.py), the scheme too
    # when the profile left it open (LBP_CHOOSE_SCHEME=1).
    if v["LBP_CHOOSE"] == "1":
        args.append("--choose")
        if v.get("LBP_CHOOSE_SCHEME") == "1":
            args += ["--preset", "auto"]
    if v.get("LBP_LINKS"):
        args += ["--links", v["LBP_LINKS"]]
    if v.get("LBP_SURVEY"):
        args += ["--survey", v["LBP_SURVEY"]]
    status = _captured(lambda: estimate.main(args))
    if status:
        raise Stop(status)
    return _read_env(state / "estimate")


def exit_time(v, env: Mapping[str, str], state: Path) -> None:
    """--exit-duration-in-mins from the job's remaining wall time (a dry run: LBP_WALLTIME or
    the script's #SBATCH -t), and when that was measured (Megatron's clock starts there)."""
    from megatron_lbp.launch import walltime

    v["LBP_EXIT_MEASURED_AT"] = str(int(time.time()))
    if v["LBP_EXIT_AUTO"] != "1":
        if not _uint(v["EXIT_DURATION_MINS"]):
            raise Refusal(2, f"EXIT_DURATION_MINS={v['EXIT_DURATION_MINS']}: use auto, minutes, "
                             "or 0 (off)")
        log(f"exit time: EXIT_DURATION_MINS={v['EXIT_DURATION_MINS']} as given")
        return
    args = ["--save-s", v["LBP_SAVE_S"], "--step-s", v["LBP_STEP_S"], "--slack-s",
            v["LBP_EXIT_SLACK_S"], "--signal-s", v["LBP_SIGNAL_S"], "--resolved", str(state / "exit")]
    wall = v.get("LBP_WALLTIME") or sbatch_directive(v.get("LBP_PROFILE_SCRIPT", ""), "-t")
    if wall:
        args += ["--walltime", wall]
    if v["LBP_DRY_RUN"] == "1":
        args.append("--no-job")   # a dry run plans for the job length
    status = _captured(lambda: walltime.main(args, env=env))
    if status:
        raise Stop(status)
    v["EXIT_DURATION_MINS"] = _read_env(state / "exit")["EXIT_DURATION_MINS"]


# --------------------------------------------------------------------------- commands


def retention(v) -> None:
    """Megatron's --save-retain-interval keeps every Nth and deletes the previous save: that is
    LBP_KEEP_LAST=1 when the milestones land on saves; else the launcher prunes."""
    keep, every = int(v["LBP_KEEP_LAST"]), int(v["LBP_MILESTONE_EVERY"])
    by_megatron = keep == 1 and every > 0 and every % int(v["SAVE_INTERVAL"]) == 0
    v["LBP_RETAIN_BY"] = "megatron" if by_megatron else "launcher"
    rule = f"newest {keep} complete"
    if every > 0:
        rule += f" + the first at or after every {every} iterations"
    if by_megatron:
        log(f"retention: {rule}, by Megatron (--save-retain-interval {every})")
    else:
        log(f"retention: {rule}, by the launcher (at job start and end, and every "
            f"{v['LBP_PRUNE_EVERY_S']} s during training); the tracker's and the newest complete "
            "checkpoint are kept")


def master_addr(v) -> None:
    if v.get("MASTER_ADDR"):
        return
    # The batch script runs on the allocation's first node; its IP works for real and for
    # emulated (unresolvable) node names alike.
    try:
        out = subprocess.run(["hostname", "-i"], capture_output=True, text=True).stdout.split()
    except OSError:
        out = []
    v["MASTER_ADDR"] = out[0] if out else socket.gethostname()


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
        if int(v["HIER_SECONDARY_GROUP_SIZE"]) > 0:
            a += ["--hier-secondary-dtype", v["HIER_SECONDARY_DTYPE"]]
        if v["HIER_GRAD_REDUCE_DTYPE"] != "fp32":
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


def quote(words: list[str]) -> str:
    """Words as one shell line, quoting (as bash's printf %q) only those that need it."""
    def one(w):
        if re.fullmatch(r"[A-Za-z0-9_./=:,+@%-]+", w):
            return w
        return re.sub(r"([^A-Za-z0-9_./=:,+@%-])", r"\\\1", w) if w else "''"
    return " ".join(one(w) for w in words)


def capabilities(v, args: list[str]) -> tuple[str, str, str]:
    """(device, the resolved training line, the flags' explanation) as the entry resolves them
    (python -m megatron_lbp.capabilities, for the device the profile runs on: LBP_DEVICE=gpu for
    a GPU profile, so that a login node without GPUs resolves for the compute nodes)."""
    device = v.get("LBP_DEVICE") or ("cpu" if v["LBP_REQUIRE_GPU"] == "none" else "gpu")
    r = subprocess.run([sys.executable, "-m", "megatron_lbp.capabilities", *args],
                       env={**os.environ, "LBP_DEVICE": device}, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr.replace("python -m megatron_lbp.capabilities: error: ",
                                          f"{PROG}: error: "))
        raise Stop(2)
    return device, r.stdout.strip(), r.stderr


def print_commands(v, srun: list[str], entry_words: list[str], args: list[str], device: str,
                   line: str, notes: str) -> None:
    log(f"profile: {v.get('LBP_PROFILE') or 'custom'}: {v['NNODES_RESOLVED']} node(s)"
        f"{v['NNODES_FROM']} x {v['TASKS_PER_NODE']} tasks = {v['WORLD']} ranks (one per GCD), "
        f"{v['GCDS_PER_PACKAGE']} GCDs per package")
    log(f"entry: {v['ENTRY_DESC']}; python: {shutil.which(v['LBP_PYTHON']) or ''}")
    log(f"rendezvous: MASTER_ADDR={v['MASTER_ADDR']} MASTER_PORT={v['MASTER_PORT']} (ranks from "
        "SLURM_PROCID per task, scripts/launch/lbp_task.sh)")
    shown = "".join(f" {k}={x}" for k, x in v["SITE_EXPORTS"])
    users = "".join(f" {k}" for k in v["SITE_USER"])
    log(f"environment:{shown}" + (f" (yours:{users})" if users else ""))
    log(f"caches: MIOpen and Triton per task under {v['LBP_NODE_LOCAL_ROOT']} (node-local), "
        f"data index cache {v['DATA_CACHE_PATH'] or '<next to the data>'}, TensorBoard "
        f"{v['TENSORBOARD_DIR'] or 'off'}")
    print("[lbp] srun command:")
    print(f"  {quote(srun)} \\")
    print(f"    {quote(entry_words + args)}")
    log(f"flags for a {device.upper()} run (python -m megatron_lbp.capabilities, "
        f"LBP_DEVICE={device}), as the entry adds them at start:")
    for n in notes.splitlines():
        print(f"[lbp]   {n}")
    print("[lbp] training command (each task):")
    print(f"  {quote(entry_words)} {line}", flush=True)


def deepspeed_config(v) -> None:
    """The DeepSpeed config the runner will use for this job shape (the function it calls)."""
    if not is_ds(v):
        return
    args = ["--scheme", v["HIER_PRESET"], "--micro-batch-size", v["MICRO_BATCH_SIZE"],
            "--global-batch-size", v["GLOBAL_BATCH_SIZE"], "--world-size", v["WORLD"],
            "--ranks-per-node", v["TASKS_PER_NODE"], "--clip-grad", v["CLIP_GRAD"]]
    if v["PRECISION"] == "bf16":
        args.append("--bf16")
    r = subprocess.run([sys.executable, "-m", "megatron_lbp.deepspeed_baseline.schemes", *args],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        raise Refusal(2, "no DeepSpeed config for this job shape (above)")
    log(f"DeepSpeed config ({v['HIER_PRESET']}, {v['WORLD']} ranks, {v['TASKS_PER_NODE']} per "
        f"node; python -m megatron_lbp.deepspeed_baseline.schemes {quote(args)}):")
    for line in r.stdout.splitlines():
        print(f"[lbp]   {line}")
    preset, secondary, _ = estimate_as(v)
    log(f"checkpoints: none (the DeepSpeed runner runs TRAIN_ITERS={v['TRAIN_ITERS']} iterations "
        f"and saves nothing); memory and step time above are estimated as the engine's {preset} "
        f"(S={secondary}), the nearest scheme the cost model has")


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


# --------------------------------------------------------------------------- state


def _read_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        k, _, x = line.partition("=")
        out[k] = x
    return out


def _write_words(path: Path, words: list[str]) -> None:
    path.write_bytes(b"".join(w.encode() + b"\0" for w in words))


def _save(state: Path, v: dict) -> None:
    (state / "job.json").write_text(json.dumps(v))
    keys = ("NNODES_RESOLVED", "WORLD", "CHECKPOINT_DIR", "DATA_CACHE_PATH", "TENSORBOARD_DIR",
            "TRAIN_ITERS", "LBP_KEEP_LAST", "LBP_MILESTONE_EVERY", "LBP_PRUNE_EVERY_S",
            "LBP_RETAIN_BY", "LBP_CKPT_BYTES", "LBP_CHAIN", "LBP_DRY_RUN", "LBP_REQUIRE_GPU",
            "TASKS_PER_NODE", "GPUS_PER_TASK", "LBP_HEALTH_NOTE", "LBP_RUN_DEVICE",
            "LBP_EXIT_MEASURED_AT", "LBP_PROFILE_SCRIPT")
    write_resolved(str(state / "job.env"), {k: v.get(k, "") for k in keys})


def _load(state: Path) -> dict:
    v = json.loads((state / "job.json").read_text())
    v["SITE_EXPORTS"] = [tuple(kv) for kv in v["SITE_EXPORTS"]]
    return v


def parse_launcher_args(argv: list[str], v: dict) -> tuple[list[str], list[str]]:
    """(the extra training flags, the arguments a chain's next job is given): the launcher's
    --dry-run and --chain N, anything else (optionally after --) for the training command."""
    extra, args0, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--dry-run":
            v["LBP_DRY_RUN"] = "1"
            args0.append(a)
        elif a == "--chain":
            n = argv[i + 1] if i + 1 < len(argv) else ""
            if not _uint(n) or int(n) < 1:
                raise Refusal(2, f"--chain {n}: give the number of jobs in the chain (>= 1)")
            v["LBP_CHAIN"] = n
            i += 1
        elif a == "--":
            extra += argv[i + 1:]
            args0 += argv[i:]
            break
        else:
            extra.append(a)
            args0.append(a)
        i += 1
    return extra, args0


def _before_modules(path: str | None) -> dict[str, str]:
    if not path:
        return dict(os.environ)
    out = {}
    for item in Path(path).read_bytes().split(b"\0"):
        k, sep, x = item.decode(errors="replace").partition("=")
        if sep:
            out[k] = x
    return out


def resolve(state: Path, argv: list[str], script_arg: str, env0: str | None) -> None:
    env = dict(os.environ)
    v = {k: x for k, x in env.items()}
    pre = {"LBP_DRY_RUN": env.get("LBP_DRY_RUN", ""), "LBP_CHAIN": env.get("LBP_CHAIN", "")}
    cli_extra, args0 = parse_launcher_args(argv, pre)
    v.update({k: x for k, x in pre.items() if x})
    v = settings(v)
    words_extra = v.get("EXTRA_ARGS", "").split() + cli_extra
    check_deepspeed(v, words_extra)
    start_flags = start_from(v)
    if v.get("LBP_SETTINGS_OUT"):   # scripts/launch/lbp_study.sh reads the profile's values
        write_resolved(v["LBP_SETTINGS_OUT"], {k: v.get(k, "") for k in SETTINGS})
        v["LBP_STOP"] = "1"
        return
    resolve_nodes(v, env, script_arg)
    check_hierarchy(v)
    check_paths(v)
    if v["LBP_DRY_RUN"] != "1":
        if not env.get("SLURM_JOB_ID"):
            raise Refusal(2, f"not inside a Slurm allocation: submit with sbatch {script_arg} (or "
                             "run with --dry-run / LBP_DRY_RUN=1 to see the commands)")
        if shutil.which("srun") is None:
            raise Refusal(2, "srun not found in PATH")
    exports: list[tuple[str, str]] = []
    entry_words, v["ENTRY_DESC"] = entry(v, exports)
    check_contents(v)
    v.update(plan_job(v, start_flags + words_extra, state))
    check_hierarchy(v)
    retention(v)
    master_addr(v)
    site_exports, v["SITE_USER"] = site.exports(
        site.defaults(v["LBP_SITE"], int(v["NNODES_RESOLVED"]), v["CPUS_PER_TASK"],
                      v.get("RCCL_NET_PLUGIN_DIR", "")), _before_modules(env0))
    v["SITE_EXPORTS"] = site_exports
    exports = site_exports + exports + [("MASTER_ADDR", v["MASTER_ADDR"]),
                                        ("MASTER_PORT", v["MASTER_PORT"])]
    health, v["LBP_HEALTH_NOTE"] = health_words(v)
    build_check = ([] if v["LBP_REQUIRE_GPU"] == "none" else
                   ["health", "--build-only", "--require-gpu", v["LBP_REQUIRE_GPU"],
                    "--devices-per-node", str(int(v["TASKS_PER_NODE"]) * int(v["GPUS_PER_TASK"]))])
    v.update(ENTRY=entry_words, START_FLAGS=start_flags, CLI_EXTRA=cli_extra)
    for name, words in (("srun", srun_words(v)), ("health", health), ("build_check", build_check),
                        ("args0", args0), ("exports", [f"{k}={x}" for k, x in exports]),
                        ("task_exports", [f"LBP_TASKS_PER_NODE={v['TASKS_PER_NODE']}",
                                          f"LBP_GCDS_PER_PACKAGE={v['GCDS_PER_PACKAGE']}",
                                          f"LBP_GPUS_PER_TASK={v['GPUS_PER_TASK']}",
                                          f"LBP_PYTHON={v['LBP_PYTHON']}",
                                          f"LBP_NODE_LOCAL_ROOT={v['LBP_NODE_LOCAL_ROOT']}"])):
        _write_words(state / name, words)
    _save(state, v)
    if v["LBP_DRY_RUN"] == "1":
        dry_run(state, v, env)


def commands(state: Path, v: dict) -> None:
    args = train_args(v, v["START_FLAGS"], v["CLI_EXTRA"])
    device, line, notes = capabilities(v, args)
    v["LBP_RUN_DEVICE"] = device
    srun = (state / "srun").read_bytes().decode().split("\0")[:-1]
    print_commands(v, srun, v["ENTRY"], args, device, line, notes)
    deepspeed_config(v)
    _write_words(state / "train", v["ENTRY"] + args)
    _save(state, v)


def dry_run(state: Path, v: dict, env: Mapping[str, str]) -> None:
    from megatron_lbp.launch import checkpoints

    exit_time(v, env, state)
    commands(state, v)
    chain = int(v["LBP_CHAIN"])
    if chain > 1:
        log(f"chain: --chain {chain}: this job submits the next at its start "
            "(--dependency=afterany:<this job>, the same sbatch options), "
            f"{chain - 1} more; a job stops the chain when training is complete or the tracker "
            "has not moved")
    status = checkpoints.main(["prune", v["CHECKPOINT_DIR"], "--keep-last", v["LBP_KEEP_LAST"],
                               "--milestone-every", v["LBP_MILESTONE_EVERY"], "--prefix", "[lbp] ",
                               "--dry-run"])
    if status:
        raise Stop(status)
    sys.stdout.flush()
    _captured(lambda: checkpoints.main(["space", v["CHECKPOINT_DIR"], "--checkpoint-bytes",
                                        v["LBP_CKPT_BYTES"]]),
              stderr_too=True, rewrite=(f"{PROG}: error: ", "a job would refuse: "))
    log("dry run: not launching (unset LBP_DRY_RUN / drop --dry-run to run srun)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["implied-secondary"] and len(argv) == 3:   # PRESET TASKS_PER_NODE
        print(implied_secondary(argv[1], argv[2]))
        return 0
    usage = ("usage: python -m megatron_lbp.launch job {resolve,exit-time,commands} --state DIR "
             "[--script PATH] [--env0 FILE] [-- launcher arguments] | implied-secondary PRESET "
             "TASKS_PER_NODE")
    if not argv or argv[0] not in ("resolve", "exit-time", "commands") or "--state" not in argv:
        print(usage, file=sys.stderr)
        return 2
    stage, rest = argv[0], argv[1:]
    launcher_args = rest[rest.index("--") + 1:] if "--" in rest else []
    opts = rest[:rest.index("--")] if "--" in rest else rest
    opt = dict(zip(opts[::2], opts[1::2]))
    state = Path(opt["--state"])
    try:
        if stage == "resolve":
            resolve(state, launcher_args, opt.get("--script", "<profile>"), opt.get("--env0"))
        else:
            v = _load(state)
            if stage == "exit-time":
                exit_time(v, os.environ, state)
                _save(state, v)
            else:
                commands(state, v)
    except Refusal as exc:
        sys.stdout.flush()
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.status
    except Stop as exc:
        return exc.status
    return 0
