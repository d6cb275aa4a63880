"""The Frontier launcher starts a run from an imported Hugging Face model (START_FROM), dry run."""
from __future__ import annotations

import pytest

from megatron_lbp.hf.importer import import_model
from tests.helpers import hf_models
from tests.launch.test_launchers import SCRIPTS, flag, run, site, training_line  # noqa: F401  (site: fixture)


def test_start_from_an_import_keeps_save_and_load_on_the_run_directory(site):
    hf_dir, start = site["tmp"] / "llama-hf", site["tmp"] / "llama-imported"
    model = hf_models.make("llama_gqa_untied", str(hf_dir))
    report = import_model(str(hf_dir), str(start))
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=2, START_FROM=start)
    assert r.returncode == 0, r.stdout + r.stderr
    words = training_line(r.stdout)
    assert flag(words, "--pretrained-checkpoint") == str(start)
    ckpt = str(site["tmp"] / "ckpt")
    assert flag(words, "--save") == ckpt and flag(words, "--load") == ckpt
    # the import's flags come after the profile's, so its architecture and tokenizer are the ones used
    tail = words[words.index("--pretrained-checkpoint") + 2:]
    assert tail[:len(report.flags)] == report.flags, (tail, report.flags)
    last = {w: words[len(words) - 1 - words[::-1].index(w) + 1]
            for w in ("--num-layers", "--hidden-size", "--tokenizer-type", "--num-query-groups")}
    assert last == {"--num-layers": "2", "--hidden-size": "64", "--tokenizer-type": "HuggingFaceTokenizer",
                    "--num-query-groups": "2"}, last
    assert f"start: the weights of {start}" in r.stdout
    # the estimate counts the model the import's flags build (GQA, SwiGLU, RMSNorm, no biases,
    # untied): the Hugging Face model's own parameter count, which the import maps one to one
    line = next(x for x in r.stdout.splitlines() if x.startswith("[lbp] model: "))
    assert line.endswith(f": {sum(p.numel() for p in model.parameters()):,} parameters"), line
    assert "heads 4/2 query groups, swiglu, RMSNorm, no linear biases, untied" in line, line


@pytest.mark.slow   # an import and a dry run (~3 s): the fast suite's budget
def test_start_from_a_gpt2_import_estimates_its_position_table_and_layers(site):
    # GPT-2's flags: learned positions with a table of the model's 64 rows (not SEQ_LENGTH's
    # 32), LayerNorm, biases, GELU, tied; the import's padded vocabulary
    hf_dir, start = site["tmp"] / "gpt2-hf", site["tmp"] / "gpt2-imported"
    model = hf_models.make("gpt2", str(hf_dir))
    import_model(str(hf_dir), str(start))
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=2, START_FROM=start, SEQ_LENGTH=32,
            LBP_CHOOSE=0)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("[lbp] model: "))
    assert line.endswith(f": {sum(p.numel() for p in model.parameters()):,} parameters"), line
    assert "gelu, LayerNorm, linear biases, tied output, learned_absolute positions (64 rows)" \
        in line, line


def test_start_from_a_directory_that_is_not_an_import_is_one_line(site):
    r = run(SCRIPTS["20b"], site, "--dry-run", NNODES=2, START_FROM=site["tmp"])
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if "START_FROM" in line]
    assert len(lines) == 1 and "python -m megatron_lbp.hf import" in lines[0], r.stderr
