"""Continued pretraining: an imported Llama-style model trained with lbp on 8 ranks, resumed, exported.

The start is the import's release checkpoint through Megatron's own
``--pretrained-checkpoint`` (weights only, iteration 0, fresh optimizer),
``--save``/``--load`` a separate run directory. lbp gives stock Megatron's
losses from the same start; the exported model's transformers logits equal
Megatron's on the trained checkpoint; a run stopped at iteration 5 and resumed
gives the losses of one run of 10.
"""
from __future__ import annotations

import pytest
import torch

from megatron_lbp.hf.exporter import export_model
from megatron_lbp.hf.importer import import_model
from megatron_lbp.testing.hf_models import checkpoint_logits
from megatron_lbp.testing.multirank import run_single
from tests.helpers import hf_models
from tests.helpers.pretrain_runner import REPO, TINY, run_pretrain, why

LBP8 = ["--hier-partition", "--hier-gpus-per-node", "4"]
SHIPPED_TOKENIZER = ["--tokenizer-type", "SentencePieceTokenizer",
                     "--tokenizer-model", str(REPO / "tokenizer" / "lbp_bpe.model")]
PRINT_REL = 2e-6     # Megatron prints losses with 7 significant digits


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-continue")
    hf_models.make("llama_demo", str(root / "hf"))
    return import_model(str(root / "hf"), str(root / "imported")), root


def _run(imported, demo_dataset, run_dir, *extra, save=True):
    report, root = imported
    # The import's flags after the tiny run's: the model's shape wins; the corpus keeps its tokenizer.
    args = (TINY + report.flags + SHIPPED_TOKENIZER
            + ["--data-path", demo_dataset, "--train-iters", "10", "--global-batch-size", "16",
               "--ckpt-format", "torch_dist", "--pretrained-checkpoint", str(root / "imported"),
               *(["--save", str(run_dir)] if save else []), "--load", str(run_dir), *extra])
    code, log, losses = run_pretrain(8, args)
    assert code == 0, why(log)
    return log, losses


@pytest.fixture(scope="module")
def straight(imported, demo_dataset):
    run_dir = imported[1] / "lbp"
    log, losses = _run(imported, demo_dataset, run_dir, *LBP8, "--save-interval", "10")
    return log, losses, run_dir


def _differ(a: dict, b: dict) -> dict:
    return {i: (a.get(i), b.get(i)) for i in sorted(set(a) | set(b))
            if i not in a or i not in b or abs(a[i] - b[i]) > PRINT_REL * abs(b[i])}


@pytest.mark.slow
def test_continue_with_lbp_equals_stock_and_the_export_equals_megatron(imported, straight, demo_dataset):
    report, root = imported
    log, losses, run_dir = straight
    assert f"attempting to finetune with checkpoint in {root / 'imported'}" in log, why(log)
    assert sorted(losses) == list(range(1, 11)), losses
    # no --save: stock's DistributedOptimizer.state_dict asserts on these CPU ranks (len(steps) == 1)
    _, stock = _run(imported, demo_dataset, root / "stock", "--use-distributed-optimizer", save=False)
    assert not _differ(losses, stock), f"lbp vs stock Megatron (iteration: lbp, stock): {_differ(losses, stock)}"

    out = root / "exported"
    export_model(str(run_dir), str(root / "imported" / "hf"), str(out))
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(3))
    mg = run_single(checkpoint_logits, report.flags, str(run_dir / "iter_0000010"), tokens, 4096, timeout=600)
    tf = hf_models.hf_env.transformers()
    model = tf.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    diff = (hf_models.hf_logits(model, tokens) - mg).abs().max().item()
    assert diff <= 1e-5, f"exported model's transformers logits differ from Megatron's by {diff:.3g}"
    start = tf.AutoModelForCausalLM.from_pretrained(str(root / "hf")).float().eval()
    assert (hf_models.hf_logits(start, tokens) - mg).abs().max().item() > 1e-3, \
        "10 iterations did not change the model"


@pytest.mark.slow
def test_resume_in_between_changes_nothing(imported, straight, demo_dataset):
    _, losses, _ = straight
    run_dir = imported[1] / "resumed"
    _, first = _run(imported, demo_dataset, run_dir, *LBP8, "--save-interval", "5", "--exit-interval", "5")
    log, resumed = _run(imported, demo_dataset, run_dir, *LBP8, "--save-interval", "5")
    assert "attempting to finetune" not in log, "the resume restarted from the import"
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(resumed) == [6, 7, 8, 9, 10], (first, resumed)
    # Megatron does not reset its loss accumulator after the first iteration of a launch, so
    # the resumed launch's second line (7) logs the mean of 6 and 7 (as tests/e2e/test_pretrain_e2e.py
    # checks for the hierarchy's own resume); every other line is that iteration's own loss.
    want = {**losses, 7: (losses[6] + losses[7]) / 2}
    both = {**first, **resumed}
    assert not _differ(both, want), \
        f"stopped at 5 and resumed vs straight 10 (iteration: resumed, straight): {_differ(both, want)}"


@pytest.mark.slow
def test_imported_gpt2_trains_with_lbp_like_stock(tmp_path, demo_dataset):
    """GPT-2 family: learned positions (built by the sharded initialisation, which holds the
    position table until LanguageModelEmbedding's constructor returns), LayerNorm, biases, the
    tanh GELU (--openai-gelu, applied by the entry)."""
    hf_models.make("gpt2_demo", str(tmp_path / "hf"))
    imported = (import_model(str(tmp_path / "hf"), str(tmp_path / "imported")), tmp_path)
    assert "--openai-gelu" in imported[0].flags
    _, lbp = _run(imported, demo_dataset, tmp_path / "lbp", *LBP8, "--train-iters", "3", save=False)
    _, stock = _run(imported, demo_dataset, tmp_path / "stock", "--use-distributed-optimizer",
                    "--train-iters", "3", save=False)
    assert sorted(lbp) == [1, 2, 3] and not _differ(lbp, stock), \
        f"lbp vs stock Megatron (iteration: lbp, stock): {_differ(lbp, stock)}"


# Every preset starts from the import (issue 30 item 3). zeropp keeps its secondary copy in bf16
# (int8 of fp32 weights is refused) and its int8 weight gathers (qwZ), so its losses are held to
# the int8 bound of tests/multirank/test_quant_training.py; every other preset gives stock's losses.
PRESETS_FROM_IMPORT = {"zero3": [], "zero2": [], "hsdp": [],
                       "zeropp": ["--hier-secondary-dtype", "bf16"]}
INT8_REL = 5e-3


@pytest.mark.slow
def test_every_preset_starts_from_the_import(imported, demo_dataset, tmp_path):
    _, stock = _run(imported, demo_dataset, tmp_path / "stock", "--use-distributed-optimizer",
                    "--train-iters", "3", save=False)
    failures = []
    for preset, extra in PRESETS_FROM_IMPORT.items():
        log, got = _run(imported, demo_dataset, tmp_path / preset, *LBP8, "--hier-preset", preset,
                        *extra, "--train-iters", "3", save=False)
        assert f"attempting to finetune with checkpoint in {imported[1] / 'imported'}" in log, why(log)
        if preset == "zeropp":
            worst = max(abs(got[i] - stock[i]) / abs(stock[i]) for i in stock)
            if sorted(got) != [1, 2, 3] or worst > INT8_REL:
                failures.append(f"zeropp: {got} vs stock {stock} (worst {worst:.3g} > {INT8_REL})")
        elif sorted(got) != [1, 2, 3] or _differ(got, stock):
            failures.append(f"{preset} vs stock (iteration: {preset}, stock): {_differ(got, stock)}")
    assert not failures, "\n".join(failures)
