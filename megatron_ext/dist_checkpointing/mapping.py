"""Megatron-core's description of how a rank's tensors and objects sit in the global checkpoint.

A *sharded state dict* is a (nested) dict whose leaves are :class:`ShardedTensor` (a local
tensor and where it lies in a global tensor stored under ``key``), :class:`ShardedObject` (one
shard of a grid of pickled objects), :class:`ShardedTensorFactory` (a tensor that becomes a
sharded sub-dict on save and is merged back on load), :class:`LocalNonpersistentObject` (kept
locally, never saved) or anything else (the *common* state, saved once by rank 0).

``replica_id`` marks copies of the same shard on several ranks (data-parallel replicas, a
tensor-parallel-replicated layer norm): only the *main* replica (0 or all zeros) is saved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import torch

from megatron_ext.dist_checkpointing.core import CheckpointingException
from megatron_ext.dist_checkpointing.dict_utils import dict_list_map_inplace

StateDict = dict[str, Any]
CommonStateDict = dict[str, Any]
ShardedStateDict = dict[str, Any]
ReplicaId = int | tuple[int, ...]


class ShardedBase:
    """What ShardedTensor, ShardedObject and ShardedTensorFactory share."""

    key: str
    data: object
    replica_id: ReplicaId

    def validate_metadata_integrity(self) -> None:
        raise NotImplementedError

    def without_data(self) -> ShardedBase:
        return replace(self, data=None)


@dataclass
class ShardedTensor(ShardedBase):
    """A local tensor ``data`` that is the box ``global_offset : global_offset + local_shape`` of
    the global tensor ``key`` of shape ``global_shape``.

    ``axis_fragmentations``: how many equal chunks each axis is cut into (a regular grid; None for
    irregular sharding). ``prepend_axis_num``: leading axes of length 1 the local tensor lacks (e.g.
    the layer axis of stacked transformer layers). ``allow_shape_mismatch``: on load, the stored
    global shape may differ (the overlap is read, the rest is zero). ``flattened_range`` is not
    supported (as in Megatron-core 0.16).
    """

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if self.data is not None:
            if self.data.dtype != self.dtype:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: data has dtype {self.data.dtype}, expected {self.dtype}"
                )
            if tuple(self.data.shape) != tuple(self.local_shape):
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: data has shape {tuple(self.data.shape)}, "
                    f"expected local_shape {tuple(self.local_shape)}"
                )
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: global_offset {self.global_offset} has another number "
                f"of dimensions than global_shape {self.global_shape}"
            )
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: local_shape {self.local_shape} with prepend_axis_num "
                f"{self.prepend_axis_num} does not have the {len(self.global_shape)} dimensions of "
                f"global_shape {self.global_shape}"
            )
        for axis, (off, size, total) in enumerate(
            zip(
                self.global_offset[self.prepend_axis_num :],
                self.local_shape,
                self.global_shape[self.prepend_axis_num :],
            )
        ):
            if off < 0 or off + size > total:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: along axis {axis + self.prepend_axis_num} the local "
                    f"box [{off}, {off + size}) lies outside the global size {total}"
                )
            if self.axis_fragmentations is not None and size != 0 and off % size != 0:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: global offset {off} is not a multiple of the local "
                    f"size {size} (a regular grid, axis_fragmentations={self.axis_fragmentations})"
                )
        if self.flattened_range is not None:
            raise CheckpointingException("ShardedTensor.flattened_range is not supported.")

    @property
    def has_regular_grid(self) -> bool:
        return self.axis_fragmentations is not None

    def global_slice(self) -> tuple[int | slice, ...]:
        """The index of this shard in the global tensor (ints for prepended axes)."""
        p = self.prepend_axis_num
        return tuple(
            chain(
                self.global_offset[:p],
                (slice(o, o + n) for o, n in zip(self.global_offset[p:], self.local_shape)),
            )
        )

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """This shard's index in the grid of chunks."""
        p = self.prepend_axis_num
        return tuple(self.global_offset[:p]) + tuple(
            o // n for o, n in zip(self.global_offset[p:], self.local_shape)
        )

    def max_allowed_chunks(self) -> tuple[int, ...]:
        chunks = []
        for size, fragments in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and size % fragments != 0:
                raise CheckpointingException(f"axis size {size} is not divisible by {fragments} fragments")
            chunks.append(size // fragments)
        return tuple(chunks)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """``rank_offsets``: (axis, index, fragments) each: the global tensor is cut into
        ``fragments`` equal chunks along ``axis`` (counting prepended axes) and ``data`` is chunk
        ``index``."""
        if flattened_range is not None:
            raise ValueError(
                "from_rank_offsets makes no flattened ShardedTensor (flattened_range must be None)"
            )
        ndim = data.ndim + prepend_axis_num
        global_offset = [0] * ndim
        global_shape = [1] * prepend_axis_num + list(data.shape)
        fragmentations = [1] * ndim
        for axis, index, fragments in rank_offsets:
            if not (0 <= axis < ndim) or index < 0 or fragments < 1 or index >= fragments:
                raise CheckpointingException(
                    f"invalid rank offsets {rank_offsets} for key {key!r}: each must be (axis, index, "
                    f"fragments) with 0 <= axis < {ndim} and 0 <= index < fragments"
                )
            local = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = fragments * local
            global_offset[axis] = index * local
            fragmentations[axis] = fragments
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(fragmentations),
            replica_id,
            prepend_axis_num,
            flattened_range=None,
            **init_kwargs,
        )

    def init_data(self, device: str | torch.device, init_fn: Callable = torch.empty) -> None:
        if self.data is None:
            self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)

    def narrow(self, dim: int, start: int, length: int) -> list[ShardedTensor]:
        """``torch.narrow`` of the local tensor, the global tensor narrowed alike on every rank."""
        axis = dim + self.prepend_axis_num
        local = self.local_shape[dim]
        if self.global_shape[axis] % local or self.global_offset[axis] % local:
            raise CheckpointingException(f"{self.key!r}: narrowing needs a regular grid along axis {axis}")
        data = self.data.narrow(dim, start, length)
        shape, offset = list(self.global_shape), list(self.global_offset)
        shape[axis] = shape[axis] // local * length
        offset[axis] = offset[axis] // local * length
        return [
            replace(
                self,
                data=data,
                local_shape=tuple(data.shape),
                global_shape=tuple(shape),
                global_offset=tuple(offset),
            )
        ]

    def __str__(self) -> str:
        return (
            f"ShardedTensor(key={self.key!r}, global_shape={self.global_shape}, "
            f"global_offset={self.global_offset})"
        )


def is_main_replica(replica_id: ReplicaId) -> bool:
    """0, or a tuple of zeros: the copy that is saved."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class LocalNonpersistentObject:
    """An object that is not saved; ``load`` puts the local one into the loaded state dict."""

    def __init__(self, obj: Any):
        self.obj = obj

    def unwrap(self) -> Any:
        return self.obj


@dataclass
class ShardedObject(ShardedBase):
    """Shard ``global_offset`` of a grid ``global_shape`` of objects stored under ``key``; each
    shard is pickled whole (it cannot be resharded)."""

    key: str
    data: object
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: global_offset {self.global_offset} has another number "
                f"of dimensions than global_shape {self.global_shape}"
            )

    @property
    def unique_key(self) -> str:
        """``<key>/shard_<offset>_<shape>``, the name the shard is stored under."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    def __str__(self) -> str:
        return f"ShardedObject(key={self.key!r})"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        key, shard = unique_key.rsplit("/", 1)
        tag, offset, shape = shard.split("_")
        if tag != "shard":
            raise CheckpointingException(f"{unique_key!r} is not a ShardedObject's unique key")
        return cls(
            key, None, tuple(map(int, shape.split("."))), tuple(map(int, offset.split("."))), replica_id
        )


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, slice | None], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor stored as the sharded sub-dict ``build_fn(key, data, replica_id,
    flattened_range)`` returns; on load, ``merge_fn`` turns the loaded sub-dict back into one
    tensor."""

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        pass


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replaces every ShardedTensorFactory by what it builds (in place)."""
    dict_list_map_inplace(
        lambda x: x.build() if isinstance(x, ShardedTensorFactory) else x, sharded_state_dict
    )


def apply_factory_merges(x1: Any, x2: Any, key: tuple = ()) -> Any:
    """Merges the loaded sub-dicts of ``x1`` where ``x2`` (of the same structure) holds a
    factory; returns ``x1`` (changed in place)."""
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise ValueError(f"apply_factory_merges: key {key + (k,)} is not in the loaded state dict")
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    elif isinstance(x1, list) and isinstance(x2, (list, dict)):
        items = enumerate(x2) if isinstance(x2, list) else x2.items()
        if isinstance(x2, list) and len(x1) != len(x2):
            raise ValueError(f"apply_factory_merges: lists of length {len(x1)} and {len(x2)} at {key}")
        for i, v2 in items:
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
    else:
        raise ValueError(
            f"apply_factory_merges: cannot merge {type(x1).__name__} and {type(x2).__name__} at {key}"
        )
    return x1
