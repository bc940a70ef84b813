"""Megatron-core's strategy API of ``megatron_ext.dist_checkpointing`` (what its own unit tests
``test_torch_dist.py`` / ``test_async_save.py`` use): save strategies by object or tuple, the
``thread_count`` files per rank, ``AsyncCallsQueue`` finalizing background saves that load the
values a synchronous save does, a failed writer raised on every rank as DCP's
``CheckpointException`` (the details on rank 0), and ``dict_utils.diff``."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from megatron_ext.dist_checkpointing import CheckpointingException, ShardedTensor
from megatron_ext.dist_checkpointing.dict_utils import diff
from megatron_ext.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy
from megatron_ext.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.distributed import run_distributed


def test_diff():
    left = {"a": torch.arange(3.0), "b": [1, 2, 3], "c": {"d": "x"}, "only_l": 1}
    right = {"a": torch.tensor([0.0, 1.0, 5.0]), "b": [1, 2], "c": {"d": "x"}, "only_r": 2}
    only_left, only_right, mismatch = diff(left, right)
    assert (only_left, only_right) == ([("only_l",), ("b", 2)], [("only_r",)])
    assert mismatch == [(("a",), torch.Tensor, torch.Tensor)]
    assert diff(left, left) == ([], [], [])
    assert diff({"t": torch.ones(2)}, {"t": torch.ones(2, dtype=torch.float64)})[2] == [
        (("t",), torch.Tensor, torch.Tensor)
    ]


def test_default_strategies():
    save = get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1)
    assert isinstance(save, TorchDistSaveShardedStrategy)
    assert (save.backend, save.version, save.thread_count, save.keep_only_main_replica) == (
        "torch_dist",
        1,
        2,
        True,
    )
    with pytest.raises(CheckpointingException, match="zarr"):
        get_default_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1)
    with pytest.raises(ValueError, match="thread_count"):
        TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=0)


def _state_dict(rank: int, world: int) -> dict:
    """keyA: rank r's row r of a (world, 4) tensor; keyB: one (3, 5) tensor replicated, saved by
    the last rank; a small view of a large tensor."""
    big = torch.arange(100_000, dtype=torch.float64)
    return {
        "a": ShardedTensor.from_rank_offsets("keyA", torch.full((1, 4), float(rank)), (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets(
            "keyB", torch.arange(15.0).view(3, 5), replica_id=world - 1 - rank
        ),
        "view": ShardedTensor.from_rank_offsets("keyV", big[rank * 10 : rank * 10 + 10], (0, rank, world)),
    }


def _async_worker(path: str) -> dict:
    import torch.distributed as dist

    from megatron_ext.dist_checkpointing import load, save
    from megatron_ext.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    rank, world = dist.get_rank(), dist.get_world_size()
    async_dir, sync_dir = os.path.join(path, "async"), os.path.join(path, "sync")
    queue = AsyncCallsQueue()
    sd = _state_dict(rank, world)
    request = save(sd, async_dir, async_sharded_save=True)
    first = queue.schedule_async_request(request)
    sd["a"].data.add_(100.0)  # training goes on: the async checkpoint holds the values at save()
    save(_state_dict(rank, world), sync_dir, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=3))
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    second = queue.schedule_async_request(
        save(_state_dict(rank, world), async_dir + "2", ("torch_dist", 1), async_sharded_save=True)
    )
    queue.close()
    loaded = {d: load(_state_dict(rank, world), os.path.join(path, d)) for d in ("async", "sync", "async2")}
    dist.barrier()
    files = {d: sorted(f for f in os.listdir(os.path.join(path, d)) if f.endswith(".distcp")) for d in loaded}
    sizes = [os.path.getsize(os.path.join(path, "sync", f)) for f in files["sync"]]
    return {
        "calls": (first, finalized, second, queue.get_num_unfinalized_calls()),
        "loaded": {d: {k: v.tolist() for k, v in sd.items()} for d, sd in loaded.items()},
        "files": files,
        "max_file_size": max(sizes),
    }


def test_async_queue_saves_what_sync_saves(tmp_path):
    results = run_distributed(2, _async_worker, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["calls"] == (0, [0], 1, 0)
        expected = {
            "a": [[float(rank)] * 4],
            "b": torch.arange(15.0).view(3, 5).tolist(),
            "view": torch.arange(rank * 10, rank * 10 + 10, dtype=torch.float64).tolist(),
        }
        assert r["loaded"] == {"async": expected, "sync": expected, "async2": expected}
    # thread_count files per rank (fewer where a rank has fewer items): rank 0 writes keyA's and
    # keyV's rows, rank 1 also keyB.
    assert results[0]["files"]["sync"] == [
        "__0_0.distcp",
        "__0_1.distcp",
        "__1_0.distcp",
        "__1_1.distcp",
        "__1_2.distcp",
    ]
    assert results[0]["files"]["async"] == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]
    assert results[0]["max_file_size"] < 10_000  # the view's 10 elements, not its 100_000-element storage


def _failing_write(transform_list, local_proc_idx, write_bucket, results_queue, count_queue, use_fsync, **kw):
    import torch.distributed as dist

    error = OSError("disk gone") if dist.get_rank() == 1 and local_proc_idx == 1 else None
    results_queue.put((local_proc_idx, error if error else []))
    count_queue.get()
    count_queue.task_done()


def _error_worker(path: str, async_save: bool) -> tuple[str, bool, bool]:
    import torch.distributed as dist
    from torch.distributed.checkpoint import CheckpointException

    from megatron_ext.dist_checkpointing import save
    from megatron_ext.dist_checkpointing.core import CheckpointWriteError
    from megatron_ext.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron_ext.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    rank = dist.get_rank()
    sd = {f"k{i}": ShardedTensor.from_rank_offsets(f"k{i}_rank{rank}", torch.ones(2, 4)) for i in range(4)}
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=4)
    try:
        with mock.patch.object(FileSystemWriterAsync, "write_preloaded_data", staticmethod(_failing_write)):
            if async_save:
                queue = AsyncCallsQueue()
                queue.schedule_async_request(save(sd, path, strategy, async_sharded_save=True))
                queue.maybe_finalize_async_calls(blocking=True)
            else:
                save(sd, path, strategy)
    except CheckpointException as e:
        return (
            str(e),
            isinstance(e, CheckpointWriteError),
            os.path.exists(os.path.join(path, "metadata.json")),
        )
    return "", False, False


@pytest.mark.parametrize("async_save", [False, True])
def test_failed_writer_raises_on_every_rank(tmp_path, async_save):
    results = run_distributed(2, _error_worker, str(tmp_path / "ckpt"), async_save)
    path = str(tmp_path / "ckpt")
    # Every rank raises; rank 0 (the coordinator, as in Megatron-core) says what failed.
    assert results == [
        (f"cannot save checkpoint {path!r}: rank 1: RuntimeError: Worker failure: disk gone", True, False),
        (
            f"cannot save checkpoint {path!r}: writing failed on rank(s) [1] (rank 0 raises the errors)",
            True,
            False,
        ),
    ]
