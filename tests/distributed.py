"""Runs a function on N CPU processes joined in a gloo process group over loopback.

Spawning costs seconds on a small machine, so a test runs many checks inside one call. Every
rank's exception is reported with its traceback; a rank that does not finish within ``timeout``
seconds fails the test and the others are killed, so nothing hangs.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        value = fn(*args)
        results.put((rank, None, value))
    except BaseException:  # noqa: BLE001  (reported to the parent)
        results.put((rank, traceback.format_exc(), None))
    finally:
        from megatron_ext import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 300) -> list[Any]:
    """Runs ``fn(*args)`` on ``world_size`` ranks; returns each rank's return value in rank order.
    A port taken by another process between choosing and binding it (tests running side by side)
    starts the ranks again on another port, up to twice."""
    for _ in range(2):
        try:
            return _run_once(world_size, fn, args, timeout)
        except _PortTaken:
            continue
    return _run_once(world_size, fn, args, timeout)


class _PortTaken(Exception):
    pass


def _run_once(world_size: int, fn: Callable, args: tuple, timeout: float) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(errors) < world_size:
            try:
                rank, error, value = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values) - set(errors))
                    errors[-1] = f"ranks {missing} did not finish within {timeout} s"
                    break
                for rank, p in enumerate(procs):
                    if rank not in values and rank not in errors and p.exitcode is not None:
                        # Give a report already on its way the chance to arrive.
                        time.sleep(0.5)
                        if results.empty():
                            errors[rank] = f"exited with code {p.exitcode} without reporting"
                continue
            if error is None:
                values[rank] = value
            elif "EADDRINUSE" in error and not values:
                raise _PortTaken()
            else:
                errors[rank] = error
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        raise AssertionError(f"{len(errors)} of {world_size} ranks failed:\n{report}")
    return [values[r] for r in range(world_size)]
