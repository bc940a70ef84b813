"""How a rank's pieces of a global tensor reach ``torch.distributed.checkpoint`` (DCP).

Every checkpoint stores each tensor as one global tensor, so that it loads at any
tensor/pipeline/data-parallel layout. A rank's copy is one or more pieces of it: a
tensor-parallel parameter (``tensor_model_parallel``) cut along ``partition_dim`` into
``tp * partition_stride`` equal pieces dealt round-robin, so TP rank r holds pieces r, r + tp,
r + 2 tp, ... (``_initialize_affine_weight_cpu`` splits a master weight the same way). The aliases
made here carry each piece's global offset (DCP's ``CheckpointableTensor`` fields, or before torch
2.14 the hooks DTensor implements): DCP writes each piece there and reads back, at the new layout,
whatever overlaps a rank's pieces. ``dcp_state`` makes them for every
ShardedTensor that ``serialization.save`` / ``load`` handle.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed.checkpoint
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megatron_ext.dist_checkpointing.mapping import ShardedBase, ShardedTensor


# torch 2.14 added DCP's CheckpointableTensor protocol (the four fields below); older DCP learns a
# tensor's chunks only through the hooks DTensor implements.
_DCP_READS_SHARD_FIELDS = hasattr(torch.distributed.checkpoint, "CheckpointableTensor")


def sharded_tensor(
    local: torch.Tensor,
    global_shape: Iterable[int],
    pieces: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]],
) -> torch.Tensor:
    """An alias of ``local`` that DCP saves and loads as parts of a global tensor.

    ``pieces``: (global offset, local offset, size) of each part of ``local``. The alias carries
    DCP's ``CheckpointableTensor`` fields: saving writes each part at its global offset, loading
    copies whatever overlaps a part from the stored chunks into ``local`` itself. Before torch 2.14
    the alias also carries the hooks that DCP reads there, and its ``size()`` is the global shape.
    """
    alias = local.detach()
    alias.global_shape = tuple(global_shape)
    alias.global_offsets = tuple(tuple(g) for g, _, _ in pieces)
    alias.local_offsets = tuple(tuple(o) for _, o, _ in pieces)
    alias.local_sizes = tuple(tuple(n) for _, _, n in pieces)
    if not _DCP_READS_SHARD_FIELDS:
        _add_dcp_hooks(alias)
    return alias


def _add_dcp_hooks(alias: torch.Tensor) -> None:
    """Makes DCP before torch 2.14 save and load ``alias`` as the fields above describe.

    That DCP asks a tensor for its write items, its chunks and the piece at a global offset
    through the hooks DTensor implements (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``), and compares ``size()`` with the stored global shape before loading.
    The hooks close over a second view of the data, not over ``alias``, so no reference cycle
    keeps it alive.
    """
    local = alias.detach()
    parts = [
        (g, local[tuple(slice(o, o + n) for o, n in zip(offset, size))])
        for g, offset, size in zip(alias.global_offsets, alias.local_offsets, alias.local_sizes)
    ]
    _set_dcp_hooks(alias, alias.global_shape, parts)


def _set_dcp_hooks(
    alias: torch.Tensor, global_shape: Iterable[int], parts: list[tuple[tuple[int, ...], torch.Tensor]]
) -> None:
    """Gives ``alias`` DCP's hooks for the chunks ``parts``: (global offset, tensor) each."""
    global_size = torch.Size(global_shape)
    chunks = [ChunkStorageMetadata(offsets=torch.Size(g), sizes=t.shape) for g, t in parts]
    pieces = {chunk.offsets: t for chunk, (_, t) in zip(chunks, parts)}
    properties = TensorProperties.create_from_tensor(parts[0][1])

    def write_items(fqn: str, _obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets, i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=global_size),
            )
            for i, chunk in enumerate(chunks)
        ]

    def piece_at(index: MetadataIndex) -> torch.Tensor:
        if index.offset is None and len(pieces) == 1:
            return next(iter(pieces.values()))
        if index.offset not in pieces:
            raise ValueError(f"{index.fqn}: this rank holds no piece at global offset {index.offset}")
        return pieces[index.offset]

    alias.__create_write_items__ = write_items
    alias.__create_chunk_list__ = lambda: list(chunks)
    alias.__get_tensor_shard__ = piece_at
    alias.size = lambda dim=None: global_size if dim is None else global_size[dim]


def sharded_parts(
    global_shape: Iterable[int], parts: list[tuple[tuple[int, ...], torch.Tensor]]
) -> torch.Tensor:
    """What DCP saves and loads as the chunks ``parts`` ((global offset, tensor) each, the tensors
    of the global tensor's rank) of one global tensor: ``sharded_tensor`` for a single tensor;
    for several separate tensors, an alias of the first that carries DCP's hooks over all of them
    (the fields of ``sharded_tensor`` describe pieces of one tensor only)."""
    if len(parts) == 1:
        offset, tensor = parts[0]
        zeros = (0,) * tensor.dim()
        return sharded_tensor(tensor, global_shape, [(tuple(offset), zeros, tuple(tensor.shape))])
    alias = parts[0][1].detach()
    _set_dcp_hooks(alias, global_shape, [(tuple(g), t.detach()) for g, t in parts])
    return alias


def _as_chunk(sh: ShardedTensor) -> tuple[tuple[int, ...], torch.Tensor]:
    """(global offset, the data with its prepended axes of length 1)."""
    data = sh.data.detach()
    if sh.prepend_axis_num:
        data = data.view((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
    return tuple(sh.global_offset), data


def dcp_state(
    shards: list[ShardedBase], global_shapes: dict | None = None, loading: bool = False
) -> dict[str, Any]:
    """The flat dict DCP saves or loads for ``shards``: a tensor alias per ShardedTensor key, a
    list of objects per ShardedObject shard (what Megatron-core stores; loading, a placeholder
    that DCP replaces with that list)."""
    tensors: dict[str, list[ShardedTensor]] = defaultdict(list)
    state: dict[str, Any] = {}
    for sh in shards:
        if isinstance(sh, ShardedTensor):
            tensors[sh.key].append(sh)
        elif loading:
            state[sh.unique_key] = io.BytesIO()
        else:
            state.setdefault(sh.unique_key, []).append(sh.data)
    for key, group in tensors.items():
        shape = (global_shapes or {}).get(key, group[0].global_shape)
        state[key] = sharded_parts(shape, [_as_chunk(sh) for sh in group])
    return state


def replicated(tensor: torch.Tensor) -> torch.Tensor:
    zeros = (0,) * tensor.dim()
    return sharded_tensor(tensor, tensor.shape, [(zeros, zeros, tuple(tensor.shape))])


def tp_partitioned(tensor: torch.Tensor, dim: int, stride: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The local shard ``tensor`` of a global tensor split along ``dim`` with ``stride``."""
    dim = dim % tensor.dim()
    if tensor.shape[dim] % stride != 0:
        raise ValueError(
            f"a shard of size {tensor.shape[dim]} along dim {dim} does not split into stride {stride}"
        )
    piece = tensor.shape[dim] // stride
    global_shape = list(tensor.shape)
    global_shape[dim] *= tp_size
    size = list(tensor.shape)
    size[dim] = piece
    pieces = []
    for k in range(stride):
        global_offset, local_offset = [0] * tensor.dim(), [0] * tensor.dim()
        global_offset[dim] = (k * tp_size + tp_rank) * piece
        local_offset[dim] = k * piece
        pieces.append((tuple(global_offset), tuple(local_offset), tuple(size)))
    return sharded_tensor(tensor, global_shape, pieces)


def model_chunks(model: torch.nn.Module | list[torch.nn.Module]) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def stored_shape(md: Any) -> tuple[int, ...] | None:
    return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
