"""Build a small GPT-2-format byte-level BPE (vocab.json + merges.txt) from the corpus in data_src/.

    python -m megatron_lbp.integration.build_gpt2_bpe --out DIR [--vocab-size 4000] [--every 1]

For tests and local runs of ``--tokenizer-type GPT2BPETokenizer`` where GPT-2's own files
are not at hand (nothing is downloaded). GPT-2's layout: the 256 byte symbols first,
``<|endoftext|>`` last; ``merges.txt`` starts with ``#version: 0.2``, one merge per line
in rank order. Trained by the ``tokenizers`` byte-level BPE trainer on every
``--every``-th document; the same arguments write the same bytes.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

PROG = "python -m megatron_lbp.integration.build_gpt2_bpe"
# The checkout's corpus (data_src/), the default input; an installed package takes --corpus.
REPO = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = REPO / "data_src" / "python-docs-3.11.jsonl.gz"
EOD_TOKEN = "<|endoftext|>"


def corpus_documents(corpus: Path, every: int = 1, key: str = "text") -> list[str]:
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)[key] for line in f if line.strip()]
    return docs[::every]


def build(out: Path, vocab_size: int = 1000, every: int = 8, corpus: Path = DEFAULT_CORPUS) -> tuple[Path, Path]:
    """Write out/vocab.json and out/merges.txt: ``vocab_size`` BPE tokens, then <|endoftext|>."""
    from tokenizers import ByteLevelBPETokenizer

    if vocab_size < 257:
        raise ValueError(f"--vocab-size {vocab_size}: must be at least 257 (the 256 bytes and one merge)")
    tok = ByteLevelBPETokenizer()  # GPT-2's pre-tokenizer (no prefix space) and all 256 bytes
    tok.train_from_iterator(corpus_documents(corpus, every), vocab_size=vocab_size, min_frequency=2,
                            show_progress=False, special_tokens=[])
    out.mkdir(parents=True, exist_ok=True)
    vocab_file, merge_file = out / "vocab.json", out / "merges.txt"
    tok.save_model(str(out))  # merges.txt with its "#version: 0.2" header, as GPT-2 ships it
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    vocab[EOD_TOKEN] = len(vocab)
    vocab_file.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    return vocab_file, merge_file


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for vocab.json and merges.txt")
    p.add_argument("--vocab-size", type=int, default=1000,
                   help="BPE tokens before <|endoftext|> (default 1000: 1001 ids, padded to 1024)")
    p.add_argument("--every", type=int, default=8,
                   help="train on every N-th document (default 8: ~1/8 of the corpus, about a second)")
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="JSONL(.gz) with a 'text' key")
    a = p.parse_args(argv)
    if a.every < 1:
        print(f"{PROG}: error: --every {a.every}: must be at least 1", file=sys.stderr)
        return 2
    try:
        vocab_file, merge_file = build(Path(a.out), a.vocab_size, a.every, Path(a.corpus))
    except (ValueError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {vocab_file} ({a.vocab_size + 1} ids, {EOD_TOKEN} = {a.vocab_size}) and {merge_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
