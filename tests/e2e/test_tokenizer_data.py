"""Tokenizer (tokenizer/, megatron_lbp.integration.build_tokenizer) and data (megatron_lbp.integration.preprocess_data and .data), issue #5 parts 3-4.

The tokenizer is checked through Megatron's own path (megatron.core's
build_tokenizer, the function megatron.training's global_vars calls for
pretrain_gpt, fed by megatron.training's own tokenizer flags); the datasets are
read back with megatron.core's IndexedDataset and compared with an independent
count made with sentencepiece directly.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

import megatron_lbp  # noqa: F401  (typing.override shim before megatron.training)

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data_src" / "python-docs-3.11.jsonl.gz"
MODEL = REPO / "tokenizer" / "lbp_bpe.model"
EOD = 2
VOCAB = 4096
SUMMARY_RE = re.compile(
    r"^summary: (\d+) documents, (\d+) tokens, ([\d.]+) s, (\d+) tokens/s \((.*)\) -> (.*)$"
)


def _load(rel: str, name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def build_tok():
    return importlib.import_module("megatron_lbp.integration.build_tokenizer")


@pytest.fixture(scope="module")
def pre():
    return importlib.import_module("megatron_lbp.integration.preprocess_data")


@pytest.fixture(scope="module")
def sp():
    return spm.SentencePieceProcessor(model_file=str(MODEL))


@pytest.fixture(scope="module")
def corpus_texts():
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def _megatron_tokenizer(*flags: str):
    """Megatron's tokenizer exactly as pretrain_gpt builds it from these flags."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
        from megatron.training import global_vars
        from megatron.training.arguments import _add_tokenizer_args
    assert global_vars.build_tokenizer is build_tokenizer  # the function pretrain_gpt reaches
    parser = argparse.ArgumentParser()
    _add_tokenizer_args(parser)
    args = parser.parse_args(list(flags))
    args.rank, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size = 1, 128, 1
    return build_tokenizer(args), args


def _write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return path


def _read_dataset(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "could not determine rank": no job here
        return IndexedDataset(prefix)


def _run(pre, capsys, *argv: str):
    rc = pre.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


TOK = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(MODEL)]


# --- corpus and tokenizer ------------------------------------------------------------


def test_shipped_corpus_is_plain_prose(corpus_texts):
    assert 1500 < len(corpus_texts) < 5000
    total = sum(len(t) for t in corpus_texts)
    assert 3_000_000 < total < 7_000_000
    joined = "\n".join(corpus_texts[:200])
    for markup in (":func:`", "``", ".. note::", "\n>>> ", ".. code-block::"):
        assert markup not in joined
    assert all(t.strip() and "\n\n\n" not in t for t in corpus_texts)


def test_corpus_cleaner_on_a_snippet():
    """scripts/build_corpus.py's reST-to-prose rules (the package itself is not in CI)."""
    bc = _load("scripts/build_corpus.py", "_lbp_build_corpus")
    rst = """\
.. _label:

**********
Some Title
**********

The :func:`~os.path.join` function and ``literal`` text, see `the docs
<https://example.org>`_ and :pep:`8` for |release| details [#]_.  For example::

   x = join("a", "b")   # code: dropped

>>> print("doctest, dropped")

.. function:: spam(eggs)

   Return spam made from *eggs*, which must be a fresh egg carton.

   .. versionchanged:: 3.10
      Eggs may now be scrambled before they are passed.

* A list item that spans
  two lines in the source.

=====  =====
table  cells
=====  =====
"""
    docs = bc.file_documents("library/spam.rst.txt", rst)
    assert len(docs) == 1 and docs[0]["id"] == "library/spam#0" and docs[0]["title"] == "Some Title"
    assert docs[0]["text"].split("\n\n") == [
        "Some Title",
        "The join function and literal text, see the docs and PEP 8 for 3.11 details. For example:",
        "Return spam made from eggs, which must be a fresh egg carton.",
        "Changed in version 3.10: Eggs may now be scrambled before they are passed.",
        "A list item that spans two lines in the source.",
    ]


def test_tokenizer_build_is_deterministic(build_tok, tmp_path):
    a, b = tmp_path / "a" / "tok", tmp_path / "b" / "tok"
    assert build_tok.main(["--out", str(a)]) == 0
    assert build_tok.main(["--out", str(b)]) == 0
    for ext in (".model", ".vocab"):
        assert a.with_suffix(ext).read_bytes() == b.with_suffix(ext).read_bytes()
    # a different vocabulary size really is a different model
    assert build_tok.main(["--out", str(tmp_path / "small"), "--vocab-size", "1024"]) == 0
    assert spm.SentencePieceProcessor(model_file=str(tmp_path / "small.model")).get_piece_size() == 1024


def test_shipped_tokenizer_equals_fresh_build(build_tok, capsys):
    assert build_tok.main(["--check"]) == 0
    out = capsys.readouterr().out
    if spm.__version__ == build_tok.SHIPPED_WITH_SENTENCEPIECE:
        assert "identical to a fresh build" in out
    else:
        assert "equivalent to a fresh build" in out


def test_check_reports_a_different_model(build_tok, tmp_path, capsys):
    out = tmp_path / "tok"
    assert build_tok.main(["--out", str(out), "--vocab-size", "1024"]) == 0
    capsys.readouterr()
    assert build_tok.main(["--check", "--out", str(out)]) == 1  # default size is 4096
    assert "DIFFERS" in capsys.readouterr().err


def test_round_trip_through_megatrons_tokenizer(sp, corpus_texts):
    tok, args = _megatron_tokenizer(*TOK)
    from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import (
        SentencePieceTokenizer,
    )

    assert isinstance(tok._tokenizer, SentencePieceTokenizer)
    assert tok.vocab_size == VOCAB and args.padded_vocab_size == VOCAB  # 4096 % 128 == 0
    assert tok.eod == EOD and sp.id_to_piece(tok.eod) == "</s>"
    assert tok.pad == 3 and tok.pad != tok.eod
    samples = corpus_texts[::97] + [
        "Hello, world!",
        "  two  spaces,\ttabs\tand\nnewlines\n\nbetween paragraphs",
        "Unicode falls back to bytes: naïve café, Ωmega ✓, 漢字, emoji 🙂.",
        "Numbers split into digits: 3.11, 2501.04266, 1e-5.",
    ]
    for text in samples:
        ids = tok.tokenize(text)
        assert ids == sp.encode(text)
        assert all(0 <= i < VOCAB for i in ids)
        assert sp.unk_id() not in ids  # byte fallback: nothing is unknown
        assert tok.detokenize(ids) == text
    # the end-of-document id is a control piece: it decodes to nothing
    assert tok.detokenize([tok.eod]) == ""
    assert tok.detokenize(tok.tokenize("one") + [tok.eod] + tok.tokenize("two")) == "one two"


# --- preprocessing -----------------------------------------------------------------


def test_preprocess_jsonl_counts_and_summary(pre, sp, corpus_texts, tmp_path, capsys):
    texts = corpus_texts[:60] + ["Ünïcödé and tabs\tand\nnewlines."]
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts)])
    rc, out, err = _run(pre, capsys, "--input", str(src), "--output-prefix",
                        str(tmp_path / "out" / "ds"), *TOK)
    assert rc == 0, err
    prefix = str(tmp_path / "out" / "ds_text_document")
    expected = [sp.encode(t) + [EOD] for t in texts]  # independent count, eod appended
    ds = _read_dataset(prefix)
    assert len(ds) == len(texts)
    assert list(ds.document_indices) == list(range(len(texts) + 1))
    assert list(ds.sequence_lengths) == [len(e) for e in expected]
    assert ds.index.dtype == np.uint16
    for i in (0, 7, len(texts) - 1):
        assert ds[i].tolist() == expected[i]
    m = SUMMARY_RE.match(out.strip().splitlines()[-1])
    assert m, out
    assert int(m.group(1)) == len(texts)
    assert int(m.group(2)) == sum(len(e) for e in expected)
    assert float(m.group(3)) > 0 and int(m.group(4)) > 0
    assert "eod 2 appended" in m.group(5)
    assert m.group(6).split() == [prefix + ".bin", prefix + ".idx"]
    assert sorted(os.listdir(tmp_path / "out")) == ["ds_text_document.bin", "ds_text_document.idx"]


def test_preprocess_several_keys_gz_lists_and_empty(pre, sp, tmp_path, capsys):
    docs = [
        {"text": "First document.", "title": "One"},
        {"text": "", "title": ""},  # tokenizes to nothing in both keys: skipped
        {"text": ["A document given", " as sentences."], "title": "Three"},
    ]
    raw = "".join(json.dumps(d) + "\n" for d in docs) + "\n"  # a trailing blank line is fine
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(gzip.compress(raw.encode()))
    rc, out, err = _run(pre, capsys, "--input", str(src), "--json-keys", "text", "title",
                        "--output-prefix", str(tmp_path / "ds"), "--no-append-eod", *TOK)
    assert rc == 0, err
    assert "2 documents" in out and "1 empty skipped" in out and "no eod" in out
    text = _read_dataset(str(tmp_path / "ds_text_document"))
    assert list(text.sequence_lengths) == [
        len(sp.encode("First document.")),
        len(sp.encode("A document given")), len(sp.encode(" as sentences.")),
    ]
    assert list(text.document_indices) == [0, 1, 3]  # sentences of one document
    title = _read_dataset(str(tmp_path / "ds_title_document"))
    assert [x.tolist() for x in (title[0], title[1])] == [sp.encode("One"), sp.encode("Three")]


def test_preprocess_plain_text(pre, sp, tmp_path, capsys):
    one = tmp_path / "one.txt"
    one.write_text("First paragraph,\nstill first.\n\n\n  \nSecond one.\n\nThird.\n", encoding="utf-8")
    rc, out, err = _run(pre, capsys, "--input", str(one), "--input-format", "text",
                        "--output-prefix", str(tmp_path / "blank"), *TOK)
    assert rc == 0, err
    ds = _read_dataset(str(tmp_path / "blank_text_document"))
    docs = ["First paragraph,\nstill first.", "Second one.", "Third."]
    assert list(ds.sequence_lengths) == [len(sp.encode(d)) + 1 for d in docs]
    assert ds[0].tolist() == sp.encode(docs[0]) + [EOD]

    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "b.txt").write_text("Bee.\n\nStill bee.\n")
    (tree / "a.txt").write_text("Ay.\n")
    (tree / "sub" / "c.txt").write_text("Sea.\n")
    (tree / ".hidden").write_text("never read\n")
    rc, out, err = _run(pre, capsys, "--input", str(tree), "--input-format", "text",
                        "--output-prefix", str(tmp_path / "files"), *TOK)
    assert rc == 0, err
    ds = _read_dataset(str(tmp_path / "files_text_document"))
    per_file = ["Ay.", "Bee.\n\nStill bee.", "Sea."]  # sorted paths, one document per file
    assert list(ds.sequence_lengths) == [len(sp.encode(d)) + 1 for d in per_file]


def test_build_demo_data_is_idempotent(sp, corpus_texts, tmp_path):
    from megatron_lbp.integration.data import build_demo_data, demo_data_prefix

    prefix = build_demo_data(tmp_path, quiet=True)
    assert prefix == demo_data_prefix(tmp_path) == str(tmp_path / "lbp_demo_text_document")
    ds = _read_dataset(prefix)
    assert len(ds) == len(corpus_texts)
    lengths = [len(ids) + 1 for ids in sp.encode(corpus_texts)]
    assert ds.sequence_lengths.tolist() == lengths
    assert ds[len(ds) - 1].tolist()[-1] == EOD
    stamp = json.loads((tmp_path / "lbp_demo.stamp.json").read_text())
    assert stamp["documents"] == len(corpus_texts) and stamp["tokens"] == sum(lengths)
    mtimes = [os.stat(prefix + ext).st_mtime_ns for ext in (".bin", ".idx")]
    assert build_demo_data(tmp_path, quiet=True) == prefix
    assert [os.stat(prefix + ext).st_mtime_ns for ext in (".bin", ".idx")] == mtimes


def test_cli_with_workers_matches_in_process(pre, corpus_texts, tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in corpus_texts[:150]])
    assert _run(pre, capsys, "--input", str(src), "--output-prefix", str(tmp_path / "one"), *TOK)[0] == 0
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lbp.preprocess_data", "--input", str(src),
         "--output-prefix", str(tmp_path / "two"), "--workers", "2", "--log-interval", "50", *TOK],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert SUMMARY_RE.match(proc.stdout.strip().splitlines()[-1]), proc.stdout
    progress = proc.stderr.strip().splitlines()
    assert len(progress) == 3 and all(p.startswith("processed ") for p in progress), proc.stderr
    for ext in (".bin", ".idx"):
        a = (tmp_path / f"one_text_document{ext}").read_bytes()
        assert a == (tmp_path / f"two_text_document{ext}").read_bytes()


# --- bad input ---------------------------------------------------------------------


# Bad input to python -m megatron_lbp.preprocess_data: tests/e2e/test_bad_input_matrix.py (every entry point's table).


def test_failed_run_keeps_previous_outputs(pre, tmp_path, capsys):
    good = _write_jsonl(tmp_path / "good.jsonl", [{"text": "Old data."}])
    prefix = tmp_path / "ds"
    assert _run(pre, capsys, "--input", str(good), "--output-prefix", str(prefix), *TOK)[0] == 0
    old = {p.name: p.read_bytes() for p in tmp_path.glob("ds_*")}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "new"}\n{"text": "newer"}\nnot json\n')
    rc, _, err = _run(pre, capsys, "--input", str(bad), "--output-prefix", str(prefix), *TOK)
    assert rc == 1 and "bad.jsonl line 3" in err
    assert {p.name: p.read_bytes() for p in tmp_path.glob("ds_*")} == old  # no tmp files either
