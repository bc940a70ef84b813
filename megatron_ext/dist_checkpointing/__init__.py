"""Sharded checkpoints that load at any tensor/pipeline/data-parallel layout: the training
checkpoints of ``save_checkpoint`` / ``load_checkpoint`` (checkpoint.py) and Megatron-core's API,
``save`` / ``load`` of sharded state dicts in its ``torch_dist`` format (serialization.py); both
write through the same DCP aliases (sharding.py)."""

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
from megatron_ext.dist_checkpointing.sharding import param_specs, replicated, sharded_tensor, tp_partitioned

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
    "param_specs",
    "prune_checkpoints",
    "read_marker",
    "replicated",
    "save_checkpoint",
    "sharded_tensor",
    "tp_partitioned",
]
