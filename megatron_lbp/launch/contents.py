"""The dry run's content checks: the tokenizer builds, the data is an indexed dataset that fits it.

    python -m megatron_lbp.launch contents --tokenizer-type T [--vocab-file F --merge-file F |
        --tokenizer-model M] [--vocab-size-padded V] [--data-path PREFIX ... | --mock-data]

The training entry's own preflight (megatron_lbp.integration.preflight.check_data_and_tokenizer),
run before anything is submitted: the tokenizer can be built here, offline, from local
files (megatron_lbp.tokenizer_check); every --data-path prefix (blend weights skipped) is
a readable Megatron indexed dataset with documents, whose .bin has the bytes its .idx
describes, and whose token ids — a sample of the first 2^20 tokens of each prefix — are
below the tokenizer's vocabulary (or the padded vocabulary when the tokenizer does not
say its size). One line per check on stdout; a failure is one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import sys

from megatron_lbp.launch._cli import PROG, Parser


class ContentsError(ValueError):
    """A check that fails; the message is one line."""


def check(tokenizer_type: str, vocab_file: str | None = None, merge_file: str | None = None,
          tokenizer_model: str | None = None, vocab_size_padded: int | None = None,
          data_path: list[str] = (), mock_data: bool = False) -> list[str]:
    """The checks' lines; the first failure raises :class:`ContentsError`."""
    from megatron_lbp.integration import preflight, tokenizer_check

    # The names preflight and tokenizer_check read (Megatron's parsed arguments).
    args = argparse.Namespace(tokenizer_type=tokenizer_type, vocab_file=vocab_file,
                              merge_file=merge_file, tokenizer_model=tokenizer_model,
                              vocab_size=vocab_size_padded, padded_vocab_size=vocab_size_padded,
                              data_path=list(data_path), mock_data=mock_data)
    import logging
    import warnings

    # Megatron's "could not determine rank" warning and its INFO lines on opening an index
    # are noise outside a job; the checks' own lines are the output.
    logging.getLogger("megatron.core.datasets.indexed_dataset").setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    try:
        vocab = tokenizer_check.check(args)
        source = tokenizer_model or " + ".join(f for f in (vocab_file, merge_file) if f)
        lines = [f"tokenizer: {tokenizer_type} {source} builds here, offline"
                 + (f" (vocabulary {vocab})" if vocab else "")]
        found = preflight.check_data_and_tokenizer(args)
    except (preflight.PreflightError, tokenizer_check.TokenizerInputError) as err:
        raise ContentsError(str(err)) from None
    if mock_data:
        lines.append("data: MOCK_DATA=1 (synthetic data, nothing to check)")
    for prefix, f in found.items():
        whole = "all of them" if f["sampled"] >= f["tokens"] else f"the first {f['sampled']:,}"
        lines.append(f"data: {prefix}: {f['documents']:,} documents, {f['tokens']:,} tokens; "
                     f"token ids in {whole} at most {f['top']}, below the vocabulary {f['vocab']}")
    return lines


def main(argv=None) -> int:
    ap = Parser(prog="python -m megatron_lbp.launch contents", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-type", required=True)
    ap.add_argument("--vocab-file", default=None)
    ap.add_argument("--merge-file", default=None)
    ap.add_argument("--tokenizer-model", default=None)
    ap.add_argument("--vocab-size-padded", type=int, default=None)
    ap.add_argument("--data-path", nargs="*", default=[])
    ap.add_argument("--mock-data", action="store_true")
    a = ap.parse_args(argv)
    try:
        lines = check(a.tokenizer_type, a.vocab_file, a.merge_file, a.tokenizer_model,
                      a.vocab_size_padded, a.data_path, a.mock_data)
    except ContentsError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
