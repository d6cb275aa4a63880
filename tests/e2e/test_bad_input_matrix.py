"""Every user-facing entry point against malformed input, in one table.

Entry points: the plan tool (python -m megatron_lbp.plan), the training entry
(python -m megatron_lbp.pretrain_gpt, one process unless the case needs the
launcher's view of several), the launchers (scripts/frontier_gpt{20,10}b.sh,
scripts/local_profile.sh, with LBP_DRY_RUN/--dry-run or a fake srun),
preprocessing (scripts/preprocess_data.py), the tokenizer check
(python -m megatron_lbp.tokenizer_check), scripts/apply_patches.sh and the
Hugging Face import/export (python -m megatron_lbp.hf).

Each row must: exit non-zero; write exactly one line to stderr (informational
lines the entry always prints are set aside, see ``NOTICES``) that names the
offending flag, path or variable; print no traceback; and leave the case's
directory (its inputs, any --save / output / checkpoint directory and, for the
launchers, the fake srun's marker) exactly as it was, file by file.

The training entry imports Megatron (10-20 s a process), so only a few of its
rows run in CI; the rest are marked slow. Its rows run forked from the multirank
harness's server, where torch and Megatron are imported already
(megatron_lbp.testing.entry.run_entry_captured: the entry's own main(), the row's
whole environment and directory, stdout and stderr apart, the exit status as a
process's); the rows marked ``fresh`` start ``python -m megatron_lbp.pretrain_gpt``
in a new interpreter, so that its start-up stays covered.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy
import pytest

from tests.helpers.pretrain_runner import REPO, TINY, run_pretrain, why
from tests.launch.test_launchers import LOCAL, SCRIPTS, _megatron_tree, site  # noqa: F401  (site: fixture)

PY = sys.executable
# Lines an entry prints on stderr whatever happens (not part of the error message).
NOTICES = ("megatron-lbp: no accelerator found; CPU runtime for megatron-core is active",
           "megatron-lbp: expected megatron-core notices not shown:")
# Each entry's exit status for bad input and the start of its message line.
EXIT = {"plan": 2, "pretrain": 2, "launcher": 2, "apply_patches": 2, "tokenizer_check": 2, "hf": 2,
        "preprocess": None}  # preprocess: 2 for argparse's usage errors, 1 for bad input files
PREFIX = {"plan": ("python -m megatron_lbp.plan: error: ",), "preprocess": ("python -m megatron_lbp.preprocess_data: error: ",),
          "tokenizer_check": ("python -m megatron_lbp.tokenizer_check: error: ",),
          "launcher": ("lbp_launch: error: ", "lbp_health: error: "),
          "pretrain": ("python -m megatron_lbp.pretrain_gpt: error: ", "pretrain_gpt.py: error: "),
          "apply_patches": ("scripts/apply_patches.sh: ", "usage: scripts/apply_patches.sh"),
          "hf": ("python -m megatron_lbp.hf import: error: ", "python -m megatron_lbp.hf export: error: ")}
SP_TOK = ["--tokenizer-type", "SentencePieceTokenizer",
          "--tokenizer-model", str(REPO / "tokenizer" / "lbp_bpe.model")]


@dataclass
class Case:
    id: str
    entry: str                     # plan | pretrain | launcher | preprocess | tokenizer_check | apply_patches | hf
    build: Callable                # (Ctx) -> argv (launcher: [script, *args])
    needles: tuple
    env: dict = field(default_factory=dict)
    slow: bool = False
    code: int | None = -1          # expected exit status; -1: the entry's usual one (EXIT), None: any non-zero
    in_process: bool = False       # preprocess: call its main() here (its imports cost ~4 s a process)
    fresh: bool = False            # pretrain: a fresh interpreter (else forked warm, see _run)


class Ctx:
    """A case's own directory, its inputs built in it on demand."""

    def __init__(self, tmp: Path, request):
        self.tmp, self.request = tmp, request

    def data(self) -> str:
        """The demo dataset, copied in so that the snapshot covers anything written next to it."""
        src = Path(self.request.getfixturevalue("shared_data"))
        for ext in (".bin", ".idx"):
            shutil.copy(str(src) + ext, self.tmp / (src.name + ext))
        return str(self.tmp / src.name)

    def gpt2(self, vocab: dict | None = None) -> tuple[str, str]:
        """GPT-2-format vocab.json and merges.txt (built from the shipped corpus), copied in; ``vocab`` edits it."""
        import json

        src = self.request.getfixturevalue("shared_gpt2")
        merges = str(shutil.copy(src[1], self.tmp / "merges.txt"))
        if vocab is None:
            return str(shutil.copy(src[0], self.tmp / "vocab.json")), merges
        edited = {**json.loads(Path(src[0]).read_text(encoding="utf-8")), **vocab}
        return self.write("vocab.json", json.dumps({k: v for k, v in edited.items() if v is not None})), merges

    def checkpoint(self) -> Path:
        dst = self.tmp / "ckpt"
        shutil.copytree(self.request.getfixturevalue("shared_checkpoint"), dst)
        return dst

    def hf_model(self) -> Path:
        """A tiny Llama saved by transformers (safetensors), copied in."""
        return Path(shutil.copytree(self.request.getfixturevalue("shared_hf_model"), self.tmp / "model"))

    def write(self, name: str, content: bytes | str) -> str:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return str(path)

    def jsonl(self, name: str, records) -> str:
        import json

        return self.write(name, "".join(json.dumps(r) + "\n" for r in records))


# --------------------------------------------------------------------------- the table

def plan(argv, flag):
    return Case("plan " + " ".join(argv), "plan", lambda c: list(argv), (flag,))


PLAN_W = ["--world-size", "16", "--params", "1e9"]
PLAN = [plan(a, f) for a, f in [
    (["--params", "1e9"], "--world-size"),
    (["--world-size", "0", "--params", "1e9"], "--world-size"),
    (["--world-size", "abc", "--params", "1e9"], "--world-size"),
    (["--world-size", "16"], "--params"),
    (["--world-size", "16", "--params", "0"], "--params"),
    (["--world-size", "16", "--params", "-2e9"], "--params"),
    (["--world-size", "16", "--params", "1.5"], "--params"),
    (["--world-size", "16", "--params", "inf"], "--params"),
    (PLAN_W + ["--num-layers", "2"], "--params"),
    (["--world-size", "16", "--num-layers", "2", "--hidden-size", "8"], "--vocab-size"),
    (PLAN_W + ["--micro-batches", "0"], "--micro-batches"),
    (PLAN_W + ["--micro-batches", "-1"], "--micro-batches"),
    # group sizes that do not divide / nest
    (PLAN_W + ["--hier-grad-group-size", "3"], "--hier-grad-group-size"),
    (PLAN_W + ["--hier-grad-group-size", "32"], "--hier-grad-group-size"),
    (PLAN_W + ["--hier-param-group-size", "4", "--hier-grad-group-size", "2"], "--hier-param-group-size"),
    (PLAN_W + ["--hier-grad-group-size", "16", "--hier-optim-group-size", "8"], "--hier-optim-group-size"),
    (PLAN_W + ["--hier-preset", "zero4"], "--hier-preset"),
    (PLAN_W + ["--preset", "zero4"], "--preset"),
    (PLAN_W + ["--preset", "zero3", "--hier-preset", "lbp"], "--hier-preset"),
    (PLAN_W + ["--preset", "zero3", "--hier-grad-group-size", "8"], "--hier-grad-group-size"),
    (PLAN_W + ["--gpus-per-node", "4", "--hier-gpus-per-node", "8"], "--hier-gpus-per-node"),
    (PLAN_W + ["--gpus-per-node", "3"], "--gpus-per-node"),
    (PLAN_W + ["--hier-secondary-group-size", "3"], "--hier-secondary-group-size"),
    (PLAN_W + ["--hier-secondary-dtype", "fp8"], "--hier-secondary-dtype"),
    (PLAN_W + ["--hier-param-group-size", "0"], "--hier-param-group-size"),
    (PLAN_W + ["--params-dtype", "int4"], "--params-dtype"),
    (PLAN_W + ["--bucket-size", "0"], "--bucket-size"),
    (PLAN_W + ["--hier-prefetch-units", "-1"], "--hier-prefetch-units"),
    (PLAN_W + ["--hier-max-pending-reduces", "0"], "--hier-max-pending-reduces=0"),
    (PLAN_W + ["--quant-block-size", "0"], "--quant-block-size"),
    (PLAN_W + ["--no-such-flag"], "--no-such-flag"),
    # non-co-located: a P-group of 3 on nodes of 4 straddles two nodes
    (["--world-size", "12", "--gpus-per-node", "4", "--params", "1e8",
      "--hier-param-group-size", "3", "--hier-grad-group-size", "6"], "--hier-param-group-size"),
]]


def pre(name, build, needle):
    return Case("preprocess " + name, "preprocess", build, (needle,), in_process=True)


def _good(c):
    return c.jsonl("good.jsonl", [{"text": "Some text."}])


GPT2 = ["--tokenizer-type", "GPT2BPETokenizer"]
HF = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]


def _gpt2_files(vocab, merges):
    return [*GPT2, "--vocab-file", vocab, "--merge-file", merges]


PREPROCESS = [
    Case("preprocess missing input", "preprocess", lambda c: ["--input", str(c.tmp / "nope.jsonl"), *SP_TOK],
         ("nope.jsonl: no such file or directory",), code=1),
    pre("empty input", lambda c: ["--input", c.write("empty.jsonl", ""), *SP_TOK], "empty.jsonl"),
    pre("no input files in dir", lambda c: ["--input", str(Path(c.write("nodir/notes.txt", "x\n")).parent),
                                            *SP_TOK], "nodir"),
    pre("no documents", lambda c: ["--input", c.jsonl("blank.jsonl", [{"text": ""}] * 2), *SP_TOK],
        "blank.jsonl"),
    pre("bad JSON line", lambda c: ["--input", c.write("badjson.jsonl", '{"text": "a"}\n{"text": "b"}\n'
                                                       '{"text": oops}\n'), *SP_TOK], "badjson.jsonl line 3"),
    pre("missing key", lambda c: ["--input", c.jsonl("nokey.jsonl", [{"text": "a"}, {"body": "b"}]), *SP_TOK],
        "nokey.jsonl line 2: no key 'text'"),
    pre("value not a string", lambda c: ["--input", c.jsonl("notstr.jsonl", [{"text": 3}]), *SP_TOK],
        "notstr.jsonl line 1"),
    pre("not an object", lambda c: ["--input", c.write("array.jsonl", "[1, 2]\n"), *SP_TOK],
        "array.jsonl line 1"),
    pre("not UTF-8", lambda c: ["--input", c.write("latin1.txt", "caf\xe9\n".encode("latin-1")),
                                "--input-format", "text", *SP_TOK], "latin1.txt"),
    pre("bad gzip", lambda c: ["--input", c.write("broken.jsonl.gz", b"this is not gzip"), *SP_TOK],
        "broken.jsonl.gz"),
    pre("unknown tokenizer type", lambda c: ["--input", _good(c), "--tokenizer-type", "NoSuchTokenizer"],
        "NoSuchTokenizer"),
    pre("no tokenizer type", lambda c: ["--input", _good(c)], "--tokenizer-type"),
    pre("missing tokenizer model", lambda c: ["--input", _good(c), "--tokenizer-type", "SentencePieceTokenizer",
                                              "--tokenizer-model", str(c.tmp / "missing.model")], "missing.model"),
    pre("corrupt tokenizer model", lambda c: ["--input", _good(c), "--tokenizer-type", "SentencePieceTokenizer",
                                              "--tokenizer-model", c.write("garbage.model", b"not a model")],
        "garbage.model"),
    pre("gpt2 without vocab", lambda c: ["--input", _good(c), "--tokenizer-type", "GPT2BPETokenizer"],
        "--vocab-file"),
    # offline tokenizers: what is missing, before any output (megatron_lbp/integration/tokenizer_check.py)
    pre("gpt2 without merges", lambda c: ["--input", _good(c), *GPT2, "--vocab-file", c.gpt2()[0]],
        "--merge-file not given"),
    pre("gpt2 vocab file missing", lambda c: ["--input", _good(c), *_gpt2_files(str(c.tmp / "nope.json"),
                                                                                c.gpt2()[1])], "nope.json"),
    pre("gpt2 vocab not JSON", lambda c: ["--input", _good(c), *_gpt2_files(c.write("v.json", "{oops"),
                                                                            c.gpt2()[1])], "v.json is not JSON"),
    pre("gpt2 vocab without <|endoftext|>", lambda c: ["--input", _good(c), *_gpt2_files(
        *c.gpt2({"<|endoftext|>": None}))], "has no <|endoftext|>"),
    pre("gpt2 merges do not fit the vocab", lambda c: ["--input", _good(c), *_gpt2_files(
        c.gpt2()[0], c.write("m.txt", "#version: 0.2\nzzzq qqqz\n"))], "--merge-file"),
    pre("HuggingFaceTokenizer hub name", lambda c: ["--input", _good(c), *HF, "gpt2"],
        "--tokenizer-model gpt2 is not a local directory"),
    pre("HuggingFaceTokenizer directory it cannot load (no transformers, or not a tokenizer)",
        lambda c: ["--input", _good(c), *HF, str(Path(c.write("hfdir/notes.txt", "x")).parent)], "hfdir"),
    pre("SentencePiece without model", lambda c: ["--input", _good(c), "--tokenizer-type", "Llama2Tokenizer"],
        "--tokenizer-model"),
    pre("NullTokenizer without vocab size", lambda c: ["--input", _good(c), "--tokenizer-type", "NullTokenizer"],
        "--vocab-size"),
    pre("workers 0", lambda c: ["--input", _good(c), "--workers", "0", *SP_TOK], "--workers"),
    pre("output under a file", lambda c: ["--input", _good(c), *SP_TOK, "--output-prefix",
                                          str(Path(c.write("afile", "x")) / "sub" / "ds")], "afile"),
]


TOKENIZER_CHECK = [
    Case("tokenizer_check no GPT-2 files (the default type)", "tokenizer_check", lambda c: ["--num-layers", "2"],
         ("GPT2BPETokenizer needs --vocab-file and --merge-file",)),
    Case("tokenizer_check HuggingFaceTokenizer hub name", "tokenizer_check", lambda c: [*HF, "gpt2"],
         ("--tokenizer-model gpt2 is not a local directory",)),
    Case("tokenizer_check gpt2 vocab without <|endoftext|>", "tokenizer_check",
         lambda c: _gpt2_files(*c.gpt2({"<|endoftext|>": None})), ("vocab.json has no <|endoftext|>",)),
]


def _partial_survey() -> str:
    """A link survey as its writer leaves it before the last key: no "complete"."""
    import json

    from megatron_lbp.projection import survey_file as sf

    return json.dumps({"schema": sf.SCHEMA, "version": sf.VERSION, "convention": sf.CONVENTION,
                       "machine": {"nodes": 4, "tasks_per_node": 8, "gcds_per_package": 2,
                                   "world": 32},
                       "shapes": {"node": {"group_size": 8, "groups": 4, "link": "node"}},
                       "tables": [{"op": "all_gather", "dtype": "bf16", "shape": "node",
                                   "group_size": 8, "bytes": [1048576],
                                   "sent_bytes": [917504.0], "seconds": [1e-4],
                                   "seconds_min": [1e-4], "seconds_max": [1e-4]}]}, indent=1)


def launch(name, script, args, env, needles, code=-1, build=None):
    needles = (needles,) if isinstance(needles, str) else needles

    def argv(c):
        if build:
            build(c)
        return [script, *args]
    return Case("launcher " + name, "launcher", argv, needles, env=env, code=code)


# 4 nodes: the 20B profile's honest per-GCD total (plan state + transient + activations +
# margin) needs at least 3, so a smaller base would be refused for memory before the input.
IN_JOB = {"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "4", "NNODES": "4"}
# A job with two hours left (Slurm >= 23.02 sets SLURM_JOB_END_TIME) on this CPU-only machine.
IN_A_JOB = {**IN_JOB, "SLURM_JOB_END_TIME": str(int(time.time()) + 10 ** 6), "LBP_REQUIRE_GPU": "none"}
SMALL = {"NUM_LAYERS": "2", "HIDDEN_SIZE": "256", "NUM_ATTENTION_HEADS": "4", "SEQ_LENGTH": "256"}
DRY = {"NNODES": "4"}
LAUNCHER = [
    *[launch(f"{var} unset", SCRIPTS["20b"], [], {**IN_JOB, var: None}, f"{var} is not set")
      for var in ("DATA_PATH", "VOCAB_FILE", "MERGE_FILE", "CHECKPOINT_DIR")],
    launch("data file missing", SCRIPTS["20b"], [], {"NNODES": "2", "DATA_PATH": "{tmp}/nope"},
           ("nope.bin", "set DATA_PATH")),
    launch("vocab file missing", SCRIPTS["20b"], [], {"NNODES": "2", "VOCAB_FILE": "{tmp}/nope.json"},
           ("VOCAB_FILE=", "does not exist")),
    # a profile without #SBATCH -N (the shipped ones have it: a dry run takes it)
    launch("no node count", SCRIPTS["20b"], ["--dry-run"],
           {"NNODES": None, "LBP_PROFILE_SCRIPT": "{tmp}/custom_profile.sh"},
           "node count unknown: submit with sbatch -N"),
    launch("NNODES=0", SCRIPTS["20b"], ["--dry-run"], {"NNODES": "0"}, "NNODES=0 is not a node count"),
    launch("NNODES=two", SCRIPTS["20b"], ["--dry-run"], {"NNODES": "two"}, "NNODES=two is not a node count"),
    launch("NNODES=5 does not divide the batch", SCRIPTS["20b"], ["--dry-run"], {"NNODES": "5"},
           "use NNODES in {1 2 3 4 6 8 12 16 24 32 48 64 96 192}"),
    launch("NNODES disagrees with SLURM_JOB_NUM_NODES", SCRIPTS["20b"], ["--dry-run"],
           {"NNODES": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "1"}, ("NNODES=4", "this allocation has 2 node(s)")),
    launch("secondary group 3", SCRIPTS["20b"], [], {"LBP_DRY_RUN": "1", "NNODES": "2",
                                                     "HIER_SECONDARY_GROUP_SIZE": "3"},
           "HIER_SECONDARY_GROUP_SIZE=3"),
    launch("secondary group across nodes", SCRIPTS["20b"], ["--dry-run"],
           {"NNODES": "2", "HIER_SECONDARY_GROUP_SIZE": "16"}, ("HIER_SECONDARY_GROUP_SIZE", "gathered inside one node")),
    launch("TASKS_PER_NODE=7", SCRIPTS["20b"], ["--dry-run"], {"NNODES": "2", "TASKS_PER_NODE": "7"},
           "must divide TASKS_PER_NODE=7"),
    launch("outside Slurm without dry run", SCRIPTS["10b"], [], {"NNODES": "2"}, "not inside a Slurm allocation"),
    launch("unpatched Megatron-LM tree", SCRIPTS["20b"], ["--dry-run"],
           {"NNODES": "2", "MEGATRON_LM_DIR": "{megatron_tree}"}, ("is not patched", "scripts/apply_patches.sh")),
    launch("MEGATRON_LM_DIR without pretrain_gpt.py", SCRIPTS["20b"], ["--dry-run"],
           {"NNODES": "2", "MEGATRON_LM_DIR": "{tmp}/none"}, "has no pretrain_gpt.py"),
    launch("local profile, data missing", LOCAL, ["--dry-run"],
           {"NNODES": "2", "DATA_PATH": "{tmp}/nope", "TOKENIZER_MODEL": str(REPO / "tokenizer" / "lbp_bpe.model")},
           "DATA_PATH"),
    launch("local profile, NNODES=two", LOCAL, ["--dry-run"], {"NNODES": "two"}, "NNODES=two"),
    # the content checks (real files; the site's stand-ins are not a dataset): data tokenized
    # with another vocabulary stops the dry run before anything else
    launch("data tokenized with another tokenizer", SCRIPTS["20b"], ["--dry-run"],
           {"NNODES": "4", "LBP_CHECK_CONTENTS": "1", "TOKENIZER_TYPE": "SentencePieceTokenizer",
            "TOKENIZER_MODEL": str(REPO / "tokenizer" / "lbp_bpe.model"),
            "DATA_PATH": "{tmp}/foreign_text_document"},
           ("holds token id 9999", "another tokenizer"), build=lambda c: _foreign_data(c)),
    launch("HuggingFaceTokenizer given a hub name", SCRIPTS["20b"], ["--dry-run"],
           {"NNODES": "2", "TOKENIZER_TYPE": "HuggingFaceTokenizer", "TOKENIZER_MODEL": "gpt2"},
           ("TOKENIZER_MODEL=gpt2 is not a local directory",)),
    # a link survey (projection/survey_file.py) cut off before it finished, or not JSON at all
    launch("LBP_SURVEY cut off", SCRIPTS["20b"], ["--dry-run"],
           {**DRY, "LBP_SURVEY": "{tmp}/lbp_survey.json"},
           ("LBP_SURVEY=", "lbp_survey.json", 'no "complete": true'),
           build=lambda c: c.write("lbp_survey.json", _partial_survey())),
    launch("LBP_SURVEY not JSON", SCRIPTS["20b"], ["--dry-run"],
           {**DRY, "LBP_SURVEY": "{tmp}/lbp_survey.json"}, ("lbp_survey.json", "not JSON"),
           build=lambda c: c.write("lbp_survey.json", _partial_survey()[:200])),
    launch("LBP_LINK_SURVEY=yes", SCRIPTS["20b"], ["--dry-run"], {**DRY, "LBP_LINK_SURVEY": "yes"},
           "LBP_LINK_SURVEY=yes"),
    # the campaign's settings
    launch("--chain 0", SCRIPTS["20b"], ["--dry-run", "--chain", "0"], DRY, "--chain 0"),
    launch("--chain without a count", SCRIPTS["20b"], ["--dry-run", "--chain"], DRY, "--chain"),
    launch("RECOMPUTE=partial", SCRIPTS["20b"], ["--dry-run"], {**DRY, "RECOMPUTE": "partial"},
           "RECOMPUTE=partial"),
    launch("MICRO_BATCH_SIZE=big", SCRIPTS["20b"], ["--dry-run"], {**DRY, "MICRO_BATCH_SIZE": "big"},
           "MICRO_BATCH_SIZE=big"),
    launch("HIER_MAX_PENDING_REDUCES=0", SCRIPTS["20b"], ["--dry-run"],
           {**DRY, "HIER_MAX_PENDING_REDUCES": "0"}, "HIER_MAX_PENDING_REDUCES=0"),
    launch("HIER_EMBEDDING_BACKWARD_GATHER=maybe", SCRIPTS["20b"], ["--dry-run"],
           {**DRY, "HIER_EMBEDDING_BACKWARD_GATHER": "maybe"}, "HIER_EMBEDDING_BACKWARD_GATHER=maybe"),
    launch("SAVE_INTERVAL=often", SCRIPTS["20b"], ["--dry-run"], {**DRY, "SAVE_INTERVAL": "often"},
           "SAVE_INTERVAL=often"),
    launch("EXIT_DURATION_MINS=soon", SCRIPTS["20b"], ["--dry-run"],
           {**DRY, "EXIT_DURATION_MINS": "soon"}, "EXIT_DURATION_MINS=soon"),
    launch("LBP_KEEP_LAST=0", SCRIPTS["20b"], ["--dry-run"], {**DRY, "LBP_KEEP_LAST": "0"},
           "LBP_KEEP_LAST=0"),
    launch("LBP_WRITE_GBPS=0", SCRIPTS["20b"], ["--dry-run"], {**DRY, "LBP_WRITE_GBPS": "0"},
           "LBP_WRITE_GBPS=0"),
    launch("SBATCH_SIGNAL without seconds", SCRIPTS["20b"], ["--dry-run"],
           {**DRY, "SBATCH_SIGNAL": "TERM@soon"}, "LBP_SIGNAL_S=soon"),
    launch("LBP_HEALTH_CHECK=maybe", SCRIPTS["20b"], ["--dry-run"],
           {**DRY, "LBP_HEALTH_CHECK": "maybe"}, "LBP_HEALTH_CHECK=maybe"),
    launch("LBP_HEALTH_EXPECT_GBPS=package=fast", SCRIPTS["20b"], ["--dry-run"],
           {**DRY, "LBP_HEALTH_EXPECT_GBPS": "package=fast"}, "LBP_HEALTH_EXPECT_GBPS=package=fast"),
    launch("LBP_REQUIRE_GPU=tpu", SCRIPTS["20b"], ["--dry-run"], {**DRY, "LBP_REQUIRE_GPU": "tpu"},
           "LBP_REQUIRE_GPU=tpu"),
    launch("LBP_SBCAST_ENV missing", SCRIPTS["20b"], ["--dry-run"],
           {**DRY, "LBP_SBCAST_ENV": "{tmp}/env.tar.gz"}, ("LBP_SBCAST_ENV=", "env.tar.gz")),
    launch("a flag the environment cannot serve", SCRIPTS["20b"], ["--dry-run"],
           {**DRY, "EXTRA_ARGS": "--transformer-impl transformer_engine"}, "--transformer-impl"),
    # refusals inside a job, before anything is written or any srun
    launch("GPU profile on a CPU-only torch", SCRIPTS["20b"], [],
           {**IN_A_JOB, "LBP_REQUIRE_GPU": None}, ("torch.version.hip=None", "needs the ROCm build"),
           code=4),
    launch("less free space than two checkpoints", SCRIPTS["20b"], [], IN_A_JOB,
           ("CHECKPOINT_DIR=", "two checkpoints need 2 x"), code=4),
    launch("job too short to train", SCRIPTS["20b"], [],
           {**IN_A_JOB, **SMALL, "SLURM_JOB_END_TIME": str(int(time.time()) + 90)},
           ("less than one minute of training", "longer -t"), code=4),
    launch("chain without progress", SCRIPTS["20b"], ["--chain", "3"],
           {**IN_A_JOB, **SMALL, "LBP_CHAIN_PREVIOUS_ITERATION": "0", "LBP_CHAIN_PREVIOUS_JOB": "41"},
           ("no progress since job 41", "not submitting the next job"), code=5),
    launch("torn tracker in CHECKPOINT_DIR", SCRIPTS["20b"], [], {**IN_A_JOB, **SMALL},
           ("latest_checkpointed_iteration.txt", "not an iteration number"),
           build=lambda c: c.write("ckpt/latest_checkpointed_iteration.txt", "")),
]

APPLY = [
    Case("apply_patches missing tree", "apply_patches", lambda c: [str(c.tmp / "nowhere")], ("nowhere", "not found")),
    Case("apply_patches other Megatron version", "apply_patches", lambda c: [str(_other_version(c))],
         ("refusing to patch",)),
    Case("apply_patches no argument", "apply_patches", lambda c: [], ("apply_patches",)),
    Case("apply_patches --check of an unpatched tree", "apply_patches",
         lambda c: ["--check", str(_megatron_tree(c.tmp))], ("Megatron-LM", "is not patched"), code=1),
]


def _other_version(c):
    tree = _megatron_tree(c.tmp)
    (tree / "megatron" / "training" / "training.py").write_text("# another version\n")
    return tree


def train(name, build, needles, env=None, slow=True, fresh=False):
    return Case("pretrain " + name, "pretrain", build, tuple(needles), env=env or {}, slow=slow,
                fresh=fresh)


def _base(c, *extra, data=None):
    return TINY + ["--data-path", data or c.data(), "--train-iters", "2", "--global-batch-size", "2",
                   "--save", str(c.tmp / "save"), "--save-interval", "1", *extra]


def _without_tokenizer(args):
    i = args.index("--tokenizer-type")
    assert args[i + 2] == "--tokenizer-model", args[i:i + 4]
    return args[:i] + args[i + 4:]


def _swap(args, flag, value):
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def _drop(args, flag):
    i = args.index(flag)
    return args[:i] + args[i + 2:]


def _few_documents(c, n=300):
    """``n`` short documents of ids the shipped tokenizer has: a newcomer's small set."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(c.tmp / "few_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for i in range(n):
        builder.add_document(torch.arange(i, i + 200) % 4000 + 3, [200])
    builder.finalize(prefix + ".idx")
    return prefix


def _foreign_data(c):
    """Token ids up to 9999: tokenized with another vocabulary than the shipped 4096-token one."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(c.tmp / "foreign_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for start in range(0, 10000, 500):
        builder.add_document(torch.arange(start, start + 500), [500])
    builder.finalize(prefix + ".idx")
    return prefix


def _load(c, ckpt, *extra):
    return _base(c, "--load", str(ckpt), "--ckpt-format", "torch_dist", *extra)


def _without_metadata(c, step=None):
    ckpt = c.checkpoint()
    (it,) = [p for p in ckpt.iterdir() if p.name.startswith("iter_")]
    if step is not None:  # a later save torn by a kill: its shards, no metadata.json, tracker not moved
        torn = ckpt / f"iter_{step:07d}"
        shutil.copytree(it, torn)
        it = torn
    (it / "metadata.json").unlink()
    return ckpt


def _truncated(c, name="__0_0.distcp"):
    ckpt = c.checkpoint()
    (path,) = list(ckpt.glob(f"iter_*/{name}"))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return ckpt


def _shard_removed(c):
    ckpt = c.checkpoint()
    (path,) = list(ckpt.glob("iter_*/__0_0.distcp"))
    path.unlink()
    return ckpt


def _torn_tracker(c, text):
    ckpt = c.tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text(text)
    return ckpt


FOUR_RANKS_ONE_NODE = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}   # rank 0's view of a 4-rank job
SLURM_ONE_TASK = {"RANK": None, "LOCAL_RANK": None, "WORLD_SIZE": None, "LOCAL_WORLD_SIZE": None,
                  "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
                  "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1", "SLURM_JOB_NUM_NODES": "1"}

PRETRAIN = [
    # data and tokenizer
    train("missing data", lambda c: _base(c, data=str(c.tmp / "nothing")),
          ["--data-path", "nothing.bin does not exist"], slow=False, fresh=True),
    train("empty data files", lambda c: _base(c, data=(c.write("empty.bin", b""), c.write("empty.idx", b""),
                                                       str(c.tmp / "empty"))[2]), ["--data-path", "is empty"]),
    train("corrupt data index", lambda c: _base(c, data=(c.write("bad.bin", b"\0" * 64),
                                                         c.write("bad.idx", b"garbage" * 10),
                                                         str(c.tmp / "bad"))[2]),
          ["--data-path", "cannot read the indexed dataset"]),
    train("data tokenized with another vocabulary", lambda c: _base(c, data=_foreign_data(c)),
          ["--data-path", "token id 9999", "vocabulary of 4096"]),
    train("missing tokenizer model", lambda c: _swap(_base(c), "--tokenizer-model", str(c.tmp / "none.model")),
          ["--tokenizer-model", "does not exist"], slow=False),
    train("corrupt tokenizer model",
          lambda c: _swap(_base(c), "--tokenizer-model", c.write("garbage.model", b"not a model")),
          ["--tokenizer-model", "garbage.model", "does not load"], slow=False),  # refused before Megatron
    train("no tokenizer flags (Megatron's default GPT2BPETokenizer, no files)",
          lambda c: _without_tokenizer(_base(c)), ["GPT2BPETokenizer needs --vocab-file and --merge-file"],
          slow=False),
    train("gpt2 vocab without <|endoftext|>",
          lambda c: _without_tokenizer(_base(c)) + _gpt2_files(*c.gpt2({"<|endoftext|>": None})),
          ["--vocab-file", "has no <|endoftext|>"], slow=False),
    train("HuggingFaceTokenizer hub name", lambda c: _without_tokenizer(_base(c)) + [*HF, "gpt2"],
          ["--tokenizer-model gpt2 is not a local directory"], slow=False),
    train("NullTokenizer vocabulary below the data's ids",
          lambda c: _without_tokenizer(_base(c)) + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
          ["--data-path", "token id", "vocabulary of 100"]),
    train("tokenizer vocabulary other than the model's",
          lambda c: _without_tokenizer(_base(c, "--pretrained-checkpoint", str(c.checkpoint())))
          + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "5000"],
          ["--pretrained-checkpoint", "vocabulary of 5000 (padded to 5120", "model's vocabulary of 4096"]),
    # a few hundred documents
    train("Megatron's default split on a few hundred documents", lambda c: _drop(_base(c, data=_few_documents(c)),
                                                                                 "--split"),
          ["--split 969,30,1 (Megatron's default)", "test split none of the 300 documents"], slow=False),
    train("validation split of 0 read by --eval-iters",
          lambda c: _swap(_swap(_base(c), "--split", "100,0,0"), "--eval-iters", "5"),
          ["--split 100,0,0", "validation split no share", "--eval-iters 5", "--eval-iters 0"], slow=False),
    # checkpoints
    train("a finished run continued with more iterations, no scheduler flag",
          lambda c: _swap(_load(c, c.checkpoint()), "--train-iters", "4"),
          ["--load", "decay samples 4 (checkpoint) vs 8 (now)", "--override-opt_param-scheduler",
           "--use-checkpoint-opt_param-scheduler"], slow=False),
    train("a Megatron assert without a message",
          lambda c: _swap(_base(c, "--save-retain-interval", "3"), "--save-interval", "2"),
          ["Megatron's argument check `assert args.save_retain_interval % args.save_interval == 0`"]),
    train("checkpoint of another model shape",
          lambda c: _swap(_load(c, c.checkpoint()), "--hidden-size", "32"),
          ["--load", "another model shape", "hidden-size 64 (checkpoint) vs 32 (now)"]),
    train("checkpoint without metadata.json", lambda c: _load(c, _without_metadata(c)),
          ["--load", "no metadata.json"]),
    train("--ckpt-step at a save torn by a kill", lambda c: _load(c, _without_metadata(c, 4), "--ckpt-step", "4"),
          ["--load", "iter_0000004", "no metadata.json"]),
    train("truncated checkpoint file", lambda c: _load(c, _truncated(c)), ["--load", "__0_0.distcp is truncated"]),
    train("checkpoint shard missing", lambda c: _load(c, _shard_removed(c)), ["--load", "__0_0.distcp is missing"]),
    train("checkpoint .metadata truncated", lambda c: _load(c, _truncated(c, ".metadata")),
          ["--load", ".metadata"]),
    train("torn (empty) tracker", lambda c: _load(c, _torn_tracker(c, "")),
          ["--load", "latest_checkpointed_iteration.txt", "not an iteration number"], slow=False),
    train("garbage tracker", lambda c: _load(c, _torn_tracker(c, "iter_12\n")),
          ["--load", "latest_checkpointed_iteration.txt", "'iter_12'"]),
    # flags the hierarchy cannot serve, groups that do not nest or co-locate
    train("--use-distributed-optimizer", lambda c: _base(c, "--hier-partition", "--use-distributed-optimizer"),
          ["--use-distributed-optimizer"]),
    train("grad group does not divide", lambda c: _base(c, "--hier-partition", "--hier-grad-group-size", "3"),
          ["--hier-grad-group-size=3"]),
    train("negative prefetch depth", lambda c: _base(c, "--hier-partition", "--hier-prefetch-units", "-1"),
          ["--hier-prefetch-units=-1"]),
    train("no reduce-scatter in flight", lambda c: _base(c, "--hier-partition",
                                                         "--hier-max-pending-reduces", "0"),
          ["--hier-max-pending-reduces=0", "an integer >= 1"]),
    train("preset contradicted", lambda c: _base(c, "--hier-partition", "--hier-preset", "zero3",
                                                 "--hier-param-group-size", "2"),
          ["contradicts --hier-preset zero3"]),
    train("unknown preset", lambda c: _base(c, "--hier-partition", "--hier-preset", "zero4"),
          ["--hier-preset", "zero4"], slow=False),
    train("groups not co-located", lambda c: _base(c, "--hier-partition", "--hier-gpus-per-node", "4",
                                                   "--hier-param-group-size", "3", "--hier-grad-group-size", "6",
                                                   "--hier-optim-group-size", "12", "--global-batch-size", "24"),
          ["--hier-param-group-size=3"], env={"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "4"}),
    train("groups do not nest", lambda c: _base(c, "--hier-partition", "--hier-gpus-per-node", "4",
                                                "--hier-param-group-size", "4", "--hier-grad-group-size", "2",
                                                "--global-batch-size", "8"),
          ["--hier-param-group-size"], env=FOUR_RANKS_ONE_NODE),
    train("--hier-gpus-per-node vs LOCAL_WORLD_SIZE", lambda c: _base(c, "--hier-partition",
                                                                      "--hier-gpus-per-node", "2"),
          ["--hier-gpus-per-node=2", "LOCAL_WORLD_SIZE"], slow=False),
    train("--hier-gpus-per-node vs Slurm", lambda c: _base(c, "--hier-partition", "--hier-gpus-per-node", "2"),
          ["--hier-gpus-per-node=2"], env=SLURM_ONE_TASK),
    train("batch does not divide over the ranks (Megatron's own check)",
          lambda c: _base(c, "--hier-partition", "--hier-gpus-per-node", "4"),
          ["global_batch_size"], env=FOUR_RANKS_ONE_NODE),
    train("unpatched Megatron with LBP_RUNTIME_HOOKS=0", lambda c: _base(c, "--hier-partition"),
          ["LBP_RUNTIME_HOOKS=0", "is not patched"], env={"LBP_RUNTIME_HOOKS": "0"}),
    # what the engine cannot serve: refused by megatron_lbp.capabilities from the argument list
    # alone, before torch or Megatron is imported (a fraction of a second a row)
    *[train(" ".join(flags), lambda c, f=flags: _base(c, "--hier-partition", *f), needles,
            slow=False) for flags, needles in [
        (["--cuda-graph-impl", "local"], ["--cuda-graph-impl local", "CUDA graphs"]),
        (["--enable-cuda-graph"], ["--enable-cuda-graph", "CUDA graphs"]),
        (["--external-cuda-graph"], ["--external-cuda-graph", "CUDA graphs"]),
        (["--fp8-param-gather"], ["--fp8-param-gather", "fp8 parameters"]),
        (["--overlap-grad-reduce"], ["--overlap-grad-reduce", "--hier-overlap"]),
        (["--overlap-param-gather"], ["--overlap-param-gather", "--hier-overlap"]),
        (["--use-torch-fsdp2"], ["--use-torch-fsdp2"]),
        (["--use-megatron-fsdp"], ["--use-megatron-fsdp"]),
        (["--init-model-with-meta-device"], ["--init-model-with-meta-device", "uninitialized"]),
        # features that read whole weights between steps, where a rank holds only its slices
        (["--check-weight-hash-across-dp-replicas-interval", "2"],
         ["--check-weight-hash-across-dp-replicas-interval 2", "only its slices"]),
        (["--save-params-interval", "2"], ["--save-params-interval 2", "only its slices"]),
        (["--save-wgrads-interval", "2"], ["--save-wgrads-interval 2", "only its slices"]),
        (["--qk-clip"], ["--qk-clip", "only its slices"]),
        (["--log-max-attention-logit"], ["--log-max-attention-logit", "only its slices"])]],
    # what this environment cannot serve (after torch is imported, before Megatron)
    train("--transformer-impl transformer_engine without Transformer Engine",
          lambda c: _base(c, "--transformer-impl", "transformer_engine"),
          ["--transformer-impl transformer_engine", "Transformer Engine"], slow=False),
    train("LBP_DEVICE=gpu where torch sees no GPU", lambda c: _base(c), ["LBP_DEVICE=gpu"],
          env={"LBP_DEVICE": "gpu"}, slow=False),
    # megatron-core 0.19.2's recomputation paths that cannot run here (stock Megatron neither:
    # tests/multirank/test_recompute_modules.py)
    train("--recompute-modules mlp with linear biases",
          lambda c: _base(c, "--hier-partition", "--recompute-granularity", "selective",
                          "--recompute-modules", "core_attn", "mlp"),
          ["--recompute-modules mlp with linear biases", "--disable-bias-linear"], slow=False),
    # these reach Megatron's parser (a start-up each)
    train("--hier-collective-timeout-s too short for the NCCL verdict",
          lambda c: _base(c, "--hier-partition", "--hier-collective-timeout-s", "20"),
          ["--hier-collective-timeout-s 20", "at least 50"], env={"LBP_FAULT_STALL_WATCH": "1"}),
]

def hf(name, build, needles):
    return Case("hf " + name, "hf", build, tuple(needles))


def _truncated_weights(c):
    model = c.hf_model()
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 1000])
    return ["import", str(model), str(c.tmp / "imported")]


def _index_naming_a_missing_tensor(c):
    import json

    from safetensors import safe_open

    model = c.hf_model()
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    weight_map = {n: "model.safetensors" for n in names + ["model.layers.7.mlp.up_proj.weight"]}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return ["import", str(model), str(c.tmp / "imported")]


def _truncated_bin(c):
    import torch
    from safetensors.torch import load_file

    model = c.hf_model()
    torch.save(load_file(str(model / "model.safetensors")), str(model / "pytorch_model.bin"))
    (model / "model.safetensors").unlink()
    blob = (model / "pytorch_model.bin").read_bytes()
    (model / "pytorch_model.bin").write_bytes(blob[: len(blob) // 2])
    return ["import", str(model), str(c.tmp / "imported")]


def _export_into_foreign(c):
    from megatron_lbp.hf.importer import import_model

    import_model(str(c.hf_model()), str(c.tmp / "imported"))
    c.write("hf-out/config.json", "{}")
    return ["export", str(c.tmp / "imported"), str(c.tmp / "hf-out"), "--hf-files", str(c.tmp / "imported" / "hf")]


HF_ROWS = [
    hf("import of a truncated safetensors file", _truncated_weights, ["model.safetensors is truncated"]),
    hf("import with an index naming a tensor its file lacks", _index_naming_a_missing_tensor,
       ["lacks 1 tensors the index places in it", "model.layers.7.mlp.up_proj.weight"]),
    hf("import of a truncated .bin", _truncated_bin, ["pytorch_model.bin cannot be read"]),
    hf("import into a non-empty directory",
       lambda c: (c.write("imported/notes.txt", "mine"), ["import", str(c.hf_model()), str(c.tmp / "imported")])[1],
       ["imported is not empty (notes.txt)"]),
    hf("export into a directory it did not write", _export_into_foreign,
       ["hf-out is not empty (config.json)", "not written by an export"]),
]

CASES = PLAN + PREPROCESS + TOKENIZER_CHECK + LAUNCHER + APPLY + PRETRAIN + HF_ROWS


# --------------------------------------------------------------------------- running a row

@pytest.fixture(scope="module")
def shared_data(demo_dataset):
    return demo_dataset


@pytest.fixture(scope="module")
def shared_hf_model(tmp_path_factory):
    from tests.helpers import hf_models

    out = tmp_path_factory.mktemp("hf-model") / "model"
    hf_models.make("llama_gqa_untied", str(out))
    return out


@pytest.fixture(scope="module")
def shared_gpt2(tmp_path_factory):
    from megatron_lbp.integration import build_gpt2_bpe as build

    return tuple(map(str, build.build(tmp_path_factory.mktemp("gpt2"))))


@pytest.fixture(scope="module")
def shared_checkpoint(tmp_path_factory, shared_data):
    ckpt = tmp_path_factory.mktemp("ckpt")
    code, log, _ = run_pretrain(1, TINY + ["--data-path", shared_data, "--train-iters", "2",
                                           "--global-batch-size", "2", "--save", str(ckpt),
                                           "--save-interval", "2", "--ckpt-format", "torch_dist"])
    assert code == 0, why(log)
    return ckpt


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size if p.is_file() else 0,
                                        p.stat().st_mtime_ns)
            for p in root.rglob("*")}


def _env(overrides: dict, base: dict) -> dict:
    env = dict(base)
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _case_env(case: Case, ctx: Ctx) -> dict:
    """The row's variables with {tmp} and {megatron_tree} (built now, before the snapshot) filled in."""
    fill = {"tmp": str(ctx.tmp)}
    if any("{megatron_tree}" in str(v) for v in case.env.values()):
        fill["megatron_tree"] = str(_megatron_tree(ctx.tmp))
    return {k: (v.format(**fill) if isinstance(v, str) else v) for k, v in case.env.items()}


def _run(case: Case, ctx: Ctx, argv: list, env_over: dict, site_env: dict | None):
    base = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if case.entry == "plan":
        cmd, env = [PY, "-m", "megatron_lbp.plan", *argv], base
    elif case.entry == "preprocess":
        if "--output-prefix" not in argv:
            argv = argv + ["--output-prefix", str(ctx.tmp / "out" / "sub" / "ds")]
        if case.in_process:
            return _preprocess_in_process(argv)
        cmd, env = [PY, "-m", "megatron_lbp.preprocess_data", *argv], base
    elif case.entry == "tokenizer_check":
        cmd, env = [PY, "-m", "megatron_lbp.tokenizer_check", *argv], base
    elif case.entry == "hf":
        cmd, env = [PY, "-m", "megatron_lbp.hf", *argv], base
    elif case.entry == "apply_patches":
        cmd, env = ["bash", str(REPO / "scripts" / "apply_patches.sh"), *argv], base
    elif case.entry == "launcher":
        cmd, env = ["bash", str(argv[0]), *argv[1:]], _env(env_over, site_env)
        env_over = {}
    elif case.entry == "pretrain":
        single = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}   # no peer needs it
        cmd, env = [PY, "-m", "megatron_lbp.pretrain_gpt", *argv], _env(single, base)
        if not case.fresh:
            # Forked from the harness's server with torch and Megatron imported (~5 s of CPU a
            # fresh interpreter spends before it reads an argument): the entry's own main(),
            # the whole environment and the working directory as exec gives them. The
            # interpreter start-up itself is covered by the rows marked fresh.
            from megatron_lbp.testing.entry import run_entry_captured

            return run_entry_captured(argv, _env(env_over, env), ctx.tmp, timeout=600)
    else:
        raise AssertionError(case.entry)
    env = _env(env_over, env)
    return subprocess.run(cmd, cwd=ctx.tmp, env=env, capture_output=True, text=True, timeout=600)


def _preprocess_in_process(argv):
    """python -m megatron_lbp.preprocess_data's main(argv) as its __main__ runs it; an escaping
    exception fails the row."""
    import contextlib
    import io
    import types

    from megatron_lbp.integration import preprocess_data as module

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = module.main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def _param(case):
    marks = [pytest.mark.slow] if case.slow else []
    return pytest.param(case, id=case.id, marks=marks)


def test_every_row_has_a_unique_id():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert {c.entry for c in CASES} == {"plan", "preprocess", "tokenizer_check", "launcher", "apply_patches",
                                        "pretrain", "hf"}


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input(case, tmp_path, request):
    if case.entry == "launcher":
        site = request.getfixturevalue("site")
        tmp, site_env = site["tmp"], site["env"]
    else:
        tmp, site_env = tmp_path / "case", None
        tmp.mkdir()
    ctx = Ctx(tmp, request)
    argv, env = case.build(ctx), _case_env(case, ctx)
    before = _snapshot(tmp)
    r = _run(case, ctx, argv, env, site_env)
    output = r.stdout + r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith(NOTICES)]
    shown = f"exit {r.returncode}\nstderr:\n{r.stderr[-3000:]}\nstdout tail:\n{r.stdout[-1500:]}"
    assert r.returncode != 0, f"accepted the bad input: {shown}"
    code = EXIT[case.entry] if case.code == -1 else case.code
    assert code is None or r.returncode == code, f"exit {r.returncode}, expected {code}: {shown}"
    assert "Traceback" not in output, f"traceback instead of a message: {shown}"
    assert len(lines) == 1, f"expected a one-line message on stderr, got {len(lines)} lines: {shown}"
    assert lines[0].startswith(PREFIX[case.entry]), f"{lines[0]!r} does not start with {PREFIX[case.entry]}"
    if case.entry == "plan":
        assert r.stdout == "", f"the plan tool printed a plan for bad input: {r.stdout!r}"
    for needle in case.needles:
        assert needle in lines[0], f"{needle!r} not named in {lines[0]!r}"
    assert "iteration        1/" not in output, "training started"
    after = _snapshot(tmp)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"files written or changed by a refused run: {changed}"
