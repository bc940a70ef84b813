"""The ``torch_dist`` backend (Megatron-core's ``strategies.torch``): the main replicas of the
shards are written with torch.distributed.checkpoint, each ShardedTensor key one global tensor
(its chunks the ranks' local tensors at their global offsets, through ``sharding.sharded_parts``),
each ShardedObject a bytes entry ``<key>/shard_<offset>_<shape>``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from megatron_ext.dist_checkpointing.core import _FAILURES, CheckpointWriteError, _all_gather, _describe
from torch.distributed.checkpoint.api import CheckpointException as _DCPException
from megatron_ext.dist_checkpointing import serialization
from megatron_ext.dist_checkpointing.dict_utils import nested_values
from megatron_ext.dist_checkpointing.mapping import ShardedBase, ShardedTensor, is_main_replica
from megatron_ext.dist_checkpointing.sharding import dcp_state
from megatron_ext.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron_ext.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    StrategyAction,
    default_strategies,
    register_default_strategy,
)
from megatron_ext.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync


WriteFailure = tuple[list[int], str]  # (the ranks whose writes failed, what failed)


def _write(
    state: dict[str, Any], checkpoint_dir: str, thread_count: int, group: Any = None
) -> WriteFailure | None:
    """Writes ``state`` with DCP (collective over ``group``); returns the failure or None."""

    try:
        dcp.save(
            state,
            storage_writer=FileSystemWriterAsync(checkpoint_dir, thread_count=thread_count),
            planner=DefaultSavePlanner(flatten_state_dict=False),
            process_group=group,
        )
        return None
    except _FAILURES as e:
        ranks = sorted(e.failures) if isinstance(e, _DCPException) else [dist.get_rank()]
        return ranks, _describe(e)


def _raise_write_errors(checkpoint_dir: str, failure: WriteFailure | None) -> None:
    """If any rank's write failed, every rank raises a CheckpointWriteError naming the failed
    ranks; rank 0's (the coordinator's, as in Megatron-core) also says what failed. Collective."""
    failures = [f for f in _all_gather(failure) if f is not None]
    if not failures:
        return
    ranks = sorted({r for failed, _ in failures for r in failed})
    prefix = f"cannot save checkpoint {checkpoint_dir!r}: "
    if dist.get_rank() == 0:
        raise CheckpointWriteError(prefix + "; ".join(sorted({what for _, what in failures})))
    raise CheckpointWriteError(prefix + f"writing failed on rank(s) {ranks} (rank 0 raises the errors)")


_async_group: tuple[Any, dist.ProcessGroup] | None = None


def _group_for_async_saves() -> dist.ProcessGroup:
    """A gloo group of all ranks for the background writes, so their collectives never
    interleave with the training's on the default group."""
    global _async_group
    world = dist.distributed_c10d._get_default_group()
    if _async_group is None or _async_group[0] is not world:
        _async_group = (world, dist.new_group(backend="gloo"))
    return _async_group[1]


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Writes the shards of a sharded state dict (without its common part) with DCP.

    ``keep_only_main_replica``: write only the main replicas (``replica_id`` 0). ``thread_count``:
    files (and writer threads) per rank. ``cached_metadata`` (``use_cached_ckpt_structure``) and
    ``separation_hint`` are accepted for Megatron-core's signature; the plan is made afresh each
    save (the checkpoint is the same)."""

    def __init__(
        self,
        backend: str,
        version: int,
        keep_only_main_replica: bool = True,
        thread_count: int = 2,
        cached_metadata: bool = False,
        separation_hint: str | None = None,
    ):
        if (backend, version) != ("torch_dist", 1):
            raise ValueError(
                f"TorchDistSaveShardedStrategy writes ('torch_dist', 1), got {(backend, version)}"
            )
        if thread_count < 1:
            raise ValueError(f"thread_count must be at least 1, got {thread_count}")
        super().__init__(backend, version)
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.use_cached_ckpt_structure = cached_metadata
        self.separation_hint = separation_hint

    def _shards(self, sharded_state_dict: dict[str, Any]) -> list[ShardedBase]:
        shards = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedBase)]
        if self.keep_only_main_replica:
            shards = [sh for sh in shards if is_main_replica(sh.replica_id)]
        return shards

    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> None:
        """Writes now; collective over the world group."""
        state = dcp_state(self._shards(sharded_state_dict))
        _raise_write_errors(str(checkpoint_dir), _write(state, str(checkpoint_dir), self.thread_count))

    def async_save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> AsyncRequest:
        """The write as an AsyncRequest: the tensors are copied to the CPU now (training may change
        them), written by ``async_fn`` over a group of its own; the finalization raises a failed
        write on every rank."""
        checkpoint_dir = str(checkpoint_dir)
        staged = [
            replace(sh, data=sh.data.detach().to("cpu", copy=True)) if isinstance(sh, ShardedTensor) else sh
            for sh in self._shards(sharded_state_dict)
        ]
        state, group = dcp_state(staged), _group_for_async_saves()
        outcome: dict[str, WriteFailure | None] = {"error": None}

        def write() -> None:
            outcome["error"] = _write(state, checkpoint_dir, self.thread_count, group)

        return AsyncRequest(write, (), [lambda: _raise_write_errors(checkpoint_dir, outcome["error"])])


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Reads ``torch_dist`` checkpoints (``serialization.load`` does the reading)."""

    def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> Any:
        return serialization.load(sharded_state_dict, checkpoint_dir)


def register_default_torch_strategies() -> None:
    if default_strategies[StrategyAction.SAVE_SHARDED.value]:
        return
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy("torch_dist", 1)
    )
    register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy())
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, SaveCommonStrategy("torch", 1))
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, LoadCommonStrategy())


register_default_torch_strategies()
