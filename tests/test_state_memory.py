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
one value back from the device, the gradient norm it returns.

FullyShardedDataParallel at dp 1, 2 and 4 (``test_sharded_state_bytes_per_parameter_and_peak``):
"optim" 2 + 4 + 12 / dp, "optim_grads" 2 + 16 / dp, "optim_grads_params" 18 / dp bytes per
parameter, up to the buckets' padding, and what a step holds on top of them."""

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
    # (address, size): a storage freed meanwhile may leave its address to a new one of another size
    before = set(live_cpu_storages().items())
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
    new = {ptr: n for ptr, n in live_cpu_storages().items() if (ptr, n) not in before}
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


HIDDEN, FFN = 256, 400  # FFN: fc1's bias (400) is padded to 448, so the buckets carry some padding


class _Block(torch.nn.Module):
    """One FSDP unit: a residual MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _held_bytes(ddp: DistributedDataParallel, optimizer) -> int:
    """Bytes of the distinct storages of what the rank's model, wrapper and optimizer hold: the
    parameters, every buffer's parameters and gradients, the shards, ``.grad``, the main parameters
    and the optimizer state (storages of at most SCALAR_BYTES left out, as above)."""
    tensors = [t for p in ddp.module.parameters() for t in (p, p.grad)]
    for buffer in ddp.buffers:
        tensors += [buffer.param_data, buffer.grad_data]
        tensors += [getattr(b, name, None) for b in buffer.buckets for name in ("param_shard", "grad_shard")]
    tensors += optimizer.get_parameters()
    tensors += [v for state in optimizer.optimizer.state.values() for v in state.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if isinstance(t, torch.Tensor)}
    return sum(n for n in storages.values() if n > SCALAR_BYTES)


def _sharded_step_bytes(strategy: str) -> dict:
    """A bf16 model of a root (two Linear layers) and three units (``_Block``) under ``strategy``
    ("distributed": DistributedDataParallel and the distributed optimizer; otherwise
    FullyShardedDataParallel's), float32 gradients and Adam: the live storages after two steps, as
    ``_step_bytes`` counts them, and what is held at every module's forward hooks and every
    gradient's arrival during a third step (the peaks of its forward and of its backward)."""
    from megatron_ext.distributed import FullyShardedDataParallel

    gc.collect()
    # (address, size): a storage freed meanwhile may leave its address to a new one of another size
    before = set(live_cpu_storages().items())
    torch.manual_seed(0)
    blocks = [_Block(), _Block(), _Block()]
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), *blocks, torch.nn.Linear(HIDDEN, HIDDEN))
    model.bfloat16()
    if strategy == "distributed":
        ddp = DistributedDataParallel(model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True))
    else:
        ddp = FullyShardedDataParallel(None, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, use_megatron_fsdp=True,
            data_parallel_sharding_strategy=strategy), model, fsdp_unit_modules=[_Block])
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, bf16=True, clip_grad=1.0, use_distributed_optimizer=True), [ddp])
    samples: dict[str, list[int]] = {"forward": [], "backward": []}

    def step(i: int) -> None:
        optimizer.zero_grad()
        x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(10 * i + dist.get_rank()))
        ddp(x.bfloat16()).float().square().mean().backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm > 0

    for i in range(2):
        step(i)
    gc.collect()
    new = {ptr: n for ptr, n in live_cpu_storages().items() if (ptr, n) not in before}
    resident = _held_bytes(ddp, optimizer)
    # Registered after the wrapper's own hooks, so each sample sees what they gathered or freed.
    def sampler(phase: str):
        return lambda *unused: samples[phase].append(_held_bytes(ddp, optimizer))

    hooks = [h for m in model.modules() for h in (m.register_forward_pre_hook(sampler("forward")),
                                                  m.register_forward_hook(sampler("forward")))]
    hooks += [p.register_post_accumulate_grad_hook(sampler("backward")) for p in model.parameters()]
    step(2)
    for hook in hooks:
        hook.remove()
    unit = max(sum(b.numel for b in ddp.buffers if not set(b.params).isdisjoint(block.parameters()))
               for block in blocks)
    return {
        "large": sum(n for n in new.values() if n > SCALAR_BYTES),
        "scalars": sum(n for n in new.values() if n <= SCALAR_BYTES),
        "numel": sum(p.numel() for p in model.parameters()),
        "padded": sum(b.numel for b in ddp.buffers),  # buckets: 1 (distributed), 4 (FSDP)
        "unit": unit,  # the largest unit's elements, padding included
        "root": sum(b.numel for b in ddp.buffers) - len(blocks) * unit if strategy != "distributed" else 0,
        "resident": resident,
        "forward": max(samples["forward"]),
        "backward": max(samples["backward"]),
    }


def _sharded_memory_worker() -> dict:
    ps.initialize_model_parallel()  # dp = the world size
    return {s: _sharded_step_bytes(s) for s in ("distributed", "optim", "optim_grads", "optim_grads_params")}


@pytest.mark.slow  # three spawns (dp 1, 2, 4), four strategies each
def test_sharded_state_bytes_per_parameter_and_peak():
    """Resident bytes per parameter with bf16 parameters, float32 gradients and Adam at dp N:
    the distributed optimizer and FSDP "optim" 2 + 4 + 12 / N, "optim_grads" 2 + (4 + 12) / N,
    "optim_grads_params" 18 / N, up to the buckets' padding. Padded elements are stored in the
    parameter and gradient buffers and their shards (at most 6 + 12 / N bytes each) and are not in
    the main parameters and moments, while a rank's shard of the buckets may hold up to all of the
    padding, so the bytes lie within [formula - 12 x padding, formula + 18 x padding]. The padding
    is at most 63 elements per parameter (each starts at a multiple of 64) and lcm(N, 128) - 1 per
    bucket: at most 16 x 63 + 4 x 127 = 1,516 elements of 747,952, which at 18 bytes each is under
    2% of the smallest formula (18 / 4 bytes per parameter), as asserted.

    During a step, at every module's forward hooks and every gradient's arrival, what the model,
    wrapper and optimizer hold is at most the resident state plus, under "optim_grads_params", the
    root's parameters (gathered from the wrapper's forward to the optimizer step) and two units'
    (the one computing and the next one prefetched), and in the backward under "optim_grads*" the
    root's full gradient buffer (alive through the backward) and one unit's; and more than the
    resident state where something is gathered. Activations, autograd's and the
    collectives' temporaries are not among these tensors and not bounded here."""
    # bytes per parameter: (held whole, divided over dp)
    formulas = {"distributed": (6, 12), "optim": (6, 12), "optim_grads": (2, 16),
                "optim_grads_params": (0, 18)}
    for dp in (1, 2, 4):
        for out in run_distributed(dp, _sharded_memory_worker):
            for strategy, m in out.items():
                full, sharded = formulas[strategy]
                formula = full * m["numel"] + sharded * m["numel"] / dp
                pad = m["padded"] - m["numel"]
                what = (dp, strategy, m["large"] / m["numel"], m)
                assert 0 <= pad <= 16 * 63 + 4 * 127 and 18 * pad <= 0.02 * formula, what
                assert formula - 12 * pad <= m["large"] <= formula + 18 * pad, what
                assert abs(m["large"] - formula) <= 0.02 * formula, what
                assert m["scalars"] <= 16 * SCALAR_BYTES, what
                assert m["resident"] == m["large"], what  # the enumeration misses no live storage
                params = 2 * (m["root"] + 2 * m["unit"]) if strategy == "optim_grads_params" else 0  # bf16
                grads = 4 * (m["root"] + m["unit"]) if strategy.startswith("optim_grads") else 0  # float32
                assert m["resident"] + (params > 0) <= m["forward"] <= m["resident"] + params, what
                assert m["resident"] + (grads > 0) <= m["backward"] <= m["resident"] + params + grads, what
