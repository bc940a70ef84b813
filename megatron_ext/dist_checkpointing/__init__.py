"""Sharded checkpoints that load at any tensor/pipeline/data-parallel layout: Megatron-core's API,
``save`` / ``load`` of sharded state dicts in its ``torch_dist`` format (serialization.py), and on
it the training checkpoints of ``save_checkpoint`` / ``load_checkpoint`` (checkpoint.py: the
model's and optimizer's sharded state, made atomic, verified and refused alike on every rank)."""

from megatron_ext.dist_checkpointing.checkpoint import (
    CONVERTIBLE_CONFIG_FIELDS,
    checkpoint_dir,
    complete_iterations,
    find_checkpoint,
    latest_iteration,
    load_checkpoint,
    prune_checkpoints,
    read_marker,
    save_checkpoint,
)
from megatron_ext.dist_checkpointing.core import CheckpointingException
from megatron_ext.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    is_main_replica,
)
from megatron_ext.dist_checkpointing.serialization import (
    AsyncRequest,
    check_is_distributed_checkpoint,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    save,
)
from megatron_ext.dist_checkpointing.validation import StrictHandling, validate_sharding_integrity
from megatron_ext.dist_checkpointing.sharding import replicated, sharded_tensor, tp_partitioned

__all__ = [
    "AsyncRequest",
    "CONVERTIBLE_CONFIG_FIELDS",
    "CheckpointingException",
    "LocalNonpersistentObject",
    "ShardedBase",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "StrictHandling",
    "check_is_distributed_checkpoint",
    "is_main_replica",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "save",
    "validate_sharding_integrity",
    "checkpoint_dir",
    "complete_iterations",
    "find_checkpoint",
    "latest_iteration",
    "load_checkpoint",
    "prune_checkpoints",
    "read_marker",
    "replicated",
    "save_checkpoint",
    "sharded_tensor",
    "tp_partitioned",
]
