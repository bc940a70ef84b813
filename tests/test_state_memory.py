"""State memory after a training step, counted as the bytes of the distinct storages that are alive
(every tensor the garbage collector can see, views counted once by their storage), on CPU with
bf16 parameters, float32 gradient buffers and Adam, as Megatron-core accounts for it:

* the plain optimizer (``Float16OptimizerWithFloat16Params``): 2 (bf16 parameter) + 4 (float32
  gradient buffer, which is also the main parameters' ``.grad``) + 4 (float32 main parameter) + 8
  (Adam's two moments) = 18 bytes per parameter;
* the distributed optimizer at dp 2: 2 + 4 + 12 / dp = 12 bytes per parameter, with and without
  ``overlap_param_gather`` (the parameters are views into the bucket's parameter buffer and the
  all-gather writes into it in place).

The layer sizes are multiples of 128 so that no padding enters the count. The optimizer step reads
one value back from the device, the gradient norm it returns."""

from __future__ import annotations

import contextlib
import gc
import sys
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_ext.optimizer import (
    DistributedOptimizer,
    Float16OptimizerWithFloat16Params,
    OptimizerConfig,
    get_megatron_optimizer,
)
from benchmarks.common import live_cpu_storages
from tests.distributed import run_distributed

SCALAR_BYTES = 64  # storages this small are counters and flags (Adam's step, found-inf), not state


@contextlib.contextmanager
def _host_reads() -> Iterator[list[str]]:
    """Records every read of a tensor's value into Python (``item``, ``float``, ``bool``, ...) by
    megatron_ext's code: on a GPU each is a wait for the device. (torch's foreach Adam reads its
    host-side step counters; on CUDA megatron_ext uses the fused Adam, whose counters stay on the
    device.)"""
    reads: list[str] = []
    names = ("item", "tolist", "__float__", "__bool__", "__int__", "__index__")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def recording(name: str):
        def read(self, *args, **kwargs):
            if "megatron_ext" in sys._getframe(1).f_code.co_filename:
                reads.append(name)
            return originals[name](self, *args, **kwargs)

        return read

    for name in names:
        setattr(torch.Tensor, name, recording(name))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _step_bytes(distributed: bool, overlap: bool) -> tuple[int, int, int]:
    """(bytes of the storages a bf16 model, its DDP and optimizer hold after two steps, bytes
    of the scalar ones among them, number of parameters)."""
    gc.collect()
    before = live_cpu_storages()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256, bias=False), torch.nn.Tanh(), torch.nn.Linear(256, 128, bias=False)
    ).bfloat16()
    ddp = DistributedDataParallel(model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=distributed,
        overlap_param_gather=overlap))
    config = OptimizerConfig(lr=1e-3, bf16=True, clip_grad=1.0, use_distributed_optimizer=distributed,
                             overlap_param_gather=overlap)
    optimizer = get_megatron_optimizer(config, [ddp])
    assert isinstance(optimizer, DistributedOptimizer if distributed else Float16OptimizerWithFloat16Params)
    for step in range(2):
        optimizer.zero_grad()
        x = torch.randn(4, 128, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        ddp(x.bfloat16()).float().square().mean().backward()
        ddp.finish_grad_sync()
        with _host_reads() as reads:
            ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm > 0
        # The step reads one value back from the device: the gradient norm it returns.
        assert reads == ["__float__"], reads
        del x
    if overlap:
        assert ddp.param_gather_in_flight  # counted while the gathers are in flight
    gc.collect()
    new = {ptr: n for ptr, n in live_cpu_storages().items() if ptr not in before}
    large = sum(n for n in new.values() if n > SCALAR_BYTES)
    scalars = sum(n for n in new.values() if n <= SCALAR_BYTES)
    numel = sum(p.numel() for p in model.parameters())
    if distributed:
        ddp.finish_param_sync()
    # Every main gradient is the float32 buffer itself (a view), not a copy.
    buffer = ddp.buffers[0].grad_data.untyped_storage().data_ptr()
    assert all(s.main.grad.untyped_storage().data_ptr() == buffer for s in optimizer._slots)
    return large, scalars, numel


def _memory_worker():
    ps.initialize_model_parallel()  # dp = 2
    return {
        "plain": _step_bytes(distributed=False, overlap=False),
        "distributed": _step_bytes(distributed=True, overlap=False),
        "distributed_overlap": _step_bytes(distributed=True, overlap=True),
    }


@pytest.mark.slow  # two spawned ranks, many training steps
def test_state_bytes_per_parameter_match_megatron_core():
    for out in run_distributed(2, _memory_worker):
        large, scalars, numel = out["plain"]
        assert large == 18 * numel, (large / numel, out)
        assert scalars <= 8 * SCALAR_BYTES
        for key in ("distributed", "distributed_overlap"):
            large, scalars, numel = out[key]
            assert large == (6 + 12 // 2) * numel, (key, large / numel)
            assert scalars <= 8 * SCALAR_BYTES
