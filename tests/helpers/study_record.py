"""Records the result files under tests/data/study/ that tests/bench/test_study.py reads.

    .venv/bin/python -m tests.helpers.study_record tests/data/study

A small real study on local gloo ranks: 2 and 4 emulated nodes of 2 ranks x lbp,
zeropp, zero3 and stock Megatron's distributed optimizer, 8 iterations each in bf16, plus
a second seed of lbp and distopt at the smallest scale. Stock runs learn their
node count from SLURM_NNODES, as under srun (the hierarchy's runs from the
placement their ranks report).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from benchmarks.study_network import SCHEMES   # each scheme's training flags, one place
from tests.helpers.pretrain_runner import TINY, demo_data, run_pretrain, why


def main(out: str) -> int:
    os.makedirs(out, exist_ok=True)
    data = demo_data(Path(tempfile.mkdtemp(prefix="study-data-")))
    for nodes in (2, 4):
        for scheme, flags in SCHEMES.items():
            for seed in ((1234, 1235) if nodes == 2 and scheme in ("lbp", "distopt") else (1234,)):
                name = f"n{nodes}-{scheme}-s{seed}.json"
                env = {"LBP_RESULT_FILE": os.path.join(out, name), "LBP_STUDY_SCALING": "weak",
                       "LBP_STUDY_RUN": name[:-5]}
                if scheme == "distopt":
                    env["SLURM_NNODES"] = str(nodes)
                argv = TINY + ["--data-path", data, "--train-iters", "8", "--global-batch-size",
                               str(4 * nodes), "--seed", str(seed), "--bf16", *flags]
                if scheme != "distopt":
                    argv += ["--hier-gpus-per-node", "2"]
                code, log, _ = run_pretrain(2 * nodes, argv, env=env)
                print(name, "exit", code, flush=True)
                if code:
                    print(why(log), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/study"))
