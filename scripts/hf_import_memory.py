"""Measure `python -m megatron_lbp.hf import` on a random Llama-shaped model: time, peak memory, sizes.

    .venv/bin/python scripts/hf_import_memory.py [--hidden 1024 --layers 24 --ffn 2816 --vocab 32000]

Builds the model with transformers (from .venv/hf-test, as the tests do), saves it in bf16 as
sharded safetensors, then runs the import in a child process and reports its wall time, its
peak resident memory and the import's own count of the most tensor
bytes alive at once, next to the model's size. The child's peak resident memory is its
VmHWM (the parent's size does not count: see megatron_lbp.hf.importer.peak_rss_bytes).
Then the export back, with shards of --export-shard-gb (it assembles one shard at a time).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--export-shard-gb", type=float, default=0.1,
                   help="then export the import back with shards of this size (the export holds one)")
    a = p.parse_args()
    import torch

    from megatron_lbp.testing import hf_env

    tf = hf_env.transformers()
    with tempfile.TemporaryDirectory(prefix="lbp-hf-mem-") as tmp:
        cfg = tf.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                             num_hidden_layers=a.layers, num_attention_heads=a.heads,
                             num_key_value_heads=a.kv_heads, max_position_embeddings=4096)
        with torch.device("meta"):
            params = sum(t.numel() for t in tf.LlamaForCausalLM(cfg).parameters())
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
        src = os.path.join(tmp, "hf")
        model.save_pretrained(src, max_shard_size="500MB")
        del model
        size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.endswith(".safetensors"))
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "megatron_lbp.hf", "import", src, os.path.join(tmp, "mg")],
                             capture_output=True, text=True, cwd=REPO)
        wall = time.perf_counter() - t0
        if out.returncode:
            sys.exit(out.stderr)
        print(f"model: {params / 1e6:.0f}M parameters, {size / 2**20:.0f} MiB of bf16 safetensors "
              f"({len([f for f in os.listdir(src) if f.endswith('.safetensors')])} shards)")
        print(f"import (python -m megatron_lbp.hf import, a child process): {wall:.1f} s wall")
        print(next(line for line in out.stderr.splitlines() if line.startswith("imported")))
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "megatron_lbp.hf", "export", os.path.join(tmp, "mg"),
                              os.path.join(tmp, "back"), "--hf-files", os.path.join(tmp, "mg", "hf"),
                              "--max-shard-gb", str(a.export_shard_gb)], capture_output=True, text=True, cwd=REPO)
        if out.returncode:
            sys.exit(out.stderr)
        print(f"export: {time.perf_counter() - t0:.1f} s wall; "
              + next(line for line in out.stderr.splitlines() if line.startswith("exported")))


if __name__ == "__main__":
    main()
