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
        self._check_files()

    def _check_files(self) -> None:
        """Every weight file opens, is as long as its header says, and holds what the index names.

        Run before anything is written: a copy cut short is found here, in one line, not
        as a reader's exception halfway through the output.
        """
        by_file: dict[str, list[str]] = {}
        for name, rel in self.file_of.items():
            by_file.setdefault(rel, []).append(name)
        for rel, names in sorted(by_file.items()):
            path = os.path.join(self.dir, rel)
            if not os.path.isfile(path):
                raise UnsupportedModel(f"{path} is missing (the index names {len(names)} tensors in it)")
            held = set(self._handle(rel).keys())
            absent = [n for n in names if n not in held]
            if absent:
                raise UnsupportedModel(f"{path} lacks {len(absent)} tensors the index places in it "
                                       f"(first: {absent[0]}): the index and the files disagree")

    def _names_in(self, rel: str) -> list[str]:
        return list(self._handle(rel).keys())

    def _handle(self, rel: str):
        if rel not in self._open:
            path = os.path.join(self.dir, rel)
            if rel.endswith(".safetensors"):
                self._open[rel] = _SafetensorsFile(path)
            else:
                try:
                    self._open[rel] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                except Exception as err:
                    text = str(err).strip().splitlines()
                    raise UnsupportedModel(
                        f"{path} cannot be read as a PyTorch checkpoint ({type(err).__name__}"
                        f"{': ' + text[0][:200] if text else ''}): truncated or not a weight file") from None
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
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or 8 + n > size:
                raise UnsupportedModel(f"{path} is truncated or not a safetensors file ({size} bytes, "
                                       f"header of {n if n is not None else '?'} bytes)")
            try:
                header = json.loads(f.read(n))
            except ValueError:
                raise UnsupportedModel(f"{path}: its safetensors header is not valid JSON") from None
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries = header
        self._check(size)

    def _check(self, size: int) -> None:
        """Offsets inside the file and consistent with each tensor's dtype and shape."""
        end = 0
        for name, e in self.entries.items():
            try:
                start, stop = e["data_offsets"]
                count = 1
                for d in e["shape"]:
                    count *= int(d)
            except (KeyError, TypeError, ValueError):
                raise UnsupportedModel(f"{self.path}: the header's entry for {name} is malformed") from None
            item = _ST_DTYPES[e["dtype"]].itemsize if e.get("dtype") in _ST_DTYPES else None
            if stop < start or (item is not None and stop - start != count * item):
                raise UnsupportedModel(f"{self.path}: {name} spans {stop - start} bytes but its "
                                       f"{e.get('dtype')} shape {e['shape']} needs {count * (item or 0)}")
            end = max(end, stop)
        if self.base + end > size:
            raise UnsupportedModel(f"{self.path} is truncated: {size} bytes, its header describes "
                                   f"{self.base + end}")

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
