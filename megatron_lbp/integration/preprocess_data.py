"""Tokenize JSONL or plain text into Megatron's indexed dataset (.bin/.idx).

Writes what Megatron-LM's tools/preprocess_data.py writes, through megatron.core's
``IndexedDatasetBuilder``, with Megatron's own tokenizer flags and ``build_tokenizer``.
Bad input (no documents, a bad JSON line, a tokenizer that cannot be built offline) is
one line on stderr and exit status 1 or 2; outputs are renamed into place only on
success, so a failed or killed run leaves no partial .bin/.idx. The last stdout line is
the summary. Inputs, formats and the differences from Megatron-LM's script:
docs/training.md, "Tokenizers and data".
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import time
import warnings
import zlib
from pathlib import Path

PROG = "python -m megatron_lbp.preprocess_data"
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


class InputError(Exception):
    """A problem with the user's input: reported as one line, exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        raise SystemExit(_fail(message, status=2))


def _fail(message: str, status: int = 1) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return status


def _import_megatron():
    """megatron.training's tokenizer flags and megatron.core's builder, quietly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Apex / Transformer Engine absent: expected
        import megatron_lbp  # noqa: F401  (typing.override shim for Python 3.11)
        from megatron.core.datasets import indexed_dataset
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
        from megatron.training.arguments import _add_tokenizer_args
        from megatron_lbp.integration import megatron_adapter

        megatron_adapter.install_gpt2_bpe_from_files()  # as training builds it: offline, from the files
    return _add_tokenizer_args, build_tokenizer, indexed_dataset


def get_parser() -> argparse.ArgumentParser:
    add_tokenizer_args, _, _ = _import_megatron()
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tokenizer_args(p)
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True,
                   help="input file(s) or directory; .gz files are decompressed on the fly")
    g.add_argument("--input-format", choices=["jsonl", "text"], default="jsonl",
                   help="jsonl (default) or plain text")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="JSON keys to extract, one output per key (default: text)")
    g.add_argument("--document-boundary", choices=["auto", "blank-line", "file"], default="auto",
                   help="plain text only: what separates documents (default: auto)")
    g = p.add_argument_group("tokenization process")
    g.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="append the tokenizer's end-of-document token to every document "
                        "(default: on; Megatron-LM's script defaults to off)")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="path prefix of the outputs, without the _<key>_document suffix")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="documents between progress lines (default: 1000)")
    return p


# --- inputs ---------------------------------------------------------------------


def _is_json_file(path: Path) -> bool:
    return path.name.endswith(JSON_SUFFIXES)


def resolve_inputs(paths: list[str], fmt: str) -> list[Path]:
    """The input files, in order; checks that they exist and are not all empty."""
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(
                f for f in p.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
                and (fmt == "text" or _is_json_file(f))
            )
            found = [f for f in found if f.stat().st_size > 0]
            if not found:
                kind = "JSONL (*.jsonl, *.json, optionally .gz)" if fmt == "jsonl" else "non-empty"
                raise InputError(f"input {raw}: directory has no {kind} files")
            files.extend(found)
        elif p.is_file():
            if p.stat().st_size == 0:
                raise InputError(f"input {raw}: file is empty")
            files.append(p)
        elif p.exists():
            raise InputError(f"input {raw}: not a regular file or directory")
        else:
            raise InputError(f"input {raw}: no such file or directory")
    return files


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _read_errors(path: Path):
    """Turn decoding and decompression errors into one-line input errors."""

    class _Ctx:
        def __enter__(self):
            return self

        def __exit__(self, et, ev, tb):
            if et is None:
                return False
            if issubclass(et, UnicodeDecodeError):
                raise InputError(f"input {path}: not UTF-8 text ({ev.reason} at byte {ev.start})")
            if issubclass(et, (gzip.BadGzipFile, EOFError, zlib.error)):
                raise InputError(f"input {path}: not a valid gzip file ({ev})")
            return False

    return _Ctx()


def iter_records(files: list[Path], fmt: str, boundary: str):
    """Yield (file index, line number, payload); payload is a JSON line or a text."""
    if fmt == "jsonl":
        for fi, path in enumerate(files):
            with _read_errors(path), _open_text(path) as f:
                for lineno, line in enumerate(f, start=1):
                    if line.strip():
                        yield fi, lineno, line
        return
    if boundary == "auto":
        boundary = "blank-line" if len(files) == 1 else "file"
    for fi, path in enumerate(files):
        with _read_errors(path), _open_text(path) as f:
            if boundary == "file":
                yield fi, 1, f.read()
                continue
            block: list[str] = []
            start = 1
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    if not block:
                        start = lineno
                    block.append(line)
                elif block:
                    yield fi, start, "".join(block)
                    block = []
            if block:
                yield fi, start, "".join(block)


# --- encoding (in worker processes, or in-process for --workers 1) -----------------


class Encoder:
    """Tokenizes one record; errors come back as values, never raised across processes."""

    tokenizer = None

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def initializer(self) -> None:
        _, build_tokenizer, _ = _import_megatron()
        Encoder.tokenizer = build_tokenizer(self.args)

    def encode(self, record):
        fi, lineno, payload = record
        nbytes = len(payload.encode("utf-8"))
        if self.args.input_format == "text":
            texts = {"text": payload.strip()}
        else:
            try:
                data = json.loads(payload)
            except json.JSONDecodeError as e:
                return fi, lineno, f"bad JSON ({e.msg} at column {e.colno})", None, nbytes
            if not isinstance(data, dict):
                return fi, lineno, f"expected a JSON object, got {type(data).__name__}", None, nbytes
            texts = {}
            for key in self.args.json_keys:
                if key not in data:
                    return fi, lineno, f"no key {key!r} (keys: {', '.join(map(repr, data))})", None, nbytes
                value = data[key]
                if not (isinstance(value, str) or (
                        isinstance(value, list) and all(isinstance(v, str) for v in value))):
                    return fi, lineno, f"key {key!r} is {type(value).__name__}, not a string", None, nbytes
                texts[key] = value
        out = {}
        for key, text in texts.items():
            doc_ids: list[int] = []
            lens: list[int] = []
            for sentence in [text] if isinstance(text, str) else text:
                ids = Encoder.tokenizer.tokenize(sentence)
                if len(ids) > 0:
                    doc_ids.extend(ids)
                    lens.append(len(ids))
            if doc_ids and self.args.append_eod:
                doc_ids.append(Encoder.tokenizer.eod)
                lens[-1] += 1
            out[key] = (doc_ids, lens)
        return fi, lineno, None, out, nbytes


# --- progress -----------------------------------------------------------------------


class Progress:
    def __init__(self, interval: int) -> None:
        self.interval = max(1, interval)
        self.start = time.time()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(unit=" docs", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, docs: int, tokens: int, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if docs % 100 == 0:
                self.bar.set_postfix(tokens=tokens, refresh=False)
        elif docs % self.interval == 0:
            dt = max(time.time() - self.start, 1e-9)
            print(f"processed {docs} documents, {tokens} tokens "
                  f"({docs / dt:.0f} docs/s, {tokens / dt:.0f} tokens/s, "
                  f"{nbytes / dt / 2**20:.2f} MB/s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --- main ---------------------------------------------------------------------------


def _check_tokenizer_args(args: argparse.Namespace) -> None:
    """The training entry's check: the tokenizer can be built here, offline, from local files."""
    from megatron_lbp.integration import tokenizer_check

    try:
        tokenizer_check.check(args)
    except tokenizer_check.TokenizerInputError as e:
        raise InputError(str(e)) from None


def _missing_dirs(directory: Path) -> list[Path]:
    """The directories that creating ``directory`` would create, outermost first."""
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    return missing[::-1]


def output_paths(prefix: str, key: str) -> tuple[str, str]:
    return f"{prefix}_{key}_document.bin", f"{prefix}_{key}_document.idx"


def run(args: argparse.Namespace) -> int:
    t0 = time.time()
    _, build_tokenizer, indexed_dataset = _import_megatron()
    # Megatron-LM's defaults for the tokenizer when no model is built.
    args.rank = 1
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    keys = args.json_keys if args.input_format == "jsonl" else ["text"]
    if args.workers < 1:
        raise InputError(f"--workers {args.workers}: must be at least 1")
    if len(set(keys)) != len(keys):
        raise InputError(f"--json-keys {' '.join(keys)}: a key is repeated")

    files = resolve_inputs(args.input, args.input_format)
    _check_tokenizer_args(args)
    try:
        tokenizer = build_tokenizer(args)
    except Exception as e:  # noqa: BLE001 - any loader failure is one line
        where = args.tokenizer_model or args.vocab_file or args.tokenizer_type
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"tokenizer {where}: cannot load {args.tokenizer_type}: {msg}")
    eod = tokenizer.eod if args.append_eod else None
    dtype = indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size)

    prefix = args.output_prefix
    out_dir = Path(prefix).parent
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"--output-prefix {prefix}: {out_dir} is not a directory")
    created = _missing_dirs(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--output-prefix {prefix}: cannot create {out_dir}: {e.strerror}")

    tag = f".tmp-{os.getpid()}"
    finals = {k: output_paths(prefix, k) for k in keys}
    tmps = {k: (b + tag, i + tag) for k, (b, i) in finals.items()}
    builders = {}
    pool = None
    ok = False
    try:
        for k, (tmp_bin, _) in tmps.items():
            try:
                builders[k] = indexed_dataset.IndexedDatasetBuilder(tmp_bin, dtype=dtype)
            except OSError as e:
                raise InputError(f"--output-prefix {prefix}: cannot write {finals[k][0]}: "
                                 f"{e.strerror}")
        encoder = Encoder(args)
        records = iter_records(files, args.input_format, args.document_boundary)
        if args.workers == 1:
            Encoder.tokenizer = tokenizer
            encoded = map(encoder.encode, records)
        else:
            pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
            encoded = pool.imap(encoder.encode, records, 32)

        progress = Progress(args.log_interval)
        docs = tokens = skipped = nbytes = 0
        try:
            for fi, lineno, err, out, size in encoded:
                if err is not None:
                    raise InputError(f"input {files[fi]} line {lineno}: {err}")
                nbytes += size
                if not any(ids for ids, _ in out.values()):
                    skipped += 1
                    continue
                for k, (ids, lens) in out.items():
                    if ids:
                        builders[k].add_document(ids, lens)
                        tokens += len(ids)
                docs += 1
                progress.update(docs, tokens, nbytes)
        finally:
            progress.close()
        if docs == 0:
            what = f"{skipped} empty" if skipped else "no"
            raise InputError(f"input {' '.join(args.input)}: no documents ({what} records)")
        for k, builder in builders.items():
            builder.finalize(tmps[k][1])
        for k in keys:  # .bin first: an .idx in place means its .bin is complete
            os.replace(tmps[k][0], finals[k][0])
            os.replace(tmps[k][1], finals[k][1])
        ok = True
    finally:
        if pool is not None:
            (pool.close if ok else pool.terminate)()
            pool.join()
        if not ok:
            for b in builders.values():
                b.data_file.close()
            for pair in tmps.values():
                for t in pair:
                    if os.path.exists(t):
                        os.remove(t)
            for d in reversed(created):
                try:
                    d.rmdir()
                except OSError:
                    pass

    dt = time.time() - t0
    outs = " ".join(p for k in keys for p in finals[k])
    extra = f", {skipped} empty skipped" if skipped else ""
    eod_note = f"eod {eod} appended" if eod is not None else "no eod"
    print(f"summary: {docs} documents, {tokens} tokens, {dt:.2f} s, {tokens / dt:.0f} tokens/s "
          f"({eod_note}{extra}) -> {outs}", flush=True)
    return 0


def _early_input_check(argv: list[str] | None) -> None:
    """Report a bad --input at once, before megatron (and torch) are imported."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--input", nargs="+")
    p.add_argument("--input-format", default="jsonl")
    try:
        known, _ = p.parse_known_args(argv)
    except SystemExit:
        return  # the full parser reports it
    if known.input and known.input_format in ("jsonl", "text"):
        resolve_inputs(known.input, known.input_format)


def main(argv: list[str] | None = None) -> int:
    try:
        _early_input_check(argv)
    except InputError as e:
        return _fail(str(e))
    try:
        args = get_parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a one-line usage error (2)
        return int(e.code or 0)
    try:
        return run(args)
    except InputError as e:
        return _fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
