"""``python -m megatron_lbp.deepspeed_baseline.pretrain``: Megatron's flags and indexed dataset under DeepSpeed.

Fast: the flag checks (one line, exit 2, before any rank starts work). Slow: the
config it prints for a job shape (a fresh interpreter parsing Megatron's flags); the runner with ds-zero3 and ``python -m
megatron_lbp.pretrain_gpt`` (stock Megatron) on the same flags and the shipped
demo dataset, 4 ranks by torchrun, fp32 at a constant learning rate: the same
gradient norm at every iteration (the log's 3 decimals) and the same loss at every
iteration (stock's log line at iteration 2 averages iterations 1 and 2; the test
undoes that).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.pretrain_runner import REPO, demo_data, grad_norms

# find_spec, not importorskip: importing deepspeed here (the ranks import this module too)
# would let it pick its accelerator before megatron_lbp.deepspeed_baseline.environment sets it up.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is a test dependency: scripts/install.sh --test")

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--lr", "1e-3", "--lr-decay-style", "constant",
         "--weight-decay", "0.1", "--clip-grad", "1.0", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--seed", "1234", "--position-embedding-type", "rope",
         "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
         "--split", "98,2,0", "--tokenizer-type", "SentencePieceTokenizer",
         "--tokenizer-model", str(REPO / "tokenizer" / "lbp_bpe.model")]


def _run(args, env=None, timeout=300):
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "megatron_lbp.deepspeed_baseline.pretrain", *args],
                          capture_output=True, text=True, cwd=REPO, env=full_env, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (MODEL, "--ds-scheme is required"),
    (["--ds-scheme", "ds-zero3", "--hier-partition", *MODEL], "--hier-* flags belong to"),
])
def test_runner_refuses_bad_flags_in_one_line(args, message):
    out = _run(args)
    assert out.returncode == 2 and message in out.stderr, (out.returncode, out.stderr[-2000:])
    errors = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, out.stderr[-2000:]


@pytest.mark.slow  # a fresh interpreter importing megatron.training: ~28 s on the loaded CI machine
def test_runner_prints_the_deepspeed_config_of_its_job_shape():
    out = _run(["--ds-scheme", "ds-zeropp", "--ds-print-config", "--train-iters", "2",
                "--mock-data", *MODEL],
               env={"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    printed = json.loads(out.stdout[out.stdout.index("{"):])
    zero = printed["deepspeed_config"]["zero_optimization"]
    assert printed["scheme"] == "ds-zeropp"
    assert (zero["stage"], zero["zero_hpz_partition_size"], zero["zero_quantized_weights"],
            zero["zero_quantized_gradients"]) == (3, 4, True, True), zero
    # 16 sequences per step = 2 per micro-batch x 8 ranks x 1 micro-batch
    assert printed["deepspeed_config"]["gradient_accumulation_steps"] == 1


ITERS = 4
LOSS_LINE = r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([\dE+\-.]+) \|"


def _torchrun(module, args, timeout=900):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", module, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"{module} failed:\n{log[-4000:]}"
    return log


@pytest.mark.slow
def test_runner_trains_like_stock_pretrain_gpt_on_the_demo_data(tmp_path):
    import re

    args = MODEL + ["--data-path", demo_data(tmp_path), "--train-iters", str(ITERS)]
    stock = _torchrun("megatron_lbp.pretrain_gpt", args)
    ds = _torchrun("megatron_lbp.deepspeed_baseline.pretrain", ["--ds-scheme", "ds-zero3", *args])
    losses = [{int(i): float(v) for i, v in re.findall(LOSS_LINE, log)} for log in (stock, ds)]
    norms = [grad_norms(log) for log in (stock, ds)]
    assert sorted(norms[0]) == sorted(norms[1]) == list(range(1, ITERS + 1)), norms
    assert norms[1] == norms[0], f"grad norms differ: ds-zero3 {norms[1]} stock {norms[0]}"
    stock_loss, ds_loss = losses
    # Stock Megatron's log line at iteration 2 carries the mean of iterations 1 and 2
    # (measured: 8.274067 = (8.303322 + 8.244812) / 2); every other line is its own iteration.
    want = dict(stock_loss)
    want[2] = 2 * stock_loss[2] - stock_loss[1]
    for it in range(1, ITERS + 1):
        assert abs(ds_loss[it] - want[it]) <= 1e-5 * want[it], (
            f"iteration {it}: ds-zero3 lm loss {ds_loss[it]}, stock {want[it]} (logged: "
            f"{stock_loss})")
