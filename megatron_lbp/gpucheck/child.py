"""One part in its own process: ``python -m megatron_lbp.gpucheck.child PART OUT.json [options]``.

The runner starts one of these per part (and per part-D variant) under a time limit, so a
part that hangs or crashes the interpreter cannot stop the others. The JSON written is the
part's checks and figures, or the exception that ended it.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_lbp.gpucheck.child")
    p.add_argument("part", choices=("A", "B", "C", "D", "E"))
    p.add_argument("out")
    p.add_argument("--variant", default=None, help="part D: int8-secondary or no-secondary")
    p.add_argument("--layers", type=int, default=None, help="part D: layers of the 20B shape")
    p.add_argument("--tokens", type=int, default=None, help="part D: tokens per micro-batch")
    p.add_argument("--device", default=None, help="part D: cpu or cuda")
    p.add_argument("--steps", type=int, default=None, help="part D: optimizer steps")
    opts = p.parse_args(argv)
    try:
        result = importlib.import_module(f"megatron_lbp.gpucheck.part_{opts.part.lower()}").run(opts)
    except BaseException as exc:  # noqa: BLE001 - the part's result is what stopped it
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400],
                  "traceback_tail": tb.splitlines()[-6:]}
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
