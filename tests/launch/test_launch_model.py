"""The launcher's estimate is for the model the training command builds (issue 26 item 5).

Megatron's architecture flags reach the training command from EXTRA_ARGS, the command
line's extras and START_FROM's megatron_args.txt; the dry run's "model:" line must count
the model those flags build, here checked against a real megatron-core GPTModel (dry runs
need no Slurm; START_FROM's case is in tests/launch/test_hf_launch.py).
"""
from __future__ import annotations

import re

import pytest

from megatron_lbp.testing.multirank import run_single
from tests.engine.test_param_count import DEFAULT, H, HEADS, L, S, V, _count_models
from tests.launch.test_launchers import SCRIPTS, run, site, training_line  # noqa: F401  (site: fixture)

SHAPE = {"NUM_LAYERS": L, "HIDDEN_SIZE": H, "NUM_ATTENTION_HEADS": HEADS, "SEQ_LENGTH": S,
         "VOCAB_SIZE_PADDED": V, "GLOBAL_BATCH_SIZE": 64, "NNODES": 2}
FFN = 176   # not 4h: the width must come through too


def model_line(out: str) -> tuple[str, int]:
    line = next((x for x in out.splitlines() if x.startswith("[lbp] model: ")), None)
    assert line, f"no '[lbp] model:' line in the dry run:\n{out}"
    return line, int(re.search(r": ([\d,]+) parameters$", line).group(1).replace(",", ""))


def test_llama_flags_from_extra_args_and_the_command_line_reach_the_estimate(site):
    # Split over both sources as a user might; the command line comes last in the training
    # command, so its --num-query-groups 2 is the one Megatron uses, not EXTRA_ARGS' 4.
    r = run(SCRIPTS["20b"], site, "--dry-run", "--group-query-attention", "--num-query-groups",
            "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            f"--ffn-hidden-size={FFN}", **SHAPE,
            EXTRA_ARGS="--swiglu --normalization RMSNorm --num-query-groups 4")
    assert r.returncode == 0, r.stdout + r.stderr
    line, params = model_line(r.stdout)
    assert f"ffn {FFN}, heads {HEADS}/2 query groups, swiglu, RMSNorm, no linear biases, " \
           "untied output, rope positions" in line, line
    assert "--swiglu" in training_line(r.stdout)
    llama = {**DEFAULT, "swiglu": True, "ffn_hidden_size": FFN, "num_query_groups": 2,
             "normalization": "RMSNorm", "add_bias_linear": False, "tied": False}
    built, gpt2 = run_single(_count_models, [llama, DEFAULT], timeout=600)
    assert built != gpt2, "the Llama-style and GPT-2-style models have the same size"
    assert params == built, (f"the dry run estimated {params:,} parameters, megatron-core's "
                             f"GPTModel with these flags has {built:,} (GPT-2-style: {gpt2:,})")


@pytest.mark.slow   # one more dry run (~3 s): the fast suite's budget
def test_group_count_without_group_query_attention_is_multi_head_as_in_megatron(site):
    # Megatron ignores --num-query-groups without --group-query-attention; so does the estimate.
    r = run(SCRIPTS["20b"], site, "--dry-run", "--num-query-groups", "2", **SHAPE,
            LBP_CHOOSE=0)   # the model line only: no ranking
    assert r.returncode == 0, r.stdout + r.stderr
    line, _ = model_line(r.stdout)
    assert f"heads {HEADS}/{HEADS} query groups, gelu, LayerNorm, linear biases, tied" in line, line


def test_a_bad_group_count_is_one_line_before_the_estimate(site):
    r = run(SCRIPTS["20b"], site, "--dry-run", "--group-query-attention", "--num-query-groups",
            "3", **SHAPE)
    errors = [x for x in r.stderr.splitlines() if "error" in x]
    assert r.returncode == 2 and len(errors) == 1, r.stdout + r.stderr
    assert f"num_query_groups=3: must divide num_attention_heads={HEADS}" in errors[0], errors
    assert "memory per GCD" not in r.stdout, r.stdout
