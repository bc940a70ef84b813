"""The process group from torchrun's environment, and the rank's device."""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_ext.tensor_parallel.utils import comm_device


def init_process_group(backend: str, timeout: timedelta) -> None:
    """``init_process_group`` from torchrun's environment, such that a restarted group never reads
    the addresses its killed predecessor left behind.

    torchrun (unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) serves one store for all attempts of
    a job, so a restarted rank may read a dead rank's address from it, and its restart count,
    kept per launcher, is no attempt number all nodes share. Instead rank 0 starts a store of its
    own, as torchrun does without sharing, and announces its port in torchrun's store; the others
    take a port that refuses connections for one the previous attempt left and read it again.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host = os.environ["MASTER_ADDR"]  # torchrun's store runs on global rank 0's node
    shared = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout)
    key = "train_gpt/store_port"
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        shared.set(key, str(store.port))
    else:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            port = int(shared.get(key))
            try:
                store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=2))
                break
            except RuntimeError:  # the previous attempt's rank 0, gone: wait for this one's
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        store.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def device_of(args: argparse.Namespace) -> torch.device:
    """Where this rank's model and batches live: its GPU when the process group runs on NCCL."""
    backend = dist.get_backend()
    if args.device == "cuda" and backend != "nccl":
        raise ValueError(f"--device cuda needs an NCCL process group, this one runs on {backend}")
    if args.device == "cpu" and backend == "nccl":
        raise ValueError("--device cpu needs a gloo process group, this one runs on nccl")
    return comm_device(dist.group.WORLD)
