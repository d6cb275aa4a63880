"""What the launcher's commands share: a one-line usage error, the KEY=VALUE file they resolve into."""
from __future__ import annotations

import argparse
import sys
from typing import Mapping

PROG = "lbp_launch"   # the launcher's prefix: its messages start "lbp_launch: error: "


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line with the launcher's prefix (exit 2)."""

    def error(self, message):
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)


def write_resolved(path: str | None, values: Mapping[str, object]) -> None:
    """KEY=VALUE lines that a reader (the launcher's lbp_read_resolved, job_cli.py) takes back, when
    ``path`` is given."""
    if path:
        with open(path, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in values.items())
