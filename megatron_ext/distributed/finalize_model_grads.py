"""Gradient reductions between the backward pass and the optimizer step."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.distributed.distributed_data_parallel import (
    DEFAULT_BUCKET_SIZE_BYTES,
    DistributedDataParallel,
    partition_into_buckets,
)
from megatron_ext.pipeline_parallel.schedules import get_attr_wrapped_model

# The one default bucket size of the package (DistributedDataParallel's).
DEFAULT_BUCKET_BYTES = DEFAULT_BUCKET_SIZE_BYTES


def _grad(param: torch.Tensor) -> torch.Tensor | None:
    """Where ``param``'s gradient lives: ``main_grad`` under a DistributedDataParallel with a
    ``ddp_config`` (Megatron-core's convention), else ``param.grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def allreduce_gradients(
    params: Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup,
    average: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Sums (or averages) the gradients of ``params`` over ``group``, one all-reduce per bucket.

    The buckets are ``partition_into_buckets``' (DistributedDataParallel's): flat buffers of at
    most ``bucket_bytes`` per dtype, reduced with SUM (gloo has no AVG), divided by the group size
    when ``average``, and copied back. Parameters without a gradient are skipped (every rank
    must pass the same set).
    """
    if dist.get_world_size(group) == 1:
        return
    grads = [(str(i), g) for i, g in enumerate(_grad(p) for p in params) if g is not None]
    divisor = dist.get_world_size(group) if average else 1
    for bucket in partition_into_buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket.params])
        dist.all_reduce(flat, group=group)
        if divisor != 1:
            flat.div_(divisor)
        for g, offset in zip(bucket.params, bucket.offsets):
            g.copy_(flat[offset : offset + g.numel()].view_as(g))


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
    grad = _grad(weight)
    if grad is None:
        grad = weight.grad = torch.zeros_like(weight)
    dist.all_reduce(grad, group=parallel_state.get_embedding_group())


def allreduce_layernorm_grads(model_chunks: list[torch.nn.Module]) -> None:
    """Sums over the tensor-parallel group the gradients of the parameters marked
    ``sequence_parallel`` (LayerNorms and row-parallel biases): under sequence parallelism each
    rank computed them from its own part of the sequence (Megatron-core's
    ``_allreduce_layernorm_grads``)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    params = []
    for chunk in model_chunks:
        try:
            config = get_attr_wrapped_model(chunk, "config")
        except AttributeError:  # a plain module: no sequence parallelism
            continue
        if not getattr(config, "sequence_parallel", False):
            continue
        params.extend(
            p for p in chunk.parameters() if p.requires_grad and getattr(p, "sequence_parallel", False)
        )
    if params:
        allreduce_gradients(params, parallel_state.get_tensor_model_parallel_group(), average=False)


def _find_ddp(model: torch.nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel that ``model`` is or wraps (through ``.module``), if any."""
    inner: Any = model
    while inner is not None:
        if isinstance(inner, DistributedDataParallel):
            return inner
        inner = getattr(inner, "module", None)
    return None


def finalize_model_grads(model_chunks: list[torch.nn.Module], num_tokens: torch.Tensor | None = None) -> None:
    """Averages gradients over the data-parallel group, sums the sequence-parallel LayerNorm and
    bias gradients over the tensor-parallel group and the tied embedding's over the embedding
    group: what must happen after every backward and before every optimizer step.

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
    allreduce_layernorm_grads(model_chunks)
    allreduce_embedding_grads(model_chunks)
