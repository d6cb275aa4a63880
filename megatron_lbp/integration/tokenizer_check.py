"""Whether a command's tokenizer flags can build their tokenizer here, offline, from local files.

Called by the training entries on the raw command line and again on Megatron's parsed
arguments (before any process group), and by preprocess_data before anything is
written. A tokenizer that cannot work is a ``TokenizerInputError`` with one line saying
what is missing; other tokenizer types are left to megatron-core. Imports nothing from
Megatron. What each ``--tokenizer-type`` needs: docs/training.md, "Tokenizers and data".
``python -m megatron_lbp.tokenizer_check [training flags...]`` prints ``ok: ...`` and
exits 0, or the one line and exits 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from megatron_lbp.core.errors import one_line

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
OFFLINE_HINT = "there is no network on compute nodes"


class TokenizerInputError(ValueError):
    pass


def check(args: Any) -> int | None:
    """Refuse tokenizer flags that cannot work offline; the tokenizer's vocabulary size (None for
    the types left to megatron-core)."""
    kind = getattr(args, "tokenizer_type", None)
    if not kind:
        raise TokenizerInputError("--tokenizer-type is required (e.g. GPT2BPETokenizer with --vocab-file "
                                  "and --merge-file, or SentencePieceTokenizer with --tokenizer-model)")
    metadata = getattr(args, "metadata_path", None)
    if metadata and not os.path.isfile(metadata):
        raise TokenizerInputError(f"--tokenizer-metadata {metadata} does not exist")
    if kind == "GPT2BPETokenizer":
        return _gpt2_bpe(args)
    model = getattr(args, "tokenizer_model", None)
    if kind in SENTENCEPIECE_TYPES:
        return _sentencepiece(kind, _need_model(kind, model, "a SentencePiece .model file"))
    if kind == "HuggingFaceTokenizer":
        return _huggingface(args, model)
    if kind == "TikTokenizer":
        _need_package(kind, "tiktoken")
        _need_model(kind, model, "a tiktoken vocabulary file")
    elif kind == "NullTokenizer":
        if not getattr(args, "vocab_size", None):
            raise TokenizerInputError("--tokenizer-type NullTokenizer needs --vocab-size (its ids are "
                                      "0..vocab-size-1)")
        return int(args.vocab_size)
    elif model and not os.path.exists(model):
        raise TokenizerInputError(f"--tokenizer-model {model} does not exist")
    return None


def _gpt2_bpe(args) -> int:
    from megatron_lbp.integration import gpt2_bpe

    vocab, merges = getattr(args, "vocab_file", None), getattr(args, "merge_file", None)
    missing = [flag for flag, value in (("--vocab-file", vocab), ("--merge-file", merges)) if not value]
    if missing:
        raise TokenizerInputError(
            f"--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file (GPT-2's vocab.json "
            f"and merges.txt; {' and '.join(missing)} not given): without them megatron-core downloads "
            f"GPT-2's, and {OFFLINE_HINT}")
    try:
        tok = gpt2_bpe.GPT2BPE(vocab, merges, additional_special_tokens=getattr(args, "special_tokens", None)
                               or ())
    except gpt2_bpe.GPT2FilesError as err:
        raise TokenizerInputError(str(err)) from None
    return tok.vocab_size


def _need_model(kind: str, model: str | None, what: str) -> str:
    if not model:
        raise TokenizerInputError(f"--tokenizer-type {kind} needs --tokenizer-model ({what})")
    if not os.path.exists(model):
        raise TokenizerInputError(f"--tokenizer-model {model} does not exist")
    if not os.path.isfile(model):
        raise TokenizerInputError(f"--tokenizer-model {model} is not a file ({kind} takes {what})")
    return model


def _need_package(kind: str, package: str, model: str | None = None, install: str | None = None) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        given = f" (--tokenizer-model {model})" if model else ""
        raise TokenizerInputError(f"--tokenizer-type {kind}{given} needs the '{package}' package, which is "
                                  f"not installed here: {install or 'pip install ' + package}")


def _sentencepiece(kind: str, model: str) -> int:
    try:
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=model).vocab_size()
    except Exception as err:
        raise TokenizerInputError(f"--tokenizer-model {model} does not load as a SentencePiece model "
                                  f"({one_line(err)})") from None


def _huggingface(args, model: str | None) -> int:
    """The vocabulary megatron-core's HuggingFaceTokenizer reports: len(tokenizer), added tokens included."""
    kind = "HuggingFaceTokenizer"
    if not model:
        raise TokenizerInputError(f"--tokenizer-type {kind} needs --tokenizer-model (a local directory "
                                  "written by save_pretrained)")
    if not os.path.exists(model):
        raise TokenizerInputError(
            f"--tokenizer-model {model} is not a local directory: {kind} would fetch {model!r} from the "
            f"Hugging Face hub, and {OFFLINE_HINT}; where there is network, save it with "
            f"AutoTokenizer.from_pretrained({model!r}).save_pretrained(DIR) and pass DIR")
    if not os.path.isdir(model):
        raise TokenizerInputError(f"--tokenizer-model {model} is a file: {kind} takes the directory "
                                  "written by save_pretrained (tokenizer.json, tokenizer_config.json)")
    _need_package(kind, "transformers", model,
                  install="pip install '.[hf]' in megatron-lbp (its Hugging Face extra)")
    kwargs = {k: v for k, v in (("vocab_file", getattr(args, "vocab_file", None)),
                                ("merges_file", getattr(args, "merge_file", None))) if v}
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model, local_files_only=True,
                                            use_fast=not getattr(args, "tokenizer_hf_no_use_fast", False),
                                            trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
                                            **kwargs)
    except Exception as err:
        raise TokenizerInputError(f"--tokenizer-model {model} does not load as a Hugging Face tokenizer "
                                  f"directory ({one_line(err)})") from None
    return len(tok)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        raise TokenizerInputError(message)


def _parser() -> argparse.ArgumentParser:
    """The tokenizer flags this check reads, named and defaulted as megatron.training's TokenizerConfig."""
    p = _Parser(prog="python -m megatron_lbp.tokenizer_check", add_help=False, allow_abbrev=False)
    p.add_argument("--tokenizer-type")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--tokenizer-model")
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--tokenizer-metadata", dest="metadata_path")
    p.add_argument("--tokenizer-special-tokens", dest="special_tokens", nargs="+")
    p.add_argument("--tokenizer-hf-no-use-fast", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    return p


def check_argv(argv: list[str], default_type: str | None = None) -> int | None:
    """check() on a command line before Megatron parses it; without --tokenizer-type, ``default_type``.

    The training entries call it with no default: Megatron's scripts differ in
    theirs, and the preflight checks the parsed arguments again anyway.
    """
    args, _ = _parser().parse_known_args(argv)
    args.tokenizer_type = args.tokenizer_type or default_type
    return check(args) if args.tokenizer_type else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    try:
        kind = _parser().parse_known_args(argv)[0].tokenizer_type or "GPT2BPETokenizer"
        vocab = check_argv(argv, default_type="GPT2BPETokenizer")  # pretrain_gpt's default
    except TokenizerInputError as err:
        print(f"python -m megatron_lbp.tokenizer_check: error: {err}", file=sys.stderr)
        return 2
    size = f", vocabulary {vocab}" if vocab else ""
    print(f"ok: --tokenizer-type {kind} builds here from local files{size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
