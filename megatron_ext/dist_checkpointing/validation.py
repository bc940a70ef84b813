"""Checks that the ranks' shards together describe each global tensor exactly once."""

from __future__ import annotations

import math
from collections import defaultdict
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.dist_checkpointing.core import CheckpointingException
from megatron_ext.dist_checkpointing.dict_utils import nested_values
from megatron_ext.dist_checkpointing.mapping import (
    CommonStateDict,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)

_LocalMetadata = list[ShardedTensor | ShardedObject]
_GlobalMetadata = list[_LocalMetadata]


class StrictHandling(Enum):
    """What ``load`` does about keys the request and the checkpoint do not share (Megatron-core's
    values). "Unexpected": requested, not in the checkpoint. "Missing": in the checkpoint, not
    requested by any rank."""

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"


def parse_strict_flag(strict: str | bool | StrictHandling) -> StrictHandling:
    if isinstance(strict, StrictHandling):
        return strict
    if strict is True:
        return StrictHandling.ASSUME_OK_UNEXPECTED
    if strict is False:
        return StrictHandling.LOG_UNEXPECTED
    try:
        return StrictHandling(strict)
    except ValueError:
        raise ValueError(
            f"invalid strict flag {strict!r}; expected one of {[s.value for s in StrictHandling]}"
        ) from None


def determine_global_metadata(sharded_state_dict: ShardedStateDict) -> tuple[_LocalMetadata, _GlobalMetadata]:
    """This rank's shards without data, and every rank's (an all-gather over the world)."""
    local = [v.without_data() for v in nested_values(sharded_state_dict)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return local, gathered


def _tensor_problems(key: str, shards: list[tuple[int, ShardedTensor]]) -> list[str]:
    first = shards[0][1]
    for rank, sh in shards:
        for attr in ("dtype", "global_shape", "has_regular_grid"):
            if getattr(sh, attr) != getattr(first, attr):
                return [
                    (
                        f"{key}: rank {rank} gives {attr} {getattr(sh, attr)}, rank {shards[0][0]} "
                        f"gives {getattr(first, attr)}"
                    )
                ]
        if first.has_regular_grid and sh.local_shape != first.local_shape:
            return [
                f"{key}: rank {rank} gives local_shape {sh.local_shape}, "
                f"rank {shards[0][0]} gives {first.local_shape}"
            ]
    if not first.has_regular_grid:
        return []  # irregular shards: DCP checks what it writes
    counts = torch.zeros(first.axis_fragmentations, dtype=torch.int)
    for _, sh in shards:
        if is_main_replica(sh.replica_id):
            counts[sh.local_chunk_offset_in_global()] += 1
    if torch.all(counts == 1):
        return []
    missing = int((counts == 0).sum())
    repeated = int((counts > 1).sum())
    return [
        (
            f"{key}: of its {counts.numel()} chunks (grid {tuple(first.axis_fragmentations)}), {missing} "
            f"have no main replica and {repeated} have several"
        )
    ]


def _object_problems(key: str, shards: list[tuple[int, ShardedObject]]) -> list[str]:
    keys = [sh.unique_key for _, sh in shards if is_main_replica(sh.replica_id)]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        return [f"{key}: ShardedObject shards saved by several ranks: {repeated}"]
    expected = math.prod(shards[0][1].global_shape)
    if len(keys) != expected:
        return [f"{key}: {expected - len(keys)} of {expected} ShardedObject shards have no main replica"]
    return []


def validate_sharding_integrity(
    global_metadata: _GlobalMetadata, common_state_dict: CommonStateDict | None = None
) -> None:
    """Checks that the main replicas of every key's shards, over all ranks, cover the global
    tensor (the grid of objects) exactly once, with one dtype and global shape. Every rank checks
    the same gathered metadata, so all raise the same :class:`CheckpointingException` or none.
    ``common_state_dict`` is accepted for Megatron-core's signature (its cross-rank comparison
    only logs)."""
    by_key: dict[str, list] = defaultdict(list)
    for rank, shards in enumerate(global_metadata):
        for sh in shards:
            by_key[sh.key].append((rank, sh))
    problems = []
    for key, shards in by_key.items():
        kinds = {type(sh).__name__ for _, sh in shards}
        if len(kinds) > 1:
            problems.append(f"{key}: saved as {sorted(kinds)} by different ranks")
        elif isinstance(shards[0][1], ShardedObject):
            problems += _object_problems(key, shards)
        else:
            problems += _tensor_problems(key, shards)
    if problems:
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise CheckpointingException("invalid sharding: " + "; ".join(problems[:8]) + more)
