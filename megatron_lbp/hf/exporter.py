"""Megatron ``torch_dist`` checkpoint (any hierarchy, any world size) -> Hugging Face model directory.

Reads the model's weights key by key and layer by layer (megatron_lbp.hf.dcp_read),
turns each into its Hugging Face tensors (megatron_lbp.hf.mapping) and writes
safetensors shards of at most ``max_shard_bytes``, with the index file
``from_pretrained`` reads when there are several; ``config.json`` and the
tokenizer files come from the import's ``hf/`` directory (or any directory
holding the model's config). The weights keep the checkpoint's dtype, unless
``dtype`` says otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch

from megatron_lbp.hf import mapping, outdir
from megatron_lbp.hf.arch import UnsupportedModel, arch_from_config, read_config
from megatron_lbp.hf.dcp_read import CheckpointReader
from megatron_lbp.hf.importer import non_weight_files

TRACKER = "latest_checkpointed_iteration.txt"


@dataclass
class ExportReport:
    iteration_dir: str
    tensors: int
    shards: int
    total_bytes: int


def checkpoint_dir(load: str, iteration: int | None = None) -> str:
    """The iteration directory ``--load``-style: the tracker's, or ``iteration``'s."""
    if iteration is None:
        tracker = os.path.join(load, TRACKER)
        if not os.path.isfile(tracker):
            if os.path.isfile(os.path.join(load, "metadata.json")):
                return load                       # already an iteration directory
            raise FileNotFoundError(f"{load} has no {TRACKER} (not a Megatron checkpoint directory)")
        text = open(tracker).read().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}"
    else:
        name = f"iter_{iteration:07d}"
    path = os.path.join(load, name)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"{path} is not a complete torch_dist checkpoint (no metadata.json)")
    return path


def _hf_tensors(arch, reader: CheckpointReader, dtype):
    """(HF name, tensor) in file order: embeddings, layers, final norm, output layer."""
    cast = (lambda t: t.to(dtype).contiguous()) if dtype is not None else (lambda t: t.contiguous())
    gnames = mapping.global_names(arch)
    for key, shape in mapping.global_shapes(arch).items():
        _check_shape(reader, key, shape)
    for key in [k for k in gnames if k.startswith("embedding.")]:
        yield gnames[key][0], cast(reader.read(key))
    shapes = mapping.layer_shapes(arch)
    for suffix, shape in shapes.items():
        _check_shape(reader, mapping.layer_key(suffix), (arch.num_layers,) + shape)
    for i in range(arch.num_layers):
        for suffix, inverse in mapping.layer_to_hf(arch, i).items():
            for name, t in inverse(reader.read(mapping.layer_key(suffix), i)).items():
                yield name, cast(t)
    for key in [k for k in gnames if not k.startswith("embedding.")]:
        yield gnames[key][0], cast(reader.read(key))


def _check_shape(reader: CheckpointReader, key: str, want: tuple[int, ...]) -> None:
    if key not in reader.tensors:
        raise UnsupportedModel(f"{reader.dir} has no {key}: the checkpoint is not of the model "
                               "config.json describes")
    if reader.shape(key) != tuple(want):
        raise UnsupportedModel(f"{reader.dir}: {key} is {reader.shape(key)}, config.json implies "
                               f"{tuple(want)}: the checkpoint is not of that model")


def export_model(ckpt: str, hf_files: str, out: str, *, dtype: torch.dtype | None = None,
                 max_shard_bytes: int = 5 << 30) -> ExportReport:
    """Write the model of ``ckpt`` (a --load directory or an iteration directory) into ``out``:
    a new or empty directory, or an earlier export, replaced whole (megatron_lbp.hf.outdir)."""
    arch = arch_from_config(read_config(hf_files))
    it_dir = checkpoint_dir(ckpt)
    reader = CheckpointReader(it_dir)
    outdir.check_destination(out, replaceable=True, what="an export")
    with outdir.staged(out, replaceable=True, what="an export",
                       marker={"checkpoint": os.path.abspath(it_dir), "hf_files": os.path.abspath(hf_files)}
                       ) as stage:
        report = _write(arch, reader, hf_files, stage, dtype, max_shard_bytes)
    return ExportReport(it_dir, *report)


def _write(arch, reader: CheckpointReader, hf_files: str, out: str, dtype, max_shard_bytes: int):
    """(tensors, shards, bytes) written into ``out``: the shards, their index, config and tokenizer."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    written: list[tuple[str, list[str]]] = []
    size = total = count = 0

    def flush(final: bool):
        nonlocal size
        if not shards[-1]:
            return
        name = f"model-{len(written) + 1:05d}.safetensors"
        save_file(shards[-1], os.path.join(out, name), metadata={"format": "pt"})
        written.append((name, list(shards[-1])))
        shards[-1] = {}
        size = 0

    for name, t in _hf_tensors(arch, reader, dtype):
        if size and size + t.nbytes > max_shard_bytes:
            flush(False)
        shards[-1][name] = t
        size += t.nbytes
        total += t.nbytes
        count += 1
    flush(True)
    if len(written) == 1:
        os.replace(os.path.join(out, written[0][0]), os.path.join(out, "model.safetensors"))
    else:
        n = len(written)
        index = {"metadata": {"total_size": total}, "weight_map": {}}
        for i, (name, names) in enumerate(written):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(out, name), os.path.join(out, final))
            index["weight_map"].update({k: final for k in names})
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    for name in non_weight_files(hf_files):
        shutil.copy2(os.path.join(hf_files, name), os.path.join(out, name))
    if dtype is not None:
        _set_config_dtype(os.path.join(out, "config.json"), dtype)
    return count, len(written), total


def _set_config_dtype(path: str, dtype: torch.dtype) -> None:
    with open(path) as f:
        cfg = json.load(f)
    name = str(dtype).replace("torch.", "")
    for field in ("torch_dtype", "dtype"):
        if field in cfg or field == "torch_dtype":
            cfg[field] = name
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
