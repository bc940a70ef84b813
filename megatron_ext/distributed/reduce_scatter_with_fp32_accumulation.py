"""A reduce-scatter that sums 16-bit inputs in float32 (Megatron-core's
``reduce_scatter_with_fp32_accumulation``).

A plain reduce-scatter of bf16 gradients adds them in bf16, rounding at every partial sum. Here an
all-to-all hands every rank the dp pieces of its own slice, still in the input dtype; the rank adds
them in float32 and rounds once when it writes the sum into the output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _ReduceScatterWithFP32AccumulationWorkHandle:
    """What the asynchronous form returns: ``wait()`` waits for the all-to-all, then adds."""

    def __init__(self, work: Any, pieces: torch.Tensor, output: torch.Tensor, world_size: int) -> None:
        self.all_to_all_handle = work
        self.all_to_all_output_tensor = pieces
        self.output_tensor = output
        self.world_size = world_size

    def wait(self) -> None:
        if self.all_to_all_handle is not None:
            self.all_to_all_handle.wait()
            self.all_to_all_handle = None
        total = self.all_to_all_output_tensor.view(self.world_size, -1).sum(dim=0, dtype=torch.float32)
        self.output_tensor.copy_(total.view_as(self.output_tensor))


def reduce_scatter_with_fp32_accumulation(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> _ReduceScatterWithFP32AccumulationWorkHandle | None:
    """Writes into ``output_tensor`` this rank's slice (the rank-th of ``world_size`` equal slices)
    of the sum of every rank's ``input_tensor``, accumulated in float32. ``op`` must be SUM. With
    ``async_op`` returns a handle whose ``wait()`` completes the sum (``output_tensor`` may be a view
    into ``input_tensor``: the input is read by the all-to-all before anything is written)."""
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"reduce_scatter_with_fp32_accumulation supports ReduceOp.SUM only, got {op}")
    world_size = dist.get_world_size(group)
    if input_tensor.numel() % world_size != 0 or output_tensor.numel() * world_size != input_tensor.numel():
        raise ValueError(
            f"reduce_scatter_with_fp32_accumulation: the input has {input_tensor.numel()} elements and "
            f"the output {output_tensor.numel()}; the input must hold world_size ({world_size}) times "
            "the output"
        )
    pieces = torch.empty_like(input_tensor)
    work = dist.all_to_all_single(pieces, input_tensor.contiguous(), group=group, async_op=async_op)
    handle = _ReduceScatterWithFP32AccumulationWorkHandle(work, pieces, output_tensor, world_size)
    if async_op:
        return handle
    handle.wait()
    return None
