"""Helpers that Megatron-core keeps in ``megatron.core.utils``: ShardedTensors of a rank's tensors
(they live in ``dist_checkpointing.utils``)."""

from megatron_ext.dist_checkpointing.utils import (
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)

__all__ = ["make_sharded_tensor_for_checkpoint", "make_tp_sharded_tensor_for_checkpoint"]
