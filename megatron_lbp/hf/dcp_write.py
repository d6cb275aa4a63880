"""Write a Megatron ``torch_dist`` checkpoint from tensors produced one at a time.

The planner makes each tensor from a callable when the distributed checkpoint writer asks
for it (``resolve_data``), and every chunk gets its own file, so at most one chunk's
tensor and its inputs are alive at a time. The layout is megatron-core's: stacked layers
are one global tensor per key with the layer index leading, one chunk per layer; the
non-tensor state is ``common_state``, and ``metadata.json``, written last, names the
``torch_dist`` backend.
"""
from __future__ import annotations

import dataclasses
import io
import os
from typing import Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

# megatron-core's ShardedObject("common_state", ..., global_shape=(1,), global_offset=(0,)).unique_key
COMMON_KEY = "common_state/shard_0_1"


@dataclasses.dataclass(frozen=True)
class Chunk:
    key: str                           # Megatron's sharded key
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]   # the chunk's tensor, made when it is written


class _LazyPlanner(DefaultSavePlanner):
    def __init__(self, chunks: list[Chunk], objects: dict[str, object],
                 on_written: Callable[[Chunk, torch.Tensor], None]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, c.offset): c for c in chunks}
        self._objects = objects
        self._on_written = on_written

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self._objects]
        for c in self._chunks.values():
            items.append(WriteItem(
                index=MetadataIndex(c.key, torch.Size(c.offset)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offset), sizes=torch.Size(c.shape)),
                    properties=TensorProperties(dtype=c.dtype), size=torch.Size(c.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            # megatron-core's ShardedObject serialisation: a list of the objects' data.
            buf = io.BytesIO()
            torch.save([self._objects[write_item.index.fqn]], buf)
            buf.seek(0)
            return buf
        c = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        t = c.make()
        if tuple(t.shape) != c.shape or t.dtype != c.dtype:
            raise ValueError(f"{c.key} at {c.offset}: made {tuple(t.shape)} {t.dtype}, "
                             f"planned {c.shape} {c.dtype}")
        self._on_written(c, t)
        return t


def write_torch_dist(ckpt_dir: str, chunks: list[Chunk], common: dict, objects: dict[str, object],
                     on_written: Callable[[Chunk, torch.Tensor], None] = lambda c, t: None) -> None:
    """Write ``chunks``, ``common`` and ``objects`` (megatron-core ShardedObjects by unique key,
    e.g. the linear layers' ``_extra_state``) as a torch_dist checkpoint in ``ckpt_dir``."""
    import json

    import torch.distributed.checkpoint as dcp

    os.makedirs(ckpt_dir, exist_ok=True)
    writer = dcp.FileSystemWriter(ckpt_dir, single_file_per_rank=False, thread_count=1)
    dcp.save({}, storage_writer=writer, planner=_LazyPlanner(chunks, {COMMON_KEY: common, **objects}, on_written), no_dist=True)
    # Written last: megatron-core treats a directory with metadata.json as a complete checkpoint.
    # Its content is megatron-core's CheckpointingConfig of the torch_dist strategy (written here
    # without importing megatron.core: the import takes seconds and no Megatron code runs here).
    with open(os.path.join(ckpt_dir, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
