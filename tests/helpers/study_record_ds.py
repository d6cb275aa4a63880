"""Records the DeepSpeed result files under tests/data/study_ds/ that tests/bench/test_study_deepspeed.py reads.

    .venv/bin/python -m tests.helpers.study_record_ds tests/data/study_ds

The DeepSpeed runner (python -m megatron_lbp.deepspeed_baseline.pretrain, 4 ranks by torchrun as 2
emulated nodes of 2) with LBP_RESULT_FILE, at the settings of tests/helpers/study_record.py's
2-node runs (the tiny GPT, 8 iterations in bf16, global batch 8, seed 1234, the demo
data), so that the report puts them beside the recorded lbp rows. The node count comes
from SLURM_NNODES, as under srun.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.helpers.pretrain_runner import REPO, TINY, demo_data

SCHEMES = ("ds-zero3", "ds-zeropp")


def main(out: str) -> int:
    os.makedirs(out, exist_ok=True)
    data = demo_data(Path(tempfile.mkdtemp(prefix="study-data-")))
    status = 0
    for scheme in SCHEMES:
        name = f"n2-{scheme}-s1234"
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", SLURM_NNODES="2",
                   LBP_RESULT_FILE=os.path.join(out, f"{name}.json"), LBP_STUDY_SCALING="weak",
                   LBP_STUDY_RUN=name)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "-m", "megatron_lbp.deepspeed_baseline.pretrain", "--ds-scheme", scheme, "--ds-ranks-per-node", "2",
               *TINY, "--data-path", data, "--train-iters", "8", "--global-batch-size", "8",
               "--seed", "1234", "--bf16"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
        print(name, "exit", r.returncode, flush=True)
        if r.returncode:
            status = 1
            print((r.stdout + r.stderr)[-4000:], file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/study_ds"))
