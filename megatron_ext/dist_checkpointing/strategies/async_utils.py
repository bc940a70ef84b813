"""Asynchronous saves (Megatron-core's ``strategies.async_utils``): an :class:`AsyncRequest`
describes the writing still to do and the collective finalization after it;
:class:`AsyncCallsQueue` runs requests in background threads and finalizes them in order."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist


class AsyncRequest(NamedTuple):
    """A save still being written (Megatron-core's fields). ``async_fn(*async_fn_args,
    **async_fn_kwargs)`` writes this rank's files (it never raises: errors surface in the
    finalization); ``finalize_fns`` then run on every rank (they complete the checkpoint with
    ``metadata.json``). ``preload_fn``, if set, returns what replaces ``async_fn_args[1]`` before
    the write. ``execute_sync()`` does all of it now; collective."""

    async_fn: Callable | None
    async_fn_args: tuple
    finalize_fns: list[Callable]
    async_fn_kwargs: dict = {}
    preload_fn: Callable | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable) -> None:
        if self.is_frozen:
            raise RuntimeError("Cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def _run_async_fn(self) -> None:
        if self.async_fn is None:
            return
        args = list(self.async_fn_args)
        if self.preload_fn is not None:
            args[1] = self.preload_fn()
        self.async_fn(*args, **self.async_fn_kwargs)

    def execute_sync(self) -> None:
        self._run_async_fn()
        dist.barrier()
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> AsyncRequest:
        return self._replace(is_frozen=True)


class _ActiveCall(NamedTuple):
    idx: int
    writer: threading.Thread | None
    request: AsyncRequest


class AsyncCallsQueue:
    """Runs scheduled requests' ``async_fn`` in background threads; ``maybe_finalize_async_calls``
    finalizes, in order, the requests done on every rank (all of them with ``blocking=True``).
    Both are collective. ``persistent`` is accepted for Megatron-core's signature: every request
    gets its own thread either way."""

    def __init__(self, persistent: bool = False):
        self.persistent = persistent
        self.call_idx = -1
        self.async_calls: deque[_ActiveCall] = deque()

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Starts writing ``async_request`` in the background; returns its index."""
        self.call_idx += 1
        request = async_request.freeze()._replace(call_idx=self.call_idx)
        writer = None
        if request.async_fn is not None:
            writer = threading.Thread(target=request._run_async_fn, daemon=True)
            writer.start()
        self.async_calls.append(_ActiveCall(self.call_idx, writer, request))
        return self.call_idx

    def _done_everywhere(self, writer: threading.Thread | None, no_dist: bool) -> bool:
        alive = torch.tensor([int(writer is not None and writer.is_alive())])
        if not no_dist:
            dist.all_reduce(alive, op=dist.ReduceOp.MAX)
        return not alive.item()

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalizes the oldest requests whose writes are done on all ranks (``no_dist``: on this
        rank); with ``blocking``, waits for all. Returns the finalized indices. A failed write
        raises here, alike on every rank."""
        finalized: list[int] = []
        while self.async_calls:
            idx, writer, request = self.async_calls[0]
            if not self._done_everywhere(writer, no_dist) and not blocking:
                break
            if writer is not None:
                writer.join()
            self.async_calls.popleft()
            for fn in request.finalize_fns:
                fn()
            latest = torch.tensor([idx])
            dist.all_reduce(latest, op=dist.ReduceOp.MAX)
            if latest.item() != idx:
                raise RuntimeError(
                    f"async checkpoint call {idx} finalized here while another rank finalized call "
                    f"{latest.item()}: every rank must schedule and finalize the same calls"
                )
            finalized.append(idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        return len(self.async_calls)

    def close(self, abort: bool = False) -> None:
        """Finalizes every request (collective); ``abort``: only waits for the writes to end,
        without finalizing (the checkpoints stay incomplete)."""
        if not abort:
            self.maybe_finalize_async_calls(blocking=True)
            return
        while self.async_calls:
            writer = self.async_calls.popleft().writer
            if writer is not None:
                writer.join()
