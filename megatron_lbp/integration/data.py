"""The local demo data: the shipped corpus tokenized with the shipped tokenizer.

:func:`build_demo_data` turns ``data_src/python-docs-3.11.jsonl.gz`` into Megatron's
indexed dataset with ``tokenizer/lbp_bpe.model`` (preprocess_data's own code, so exactly
what a user's run writes) and returns the ``--data-path`` prefix
(``<out_dir>/lbp_demo_text_document``, with ``--tokenizer-type SentencePieceTokenizer
--tokenizer-model tokenizer/lbp_bpe.model``). Idempotent: a stamp holds the SHA-256 of the
corpus and the model, and the tokenizer is built first if missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data_src" / "python-docs-3.11.jsonl.gz"
TOKENIZER_MODEL = REPO / "tokenizer" / "lbp_bpe.model"
TOKENIZER_TYPE = "SentencePieceTokenizer"
DEMO_NAME = "lbp_demo"  # output prefix given to preprocess_data
DATA_PREFIX_NAME = f"{DEMO_NAME}_text_document"  # what --data-path names


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ensure_tokenizer(model: Path = TOKENIZER_MODEL) -> Path:
    """The shipped tokenizer model; built from the shipped corpus if it is missing."""
    if not model.is_file():
        from megatron_lbp.integration import build_tokenizer as build

        rc = build.main(["--out", str(model.with_suffix(""))])
        if rc != 0:
            raise RuntimeError(f"building the tokenizer {model} failed (exit {rc})")
    return model


def demo_data_prefix(out_dir: str | os.PathLike) -> str:
    """The ``--data-path`` prefix build_demo_data writes under ``out_dir``."""
    return str(Path(out_dir) / DATA_PREFIX_NAME)


def build_demo_data(out_dir: str | os.PathLike, *, quiet: bool = False) -> str:
    """Build the demo dataset under ``out_dir`` if missing or stale; return its prefix.

    Writes ``<out_dir>/lbp_demo_text_document.{bin,idx}`` (documents end with the
    tokenizer's ``</s>``, id 2) and ``<out_dir>/lbp_demo.stamp.json``.
    """
    out = Path(out_dir)
    prefix = demo_data_prefix(out)
    model = ensure_tokenizer()
    stamp_path = out / f"{DEMO_NAME}.stamp.json"
    want = {
        "corpus": CORPUS.name,
        "corpus_sha256": _sha256(CORPUS),
        "tokenizer_type": TOKENIZER_TYPE,
        "tokenizer_model": model.name,
        "tokenizer_sha256": _sha256(model),
        "append_eod": True,
    }
    have_files = os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")
    if have_files and stamp_path.is_file():
        try:
            have = json.loads(stamp_path.read_text())
        except ValueError:
            have = {}
        if all(have.get(k) == v for k, v in want.items()):
            return prefix

    from megatron_lbp.integration import preprocess_data as pre

    argv = [
        "--input", str(CORPUS),
        "--output-prefix", str(out / DEMO_NAME),
        "--tokenizer-type", TOKENIZER_TYPE,
        "--tokenizer-model", str(model),
        "--workers", "1",
        "--log-interval", "100000" if quiet else "1000",
    ]
    if quiet:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            rc = pre.main(argv)
    else:
        rc = pre.main(argv)
    if rc != 0:
        raise RuntimeError(f"preprocessing the demo corpus into {prefix} failed (exit {rc})")

    import logging

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    log = logging.getLogger("megatron.core.datasets.indexed_dataset")
    level = log.level
    log.setLevel(logging.WARNING)  # its INFO lines on loading an index are noise here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "could not determine rank" outside a job
            ds = IndexedDataset(prefix)
        want.update(documents=int(len(ds.document_indices) - 1),
                    tokens=int(ds.sequence_lengths.sum()))
        del ds
    finally:
        log.setLevel(level)
    tmp = stamp_path.with_name(f".{stamp_path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(want, indent=1) + "\n")
    os.replace(tmp, stamp_path)
    return prefix
