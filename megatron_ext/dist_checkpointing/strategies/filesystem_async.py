"""Megatron-core's ``FileSystemWriterAsync``: a DCP file-system writer that splits this rank's
items into ``thread_count`` buckets (files ``__<rank>_<i>.distcp``), each written by
``write_preloaded_data`` in its own worker thread. A worker's error fails the save with
``Worker failure: <error>``."""

from __future__ import annotations

import io
import os
import queue
import threading
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter, SavePlan, SavePlanner
from torch.distributed.checkpoint.filesystem import SerializationFormat, _write_item
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megatron_ext.dist_checkpointing.core import os_error_behind

# (file path, storage key (the file name), (bytes items, tensor items)) with the data resolved.
WriteBucket = tuple[str, str, tuple[list[tuple[WriteItem, io.BytesIO]], list[tuple[WriteItem, torch.Tensor]]]]


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize


def _split(items: list[WriteItem], buckets: int) -> list[list[WriteItem]]:
    """The items in ``buckets`` lists of about equal bytes (largest first to the lightest list);
    empty lists left out."""
    out: list[list[WriteItem]] = [[] for _ in range(max(buckets, 1))]
    load = [0] * len(out)
    for item in sorted(items, key=_item_bytes, reverse=True):
        i = load.index(min(load))
        out[i].append(item)
        load[i] += _item_bytes(item) or 1
    return [b for b in out if b]


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU holding only its own elements (a view of a larger storage is copied,
    so the file does not carry the whole storage)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


class FileSystemWriterAsync(FileSystemWriter):
    """``FileSystemWriter`` whose ``write_data`` resolves every item first, then writes the
    buckets in parallel worker threads (``thread_count``)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        buckets: list[WriteBucket] = []
        for i, items in enumerate(_split(plan.items, self.thread_count)):
            name = f"{plan.storage_data.prefix}{i}.distcp"
            bytes_data = [(it, planner.resolve_data(it)) for it in items if it.type == WriteItemType.BYTE_IO]
            tensor_data = [
                (it, _cpu_copy(planner.resolve_data(it))) for it in items if it.type != WriteItemType.BYTE_IO
            ]
            buckets.append((os.path.join(str(self.path), name), name, (bytes_data, tensor_data)))
        results_queue: queue.Queue = queue.Queue()
        count_queue: queue.Queue = queue.Queue()
        workers = []
        for i, bucket in enumerate(buckets):
            count_queue.put(i)
            worker = threading.Thread(
                target=FileSystemWriterAsync.write_preloaded_data,
                args=([self.transforms], i, bucket, results_queue, count_queue, self.sync_files),
            )
            workers.append(worker)
            worker.start()
        for worker in workers:
            worker.join()
        results: dict[int, list[WriteResult]] = {}
        while not results_queue.empty():
            idx, result = results_queue.get()
            if isinstance(result, Exception):
                raise RuntimeError(f"Worker failure: {os_error_behind(result)}") from result
            results[idx] = result
        if len(results) != len(buckets):
            raise RuntimeError(
                f"Worker failure: {len(buckets) - len(results)} of {len(buckets)} write workers "
                "returned no result"
            )
        future: Future[list[WriteResult]] = Future()
        future.set_result([r for i in sorted(results) for r in results[i]])
        return future

    @staticmethod
    def write_preloaded_data(
        transform_list: list[Any],
        local_proc_idx: int,
        write_bucket: WriteBucket,
        results_queue: queue.Queue,
        count_queue: queue.Queue,
        use_fsync: bool,
        **kwargs: Any,
    ) -> None:
        """Writes one bucket's file; puts ``(local_proc_idx, write results or the exception)``
        on ``results_queue`` and marks one ``count_queue`` task done."""
        try:
            path, storage_key, (bytes_data, tensor_data) = write_bucket
            written = []
            with open(path, "wb") as stream:
                for item, data in [*bytes_data, *tensor_data]:
                    written.append(
                        _write_item(
                            *transform_list, stream, data, item, storage_key, SerializationFormat.TORCH_SAVE
                        )
                    )
                if use_fsync:
                    os.fsync(stream.fileno())
            output: tuple[int, Any] = (local_proc_idx, written)
        except Exception as e:  # reported to the caller, which fails the save
            output = (local_proc_idx, e)
        results_queue.put(output)
        count_queue.get()
        count_queue.task_done()
