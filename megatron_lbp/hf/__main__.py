"""python -m megatron_lbp.hf {import,export} ... (see megatron_lbp.hf)."""
from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_lbp.hf",
                                description="Hugging Face model <-> Megatron torch_dist checkpoint")
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF model directory -> Megatron checkpoint starting a new run")
    imp.add_argument("hf_dir", help="local Hugging Face model directory (config.json + weights)")
    imp.add_argument("out_dir", help="new directory: release/ checkpoint, megatron_args.txt, hf/")
    imp.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: as stored)")
    exp = sub.add_parser("export", help="Megatron checkpoint -> HF model directory")
    exp.add_argument("load", help="a --save/--load directory (its tracker's iteration) or an iteration directory")
    exp.add_argument("out_dir", help="directory to write config.json, safetensors shards, tokenizer files")
    exp.add_argument("--hf-files", required=True,
                     help="directory with the model's config.json and tokenizer files (the import's hf/)")
    exp.add_argument("--iteration", type=int, help="export iter_N instead of the tracker's")
    exp.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: as stored)")
    exp.add_argument("--max-shard-gb", type=float, default=5.0)
    return p


def main(argv: list[str] | None = None) -> int:
    from megatron_lbp.hf.arch import UnsupportedModel
    from megatron_lbp.hf.outdir import OutputDirError

    args = _parser().parse_args(argv)
    dtype = DTYPES.get(args.dtype) if args.dtype else None
    try:
        if args.command == "import":
            from megatron_lbp.hf.importer import ARGS_FILE, import_model

            r = import_model(args.hf_dir, args.out_dir, dtype=dtype)
            print(f"imported {r.arch.model_type}: {r.chunks} tensors, {r.total_bytes / 2**20:.1f} MiB "
                  f"in {r.seconds:.1f} s; most tensor bytes alive at once {r.peak_tensor_bytes / 2**20:.1f} MiB, "
                  f"peak RSS {r.max_rss_bytes / 2**20:.0f} MiB", file=sys.stderr)
            print(f"flags (also in {args.out_dir}/{ARGS_FILE}):", file=sys.stderr)
            print(" ".join(r.flags))
        else:
            from megatron_lbp.hf.exporter import checkpoint_dir, export_model

            load = checkpoint_dir(args.load, args.iteration) if args.iteration is not None else args.load
            r = export_model(load, args.hf_files, args.out_dir, dtype=dtype,
                             max_shard_bytes=int(args.max_shard_gb * 2**30))
            from megatron_lbp.hf.importer import peak_rss_bytes

            print(f"exported {r.iteration_dir}: {r.tensors} tensors, {r.total_bytes / 2**20:.1f} MiB "
                  f"in {r.shards} shard(s) -> {args.out_dir}; peak RSS {peak_rss_bytes() / 2**20:.0f} MiB",
                  file=sys.stderr)
    except (UnsupportedModel, OutputDirError, FileNotFoundError, FileExistsError, KeyError) as err:
        msg = str(err).strip("'\"")
        print(f"python -m megatron_lbp.hf {args.command}: error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
