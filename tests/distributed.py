"""Runs a function on N CPU processes joined in a gloo process group over loopback.

Spawning costs seconds on a small machine, so the ranks of one world size are kept between calls
(each call starts from the state a fresh process has), and a test runs many checks inside one call.
Every rank's exception is reported with its traceback; a rank that does not finish within
``timeout`` seconds fails the test and the ranks are killed, so nothing hangs.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import queue
import socket
import sys
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


_FRESH_SEED = torch.initial_seed()  # a fresh process's default CPU generator seed
_MAX_THREADS = 32  # a rank holds about 6 threads between functions once its groups are gone


def _reset_process_state(environ: dict[str, str]) -> None:
    """Puts back what a finished function may have changed, so the next one on this process starts
    as on a fresh one: the model-parallel state, the RNG tracker, the default generator, dtype,
    grad mode, thread count and environment."""
    import gc

    from megatron_ext import parallel_state
    from megatron_ext.tensor_parallel import random as tp_random

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    tp_random._CUDA_RNG_STATE_TRACKER = None
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    torch.manual_seed(_FRESH_SEED)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    os.environ.clear()
    os.environ.update(environ)
    gc.collect()


def _own_functions() -> dict[str, Any]:
    """Every function and class of megatron_ext's loaded modules, and every function of those
    classes, by qualified name: what a test that patches the library would change."""
    out: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if name != "megatron_ext" and not name.startswith("megatron_ext."):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == name:
                out[f"{name}.{attr}"] = value
                out.update((f"{name}.{attr}.{a}", v) for a, v in vars(value).items() if callable(v))
            elif callable(value):
                out[f"{name}.{attr}"] = value
    return out


def _patches() -> tuple:
    """What tells a process a function patched it: the import hooks, the attributes of torch,
    torch.cuda, torch.distributed and torch.Tensor, megatron_ext's functions and classes, and
    whether megatron-core (whose packages a compatibility test aliases) is loaded."""
    return (
        tuple(sys.meta_path),
        dict(vars(torch)),
        dict(vars(torch.cuda)),
        dict(vars(torch.Tensor)),
        dict(vars(dist)),
        _own_functions(),
    )


def _unpatched(before: tuple) -> bool:
    """Whether the process is as ``before`` (an attribute rewrapped by one of torch's own lazy
    imports, as torch._dynamo does to ``torch.manual_seed``, still counts as unpatched)."""
    after = _patches()
    if after[0] != before[0] or any(m == "megatron" or m.startswith("megatron.") for m in sys.modules):
        return False
    return all(
        new is old or getattr(new, "__wrapped__", None) is old
        for i in range(1, len(before))
        for name, old in before[i].items()
        if (new := after[i].get(name, old)) is not None
    )


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    """One rank of a pool: joins the gloo group once, then runs the functions it is sent until it
    gets None, or until a function fails, leaves the default group, patches the process or leaves
    process groups (threads) behind; the pool is then retired and the next call starts a fresh one."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Gloo connects a group's ranks at its first collective instead of at creation: the layouts
    # build dozens of groups that a test never uses (group creation took 1.7-2.7x longer eagerly).
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    torch.set_num_threads(1)
    environ = dict(os.environ)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    except BaseException:  # noqa: BLE001  (reported to the parent)
        results.put((rank, traceback.format_exc(), None, False))
        return
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test run is gone
                break
            continue
        if task is None:
            break
        fn, args = task
        before = _patches()
        try:
            value = fn(*args)
            error = None
        except BaseException:  # noqa: BLE001  (reported to the parent)
            value, error = None, traceback.format_exc()
        reusable = error is None and dist.is_initialized() and _unpatched(before)
        if reusable:
            try:
                _reset_process_state(environ)
            except BaseException:  # noqa: BLE001
                reusable = False
            # Process groups a function kept alive hold a gloo thread each, some of them polling.
            reusable = reusable and len(os.listdir("/proc/self/task")) <= _MAX_THREADS
        # Pickled by value here: a tensor handed over as a shared file descriptor needs this process
        # alive until the parent has read it, and a process that is not reused exits at once.
        results.put((rank, error, pickle.dumps(value), reusable))
        if not reusable:
            break
    if dist.is_initialized():
        dist.destroy_process_group()


class _Pool:
    """``world_size`` ranks in one gloo group, kept between calls: importing torch costs seconds per
    process on a small machine, and a test suite makes hundreds of calls. The ranks are forked from
    a server process that imported torch and megatron_ext once (and holds no thread to fork)."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "megatron_ext", "tests.distributed"])
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def close(self, wait: float) -> None:
        for q in self.tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.procs:
            p.join(timeout=wait)
            if p.is_alive():
                p.kill()
                p.join()

    def run(self, fn: Callable, args: tuple, timeout: float) -> tuple[dict[int, Any], dict[int, str], bool]:
        for q in self.tasks:
            q.put((fn, args))
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        reusable = True
        deadline = time.monotonic() + timeout
        while len(values) + len(errors) < self.world_size:
            try:
                rank, error, value, rank_reusable = self.results.get(timeout=0.5)
                value = pickle.loads(value)
            except queue.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(values) - set(errors))
                    errors[-1] = f"ranks {missing} did not finish within {timeout} s"
                    return values, errors, False
                for rank, p in enumerate(self.procs):
                    if rank not in values and rank not in errors and p.exitcode is not None:
                        # Give a report already on its way the chance to arrive.
                        time.sleep(0.5)
                        if self.results.empty():
                            errors[rank] = f"exited with code {p.exitcode} without reporting"
                            reusable = False
                continue
            reusable = reusable and rank_reusable
            if error is None:
                values[rank] = value
            else:
                errors[rank] = error
        return values, errors, reusable


_POOLS: dict[int, _Pool] = {}  # by world size, the most recently used last
# 18 keeps the pools of 1, 2, 3, 4 and 8 ranks the suite uses all alive; with them the whole suite
# peaked at 6.4 GiB of memory in use on the machine (a rank's resident set is 0.5-0.8 GiB, much of it
# torch's shared libraries).
_MAX_POOLED_RANKS = 18


def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close(wait=10)
    _POOLS.clear()


atexit.register(_close_pools)


def _log(event: str, world_size: int, fn: Callable) -> None:
    """With MEGATRON_EXT_TEST_POOL_LOG=FILE, one line per pool started or retired (which test, which
    function), to find the tests that cost the suite fresh processes."""
    path = os.environ.get("MEGATRON_EXT_TEST_POOL_LOG")
    if path:
        with open(path, "a") as f:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
            f.write(f"{time.time():.1f} {event} {world_size} {test} {getattr(fn, '__qualname__', fn)}\n")


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 300) -> list[Any]:
    """Runs ``fn(*args)`` on ``world_size`` ranks; returns each rank's return value in rank order.
    The ranks are kept for the next call with the same world size (up to 18 ranks in all) while
    every function succeeds and leaves the default group in place. A port taken by another process
    between choosing and binding it (tests running side by side) starts the ranks again on another
    port, up to twice."""
    for attempt in range(3):
        pool = _POOLS.pop(world_size, None)
        if pool is None:
            while _POOLS and sum(_POOLS) + world_size > _MAX_POOLED_RANKS:  # the least recently used go
                evicted = _POOLS.pop(next(iter(_POOLS)))
                _log("evict", evicted.world_size, fn)
                evicted.close(wait=10)
            pool = _Pool(world_size)
            _log("start", world_size, fn)
        values, errors, reusable = pool.run(fn, args, timeout)
        if reusable and not errors:
            _POOLS[world_size] = pool
        else:
            _log("retire", world_size, fn)
            pool.close(wait=10)
        if not (errors and not values and attempt < 2 and any("EADDRINUSE" in e for e in errors.values())):
            break
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        raise AssertionError(f"{len(errors)} of {world_size} ranks failed:\n{report}")
    return [values[r] for r in range(world_size)]
