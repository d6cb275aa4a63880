"""Whether ``--split`` leaves every split Megatron builds or reads with documents.

megatron-core builds a dataset for every split with a non-zero share and, for
one whose share rounds to no documents, loops forever counting epochs of zero
tokens on the rank that builds the indices while the others wait for it
(gloo's timeout, minutes later). A validation split with no share is read
anyway when ``--eval-iters`` > 0 (the run dies after its last iteration on
``'NoneType' object is not an iterator``). With a few hundred documents
Megatron's default ``--split 969,30,1`` does the first. Both are refused here,
from the document counts alone, before any rank starts building indices.
"""
from __future__ import annotations

import re
from typing import Any

NAMES = ("training", "validation", "test")


class SplitError(ValueError):
    pass


def shares(split: str) -> list[float]:
    """``"98,2,0"`` -> normalised shares, as megatron-core parses it (missing parts are 0)."""
    parts = [float(p) for p in re.findall(r"[.0-9]+", split)]
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts] if total > 0 else parts


def document_ranges(split: str, documents: int) -> list[tuple[int, int] | None]:
    """Each split's [begin, end) documents as megatron-core rounds them; None for no share."""
    out, lo = [], 0.0
    for share in shares(split):
        hi = lo + share
        out.append((int(round(lo * documents)), int(round(hi * documents))) if share > 0 else None)
        lo = hi
    return out


def check(args: Any, documents: dict[str, int]) -> None:
    """SplitError naming --split (and --eval-iters) for ``{prefix: documents}`` of --data-path."""
    split = getattr(args, "split", None)
    if not documents or not split or getattr(args, "mock_data", False):
        return
    split = _shown(split)
    if not sum(shares(split)):
        raise SplitError(f"--split {split} gives every split a share of 0")
    eval_iters = getattr(args, "eval_iters", 0) or 0
    fix = _suggestion(min(documents.values()))
    for prefix, n in documents.items():
        ranges = document_ranges(split, n)
        if ranges[0] is None:
            raise SplitError(f"--split {split} gives the training split no share: {fix}")
        if ranges[1] is None and eval_iters > 0:
            raise SplitError(
                f"--split {split} gives the validation split no share but --eval-iters {eval_iters} "
                f"reads it (Megatron fails after the last iteration): add --eval-iters 0, or {fix}")
        for name, r in zip(NAMES, ranges):
            if r is not None and r[1] <= r[0]:
                raise SplitError(
                    f"--split {split} gives the {name} split none of the {n} documents of "
                    f"--data-path {prefix} (Megatron would build its index forever): {fix}")


def _shown(split: str) -> str:
    """The split as a flag value; Megatron's default is "969, 30, 1", which the user never typed."""
    import sys

    compact = ",".join(re.findall(r"[.0-9]+", split))
    typed = any(a == "--split" or a.startswith("--split=") for a in sys.argv[1:])
    return compact if typed else f"{compact} (Megatron's default)"


def _suggestion(documents: int) -> str:
    """A --split whose every non-zero share holds at least one document (two for validation)."""
    held = max(1, -(-200 // documents))               # percent holding >= 2 documents
    if held >= 50:
        return f"{documents} documents are too few to hold out any: --split 100,0,0 --eval-iters 0"
    return f"use e.g. --split {100 - held},{held},0 (a share of 0 builds no split)"
