"""Build the demo SentencePiece BPE tokenizer from the corpus shipped in data_src/.

    python -m megatron_lbp.integration.build_tokenizer           # writes tokenizer/lbp_bpe.{model,vocab}
    python -m megatron_lbp.integration.build_tokenizer --check   # shipped files == a fresh build?
    python -m megatron_lbp.integration.build_tokenizer --vocab-size 8192 --out /tmp/my_bpe

Training is deterministic: the corpus is read in file order (every paragraph of
every document is one training sentence, none sampled or shuffled), SentencePiece
runs on one thread with a fixed seed, and the model is written from memory, so
no file name or path lands in it. Building twice gives byte-identical files.
The model loads with Megatron's ``--tokenizer-type SentencePieceTokenizer
--tokenizer-model tokenizer/lbp_bpe.model``; its end-of-document id is ``</s>``.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys
from pathlib import Path

PROG = "python -m megatron_lbp.integration.build_tokenizer"
# The checkout's corpus (data_src/) and shipped tokenizer (tokenizer/), the defaults; an
# installed package takes --corpus and --out.
REPO = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = REPO / "data_src" / "python-docs-3.11.jsonl.gz"
DEFAULT_OUT = REPO / "tokenizer" / "lbp_bpe"
DEFAULT_VOCAB_SIZE = 4096
SEED = 1234
# The shipped lbp_bpe.model was built with this sentencepiece; another version may
# write other trainer metadata (then --check reports "equivalent", not "identical").
SHIPPED_WITH_SENTENCEPIECE = "0.2.3"

# Special pieces: ids 0-3. </s> is the end-of-document token Megatron appends.
SPECIAL = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


def trainer_options(vocab_size: int) -> dict:
    """Every SentencePiece option the build uses (all others are SentencePiece's defaults)."""
    return dict(
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=0.9999,  # rarer characters fall back to bytes
        byte_fallback=True,  # any text encodes without <unk>
        split_digits=True,
        normalization_rule_name="identity",  # lossless: decode(encode(x)) == x
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        max_sentence_length=1 << 16,
        input_sentence_size=0,  # use every sentence ...
        shuffle_input_sentence=False,  # ... in corpus order
        num_threads=1,
        minloglevel=2,
        **SPECIAL,
    )


def corpus_sentences(corpus: Path, key: str = "text") -> list[str]:
    """Training sentences: the paragraphs of each document, in file order."""
    opener = gzip.open if corpus.suffix == ".gz" else open
    out: list[str] = []
    with opener(corpus, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.extend(p for p in json.loads(line)[key].split("\n\n") if p.strip())
    return out


def train(corpus: Path, vocab_size: int) -> tuple[bytes, bytes]:
    """Return (model bytes, vocab bytes) for a fresh build."""
    import sentencepiece as spm

    sentences = corpus_sentences(corpus)
    spm.set_random_generator_seed(SEED)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=buf, **trainer_options(vocab_size)
    )
    model = buf.getvalue()
    return model, vocab_bytes(model)


def vocab_bytes(model: bytes) -> bytes:
    """The .vocab file SentencePiece itself writes: "piece<TAB>score" per id."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    lines = (f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    return "".join(lines).encode("utf-8")


def equivalent(a: bytes, b: bytes) -> bool:
    """Same pieces, scores and special ids (same tokenization), even if bytes differ."""
    import sentencepiece as spm

    sa, sb = (spm.SentencePieceProcessor(model_proto=m) for m in (a, b))
    if sa.get_piece_size() != sb.get_piece_size():
        return False
    probe = "Building twice gives byte-identical files: 3.11, naïve café, \t tabs\n\nΩ ✓"
    return (
        vocab_bytes(a) == vocab_bytes(b)
        and [sa.eos_id(), sa.bos_id(), sa.unk_id(), sa.pad_id()]
        == [sb.eos_id(), sb.bos_id(), sb.unk_id(), sb.pad_id()]
        and sa.encode(probe) == sb.encode(probe)
    )


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                    help="JSONL (optionally .gz) with a 'text' field (default: %(default)s)")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                    help="pieces, special and byte pieces included (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="output prefix: writes <out>.model and <out>.vocab (default: %(default)s)")
    ap.add_argument("--check", action="store_true",
                    help="build in memory and compare with <out>.model/.vocab instead of writing")
    args = ap.parse_args(argv)
    if not args.corpus.is_file():
        print(f"{PROG}: error: corpus {args.corpus} not found", file=sys.stderr)
        return 2
    model_path = args.out.with_name(args.out.name + ".model")
    vocab_path = args.out.with_name(args.out.name + ".vocab")
    model, vocab = train(args.corpus, args.vocab_size)

    if args.check:
        import sentencepiece as spm

        if not model_path.is_file() or not vocab_path.is_file():
            print(f"{PROG}: error: {model_path} or {vocab_path} missing", file=sys.stderr)
            return 1
        shipped_model, shipped_vocab = model_path.read_bytes(), vocab_path.read_bytes()
        if shipped_model == model and shipped_vocab == vocab:
            print(f"{model_path}: identical to a fresh build (sentencepiece {spm.__version__})")
            return 0
        if shipped_vocab == vocab and equivalent(shipped_model, model):
            print(f"{model_path}: equivalent to a fresh build (same pieces, scores and special "
                  f"ids; bytes differ, e.g. trainer metadata of sentencepiece {spm.__version__})")
            return 0
        print(f"{model_path}: DIFFERS from a fresh build with sentencepiece {spm.__version__} "
              f"(rebuild with: {PROG} --vocab-size "
              f"{args.vocab_size} --out {args.out})", file=sys.stderr)
        return 1

    model_path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(model_path, model)
    _write_atomic(vocab_path, vocab)
    print(f"wrote {model_path} ({len(model)} bytes) and {vocab_path}: "
          f"vocab size {args.vocab_size}, eod </s> = {SPECIAL['eos_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
