"""Gradient norm, clipping and zero counting over every parallel group (Megatron-core's
``megatron.core.optimizer.clip_grads`` names).

The callers pass each gradient element exactly once across the ranks of the reducing groups:
tensor-parallel duplicates (``param_is_not_tensor_parallel_duplicate``) and the last pipeline
stage's copy of the tied embedding (``param.shared``) are left out by the optimizer, and the
distributed optimizer passes only this data-parallel rank's shard.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from megatron_ext.comm_errors import reported
from megatron_ext.tensor_parallel.utils import comm_device


def _groups(group: dist.ProcessGroup | list[dist.ProcessGroup] | None) -> list[dist.ProcessGroup]:
    if group is None:
        return []
    return list(group) if isinstance(group, (list, tuple)) else [group]


def _stats_tensor(groups: list[dist.ProcessGroup]) -> torch.Tensor:
    """A float64 accumulator on the device the groups' backend reduces (NCCL: the GPU)."""
    return torch.zeros(1, dtype=torch.float64, device=comm_device(*groups))


def group_by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped for the multi-tensor (``torch._foreach_*``) kernels."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def grad_norm_tensor(
    grads_for_norm: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2,
    grad_stats_parallel_group: dist.ProcessGroup | list[dist.ProcessGroup] | None = None,
) -> torch.Tensor:
    """``get_grad_norm_fp32`` as a one-element float64 tensor on the groups' device, without
    waiting for the device (no ``.item()``): the per-tensor norms come from one multi-tensor
    kernel per (device, dtype), their powers are summed in float64."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    grads = [g.detach() for g in grads_for_norm if g.numel()]
    norm_type = float(norm_type)
    groups = _groups(grad_stats_parallel_group)
    total = _stats_tensor(groups)
    for same in group_by_device_and_dtype(grads):
        norms = torch.stack(torch._foreach_norm(same, norm_type)).double().to(total.device)
        if norm_type == math.inf:
            total = torch.maximum(total, norms.max().view(1))
        else:
            total += norms.pow(norm_type).sum()
    for group in groups:
        if norm_type == math.inf:
            with reported("all-reduce (max) of the gradient norm", group):
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            with reported("all-reduce of the gradient norm", group):
                dist.all_reduce(total, group=group)
    return total if norm_type == math.inf else total.pow(1.0 / norm_type)


def get_grad_norm_fp32(
    grads_for_norm: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2,
    grad_stats_parallel_group: dist.ProcessGroup | list[dist.ProcessGroup] | None = None,
) -> float:
    """The ``norm_type`` norm of all the gradients together, summed (max for inf) over the
    group(s); the per-tensor norms are combined in float64."""
    return grad_norm_tensor(grads_for_norm, norm_type, grad_stats_parallel_group).item()


def clip_grad_by_total_norm_fp32(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, total_norm: float | torch.Tensor
) -> None:
    """Scales the ``.grad`` of ``parameters`` by ``max_norm / (total_norm + 1e-6)`` when that is
    below 1 (the rule of ``torch.nn.utils.clip_grad_norm_``). A tensor ``total_norm`` (from
    ``grad_norm_tensor``) is used on the device: the gradients are multiplied by the coefficient
    clamped to 1, which leaves them unchanged when it is 1, and the host does not wait."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if isinstance(total_norm, torch.Tensor):
        coeff = (max_norm / (total_norm.reshape(()) + 1.0e-6)).clamp(max=1.0)
        for same in group_by_device_and_dtype(grads):
            torch._foreach_mul_(same, coeff.to(same[0].device, same[0].dtype))
        return
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for same in group_by_device_and_dtype(grads):
            torch._foreach_mul_(same, clip_coeff)


def count_zeros_fp32(
    grads: Iterable[torch.Tensor],
    grad_stats_parallel_group: dist.ProcessGroup | list[dist.ProcessGroup] | None = None,
) -> int:
    """How many gradient elements are exactly zero, summed over the group(s)."""
    groups = _groups(grad_stats_parallel_group)
    total = _stats_tensor(groups)
    for g in grads:
        total += (g.detach() == 0).sum().double().to(total.device)
    for group in groups:
        with reported("all-reduce of the count of zero gradients", group):
            dist.all_reduce(total, group=group)
    return int(total.item())
