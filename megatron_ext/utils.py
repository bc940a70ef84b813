"""Helpers that Megatron-core keeps in ``megatron.core.utils``: ShardedTensors of a rank's tensors
(they live in ``dist_checkpointing.rank_shards``) and a batch's share of a context-parallel rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.dist_checkpointing.rank_shards import (
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)
from megatron_ext.resolve import group_rank, group_size

__all__ = [
    "make_sharded_tensor_for_checkpoint",
    "make_tp_sharded_tensor_for_checkpoint",
    "get_batch_on_this_cp_rank",
]


def get_batch_on_this_cp_rank(
    batch: dict[str, Any], cp_group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """This context-parallel rank's part of ``batch`` (Megatron-core's signature and layout): each
    tensor's sequence (dim 1; dim 2 for ``attention_mask``) cut into ``2 * cp`` chunks, of which
    rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r``, so every rank has the same causal work.
    ``cp_group`` defaults to parallel_state's. Updates ``batch`` in place and returns it; ValueError
    if a sequence does not divide into ``2 * cp`` chunks."""
    if cp_group is None:
        cp = parallel_state.get_context_parallel_world_size()
        rank = parallel_state.get_context_parallel_rank()
    else:
        cp, rank = group_size(cp_group), group_rank(cp_group)
    if cp <= 1:
        return batch
    for key, value in batch.items():
        if value is None:
            continue
        dim = 2 if key == "attention_mask" else 1
        if value.shape[dim] % (2 * cp):
            raise ValueError(
                f"get_batch_on_this_cp_rank: batch[{key!r}] has sequence length {value.shape[dim]} (dim "
                f"{dim}), which does not divide into 2 * context_parallel_size = {2 * cp} chunks"
            )
        chunks = value.unflatten(dim, (2 * cp, -1))
        index = torch.tensor([rank, 2 * cp - 1 - rank], device=value.device)
        batch[key] = chunks.index_select(dim, index).flatten(dim, dim + 1)
    return batch
