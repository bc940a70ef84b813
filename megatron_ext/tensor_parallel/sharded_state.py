"""``sharded_state_dict()`` of the tensor-parallel layers and of any module made of them: each
tensor as a ShardedTensor that says where this rank's copy lies in the global tensor, read from the
attributes the layers set (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``).

A tensor-parallel tensor split with stride s (a fused ``[gate | up]`` weight, s = 2) is, on TP
rank r of tp, pieces r, r + tp, ... of the global tensor cut into tp * s: a
:class:`ShardedTensorFactory` of s ShardedTensors, the layout of the serial tensor whatever tp,
as ``save_checkpoint`` stores it.

The modules keep Megatron's earlier names (``query_key_value``, ``dense``, ``dense_h_to_4h``, ...)
in ``state_dict()``; ``renamed_sharded_state_dict`` stores them under Megatron-core's keys by the
table each module owns (``transformer.attention.ATTENTION_KEYS``, ``transformer.mlp.MLP_KEYS``,
``transformer.transformer_layer.LAYER_KEYS``). Each column- or row-parallel linear adds the empty
``_extra_state`` object Megatron-core's linears save (its load asks for them); the linears' load
pre-hook drops it (``tensor_parallel.layers.drop_extra_state``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from megatron_ext import parallel_state
from megatron_ext.dist_checkpointing.mapping import (
    ReplicaId,
    ShardedBase,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron_ext.dist_checkpointing.rank_shards import (
    make_sharded_object_for_checkpoint,
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)


def _strided_build(
    dim: int,
    stride: int,
    prepend_offsets: tuple,
    split_keys: bool,
    key: str,
    data: torch.Tensor,
    replica_id: ReplicaId,
    _flat: Any,
) -> list[ShardedTensor]:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    axis = dim + len(prepend_offsets)
    return [
        ShardedTensor.from_rank_offsets(
            f"{key}_{'wv'[k]}" if split_keys else key,
            piece,
            *prepend_offsets,
            (axis, rank, tp) if split_keys else (axis, k * tp + rank, tp * stride),
            replica_id=replica_id,
            prepend_axis_num=len(prepend_offsets),
        )
        for k, piece in enumerate(data.detach().chunk(stride, dim))
    ]


def _strided_merge(dim: int, pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces, dim)


def sharded_tensor_like(
    tensor: torch.Tensor,
    key: str,
    like: torch.Tensor,
    prepend_offsets: tuple = (),
    replica_id: ReplicaId | None = None,
    singleton_local_shards: bool = False,
    **kwargs: Any,
) -> ShardedBase:
    """``tensor`` (of ``like``'s local shape) as the ShardedTensor (or, for a strided split, the
    factory) of global tensor ``key``, sharded as parameter ``like`` is. A stride-2 split with
    ``singleton_local_shards`` stores its halves as two global tensors ``key_w`` and ``key_v``
    (Megatron-core's gated ``linear_fc1`` under that flag)."""
    if not getattr(like, "tensor_model_parallel", False):
        return make_sharded_tensor_for_checkpoint(tensor, key, prepend_offsets, replica_id, **kwargs)
    dim = like.partition_dim % tensor.dim()
    stride = getattr(like, "partition_stride", 1)
    if stride == 1:
        return make_tp_sharded_tensor_for_checkpoint(tensor, key, dim, replica_id, prepend_offsets, **kwargs)
    if tensor.shape[dim] % stride:
        raise ValueError(
            f"{key}: size {tensor.shape[dim]} along dim {dim} does not split into stride {stride}"
        )
    if replica_id is None:
        replica_id = (0, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return ShardedTensorFactory(
        key,
        tensor,
        partial(_strided_build, dim, stride, tuple(prepend_offsets), singleton_local_shards and stride == 2),
        partial(_strided_merge, dim),
        replica_id,
    )


def module_sharded_state_dict(
    module: torch.nn.Module,
    prefix: str = "",
    sharded_offsets: tuple = (),
    skip: tuple[str, ...] = (),
    metadata: dict | None = None,
) -> ShardedStateDict:
    """Every tensor of ``module.state_dict()`` (but the submodules named in ``skip``) under
    ``prefix + name``, both as the key of the dict and of the ShardedTensor (``metadata``: its
    ``singleton_local_shards``, see ``sharded_tensor_like``)."""
    singleton = bool((metadata or {}).get("singleton_local_shards"))
    out: ShardedStateDict = {}
    for name, tensor in module.state_dict(prefix="", keep_vars=True).items():
        if (
            name.split(".", 1)[0] in skip
            or name.endswith("_extra_state")
            or not isinstance(tensor, torch.Tensor)
        ):
            continue
        out[prefix + name] = sharded_tensor_like(
            tensor, prefix + name, tensor, sharded_offsets, singleton_local_shards=singleton
        )
    return out


def renamed_key(name: str, keys: dict[str, str]) -> str:
    for old, new in keys.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def renamed_sharded_state_dict(
    module: torch.nn.Module,
    prefix: str,
    sharded_offsets: tuple,
    keys: dict[str, str],
    metadata: dict | None = None,
    skip: tuple[str, ...] = (),
) -> ShardedStateDict:
    """``module_sharded_state_dict`` under Megatron-core's keys: a name inside ``module`` starting
    with a key of ``keys`` is stored under its value instead (the dict keeps the module's names),
    and each column- or row-parallel linear (``module`` itself included) adds an empty
    ``_extra_state`` object, as Megatron-core's linears do. The submodules named in ``skip`` are
    left out."""
    out = module_sharded_state_dict(module, prefix, sharded_offsets, skip=skip, metadata=metadata)
    for name, sub in module.named_modules():
        if name.split(".", 1)[0] in skip and name:
            continue
        if getattr(sub, "saves_megatron_extra_state", False):
            key = f"{prefix}{name}{'.' if name else ''}_extra_state"
            out[key] = make_sharded_object_for_checkpoint(None, key, sharded_offsets)
    for sh in out.values():
        sh.key = prefix + renamed_key(sh.key[len(prefix) :], keys)
    return out
