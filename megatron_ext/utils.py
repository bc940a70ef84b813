"""Helpers that Megatron-core keeps in ``megatron.core.utils``: ShardedTensors of a rank's tensors."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.dist_checkpointing.mapping import ReplicaId, ShardedTensor


def _groups(kwargs: dict) -> tuple[Any, Any]:
    tp_group, dp_cp_group = kwargs.pop("tp_group", None), kwargs.pop("dp_cp_group", None)
    if tp_group is None and dp_cp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return tp_group, dp_cp_group


def _rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def make_tp_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor,
    key: str,
    tp_axis: int = 0,
    replica_id: ReplicaId | None = None,
    prepend_offsets: tuple = (),
    **kwargs: Any,
) -> ShardedTensor:
    """``tensor`` as this tensor-parallel rank's chunk along ``tp_axis`` of global tensor ``key``
    (after the axes ``prepend_offsets`` prepends: (axis, index, fragments) each); replicated over
    data-parallel ranks (replica_id ``(0, 0, dp_rank)``). Groups: ``tp_group`` / ``dp_cp_group``
    keyword arguments, else parallel_state's."""
    tp_group, dp_cp_group = _groups(kwargs)
    prepend_axis_num = len(prepend_offsets)
    if replica_id is None:
        replica_id = (0, 0, _rank(dp_cp_group))
    return ShardedTensor.from_rank_offsets(
        key,
        tensor,
        *prepend_offsets,
        (tp_axis + prepend_axis_num, _rank(tp_group), _size(tp_group)),
        replica_id=replica_id,
        prepend_axis_num=prepend_axis_num,
        **kwargs,
    )


def make_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor,
    key: str,
    prepend_offsets: tuple = (),
    replica_id: ReplicaId | None = None,
    **kwargs: Any,
) -> ShardedTensor:
    """``tensor`` whole as global tensor ``key`` (but for ``prepend_offsets``), replicated over
    tensor- and data-parallel ranks (replica_id ``(0, tp_rank, dp_rank)``)."""
    tp_group, dp_cp_group = _groups(kwargs)
    if replica_id is None:
        replica_id = (0, _rank(tp_group), _rank(dp_cp_group))
    return ShardedTensor.from_rank_offsets(
        key,
        tensor,
        *prepend_offsets,
        replica_id=replica_id,
        prepend_axis_num=len(prepend_offsets),
        **kwargs,
    )


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
        cp, rank = _size(cp_group), _rank(cp_group)
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
