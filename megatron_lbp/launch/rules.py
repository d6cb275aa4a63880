"""The rules of a launch, once: the launcher's defaults and what they imply (the secondary copy
a preset implies, the device's torch build and memory margin, the --signal lead), every
refusal of bad input (one line, ``lbp_launch: error: ...``), and the scheme the estimate costs a
job as. Read from the environment by python -m megatron_lbp.launch job (job_cli.py).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Mapping

from megatron_lbp.launch import site

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
    "HIER_SECONDARY_DTYPE": "", "GCD_MEMORY_GB": "64", "HIER_GRAD_REDUCE_DTYPE": "",
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
NUM = r"[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?"


class Refusal(Exception):
    """A one-line refusal: ``lbp_launch: error: <message>``, exit ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def log(text: str) -> None:
    print(f"[lbp] {text}", flush=True)


def uint(text) -> bool:
    return bool(re.fullmatch(r"[0-9]+", str(text or "")))



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

    job_settings(v)
    one_of("PRECISION", ("bf16", "fp32"), "bf16 or fp32")
    if not uint(v["GPUS_PER_TASK"]):
        raise Refusal(2, f"GPUS_PER_TASK={v['GPUS_PER_TASK']}: use 1 (GCD) or 0 (CPU)")
    gpu = int(v["GPUS_PER_TASK"]) > 0
    if not env.get("LBP_REQUIRE_GPU"):
        v["LBP_REQUIRE_GPU"] = ("rocm" if v["LBP_SITE"] == "frontier" else "any") if gpu else "none"
    one_of("LBP_REQUIRE_GPU", ("rocm", "cuda", "any", "none"), "rocm, cuda, any or none")
    if not env.get("LBP_MEMORY_RESERVE_GB"):
        v["LBP_MEMORY_RESERVE_GB"] = "4" if gpu else "0"
    if not uint(v["LBP_SIGNAL_S"]):
        raise Refusal(2, f"LBP_SIGNAL_S={v['LBP_SIGNAL_S']}: the --signal lead (from LBP_SIGNAL_S, "
                         "SBATCH_SIGNAL or the script's #SBATCH --signal=SIG@SECONDS) must be "
                         "seconds >= 0")
    for name in ("LBP_KEEP_LAST", "LBP_MILESTONE_EVERY", "LBP_PRUNE_EVERY_S", "LBP_EXIT_SLACK_S"):
        if not uint(v[name]):
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


def job_settings(v) -> None:
    """The job's own settings, refused before any work by the rules the job is typed by later
    (job_values.py, job_env.py)."""
    # Imported here: the implied-secondary stage reads this module without the planner.
    from megatron_lbp.launch import job_values as jv
    from megatron_lbp.launch.candidates import EstimateError

    try:
        jv.auto_or_int("MICRO_BATCH_SIZE", v["MICRO_BATCH_SIZE"])
        jv.one_of("RECOMPUTE", v["RECOMPUTE"], jv.RECOMPUTES)
        jv.auto_or_int("HIER_PREFETCH_UNITS", v["HIER_PREFETCH_UNITS"], 0)
        jv.auto_or_int("HIER_MAX_PENDING_REDUCES", v["HIER_MAX_PENDING_REDUCES"])
        jv.one_of("HIER_EMBEDDING_BACKWARD_GATHER", v["HIER_EMBEDDING_BACKWARD_GATHER"],
                  jv.EMBEDDING_GATHERS)
        jv.one_of("HIER_LAYER_UNIT", v["HIER_LAYER_UNIT"], jv.LAYER_UNIT_SETTINGS)
        jv.layer_unit_fits(v["HIER_LAYER_UNIT"], v["RECOMPUTE"])
    except EstimateError as exc:
        raise Refusal(2, str(exc)) from None


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
    if v["HIER_GRAD_REDUCE_DTYPE"]:
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


def start_from(v, say: Callable[[str], None] = log) -> list[str]:
    """START_FROM's flags (an imported model's megatron_args.txt), and the model variables
    the estimate reads from them; ``say`` takes the launcher's note."""
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
    say(f"start: the weights of {d} (--pretrained-checkpoint; flags from {file})")
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
    if not uint(n) or int(n) < 1:
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
        if not uint(v[name]) or int(v[name]) < 1:
            raise Refusal(2, f"{name}={v[name]} must be an integer >= 1")
    mbs = 1 if v["MICRO_BATCH_SIZE"] == "auto" else v["MICRO_BATCH_SIZE"]   # job_settings checked it
    s = v["HIER_SECONDARY_GROUP_SIZE"]
    if not uint(s):
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


def estimate_as(v) -> tuple[str, str, str]:
    """The engine scheme the estimate costs this job as (preset, secondary size and dtype, ""
    for the preset's own): the cost model has no DeepSpeed scheme nor stock Megatron's; these
    are the nearest (zeropp is ZeRO++ as DeepSpeed ships it; hpZ alone keeps the weights' dtype)."""
    p = v["HIER_PRESET"]
    if p == "ds-zero3":
        return "zero3", "0", v["HIER_SECONDARY_DTYPE"]
    if p in ("ds-hpz", "ds-zeropp"):
        return "zeropp", v["TASKS_PER_NODE"], "param" if p == "ds-hpz" else ""
    return ("zero2" if p == "distopt" else p), v["HIER_SECONDARY_GROUP_SIZE"], v["HIER_SECONDARY_DTYPE"]


def retention(v, say: Callable[[str], None] = log) -> None:
    """Megatron's --save-retain-interval keeps every Nth and deletes the previous save: that is
    LBP_KEEP_LAST=1 when the milestones land on saves; else the launcher prunes."""
    keep, every = int(v["LBP_KEEP_LAST"]), int(v["LBP_MILESTONE_EVERY"])
    by_megatron = keep == 1 and every > 0 and every % int(v["SAVE_INTERVAL"]) == 0
    v["LBP_RETAIN_BY"] = "megatron" if by_megatron else "launcher"
    rule = f"newest {keep} complete"
    if every > 0:
        rule += f" + the first at or after every {every} iterations"
    if by_megatron:
        say(f"retention: {rule}, by Megatron (--save-retain-interval {every})")
    else:
        say(f"retention: {rule}, by the launcher (at job start and end, and every "
            f"{v['LBP_PRUNE_EVERY_S']} s during training); the tracker's and the newest complete "
            "checkpoint are kept")


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
            if not uint(n) or int(n) < 1:
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
