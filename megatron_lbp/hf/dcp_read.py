"""Read pieces of a ``torch_dist`` checkpoint's global tensors, one region at a time, in one process.

PyTorch's distributed checkpoint reads whatever stored chunks overlap the
region asked for (``create_read_items_for_chunk_list``), so a layer of a
stacked tensor can be read from a checkpoint written as flat pieces by any
number of ranks, without holding the rest of the stack.
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


class _RegionPlanner(DefaultLoadPlanner):
    def __init__(self, key: str, offset: tuple[int, ...], buffer: torch.Tensor):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._key, self._offset, self._buffer = key, offset, buffer

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata[self._key]
        chunk = ChunkStorageMetadata(offsets=torch.Size(self._offset), sizes=self._buffer.shape)
        return LoadPlan(create_read_items_for_chunk_list(self._key, md, [chunk]))

    def lookup_tensor(self, index):
        return self._buffer


class CheckpointReader:
    """The tensors of one torch_dist iteration directory, by key and region."""

    def __init__(self, ckpt_dir: str):
        self.dir = ckpt_dir
        self._reader = dcp.FileSystemReader(ckpt_dir)
        meta = self._reader.read_metadata()
        self.tensors: dict[str, TensorStorageMetadata] = {
            k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        """The whole tensor, or layer ``index`` of a stacked one (its leading axis dropped)."""
        if key not in self.tensors:
            raise KeyError(f"{self.dir} has no tensor {key}")
        shape = self.shape(key)
        if index is None:
            offset, size = (0,) * len(shape), shape
        else:
            offset, size = (index,) + (0,) * (len(shape) - 1), (1,) + shape[1:]
        buf = torch.empty(size, dtype=self.dtype(key))
        dcp.load({}, storage_reader=self._reader,
                 planner=_RegionPlanner(key, offset, buf), no_dist=True)
        return buf if index is None else buf[0]
