"""Reading a training argv before any parser: pure, so every layer may use it (the engine's faults too)."""
from __future__ import annotations

from typing import Sequence


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` / ``flag=VALUE`` in argv (Megatron parses with
    allow_abbrev=False, so the spelling is exact), or None."""
    value = None
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(flag + "="):
            value = tok[len(flag) + 1:]
    return value


def flag_values(argv: Sequence[str], flag: str) -> list[str]:
    """The values of the last ``flag V1 V2 ...`` / ``flag=V`` in argv (an nargs='*' option
    such as --recompute-modules), or []."""
    values: list[str] = []
    for i, tok in enumerate(argv):
        if tok == flag:
            values = []
            for nxt in argv[i + 1:]:
                if nxt.startswith("--"):
                    break
                values.append(nxt)
        elif tok.startswith(flag + "="):
            values = [tok[len(flag) + 1:]]
    return values


def given(argv: Sequence[str], flag: str) -> bool:
    return any(tok == flag or tok.startswith(flag + "=") for tok in argv)
