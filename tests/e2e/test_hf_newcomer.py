"""README's "Continue from an existing model" and docs/continued-pretraining.md, run as typed.

A newcomer's inputs: a tiny random model saved by transformers with its own
byte-level BPE trained on the documents (a Llama with tokenizer.json, a GPT-2
with vocab.json/merges.txt), 300 documents of the shipped corpus as
docs.jsonl, 20 others held out. The page's block runs command by command in a
scratch directory, with only the substitutions below (each must match the page
once at least, so the page cannot drift from what runs): the model's path, 2
ranks, this model's 64 positions, fewer iterations, and a learning rate a tiny
random model moves with. The held-out loss of the exported model, through
transformers' from_pretrained, is below the imported model's; the export's
tensors are the checkpoint's; continuing the finished run (the page's second
block) trains on from the last iteration and the export replaces the first
one whole.

Run with ``pytest -s`` to see each command's wall time and the losses.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import doc_commands, hf_models

REPO = doc_commands.REPO
DOC = REPO / "docs" / "continued-pretraining.md"
README = REPO / "README.md"
DOCUMENTS, HELD_OUT, SEQ = 300, 20, 64
SUBS = {
    "/models/Llama-3-8B": "model",
    "--nproc-per-node 8": "--nproc-per-node 2",
    "--seq-length 2048": f"--seq-length {SEQ}",
    "--train-iters 30": "--train-iters 8",
    "--train-iters 60": "--train-iters 12",
    "--eval-interval 10": "--eval-interval 4",
    "--lr 1e-5 --min-lr 1e-6": "--lr 3e-3 --min-lr 3e-4",
}


def test_readme_runs_the_pages_commands():
    """The README's block is the page's first block, command for command (the slow test runs it)."""
    readme = [doc_commands.without_comment(c) for c in doc_commands.commands(
        doc_commands.bash_blocks(README, after="## Continue from an existing model")[0])]
    page = [doc_commands.without_comment(c) for c in doc_commands.commands(doc_commands.bash_blocks(DOC)[0])]
    assert readme == page, "README's block and docs/continued-pretraining.md's first block differ:\n" + \
        "\n".join(f"- {a}\n+ {b}" for a, b in zip(readme, page) if a != b)
    assert page[0].startswith(".venv/bin/pip install '.[hf]'"), page[0]


def _inputs(root: Path, kind: str) -> list[str]:
    """model/ (a tiny random model with a BPE trained on the documents), docs.jsonl; the held-out texts."""
    with gzip.open(REPO / "data_src" / "python-docs-3.11.jsonl.gz", "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    train, held = texts[:DOCUMENTS], texts[1000:1000 + HELD_OUT]
    root.mkdir(parents=True, exist_ok=True)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in train))
    hf_models.make(kind, str(root / "model"), vocab=512)
    hf_models.make_tokenizer(str(root / "model"), vocab=512, texts=train)
    if kind != "gpt2":   # the Llama keeps tokenizer.json only, as Llama checkpoints ship
        (root / "model" / "vocab.json").unlink()
        (root / "model" / "merges.txt").unlink()
    return held


def _held_out_loss(model_dir: Path, tok_dir: Path, texts: list[str]) -> float:
    """Mean next-token loss of transformers' from_pretrained model over the first SEQ tokens of each text."""
    tf = hf_models.hf_env.transformers()
    tok = tf.AutoTokenizer.from_pretrained(str(tok_dir))
    model = tf.AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()
    losses = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok.encode(t, add_special_tokens=False)[:SEQ]])
            losses.append(model(ids, labels=ids).loss.item())
    return sum(losses) / len(losses)


def _exported_equals_checkpoint(out: Path, run: Path, iteration: int) -> None:
    """What from_pretrained loads is the export, and the export is the checkpoint's iteration."""
    from safetensors.torch import load_file

    marker = json.loads((out / ".megatron_lbp_export.json").read_text())
    assert marker["checkpoint"].endswith(f"iter_{iteration:07d}"), marker
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == ["model.safetensors"], f"stale or extra shards in the export: {files}"
    tf = hf_models.hf_env.transformers()
    loaded = tf.AutoModelForCausalLM.from_pretrained(str(out)).float().state_dict()
    saved = load_file(str(out / "model.safetensors"))
    for name, t in saved.items():
        assert torch.equal(loaded[name], t.float()), f"from_pretrained's {name} is not the exported tensor"


@pytest.mark.slow
@pytest.mark.parametrize("kind, tokenizer", [("llama_gqa_untied", "HuggingFaceTokenizer"),
                                             ("gpt2", "GPT2BPETokenizer")])
def test_the_documented_commands_as_typed(tmp_path, kind, tokenizer):
    root = tmp_path / "work"
    held = _inputs(root, kind)
    env = doc_commands.scratch(root)
    first, more = doc_commands.bash_blocks(DOC)[:2]
    used = {old for old in SUBS if old in first + more}
    assert used == set(SUBS), f"the page no longer has {sorted(set(SUBS) - used)}"
    report = []
    for block in (first, more):
        for command in doc_commands.commands(block):
            if command.startswith(".venv/bin/pip install '.[hf]'"):
                report.append(f"(not run here: {command}; the tests take transformers from {env['PYTHONPATH']})")
                continue
            typed = doc_commands.substitute(command, SUBS)
            code, out, wall = doc_commands.run(typed, root, env)
            report.append(f"{wall:6.1f} s  {typed}")
            assert code == 0, f"{typed}\nexit {code}\n{out[-4000:]}"
            assert "failed without a message" not in out
            if "pretrain_gpt" in typed:
                assert "adding --save-interval" in out, "the --save default was not announced"
            if "megatron_lbp.hf import" in typed:
                assert f"--tokenizer-type {tokenizer}" in (root / "imported" / "megatron_args.txt").read_text()
        if block is first:
            before = _held_out_loss(root / "model", root / "imported" / "hf", held)
            after_first = _held_out_loss(root / "hf-out", root / "imported" / "hf", held)
            _exported_equals_checkpoint(root / "hf-out", root / "run", 8)
    after_more = _held_out_loss(root / "hf-out", root / "imported" / "hf", held)
    _exported_equals_checkpoint(root / "hf-out", root / "run", 12)
    assert (root / "run" / "latest_checkpointed_iteration.txt").read_text().strip() == "12"
    print(f"\n{kind} ({tokenizer}), {DOCUMENTS} documents, held-out loss over {HELD_OUT} others:")
    print("\n".join(report))
    print(f"held-out loss: imported {before:.3f}, after 8 iterations {after_first:.3f}, "
          f"after 12 {after_more:.3f}")
    assert after_first < before - 0.1, (before, after_first)
    assert after_more < after_first, (after_first, after_more)
