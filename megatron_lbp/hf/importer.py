"""Hugging Face model directory -> Megatron ``torch_dist`` checkpoint that starts a new run.

The checkpoint is Megatron's ``release`` form (tracker ``release``): weights
only, loaded at iteration 0 with no optimizer or RNG state, by ``--load``,
``--pretrained-checkpoint`` or ``--finetune`` alike, under any ``--hier-*``
preset and world size (the tensors are whole, in global coordinates). Next to
it: ``megatron_args.txt``, the flags that build the model (architecture and
tokenizer), ``tokenizer_args.txt`` (the tokenizer's alone), and ``hf/``, the
source's config and tokenizer files, which the export copies back.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import time
from dataclasses import dataclass

import torch

from megatron_lbp.hf import mapping, outdir
from megatron_lbp.hf.arch import Arch, UnsupportedModel, arch_from_config, megatron_flags, read_config
from megatron_lbp.hf.dcp_write import Chunk, write_torch_dist
from megatron_lbp.hf.reader import HFWeights

ARGS_FILE = "megatron_args.txt"
TOKENIZER_ARGS_FILE = "tokenizer_args.txt"      # the tokenizer part alone, for python -m megatron_lbp.preprocess_data
HF_FILES_DIR = "hf"
RELEASE = "release"
# Everything of a model directory but its weights: config, generation config, tokenizer files.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt", ".gguf")


@dataclass
class ImportReport:
    arch: Arch
    flags: list[str]
    chunks: int
    peak_tensor_bytes: int      # most bytes of tensors alive at once (inputs + the chunk made of them)
    total_bytes: int
    max_rss_bytes: int
    seconds: float


def non_weight_files(model_dir: str) -> list[str]:
    """Config, generation config and tokenizer files of a model directory (not its weights or index)."""
    return [name for name in sorted(os.listdir(model_dir))
            if os.path.isfile(os.path.join(model_dir, name)) and not name.endswith(_WEIGHT_SUFFIXES)
            and not name.endswith(".index.json")]


def tokenizer_flags(hf_dir: str, arch: Arch) -> list[str]:
    """The tokenizer the directory implies: GPT-2's two files need no transformers; the rest do."""
    vocab, merges = os.path.join(hf_dir, "vocab.json"), os.path.join(hf_dir, "merges.txt")
    if arch.gpt2 and os.path.isfile(vocab) and os.path.isfile(merges):
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir]


def plan_chunks(arch: Arch, weights: HFWeights, dtype: torch.dtype | None, track) -> list[Chunk]:
    """One Chunk per global tensor and per (layer kind, layer); checks every input exists first."""
    missing: list[str] = []

    def make(names, fn):
        missing.extend(n for n in names if n not in weights)

        def produce():
            inputs = [weights.get(n) for n in names]
            out = fn(*inputs)
            out = out.to(dtype) if dtype is not None else out
            track(sum(t.nbytes for t in inputs) + (0 if any(out.data_ptr() == t.data_ptr() for t in inputs)
                                                   else out.nbytes))
            return out
        return produce

    src_dtype = weights.dtype()
    out_dtype = dtype or src_dtype
    chunks = []
    gnames = mapping.global_names(arch)
    for key, shape in mapping.global_shapes(arch).items():
        chunks.append(Chunk(key, shape, (0,) * len(shape), shape, out_dtype,
                            make(gnames[key], lambda t: t)))
    shapes = mapping.layer_shapes(arch)
    for i in range(arch.num_layers):
        for suffix, (names, fn) in mapping.layer_to_megatron(arch, i).items():
            shape = shapes[suffix]
            chunks.append(Chunk(mapping.layer_key(suffix), (arch.num_layers,) + shape,
                                (i,) + (0,) * len(shape), (1,) + shape, out_dtype,
                                make(names, lambda *ts, fn=fn: fn(*ts).unsqueeze(0))))
    if missing:
        raise UnsupportedModel(f"{weights.dir}: the weights lack {len(missing)} tensors the "
                               f"{arch.model_type} config implies (first: {missing[0]})")
    return chunks


def checkpoint_args(arch: Arch, tok_flags: list[str]) -> argparse.Namespace:
    """What megatron.training and the preflight read from a checkpoint's ``args``."""
    return argparse.Namespace(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        ffn_hidden_size=arch.ffn_hidden_size, group_query_attention=arch.num_query_groups != arch.num_heads,
        num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim,
        padded_vocab_size=arch.vocab_size, make_vocab_size_divisible_by=arch.vocab_size,
        max_position_embeddings=arch.max_positions, add_position_embedding=arch.gpt2,
        position_embedding_type="learned_absolute" if arch.gpt2 else "rope",
        untie_embeddings_and_output_weights=not arch.tied,
        tokenizer_type=tok_flags[tok_flags.index("--tokenizer-type") + 1],
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, world_size=1,
        data_parallel_size=1, consumed_train_samples=0, skipped_train_samples=0,
        consumed_valid_samples=0, no_save_optim=True, no_save_rng=True, ckpt_format="torch_dist")


def import_model(src: str, dst: str, dtype: torch.dtype | None = None) -> ImportReport:
    """Convert ``src`` (a Hugging Face model directory) into ``dst``; see the module docstring.

    Everything is checked before anything is written (the config, every weight file's header
    and length, every tensor the config implies); the output is written into a staging
    directory that becomes ``dst`` only when complete (megatron_lbp.hf.outdir), so a failure
    leaves no partial output. ``dst`` must be new or empty.
    """
    t0 = time.perf_counter()
    arch = arch_from_config(read_config(src))          # refuses before any tensor is read
    weights = HFWeights(src)                           # refuses a torn or inconsistent weight file
    if os.path.exists(os.path.join(dst, "latest_checkpointed_iteration.txt")):
        raise FileExistsError(f"{dst} already holds a Megatron checkpoint; import into a new directory")
    outdir.check_destination(dst, replaceable=False, what="an import")
    peak = [0]

    def track(nbytes):
        peak[0] = max(peak[0], nbytes)

    chunks = plan_chunks(arch, weights, dtype, track)
    hf_dir = os.path.join(os.path.abspath(dst), HF_FILES_DIR)     # where the flags point once in place
    with outdir.staged(dst, replaceable=False, what="an import") as stage:
        os.makedirs(os.path.join(stage, HF_FILES_DIR))
        for name in non_weight_files(src):
            shutil.copy2(os.path.join(src, name), os.path.join(stage, HF_FILES_DIR, name))
        tok = tokenizer_flags(os.path.join(stage, HF_FILES_DIR), arch)
        tok = [hf_dir + t[len(os.path.join(stage, HF_FILES_DIR)):]
               if t.startswith(os.path.join(stage, HF_FILES_DIR)) else t for t in tok]
        flags = megatron_flags(arch) + tok
        total = sum(torch.Size(c.shape).numel() * c.dtype.itemsize for c in chunks)
        write_torch_dist(os.path.join(stage, RELEASE), chunks,
                         {"args": checkpoint_args(arch, tok), "checkpoint_version": 3.0, "iteration": 0},
                         mapping.extra_states(arch))
        with open(os.path.join(stage, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(RELEASE)
        with open(os.path.join(stage, ARGS_FILE), "w") as f:
            f.write(" ".join(flags) + "\n")
        with open(os.path.join(stage, TOKENIZER_ARGS_FILE), "w") as f:
            f.write(" ".join(tok) + "\n")
    return ImportReport(arch, flags, len(chunks), peak[0], total, peak_rss_bytes(), time.perf_counter() - t0)


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started (exec'd).

    Linux's VmHWM belongs to the address space, which exec replaces; ru_maxrss
    starts a child at its parent's resident size at fork, so a small import
    run from a big process would report the parent's size.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
