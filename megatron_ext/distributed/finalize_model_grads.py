"""Gradient reductions between the backward pass and the optimizer step."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_ext.pipeline_parallel.schedules import get_attr_wrapped_model

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def allreduce_gradients(
    params: Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup,
    average: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Sums (or averages) the gradients of ``params`` over ``group``, one all-reduce per bucket.

    Gradients are packed into flat buffers of at most ``bucket_bytes`` per dtype, reduced with
    SUM (gloo has no AVG) and divided by the group size, then copied back.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads:
            if bucket and size + g.numel() * g.element_size() > bucket_bytes:
                _allreduce_bucket(bucket, group, world if average else 1)
                bucket, size = [], 0
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket:
            _allreduce_bucket(bucket, group, world if average else 1)


def _allreduce_bucket(bucket: list[torch.Tensor], group: dist.ProcessGroup, divisor: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in bucket])
    dist.all_reduce(flat, group=group)
    if divisor != 1:
        flat.div_(divisor)
    offset = 0
    for g in bucket:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def allreduce_embedding_grads(model_chunks: list[torch.nn.Module]) -> None:
    """Sums the gradients of the tied word embedding over the first and last pipeline stage."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
        model = model_chunks[0]
    elif parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        model = model_chunks[-1]
    else:
        return
    try:  # look through wrappers such as DistributedDataParallel
        shared_weight = get_attr_wrapped_model(model, "shared_embedding_or_output_weight")
    except AttributeError:
        return
    weight = shared_weight()
    if weight is None or not getattr(weight, "shared_embedding", False):
        return
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    dist.all_reduce(grad, group=parallel_state.get_embedding_group())
    weight.grad = grad


def _find_ddp(model: torch.nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel that ``model`` is or wraps (through ``.module``), if any."""
    inner: Any = model
    while inner is not None:
        if isinstance(inner, DistributedDataParallel):
            return inner
        inner = getattr(inner, "module", None)
    return None


def finalize_model_grads(model_chunks: list[torch.nn.Module], num_tokens: torch.Tensor | None = None) -> None:
    """Averages gradients over the data-parallel group and sums the tied embedding's over the
    embedding group: what must happen after every backward and before every optimizer step.

    A chunk that is (or wraps) a ``DistributedDataParallel`` has started its reductions during
    the backward: its ``finish_grad_sync()`` completes them. The gradients of other chunks are
    all-reduced here, after the backward.
    """
    params = []
    for chunk in model_chunks:
        ddp = _find_ddp(chunk)
        if ddp is not None:
            ddp.finish_grad_sync()
        else:
            params.extend(p for p in chunk.parameters() if p.requires_grad)
    if params:
        allreduce_gradients(params, parallel_state.get_data_parallel_group())
    allreduce_embedding_grads(model_chunks)
