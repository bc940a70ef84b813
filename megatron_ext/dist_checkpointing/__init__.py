"""Sharded checkpoints that load at any tensor/pipeline/data-parallel layout: Megatron-core's API,
``save`` / ``load`` of sharded state dicts in its ``torch_dist`` format (serialization.py). A leaf
library: it knows no model, layer or optimizer; each layer's ``sharded_state_dict`` lives beside the
layer. The training checkpoints built on it (``save_checkpoint`` / ``load_checkpoint``: the model's
and optimizer's sharded state, made atomic, verified and refused alike on every rank) are
``megatron_ext.training.checkpointing``; its command-line converter is ``megatron_ext.training.convert``."""

from typing import Any

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
from megatron_ext.dist_checkpointing.strategies import torch as _torch_strategies  # noqa: F401  (registers the defaults)
from megatron_ext.dist_checkpointing.validation import StrictHandling, validate_sharding_integrity
from megatron_ext.dist_checkpointing.sharding import replicated, sharded_tensor, tp_partitioned

# The training checkpoint manager's names, where they were before it moved up to
# megatron_ext.training.checkpointing: a clear error, as this package imports nothing above it.
_TRAINING_CHECKPOINT_NAMES = (
    "CONVERTIBLE_CONFIG_FIELDS",
    "checkpoint",
    "checkpoint_dir",
    "complete_iterations",
    "find_checkpoint",
    "latest_iteration",
    "load_checkpoint",
    "prune_checkpoints",
    "read_marker",
    "save_checkpoint",
)


def __getattr__(name: str) -> Any:
    if name in _TRAINING_CHECKPOINT_NAMES:
        where = "megatron_ext.training.checkpointing" + ("" if name == "checkpoint" else f".{name}")
        raise AttributeError(
            f"megatron_ext.dist_checkpointing.{name} moved to {where} (dist_checkpointing is the sharded "
            "checkpoint library and knows nothing of training runs)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AsyncRequest",
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
    "replicated",
    "sharded_tensor",
    "tp_partitioned",
]
