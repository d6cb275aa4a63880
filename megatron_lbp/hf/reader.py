"""Read one tensor at a time from a Hugging Face model directory (safetensors or PyTorch bins, sharded or not)."""
from __future__ import annotations

import json
import os
import struct

import torch

from megatron_lbp.hf.arch import UnsupportedModel

_SINGLE = ("model.safetensors", "pytorch_model.bin")
_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class HFWeights:
    """Name -> tensor, loaded on request: nothing but the file handles stays open between calls.

    safetensors files are read tensor by tensor with plain reads at the offsets
    their header gives (a memory map would leave every page read resident, and
    the process would grow to the model's size); a ``.bin`` is memory-mapped
    (``torch.load(mmap=True)``: the pickle format has no such header).
    """

    def __init__(self, model_dir: str):
        self.dir = model_dir
        self._open: dict[str, object] = {}
        self.file_of: dict[str, str] = {}
        for index in _INDEX:
            path = os.path.join(model_dir, index)
            if os.path.isfile(path):
                with open(path) as f:
                    self.file_of = dict(json.load(f)["weight_map"])
                break
        else:
            for single in _SINGLE:
                if os.path.isfile(os.path.join(model_dir, single)):
                    self.file_of = {name: single for name in self._names_in(single)}
                    break
        if not self.file_of:
            raise UnsupportedModel(f"{model_dir} has no weights ({', '.join(_SINGLE + _INDEX)})")

    def _names_in(self, rel: str) -> list[str]:
        return list(self._handle(rel).keys())

    def _handle(self, rel: str):
        if rel not in self._open:
            path = os.path.join(self.dir, rel)
            if rel.endswith(".safetensors"):
                self._open[rel] = _SafetensorsFile(path)
            else:
                self._open[rel] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self._open[rel]

    def resolve(self, name: str) -> str | None:
        """The stored name of ``name``: some checkpoints drop the ``transformer.``/``model.`` prefix."""
        if name in self.file_of:
            return name
        short = name.split(".", 1)[1] if name.startswith(("transformer.", "model.")) else None
        return short if short in self.file_of else None

    def __contains__(self, name: str) -> bool:
        return self.resolve(name) is not None

    def get(self, name: str) -> torch.Tensor:
        stored = self.resolve(name)
        if stored is None:
            raise KeyError(f"{self.dir}: the checkpoint has no tensor {name}")
        h = self._handle(self.file_of[stored])
        return h.get_tensor(stored) if isinstance(h, _SafetensorsFile) else h[stored].clone()

    def dtype(self) -> torch.dtype:
        first = next(iter(self.file_of))
        return self.get(first).dtype


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool}


class _SafetensorsFile:
    """A safetensors file: an 8-byte little-endian header length, a JSON header, the raw tensors."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries = header

    def keys(self):
        return self.entries.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        if e["dtype"] not in _ST_DTYPES:
            raise UnsupportedModel(f"{self.path}: {name} has dtype {e['dtype']}, which is not supported")
        start, stop = e["data_offsets"]
        buf = bytearray(stop - start)
        with open(self.path, "rb") as f:
            f.seek(self.base + start)
            if f.readinto(buf) != len(buf):
                raise UnsupportedModel(f"{self.path} is truncated (reading {name})")
        return torch.frombuffer(buf, dtype=_ST_DTYPES[e["dtype"]]).reshape(e["shape"]) if buf \
            else torch.empty(e["shape"], dtype=_ST_DTYPES[e["dtype"]])
