"""Sharded checkpoints that load at any tensor/pipeline/data-parallel layout (see checkpoint.py)."""

from megatron_ext.dist_checkpointing.checkpoint import (
    CONVERTIBLE_CONFIG_FIELDS,
    CheckpointingException,
    checkpoint_dir,
    complete_iterations,
    find_checkpoint,
    latest_iteration,
    load_checkpoint,
    prune_checkpoints,
    read_marker,
    save_checkpoint,
)
from megatron_ext.dist_checkpointing.sharding import param_specs, replicated, sharded_tensor, tp_partitioned

__all__ = [
    "CONVERTIBLE_CONFIG_FIELDS",
    "CheckpointingException",
    "checkpoint_dir",
    "complete_iterations",
    "find_checkpoint",
    "latest_iteration",
    "load_checkpoint",
    "param_specs",
    "prune_checkpoints",
    "read_marker",
    "replicated",
    "save_checkpoint",
    "sharded_tensor",
    "tp_partitioned",
]
