"""Sharded checkpoints that load at any tensor/pipeline/data-parallel layout (see checkpoint.py)."""

from megatron_ext.dist_checkpointing.adam import NamedAdam
from megatron_ext.dist_checkpointing.checkpoint import (
    CheckpointingException,
    checkpoint_dir,
    find_checkpoint,
    load_checkpoint,
    read_marker,
    save_checkpoint,
)
from megatron_ext.dist_checkpointing.sharding import param_specs, replicated, sharded_tensor, tp_partitioned

__all__ = [
    "CheckpointingException",
    "NamedAdam",
    "checkpoint_dir",
    "find_checkpoint",
    "load_checkpoint",
    "param_specs",
    "read_marker",
    "replicated",
    "save_checkpoint",
    "sharded_tensor",
    "tp_partitioned",
]
