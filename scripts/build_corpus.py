#!/usr/bin/env python3
"""Regenerate the shipped demo corpus, data_src/python-docs-3.11.jsonl.gz.

The corpus is the English prose of the Python 3.11 documentation as Debian 12
ships it in the package ``python3.11-doc`` (version 3.11.2-6+deb12u9, PSF
License Version 2; see data_src/SOURCES.md and data_src/LICENSE-PSF-2.0.txt).
The reStructuredText sources under ``usr/share/doc/python3.11/html/_sources``
are cleaned to plain prose paragraphs: code, doctests, tables, indices,
comments and directive options are dropped, inline markup is reduced to its
text, and every file is split into documents at its section headings (a short
section is merged into the next one so that no document is a bare heading).
Each document is one JSON line ``{"id", "title", "text"}`` where ``text`` is
the title and the paragraphs separated by blank lines.

Regenerate (needs Debian's apt and dpkg-deb, and nothing else; it does not run
in CI):

    apt-get update
    cd "$(mktemp -d)" && apt-get download python3.11-doc=3.11.2-6+deb12u9
    python scripts/build_corpus.py --deb python3.11-doc_3.11.2-6+deb12u9_all.deb
    # or, from an unpacked tree:  dpkg-deb -x <deb> root && \\
    #     python scripts/build_corpus.py --root root

``--check`` rebuilds into memory and compares the decompressed JSON lines with
the shipped file (exit 1 on a difference) instead of writing it. The output is
deterministic: files are read in sorted order and gzip is written with mtime 0
and no file name, so the same package gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "data_src" / "python-docs-3.11.jsonl.gz"
PACKAGE = "python3.11-doc"
VERSION = "3.11.2-6+deb12u9"
DEB_SHA256 = "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be"
SOURCES_REL = "usr/share/doc/python3.11/html/_sources"

# Parts of the documentation taken, in this order (files sorted inside each).
# Left out: whatsnew/ (change logs, mostly issue numbers), c-api/ and
# distutils/ (C signatures and option tables), license/copyright pages.
SECTIONS = [
    "tutorial",
    "glossary.rst.txt",
    "faq",
    "howto",
    "reference",
    "library",
    "using",
    "extending",
    "installing",
    "distributing",
]

# Directives whose body is prose (kept); every other directive's body is dropped.
PROSE_DIRECTIVES = {
    "note", "warning", "seealso", "important", "caution", "attention", "tip", "hint",
    "topic", "sidebar", "only", "impl-detail", "glossary", "epigraph", "admonition",
    "function", "method", "class", "attribute", "data", "exception", "decorator",
    "decoratormethod", "classmethod", "staticmethod", "abstractmethod",
    "coroutinefunction", "coroutinemethod", "awaitablefunction", "describe", "object",
    "cmdoption", "option", "envvar", "opcode", "pdbcommand", "availability",
    "versionadded", "versionchanged", "deprecated", "deprecated-removed",
}
VERSION_PREFIX = {
    "versionadded": "New in version {}.",
    "versionchanged": "Changed in version {}:",
    "deprecated": "Deprecated since version {}:",
    "deprecated-removed": "Deprecated since version {}, will be removed in version {}:",
}

DIRECTIVE_RE = re.compile(r"^\.\.\s+([A-Za-z][\w:-]*)::\s*(.*)$")
HEADING_CHARS = set("=-~^*#\"'`+:._")
BULLET_RE = re.compile(r"^([*+-]|#\.|\d+\.|\(?[a-zA-Z0-9]\)|[a-zA-Z]\.)\s+\S")
FIELD_RE = re.compile(r"^:[\w .()-]+:(\s|$)")
SIMPLE_TABLE_RE = re.compile(r"^=+( +=+)+\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _dedent(lines: list[str]) -> list[str]:
    ind = min((_indent(l) for l in lines if l.strip()), default=0)
    return [l[ind:] if l.strip() else "" for l in lines]


def _is_underline(line: str, title: str) -> bool:
    s = line.rstrip()
    return (
        len(s) >= 3
        and len(set(s)) == 1
        and s[0] in HEADING_CHARS
        and len(s) >= len(title.strip()) - 1
        and _indent(line) == 0
    )


# --- inline markup -----------------------------------------------------------

ROLE_RE = re.compile(r":[A-Za-z][\w.+:-]*:`([^`]+)`")
LITERAL_RE = re.compile(r"``(.+?)``")
LINK_RE = re.compile(r"`([^`<]+?)\s*<[^>`]*>`_{1,2}")
REF_RE = re.compile(r"`([^`]+)`_{1,2}")
INTERP_RE = re.compile(r"`([^`]+)`")
STRONG_RE = re.compile(r"\*\*(\S(?:.*?\S)?)\*\*")
EMPH_RE = re.compile(r"(?<![\w*])\*(?=\S)([^*\n]+?)(?<=\S)\*(?![\w*])")
FOOTNOTE_RE = re.compile(r"\s*\[(#[\w-]*|\d+|\*)\]_")
SUBST_RE = re.compile(r"\|([\w -]+)\|")


def _role_text(m: re.Match) -> str:
    body = m.group(1)
    role = m.group(0).split("`", 1)[0].strip(":")
    t = re.match(r"(?s)(.*?)\s*<[^>]*>$", body)
    if t and t.group(1).strip():
        return t.group(1).strip()
    if role in ("pep", "rfc"):
        return f"{role.upper()} {body.split('#')[0]}"
    body = body.lstrip("!")
    if body.startswith("~"):
        body = body[1:].rsplit(".", 1)[-1]
    return body


def clean_inline(text: str) -> str:
    text = ROLE_RE.sub(_role_text, text)
    text = LITERAL_RE.sub(r"\1", text)
    text = LINK_RE.sub(r"\1", text)
    text = REF_RE.sub(r"\1", text)
    text = INTERP_RE.sub(r"\1", text)
    text = STRONG_RE.sub(r"\1", text)
    text = EMPH_RE.sub(r"\1", text)
    text = FOOTNOTE_RE.sub("", text)
    text = SUBST_RE.sub(lambda m: {"release": "3.11", "version": "3.11"}.get(m.group(1), m.group(1)), text)
    text = text.replace("\\ ", "")
    text = re.sub(r"\\(.)", r"\1", text)
    text = re.sub(r"\s+", " ", text).strip()
    if text.endswith(" ::"):
        text = text[:-3]
    elif text.endswith("::"):
        text = text[:-1]
    return text


def is_prose(par: str) -> bool:
    """A paragraph worth keeping: several words, mostly letters, no leftover markup."""
    if len(par.split()) < 5 or "``" in par or par.startswith((">>>", "..", "$ ")):
        return False
    chars = [c for c in par if not c.isspace()]
    letters = sum(c.isalpha() for c in chars)
    return letters / len(chars) >= 0.75


# --- block structure -----------------------------------------------------------


def parse_blocks(lines: list[str], out: list[tuple[str, str]]) -> None:
    """Append ("heading", title) and ("par", text) items found in ``lines``."""
    i, n = 0, len(lines)
    skip_literal = False  # the previous paragraph ended with "::"

    def take_indented(j: int) -> int:
        # Lines from j on that are blank or indented (the body of a block).
        while j < n and (not lines[j].strip() or _indent(lines[j]) > 0):
            j += 1
        return j

    while i < n:
        line = lines[i]
        s = line.strip()
        if not s:
            i += 1
            continue
        ind = _indent(line)
        if ind > 0:
            j = take_indented(i)
            if not skip_literal:  # block quote / definition body
                parse_blocks(_dedent(lines[i:j]), out)
            skip_literal = False
            i = j
            continue
        skip_literal = False
        # Overlined heading, then underlined heading.
        if (i + 2 < n and _is_underline(line, lines[i + 1]) and lines[i + 1].strip()
                and lines[i + 2].rstrip() == line.rstrip()):
            out.append(("heading", clean_inline(lines[i + 1])))
            i += 3
            continue
        if i + 1 < n and not set(s) <= HEADING_CHARS and _is_underline(lines[i + 1], s):
            out.append(("heading", clean_inline(s)))
            i += 2
            continue
        if s.startswith(".."):
            j = take_indented(i + 1)
            m = DIRECTIVE_RE.match(s)
            if m and m.group(1).split(":")[-1] in PROSE_DIRECTIVES:
                name = m.group(1).split(":")[-1]
                body = _dedent(lines[i + 1:j])
                while body and (not body[0].strip() or FIELD_RE.match(body[0])):
                    body.pop(0)
                sub: list[tuple[str, str]] = []
                parse_blocks(body, sub)
                if name in VERSION_PREFIX:
                    arg = m.group(2).split()
                    nver = VERSION_PREFIX[name].count("{}")
                    versions = (arg + [""] * nver)[:nver]
                    extra = clean_inline(" ".join(arg[nver:]))
                    pars = [t for k, t in sub if k == "par"]
                    lead = VERSION_PREFIX[name].format(*versions)
                    text = " ".join(x for x in [lead, extra, *pars] if x)
                    out.append(("par", text))
                else:
                    out.extend(sub)
            i = j
            continue
        if s.startswith(">>>"):
            while i < n and lines[i].strip():
                i += 1
            continue
        if SIMPLE_TABLE_RE.match(s):
            borders = 0
            while i < n:
                if SIMPLE_TABLE_RE.match(lines[i].strip()):
                    borders += 1
                i += 1
                if borders == 3:
                    break
            continue
        if s.startswith(("+-", "+=", "|")):
            while i < n and lines[i].strip():
                i += 1
            continue
        if FIELD_RE.match(s):
            i = take_indented(i + 1)
            continue
        bm = BULLET_RE.match(s)
        if bm:
            marker = s.split(None, 1)[0]
            first = line[len(marker):].lstrip()
            j = i + 1
            while j < n and lines[j].strip() and _indent(lines[j]) > 0:
                j += 1
            k = j
            # following blank + indented lines still belong to the item
            while k < n:
                m2 = k
                while m2 < n and not lines[m2].strip():
                    m2 += 1
                if m2 < n and _indent(lines[m2]) > 0:
                    k = take_indented(m2)
                    j = k
                else:
                    break
            cut = len(line) - len(first)  # the item's content column
            rest = [l[cut:] if l[:cut].strip() == "" else l.lstrip() for l in lines[i + 1:j]]
            parse_blocks([first] + rest, out)
            i = j
            continue
        # An ordinary paragraph: consecutive lines at this indentation.
        j = i
        par: list[str] = []
        while j < n and lines[j].strip() and _indent(lines[j]) == 0:
            par.append(lines[j])
            j += 1
        text = " ".join(p.strip() for p in par)
        skip_literal = text.endswith("::")
        out.append(("par", clean_inline(text)))
        # A definition list: term lines directly followed by an indented body.
        i = j


def file_documents(rel: str, text: str) -> list[dict]:
    items: list[tuple[str, str]] = []
    parse_blocks(text.expandtabs(8).splitlines(), items)
    docs: list[dict] = []
    title, pars = "", []

    def flush() -> None:
        body = [p for p in pars if is_prose(p)]
        if body:
            docs.append({"title": title, "pars": body})

    for kind, value in items:
        if kind == "heading":
            if sum(len(p) for p in pars if is_prose(p)) >= 800:
                flush()
                title, pars = value, []
            elif not title:
                title = value
            else:
                pars.append(value) if is_prose(value) else None
        else:
            pars.append(value)
    flush()
    out = []
    for k, d in enumerate(docs):
        t = d["title"]
        text = "\n\n".join(([t] if t else []) + d["pars"])
        out.append({"id": f"{rel.removesuffix('.rst.txt')}#{k}", "title": t, "text": text})
    return out


def source_files(src: Path) -> list[Path]:
    files: list[Path] = []
    for part in SECTIONS:
        p = src / part
        if p.is_file():
            files.append(p)
        else:
            files.extend(sorted(p.rglob("*.rst.txt")))
    return files


def build(src: Path) -> bytes:
    """The corpus as uncompressed JSON lines, deterministic."""
    buf = io.StringIO()
    for f in source_files(src):
        rel = f.relative_to(src).as_posix()
        for doc in file_documents(rel, f.read_text(encoding="utf-8")):
            buf.write(json.dumps(doc, ensure_ascii=False, sort_keys=True) + "\n")
    return buf.getvalue().encode("utf-8")


def gzip_bytes(data: bytes) -> bytes:
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=9, mtime=0) as gz:
        gz.write(data)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--deb", type=Path, help=f"the downloaded {PACKAGE}_{VERSION}_all.deb")
    g.add_argument("--root", type=Path, help="a tree unpacked from it with dpkg-deb -x")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        root = args.root
        if args.deb:
            digest = hashlib.sha256(args.deb.read_bytes()).hexdigest()
            if digest != DEB_SHA256:
                print(f"warning: {args.deb} sha256 {digest} is not the recorded {DEB_SHA256}",
                      file=sys.stderr)
            subprocess.run(["dpkg-deb", "-x", str(args.deb), tmp], check=True)
            root = Path(tmp)
        src = root / SOURCES_REL
        if not src.is_dir():
            print(f"error: {src} not found (is this {PACKAGE}?)", file=sys.stderr)
            return 1
        data = build(src)

    ndocs = data.count(b"\n")
    if args.check:
        shipped = gzip.decompress(args.out.read_bytes())
        same = shipped == data
        print(f"{args.out}: {'identical to' if same else 'DIFFERS from'} a fresh build "
              f"({ndocs} documents, {len(data)} bytes)")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_name(args.out.name + ".tmp")
    tmp_out.write_bytes(gzip_bytes(data))
    os.replace(tmp_out, args.out)
    print(f"wrote {args.out}: {ndocs} documents, {len(data)} bytes uncompressed, "
          f"{args.out.stat().st_size} compressed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
