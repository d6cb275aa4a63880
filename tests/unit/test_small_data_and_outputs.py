"""The checks a newcomer's continued-pretraining run meets first, on their own (no Megatron run).

--split against the document count (megatron_lbp.integration.data_splits), the
resumed schedule against the checkpoint's (schedule_check), output directories
written whole (megatron_lbp.hf.outdir), weight files checked before an import
writes (megatron_lbp.hf.reader). The same refusals through the entry points are
rows of tests/e2e/test_bad_input_matrix.py.
"""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from megatron_lbp.hf import outdir
from megatron_lbp.hf.arch import UnsupportedModel
from megatron_lbp.hf.reader import HFWeights
from megatron_lbp.integration import data_splits, schedule_check


def _split_args(split, eval_iters):
    return argparse.Namespace(split=split, eval_iters=eval_iters)


def test_document_ranges_round_as_megatron_does():
    # megatron-core: begin = round(lo * n), end = round(hi * n) per non-zero share
    assert data_splits.document_ranges("969,30,1", 300) == [(0, 291), (291, 300), (300, 300)]
    assert data_splits.document_ranges("98,2,0", 300) == [(0, 294), (294, 300), None]
    assert data_splits.document_ranges("100,0,0", 7) == [(0, 7), None, None]


@pytest.mark.parametrize("split, eval_iters, needles", [
    ("969,30,1", 100, ("test split none of the 300 documents", "99,1,0")),
    ("969,30,1", 0, ("test split none of the 300 documents",)),       # built whatever reads it
    ("100,0,0", 10, ("validation split no share", "--eval-iters 10", "--eval-iters 0")),
    ("0,100,0", 0, ("training split no share",)),
    ("0,0,0", 0, ("every split a share of 0",)),
])
def test_a_split_that_would_hang_or_crash_is_one_line(split, eval_iters, needles):
    with pytest.raises(data_splits.SplitError) as err:
        data_splits.check(_split_args(split, eval_iters), {"data/docs": 300})
    msg = str(err.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


@pytest.mark.parametrize("split, eval_iters", [("98,2,0", 10), ("99,1,0", 5), ("100,0,0", 0),
                                                ("969,30,1", 100)])
def test_splits_that_hold_documents_pass(split, eval_iters):
    n = 300 if split != "969,30,1" else 2000       # 2000 documents: the test share holds 2
    data_splits.check(_split_args(split, eval_iters), {"data/docs": n})


def test_too_few_documents_to_hold_out_says_so():
    with pytest.raises(data_splits.SplitError) as err:
        data_splits.check(_split_args("98,2,0", 5), {"tiny": 3})
    assert "--split 100,0,0 --eval-iters 0" in str(err.value), err.value


def _sched_args(**over):
    base = dict(train_iters=10, global_batch_size=8, lr_decay_iters=None, lr_warmup_iters=0,
                lr_warmup_fraction=None, lr=1e-3, min_lr=1e-4, lr_decay_style="cosine",
                start_weight_decay=0.01, end_weight_decay=0.01, weight_decay_incr_style="constant",
                override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False,
                finetune=False, no_load_optim=False)
    return argparse.Namespace(**{**base, **over})


def _saved_schedule(args):
    # what megatron-core's OptimizerParamScheduler.state_dict() saves for these arguments
    now = schedule_check.command_schedule(args)
    return {**now, "num_steps": 80}


def test_a_longer_run_conflicts_with_the_saved_schedule_and_the_flags_resolve_it():
    saved = _saved_schedule(_sched_args())
    assert schedule_check.conflicts(_sched_args(), saved) == []
    diffs = schedule_check.conflicts(_sched_args(train_iters=20), saved)
    assert diffs == ["decay samples 80 (checkpoint) vs 160 (now)",
                     "weight-decay samples 80 (checkpoint) vs 160 (now)"], diffs
    msg = schedule_check.message("run", diffs)
    assert "--override-opt_param-scheduler" in msg and "--use-checkpoint-opt_param-scheduler" in msg
    for flag in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        assert schedule_check.conflicts(_sched_args(train_iters=20, **{flag: True}), saved) == []
    # a fixed decay length: only the weight-decay length changes, and it is still named
    assert schedule_check.conflicts(_sched_args(train_iters=20, lr_decay_iters=10), saved) == \
        ["weight-decay samples 80 (checkpoint) vs 160 (now)"]


def test_output_directory_new_empty_or_an_earlier_export(tmp_path):
    out = tmp_path / "out"
    for content in ("first", "second"):
        with outdir.staged(str(out), replaceable=True, what="an export", marker={"n": content}) as stage:
            open(os.path.join(stage, f"{content}.txt"), "w").write(content)
        assert sorted(os.listdir(out)) == sorted([outdir.MARKER, f"{content}.txt"]), os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["out"], "a staging directory was left behind"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    with pytest.raises(outdir.OutputDirError) as err:
        outdir.check_destination(str(foreign), replaceable=True, what="an export")
    assert "not empty (config.json)" in str(err.value), err.value
    # a failure while writing leaves the earlier output as it was and no staging directory
    with pytest.raises(RuntimeError):
        with outdir.staged(str(out), replaceable=True, what="an export", marker={}) as stage:
            open(os.path.join(stage, "partial.txt"), "w").write("x")
            raise RuntimeError("stop")
    assert sorted(os.listdir(out)) == sorted([outdir.MARKER, "second.txt"])
    assert sorted(os.listdir(tmp_path)) == ["foreign", "out"]


def _weights(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "model"
    d.mkdir()
    save_file({"a.weight": torch.ones(64, 32), "b.weight": torch.zeros(32)}, str(d / "model.safetensors"))
    return d


def test_a_truncated_or_inconsistent_weight_file_is_refused_on_opening(tmp_path):
    d = _weights(tmp_path)
    assert sorted(HFWeights(str(d)).file_of) == ["a.weight", "b.weight"]
    path = d / "model.safetensors"
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(UnsupportedModel, match="is truncated: .* its header describes"):
        HFWeights(str(d))
    path.write_bytes(whole[:6])
    with pytest.raises(UnsupportedModel, match="truncated or not a safetensors file"):
        HFWeights(str(d))
    path.write_bytes(whole)
    (d / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a.weight": "model.safetensors", "c.weight": "model.safetensors"}}')
    with pytest.raises(UnsupportedModel, match="lacks 1 tensors the index places in it .first: c.weight"):
        HFWeights(str(d))
    os.unlink(d / "model.safetensors.index.json")
    os.unlink(path)
    torch.save({"a.weight": torch.ones(64, 32)}, str(d / "pytorch_model.bin"))
    blob = (d / "pytorch_model.bin").read_bytes()
    (d / "pytorch_model.bin").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(UnsupportedModel, match="cannot be read as a PyTorch checkpoint"):
        HFWeights(str(d))


def test_save_without_interval_gets_the_run_length_announced():
    from megatron_lbp.integration import run_defaults

    added = []
    run_defaults.add_defaults(["--save", "run", "--train-iters", "30"], lambda f, why: added.append((f, why)))
    assert [f for f, _ in added] == [["--save-interval", "30"]], added
    assert "after its last iteration (30)" in added[0][1] and "\n" not in added[0][1]
    for argv in (["--save", "run", "--train-iters", "30", "--save-interval", "5"],   # the user's own
                 ["--train-iters", "30"],                                              # nothing to save
                 ["--save", "run", "--train-samples", "300"]):                        # no iteration count
        added.clear()
        run_defaults.add_defaults(argv, lambda f, why: added.append(f))
        assert added == [], (argv, added)
