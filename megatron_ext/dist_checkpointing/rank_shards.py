"""Sharded views of one rank's tensors and objects (Megatron-core keeps these in
``megatron.core.utils``, ``transformer.utils`` and ``dist_checkpointing.utils``; not named ``utils``
here, so that Megatron-core's own ``dist_checkpointing.utils`` stays what its code imports): where a
rank's copy lies in a global tensor, by its tensor- and data-parallel rank; no model or layer is
known here."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext import parallel_state
from megatron_ext.dist_checkpointing.dict_utils import nested_values
from megatron_ext.dist_checkpointing.mapping import (
    ReplicaId,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
)
from megatron_ext.resolve import default_group, group_rank, group_size


def _groups(kwargs: dict) -> tuple[Any, Any]:
    tp_group, dp_cp_group = kwargs.pop("tp_group", None), kwargs.pop("dp_cp_group", None)
    if tp_group is None and dp_cp_group is None:
        tp_group, dp_cp_group = default_group("tp"), default_group("dp_cp")
    return tp_group, dp_cp_group


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
        replica_id = (0, 0, group_rank(dp_cp_group))
    return ShardedTensor.from_rank_offsets(
        key,
        tensor,
        *prepend_offsets,
        (tp_axis + prepend_axis_num, group_rank(tp_group), group_size(tp_group)),
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
        replica_id = (0, group_rank(tp_group), group_rank(dp_cp_group))
    return ShardedTensor.from_rank_offsets(
        key,
        tensor,
        *prepend_offsets,
        replica_id=replica_id,
        prepend_axis_num=len(prepend_offsets),
        **kwargs,
    )


def make_sharded_object_for_checkpoint(
    obj: Any, key: str, sharded_offsets: tuple = (), replica_id: Any = None, **kwargs: Any
) -> ShardedObject:
    """``obj`` as a ShardedObject at the grid position ``sharded_offsets`` gives ((axis, index,
    fragments) each, axes 0, 1, ... in order; none: a 1-element grid), replicated over tensor- and
    data-parallel ranks unless ``replica_id`` says otherwise."""
    if replica_id is None:
        replica_id = (
            0,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(with_context_parallel=True),
        )
    if sharded_offsets:
        ordered = sorted(sharded_offsets, key=lambda x: x[0])
        if [axis for axis, _, _ in ordered] != list(range(len(ordered))):
            raise ValueError(f"sharded_offsets {sharded_offsets} must cover the axes 0, 1, ... in order")
        shape, offset = tuple(f for _, _, f in ordered), tuple(i for _, i, _ in ordered)
    else:
        shape, offset = (1,), (0,)
    return ShardedObject(key, obj, shape, offset, replica_id, **kwargs)


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Renames the ShardedTensor / factory / object keys starting with ``old_prefix`` (in place;
    the dict's own keys stay)."""
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedBase):
            if not sh.key.startswith(old_prefix):
                raise ValueError(f"key {sh.key!r} does not start with {old_prefix!r}")
            sh.key = new_prefix + sh.key[len(old_prefix) :]
