"""python -m megatron_lbp.launch <command> ...: the launchers' Python side (see __init__)."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "job": "megatron_lbp.launch.job_cli",
    "estimate": "megatron_lbp.launch.estimate",
    "exit-time": "megatron_lbp.launch.walltime",
    "checkpoints": "megatron_lbp.launch.checkpoints",
    "placement": "megatron_lbp.launch.placement",
    "health": "megatron_lbp.launch.health",
    "survey": "megatron_lbp.launch.link_survey",
    "contents": "megatron_lbp.launch.contents",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m megatron_lbp.launch {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    # Each command imports only what it needs (the placement check runs at every task start).
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
