"""Read one tensor at a time from a Hugging Face model directory (safetensors or PyTorch bins, sharded or not)."""
from __future__ import annotations

import json
import os

import torch

from megatron_lbp.hf.arch import UnsupportedModel

_SINGLE = ("model.safetensors", "pytorch_model.bin")
_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class HFWeights:
    """Name -> tensor, loaded on request: nothing but the file handles stays open between calls.

    safetensors files are read tensor by tensor (``safe_open``); a ``.bin`` is
    memory-mapped (``torch.load(mmap=True)``), so a tensor costs memory when it
    is copied out, not when the file is opened.
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
                try:
                    from safetensors import safe_open
                except ImportError:
                    raise UnsupportedModel(f"{path} needs the 'safetensors' package, which is not "
                                           "installed here: pip install .[hf]") from None

                self._open[rel] = safe_open(path, framework="pt")
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
        t = h.get_tensor(stored) if hasattr(h, "get_tensor") else h[stored]
        return t.clone() if not hasattr(h, "get_tensor") else t

    def dtype(self) -> torch.dtype:
        first = next(iter(self.file_of))
        return self.get(first).dtype
