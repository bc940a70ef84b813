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


def get_grad_norm_fp32(
    grads_for_norm: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2,
    grad_stats_parallel_group: dist.ProcessGroup | list[dist.ProcessGroup] | None = None,
) -> float:
    """The ``norm_type`` norm of all the gradients together, summed (max for inf) over the
    group(s). Accumulated in float64, so float64 runs are exact to rounding."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    grads = list(grads_for_norm)
    norm_type = float(norm_type)
    groups = _groups(grad_stats_parallel_group)
    total = _stats_tensor(groups)
    if norm_type == math.inf:
        for g in grads:
            if g.numel():
                total = torch.maximum(total, g.detach().abs().max().double().to(total.device).view(1))
        for group in groups:
            with reported("all-reduce (max) of the gradient norm", group):
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total.item()
    for g in grads:
        # One pass accumulating in float64 (no float64 copy of the gradient).
        norm = torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float64)
        total += norm.pow(norm_type).to(total.device)
    for group in groups:
        with reported("all-reduce of the gradient norm", group):
            dist.all_reduce(total, group=group)
    return total.item() ** (1.0 / norm_type)


def clip_grad_by_total_norm_fp32(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, total_norm: float
) -> None:
    """Scales the ``.grad`` of ``parameters`` by ``max_norm / (total_norm + 1e-6)`` when that is
    below 1 (the rule of ``torch.nn.utils.clip_grad_norm_``)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.detach().mul_(clip_coeff)


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
