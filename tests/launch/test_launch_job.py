"""python -m megatron_lbp.launch job: the rules of a launch, read from the environment once.

The launchers' own tests (test_launchers.py) run them through the profiles; these call the
Python side directly: what a preset implies and a refusal that stops before anything is
written (the model flags the estimate counts: test_job_env.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lbp.launch import rules

REPO = Path(__file__).resolve().parents[2]
MODEL = {"NUM_LAYERS": "2", "HIDDEN_SIZE": "64", "NUM_ATTENTION_HEADS": "4", "SEQ_LENGTH": "128",
         "GLOBAL_BATCH_SIZE": "16", "LR": "1e-3", "MIN_LR": "1e-4"}


@pytest.mark.parametrize("preset, tasks, secondary", [
    ("lbp", "8", "8"), ("zeropp", "4", "4"), ("zero3", "8", "0"), ("zero2", "8", "0"),
    ("hsdp", "8", "0"), ("distopt", "8", "0"), ("ds-zeropp", "8", "0")])
def test_a_preset_implies_its_secondary_size(preset, tasks, secondary):
    v = rules.settings({**MODEL, "HIER_PRESET": preset, "TASKS_PER_NODE": tasks})
    assert v["HIER_SECONDARY_GROUP_SIZE"] == secondary, (preset, v["HIER_SECONDARY_GROUP_SIZE"])
    # a given size wins; a given scheme is not chosen
    v = rules.settings({**MODEL, "HIER_PRESET": preset, "HIER_SECONDARY_GROUP_SIZE": "2"})
    assert v["HIER_SECONDARY_GROUP_SIZE"] == "2" and "LBP_CHOOSE_SCHEME" not in v


def test_the_scheme_is_chosen_only_when_neither_it_nor_its_copy_is_given():
    assert rules.settings(dict(MODEL))["LBP_CHOOSE_SCHEME"] == "1"
    assert "LBP_CHOOSE_SCHEME" not in rules.settings({**MODEL, "HIER_SECONDARY_GROUP_SIZE": "8"})


def test_derived_defaults_follow_the_device_and_site():
    gpu = rules.settings(dict(MODEL))
    assert (gpu["LBP_REQUIRE_GPU"], gpu["LBP_MEMORY_RESERVE_GB"]) == ("rocm", "4")
    local = rules.settings({**MODEL, "LBP_SITE": "local"})
    assert local["LBP_REQUIRE_GPU"] == "any"
    cpu = rules.settings({**MODEL, "GPUS_PER_TASK": "0"})
    assert (cpu["LBP_REQUIRE_GPU"], cpu["LBP_MEMORY_RESERVE_GB"]) == ("none", "0")


@pytest.mark.parametrize("env, needle", [
    ({"NUM_LAYERS": ""}, "NUM_LAYERS is not set (the profile script sets it)"),
    ({"RECOMPUTE": "partial"}, "RECOMPUTE=partial: use one of auto, none, selective, full"),
    ({"MICRO_BATCH_SIZE": "x"}, "MICRO_BATCH_SIZE=x: use auto or an integer >= 1"),
    ({"HIER_PREFETCH_UNITS": "-1"}, "HIER_PREFETCH_UNITS=-1: use auto or an integer >= 0"),
    ({"HIER_LAYER_UNIT": "split", "RECOMPUTE": "full"}, "HIER_LAYER_UNIT=split with RECOMPUTE=full"),
    ({"LBP_SITE": "moon"}, "LBP_SITE=moon: use frontier or local"),
])
def test_a_refusal_is_one_line_before_anything_is_written(tmp_path, env, needle):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("LBP_", "HIER_", "SLURM_"))}
    e.update(MODEL, NNODES="1", LBP_REPO=str(REPO), **env)
    r = subprocess.run([sys.executable, "-m", "megatron_lbp.launch", "job", "resolve", "--state",
                        str(tmp_path), "--", "--dry-run"], env=e, capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lbp_launch: error: "), r.stderr
    assert needle in lines[0] and list(tmp_path.iterdir()) == [], r.stderr


def test_a_dry_runs_summary_leads_whatever_stops_the_stage(capsys):
    """The stage's lines are shown once it ends: the summary first, with the lines it repeats
    (exit time, what a job would refuse), then every line in the order it was made."""
    from megatron_lbp.launch.job_cli import Screen

    out = Screen()
    out.log("contents: not checked")
    out.lead("exit time: before the estimate, not in a summary")
    out.summary = ["summary:", "  choice: lbp"]
    out.lead("exit time: 116 min")
    out.lines.append("  srun ...")
    out.lead("a job would refuse: CHECKPOINT_DIR=/x: too small")
    out.show()
    assert capsys.readouterr().out.splitlines() == [
        "[lbp] summary:", "[lbp]   choice: lbp", "[lbp]   exit time: 116 min",
        "[lbp]   a job would refuse: CHECKPOINT_DIR=/x: too small",
        "[lbp] contents: not checked", "[lbp] exit time: before the estimate, not in a summary",
        "[lbp] exit time: 116 min", "  srun ...",
        "[lbp] a job would refuse: CHECKPOINT_DIR=/x: too small"]
    out.show()   # shown once
    assert capsys.readouterr().out == ""
