"""The Frontier profile at small size (issue 16 item 3): its overrides and the dry-run diff.

``scripts/frontier_small.env`` holds the values a CPU run of ``scripts/frontier_gpt20b.sh``
changes. :func:`unexplained` compares what two launcher outputs print as settings (the
srun command, the training command as the entry runs it, the flags the capability check
adds and why, the environment, the profile, entry, rendezvous, caches and retention
lines) and returns every difference that no variable of an override set explains, one
line each, naming the setting and both values. Used on two dry runs
(tests/launch/test_launchers.py) and on a real job's log against the profile's dry run
(test_local_slurm_job): a job prints the same sections before its srun.
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV_FILE = REPO / "scripts" / "frontier_small.env"

# What issue 16 lets the small profile change, and why: size, node and task counts, the
# device. Paths (and the job's length) are the caller's, not the file's.
ALLOWED = {
    "NUM_LAYERS": "size", "HIDDEN_SIZE": "size", "NUM_ATTENTION_HEADS": "size",
    "SEQ_LENGTH": "size", "GLOBAL_BATCH_SIZE": "size (batch)", "MICRO_BATCH_SIZE": "size (batch)",
    "VOCAB_SIZE_PADDED": "size (the vocabulary of VOCAB_FILE)",
    "NNODES": "node count", "TASKS_PER_NODE": "task count", "CPUS_PER_TASK": "task count (cores)",
    "GPU_BIND": "device (fake GPUs)", "LBP_REQUIRE_GPU": "device (CPU ranks, gloo)",
    "LBP_HEALTH_EXPECT_GBPS": "device (loopback links)",
    "LBP_HEALTH_MIN_FRACTION": "device (loopback links)", "LBP_HEALTH_MB": "device (loopback links)",
    "DATA_PATH": "path", "VOCAB_FILE": "path", "MERGE_FILE": "path", "CHECKPOINT_DIR": "path",
    "LBP_WALLTIME": "job length (a dry run's -t)",
    # The profile chooses these by Frontier's projected step time (megatron_lbp/launch/
    # choose.py), which says nothing about CPU ranks: the small run names them.
    "HIER_PRESET": "device (the projection is Frontier's)",
    "RECOMPUTE": "device (the projection is Frontier's)",
}
CHOICE = ("HIER_PRESET", "RECOMPUTE")
SIZE = ("NUM_LAYERS", "HIDDEN_SIZE", "NUM_ATTENTION_HEADS", "SEQ_LENGTH", "GLOBAL_BATCH_SIZE",
        "VOCAB_SIZE_PADDED", "NNODES", "TASKS_PER_NODE")
CPU = ("LBP_REQUIRE_GPU",)   # a CPU run: the capability check adds what only a CPU needs
CKPT = ("CHECKPOINT_DIR",)

# Which variables may explain a difference in each printed setting. A setting not listed
# may not differ at all.
EXPLAINED_BY = {
    "srun -N": ("NNODES",), "srun -n": ("NNODES", "TASKS_PER_NODE"),
    "srun --ntasks-per-node": ("TASKS_PER_NODE",), "srun -c": ("CPUS_PER_TASK",),
    "srun --gpu-bind": ("GPU_BIND",),
    "env OMP_NUM_THREADS": ("CPUS_PER_TASK",),       # the site sets it to CPUS_PER_TASK
    "env NCCL_NET": ("NNODES",),                     # Socket on one node, else OFI
    "profile nodes": ("NNODES",), "profile tasks": ("TASKS_PER_NODE",),
    "profile ranks": ("NNODES", "TASKS_PER_NODE"),
    "--num-layers": ("NUM_LAYERS",), "--hidden-size": ("HIDDEN_SIZE",),
    "--num-attention-heads": ("NUM_ATTENTION_HEADS",),
    "--seq-length": ("SEQ_LENGTH",), "--max-position-embeddings": ("SEQ_LENGTH",),
    "--global-batch-size": ("GLOBAL_BATCH_SIZE",),
    # MICRO_BATCH_SIZE=auto: the largest that fits and divides the batch over the ranks
    # (and the choice by projected step time: the fastest that fits)
    "--micro-batch-size": ("MICRO_BATCH_SIZE", "GLOBAL_BATCH_SIZE", "NNODES", "TASKS_PER_NODE")
    + CHOICE,
    "--hier-gpus-per-node": ("TASKS_PER_NODE",),
    "--hier-secondary-group-size": ("TASKS_PER_NODE",) + CHOICE,   # the node, or the choice's
    "--hier-preset": CHOICE, "--hier-secondary-dtype": CHOICE,
    # the transient knobs: the first setting that fits the chosen row (at this size)
    "--hier-prefetch-units": ("HIER_PREFETCH_UNITS",) + CHOICE + SIZE,
    "--hier-max-pending-reduces": ("HIER_MAX_PENDING_REDUCES",) + CHOICE + SIZE,
    "--hier-layer-unit": ("HIER_LAYER_UNIT",) + CHOICE + SIZE,
    "--hier-embedding-backward-gather": ("HIER_EMBEDDING_BACKWARD_GATHER",) + CHOICE + SIZE,
    "--exit-interval": ("EXTRA_ARGS",),
    "--recompute-granularity": CHOICE, "--recompute-method": CHOICE,
    "--recompute-num-layers": CHOICE,
    # SAVE_INTERVAL=auto: about 45 min at the step time estimated for this size
    "--save-interval": SIZE,
    # EXIT_DURATION_MINS=auto: the job's time left minus a save of this size
    "--exit-duration-in-mins": ("LBP_WALLTIME",) + SIZE,
    "--data-path": ("DATA_PATH",), "--vocab-file": ("VOCAB_FILE",), "--merge-file": ("MERGE_FILE",),
    "--save": CKPT, "--load": CKPT, "--data-cache-path": CKPT, "--tensorboard-dir": CKPT,
    "caches": CKPT,
    "--distributed-backend": CPU, "--use-cpu-initialization": CPU,
    "--no-bias-gelu-fusion": CPU, "--no-bias-swiglu-fusion": CPU, "--no-bias-dropout-fusion": CPU,
    "capabilities device": CPU, "capability reason": CPU,
}


def overrides(path: Path = ENV_FILE) -> dict[str, str]:
    """KEY=VALUE lines of the env file (comments and blank lines skipped)."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", key) or re.search(r"[\s'\"$`]", value):
            raise ValueError(f"{path}:{n}: not a plain KEY=VALUE line: {line!r}")
        out[key] = value
    return out


def _options(words: list[str]) -> dict[str, object]:
    """--flag value... / --flag=value / -X value / --switch, in order, as {flag: value}."""
    out: dict[str, object] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if "=" in w and w.startswith("--"):
            k, v = w.split("=", 1)
            out[k] = v
            i += 1
            continue
        vals = []
        j = i + 1
        while j < len(words) and not words[j].startswith("-"):
            vals.append(words[j])
            j += 1
        out[w] = " ".join(vals) if vals else True
        i = j
    return out


def settings(out: str) -> dict[str, object]:
    """What a launcher output prints as settings, by name."""
    lines = out.splitlines()
    s: dict[str, object] = {}
    i = lines.index("[lbp] srun command:")
    srun = lines[i + 1].strip().removesuffix("\\").split()
    task = srun.index("bash")                 # srun ... bash .../lbp_task.sh
    for k, v in _options(srun[1:task]).items():
        s[f"srun {k}"] = v
    s["srun task"] = " ".join(srun[task:])
    j = lines.index("[lbp] training command (each task):")
    words = lines[j + 1].split()
    entry = words.index("megatron_lbp.pretrain_gpt") + 1 if "megatron_lbp.pretrain_gpt" in words else 3
    s["entry command"] = " ".join(words[:entry])
    for k, v in _options(words[entry:]).items():
        s[k] = v
    for line in lines:
        m = re.match(r"\[lbp\] flags for a (\w+) run \(python -m megatron_lbp.capabilities, "
                     r"LBP_DEVICE=(\w+)\)", line)
        if m:
            s["capabilities device"] = m.group(2)
        m = re.match(r"\[lbp\]   \[megatron-lbp\] adding (.*?): (.*)", line)
        if m:
            s[f"capability reason {m.group(1)}"] = m.group(2)
        m = re.match(r"\[lbp\] environment:(.*?)( \(yours:.*\))?$", line)
        if m:
            for kv in m.group(1).split():
                k, _, v = kv.partition("=")
                s[f"env {k}"] = v
            s["env yours"] = m.group(2) or ""
        m = re.match(r"\[lbp\] profile: (\S+): (\d+) node\(s\)(?: \(.*?\))? x (\d+) tasks = (\d+) "
                     r"ranks (.*)", line)
        if m:
            s.update({"profile name": m.group(1), "profile nodes": m.group(2),
                      "profile tasks": m.group(3), "profile ranks": m.group(4),
                      "profile rest": m.group(5)})
        for name in ("entry", "rendezvous", "caches", "retention"):
            if line.startswith(f"[lbp] {name}: "):
                s[name] = line[len(f"[lbp] {name}: "):]
    return s


def _explainer(key: str) -> tuple[str, ...]:
    if key.startswith("capability reason"):
        flags = [w for w in key.removeprefix("capability reason ").split() if w.startswith("--")]
        # a reason line is explained when every flag it adds is (CPU-only flags: the device)
        if all(f in EXPLAINED_BY for f in flags):
            return tuple({v for f in flags for v in EXPLAINED_BY[f]})
        return ()
    return EXPLAINED_BY.get(key, ())


def unexplained(profile_out: str, small_out: str, given: set[str]) -> list[str]:
    """Differences between the profile's printed settings and the small run's that no variable
    in ``given`` explains, one line each."""
    a, b = settings(profile_out), settings(small_out)
    bad = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, "<absent>"), b.get(key, "<absent>")
        if va == vb:
            continue
        why = [v for v in _explainer(key) if v in given]
        if not why:
            bad.append(f"{key}: the profile's {va!r}, the small run's {vb!r} (no override explains it)")
    return bad
