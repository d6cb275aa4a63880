"""The dry run's content checks (python -m megatron_lbp.launch contents) on real files: the
shipped tokenizer, the shipped corpus preprocessed into an indexed dataset, and broken
copies of it (token ids beyond the vocabulary, a .bin cut short, an index that is not one)."""
from __future__ import annotations

import shutil

import numpy
import pytest

from megatron_lbp.integration.data import TOKENIZER_MODEL
from megatron_lbp.launch import contents

SP = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(TOKENIZER_MODEL),
      "--vocab-size-padded", "4096"]


def _copy(prefix: str, tmp_path, name="copy_text_document") -> str:
    dst = str(tmp_path / name)
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, dst + ext)
    return dst


def _run(capsys, *argv):
    code = contents.main(list(argv))
    out, err = capsys.readouterr()
    return code, out.splitlines(), [l for l in err.splitlines() if l.strip()]


def test_a_good_dataset_and_tokenizer_pass_with_one_line_each(demo_dataset, capsys):
    code, out, err = _run(capsys, *SP, "--data-path", "1.0", demo_dataset)
    assert code == 0 and not err, (out, err)
    assert len(out) == 2, out
    assert out[0].startswith("tokenizer: SentencePieceTokenizer") and "vocabulary 4096" in out[0]
    assert out[1].startswith(f"data: {demo_dataset}: ") and "below the vocabulary 4096" in out[1]


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path, capsys):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "foreign_text_document")   # ids up to 9999: another tokenizer's
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for start in range(0, 10000, 500):
        builder.add_document(torch.arange(start, start + 500), [500])
    builder.finalize(prefix + ".idx")
    code, out, err = _run(capsys, *SP, "--data-path", prefix)
    assert code == 2 and len(err) == 1, (out, err)
    assert "holds token id" in err[0] and "vocabulary of 4096" in err[0], err


def test_a_truncated_bin_and_a_foreign_index_are_refused(demo_dataset, tmp_path, capsys):
    cut = _copy(demo_dataset, tmp_path, "cut_text_document")
    with open(cut + ".bin", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    code, out, err = _run(capsys, *SP, "--data-path", cut)
    assert code == 2 and len(err) == 1 and "truncated or mismatched" in err[0], (out, err)
    bad = _copy(demo_dataset, tmp_path, "bad_text_document")
    (tmp_path / "bad_text_document.idx").write_bytes(b"not an index" * 8)
    code, out, err = _run(capsys, *SP, "--data-path", bad)
    assert code == 2 and len(err) == 1 and "cannot read the indexed dataset" in err[0], (out, err)


def test_a_tokenizer_that_does_not_build_is_refused(demo_dataset, tmp_path, capsys):
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    code, out, err = _run(capsys, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                          str(tmp_path / "vocab.json"), "--merge-file",
                          str(tmp_path / "merges.txt"), "--data-path", demo_dataset)
    assert code == 2 and len(err) == 1 and not out, (out, err)
