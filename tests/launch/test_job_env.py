"""The launcher's edge into the planner (megatron_lbp/launch/job_env.py): the environment typed
once into the Job the estimate's flags would make, held to the same rules (job_values.py), a
bad value refused in one line that names its variable. Real files, no planning run."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lbp.launch import estimate, health, model_flags, rules
from megatron_lbp.launch.candidates import EstimateError
from megatron_lbp.launch.job_env import job_from_env
from megatron_lbp.projection import survey_file as sf

REPO = Path(__file__).resolve().parents[2]
MODEL = {"NUM_LAYERS": "4", "HIDDEN_SIZE": "256", "NUM_ATTENTION_HEADS": "8", "SEQ_LENGTH": "512",
         "GLOBAL_BATCH_SIZE": "64", "LR": "1e-3", "MIN_LR": "1e-4"}
SHAPE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "512", "--global-batch-size", "64", "--vocab-size", "50304",
         "--max-position-embeddings", "512"]
# rules.settings' defaults as the estimate's flags spell them (GPU profile: 4 GB reserve)
DEFAULTS = ["--gcds-per-package", "2", "--gcd-memory-gb", "64", "--reserve-gb", "4",
            "--train-iters", "150000", "--save-minutes", "45", "--milestone-every", "10000",
            "--write-gbps-per-node", "1", "--save-fixed-s", "60", "--params-dtype", "bf16"]


def _links(tmp_path) -> str:
    path = tmp_path / "links.json"
    health.write_links(str(path), {"package": {0: 180.0}, "node": {0: 40.0},
                                   "network0": {0: 10.0}}, "test")
    return str(path)


def _survey(tmp_path) -> str:
    sent, sec = [1e6, 4e6], [1e-3, 3e-3]
    table = {"op": "all_gather", "dtype": "bf16", "shape": "cross_node", "group_size": 4,
             "bytes": [b * 4 / 3 for b in sent], "sent_bytes": sent, "seconds": sec,
             "seconds_min": [t * 0.9 for t in sec], "seconds_max": [t * 1.2 for t in sec]}
    data = {"schema": sf.SCHEMA, "version": sf.VERSION, "complete": True,
            "convention": sf.CONVENTION,
            "machine": {"nodes": 4, "tasks_per_node": 8, "gcds_per_package": 2, "world": 32},
            "shapes": {"cross_node": {"group_size": 4, "groups": 8, "link": "network"}},
            "tables": [table], "overlap": None, "skipped": []}
    path = tmp_path / "survey.json"
    path.write_text(json.dumps(data))
    return str(path)


def _env(nodes="4", **over) -> dict:
    v = rules.settings({**MODEL, **over})
    v["NNODES_RESOLVED"] = nodes
    return v


def _fields(job) -> dict:
    out = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
    out["survey"] = out["survey"] and out["survey"].survey   # the file's content, read
    return out


def _flags(argv) -> dict:
    return _fields(estimate.job_from_args(estimate.build_parser().parse_args(argv)))


def test_an_explicit_job_is_the_job_its_flags_make(tmp_path):
    links, survey = _links(tmp_path), _survey(tmp_path)
    v = _env(HIER_PRESET="lbp", HIER_SECONDARY_GROUP_SIZE="2", HIER_SECONDARY_DTYPE="bf16",
             HIER_GRAD_REDUCE_DTYPE="bf16", MICRO_BATCH_SIZE="2", RECOMPUTE="selective",
             HIER_PREFETCH_UNITS="0", HIER_MAX_PENDING_REDUCES="3",
             HIER_EMBEDDING_BACKWARD_GATHER="skip", HIER_LAYER_UNIT="split",
             SAVE_INTERVAL="100", LBP_STEP_SECONDS="2.5", LBP_VERBOSE="1",
             LBP_COMPARE_SCHEMES="1", LBP_CHOOSE="0", LBP_LINKS=links, LBP_SURVEY=survey)
    words = ["--swiglu", "--num-layers", "6", "--group-query-attention", "--num-query-groups=2",
             "--normalization", "RMSNorm", "--disable-bias-linear", "--kv-channels", "64"]
    got = _fields(job_from_env(v, words))
    want = _flags(SHAPE + DEFAULTS + [
        "--nodes", "4", "--tasks-per-node", "8", "--preset", "lbp",
        "--hier-secondary-group-size", "2", "--hier-secondary-dtype", "bf16",
        "--hier-grad-reduce-dtype", "bf16", "--micro-batch-size", "2", "--recompute", "selective",
        "--hier-prefetch-units", "0", "--hier-max-pending-reduces", "3",
        "--hier-embedding-backward-gather", "skip", "--hier-layer-unit", "split",
        "--save-interval", "100", "--step-seconds", "2.5", "--verbose", "--compare",
        "--links", links, "--survey", survey, "--num-layers", "6", "--swiglu",
        "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
        "--disable-bias-linear", "--kv-channels", "64"])
    assert got == want, {k: (got[k], want[k]) for k in got if got[k] != want[k]}
    assert got["links"] and got["survey"] and got["num_layers"] == 6


@pytest.mark.parametrize("over, flags", [
    # neither the scheme nor its copy given: the scheme is chosen (preset auto)
    ({}, ["--preset", "auto", "--hier-secondary-group-size", "8", "--choose"]),
    # DeepSpeed's hpZ + quantisation: costed as zeropp at the engine's knob defaults
    ({"HIER_PRESET": "ds-zeropp"},
     ["--preset", "zeropp", "--hier-secondary-group-size", "8", "--choose",
      "--hier-prefetch-units", "1", "--hier-max-pending-reduces", "2",
      "--hier-embedding-backward-gather", "gather", "--hier-layer-unit", "whole"]),
    # stock Megatron's distributed optimizer: costed as zero2
    ({"HIER_PRESET": "distopt", "LBP_CHOOSE": "0"},
     ["--preset", "zero2", "--hier-secondary-group-size", "0",
      "--hier-prefetch-units", "1", "--hier-max-pending-reduces", "2",
      "--hier-embedding-backward-gather", "gather", "--hier-layer-unit", "whole"]),
])
def test_a_scheme_is_costed_as_its_flags_say(over, flags):
    got = _fields(job_from_env(_env(**over), []))
    want = _flags(SHAPE + DEFAULTS + ["--nodes", "4", "--tasks-per-node", "8"] + flags)
    assert got == want, {k: (got[k], want[k]) for k in got if got[k] != want[k]}


def test_the_model_flags_the_last_wins_and_groups_need_gqa():
    given = {"--num-layers": ("NUM_LAYERS", "2"), "--ffn-hidden-size": ("FFN_HIDDEN_SIZE", "")}
    said = []
    got = model_flags.read(given, ["--num-layers", "6", "--num-query-groups", "2", "--swiglu",
                                   "--num-layers=8", "--normalization", "RMSNorm",
                                   "--num-experts", "4"], said.append)
    assert got == {"num_layers": 8, "swiglu": True, "normalization": "RMSNorm"}, got
    assert len(said) == 1 and "--num-experts" in said[0], said
    got = model_flags.read(given, ["--group-query-attention", "--num-query-groups", "2"], print)
    assert got == {"num_layers": 2, "group_query_attention": True, "num_query_groups": 2}, got
    # one table: every flag it reads is one the estimate's command line takes
    assert set(model_flags.FLAGS) <= set(estimate.build_parser()._option_string_actions)


@pytest.mark.parametrize("over, words, says", [
    ({"MICRO_BATCH_SIZE": "x"}, [], "MICRO_BATCH_SIZE=x: use auto or an integer >= 1"),
    ({"RECOMPUTE": "partial"}, [], "RECOMPUTE=partial: use one of auto, none, selective, full"),
    ({"GCD_MEMORY_GB": "lots"}, [], "GCD_MEMORY_GB=lots must be a number"),
    ({"HIER_GRAD_REDUCE_DTYPE": "fp8"}, [], "HIER_GRAD_REDUCE_DTYPE=fp8: use one of fp32, bf16"),
    ({"NUM_LAYERS": "four"}, [], "NUM_LAYERS=four must be an integer"),
    ({}, ["--hidden-size", "wide"], "--hidden-size=wide must be an integer"),
    ({}, ["--normalization", "BatchNorm"], "--normalization=BatchNorm: use one of LayerNorm"),
    ({}, ["--kv-channels"], "--kv-channels needs a value"),
    ({"LBP_WRITE_GBPS": "0"}, [], "LBP_WRITE_GBPS=0 must be > 0"),
    ({"LBP_SURVEY": "{tmp}/survey.json"}, [], "LBP_SURVEY={tmp}/survey.json: not a usable link"),
    ({"LBP_LINKS": "{tmp}/none.json"}, [], "LBP_LINKS={tmp}/none.json: "),
])
def test_a_bad_value_is_refused_in_one_line_naming_its_variable(tmp_path, over, words, says):
    (tmp_path / "survey.json").write_text('{"schema": "not a survey"}')
    v = _env()   # values rules.settings would refuse first are refused here too
    v.update({k: x.format(tmp=tmp_path) for k, x in over.items()})
    with pytest.raises(EstimateError) as exc:
        job_from_env(v, words)
    text = str(exc.value)
    assert text.startswith(says.format(tmp=tmp_path)) and "\n" not in text, text


def test_the_launcher_refuses_a_malformed_survey_naming_the_variable(tmp_path):
    """Through python -m megatron_lbp.launch job resolve: one line, exit 2, nothing written."""
    bad = tmp_path / "survey.json"
    bad.write_text("not json")
    state = tmp_path / "state"
    state.mkdir()
    e = {k: x for k, x in os.environ.items() if not k.startswith(("LBP_", "HIER_", "SLURM_"))}
    e.update(MODEL, NNODES="1", LBP_REPO=str(REPO), MOCK_DATA="1", TOKENIZER_TYPE="NullTokenizer",
             CHECKPOINT_DIR=str(tmp_path / "ckpt"), LBP_CHECK_CONTENTS="0", GPUS_PER_TASK="0",
             LBP_SURVEY=str(bad))
    r = subprocess.run([sys.executable, "-m", "megatron_lbp.launch", "job", "resolve", "--state",
                        str(state), "--", "--dry-run"], env=e, capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"lbp_launch: error: LBP_SURVEY={bad}: not a usable link survey: not JSON"), r.stderr
    assert list(state.iterdir()) == []
