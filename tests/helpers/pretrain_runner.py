"""Run python -m megatron_lbp.pretrain_gpt on local ranks (real files, real gloo) and read its log.

Two launchers: ``forkserver`` (the default) forks each rank from the test harness's
server with torch and Megatron imported and torchrun's variables set
(megatron_lbp.testing.entry), which saves ~5 s of CPU per rank; ``torchrun`` is the
launcher users run, for what needs a fresh interpreter (another megatron/ on
PYTHONPATH, tests/unit/test_patches.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([\dE+\-.]+) \|")
GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? grad norm: ([\d.]+) \|")

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
        "--position-embedding-type", "rope", "--log-interval", "1", "--eval-iters", "0",
        "--eval-interval", "100000", "--split", "98,2,0",
        "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(REPO / "tokenizer" / "lbp_bpe.model")]


def demo_data(tmp_root: Path) -> str:
    from megatron_lbp.integration.data import build_demo_data

    return build_demo_data(str(tmp_root))


def run_pretrain(nproc: int, args: list[str], *, timeout: int = 900, env: dict | None = None,
                 launcher: str = "forkserver"):
    """(returncode, log text, {iteration: loss}) of one launch (see the module docstring)."""
    if launcher == "forkserver":
        import tempfile

        from megatron_lbp.testing.entry import run_entry

        with tempfile.TemporaryDirectory(prefix="lbp-entry-") as tmp:
            code, log = run_entry(nproc, args, os.path.join(tmp, "ranks.log"), timeout=timeout,
                                  env={"PYTHONWARNINGS": "ignore", **(env or {})}, cwd=REPO)
        return code, log, _losses(log)
    if launcher != "torchrun":
        raise ValueError(f"launcher={launcher!r} is not 'forkserver' or 'torchrun'")
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_lbp.pretrain_gpt"]
        extra = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}   # one rank: no peer needs the port
    else:
        # --standalone: the agent hosts the store on a port the OS assigns while it binds.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(nproc), "-m", "megatron_lbp.pretrain_gpt"]
        extra = {}
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra,
                    **(env or {}))
    out = subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                         env=full_env)
    log = out.stdout + out.stderr
    return out.returncode, log, _losses(log)


def _losses(log: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(log)}


def grad_norms(log: str) -> dict[int, float]:
    """{iteration: gradient norm} from Megatron's iteration log (printed with 3 decimals)."""
    return {int(m.group(1)): float(m.group(2)) for m in GRAD_NORM.finditer(log)}


def why(log: str) -> str:
    """The lines of a failed run worth reading: errors and the last Megatron output."""
    keep = [l for l in log.splitlines()
            if ("error" in l.lower() and "error_injection" not in l and "logits_load" not in l)
            or "Error" in l]
    return "\n".join(keep[-15:] + ["--- tail ---"] + log.splitlines()[-15:])
