"""The engine's one door to megatron-core: the classes it subclasses and the checkpoint types it builds.

The engine is the layer below the Megatron integration (megatron_adapter.py
reads Megatron's module, optimizer and tokenizer structure and imports the
engine), so the engine does not import the adapter; what it needs of
megatron-core itself it takes from here, each imported where first used.
"""
from __future__ import annotations


def base_data_parallel():
    """megatron-core's ``_BaseDataParallel``: HierDataParallel offers Megatron's DDP interface."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    return _BaseDataParallel


def megatron_optimizer():
    """megatron-core's ``MegatronOptimizer``: HierDistributedOptimizer is one."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    return MegatronOptimizer


def sharded_tensor():
    """``dist_checkpointing.mapping.ShardedTensor``: a rank's piece of a global tensor in a checkpoint."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor


def sharded_tensor_factory():
    """``dist_checkpointing.mapping.ShardedTensorFactory``: Megatron's split-on-save tensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return ShardedTensorFactory
