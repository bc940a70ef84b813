"""Gradient reductions between the backward pass and the optimizer step."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.comm_errors import reported
from megatron_ext.distributed.distributed_data_parallel import (
    DEFAULT_BUCKET_SIZE_BYTES,
    DistributedDataParallel,
    partition_into_buckets,
)
from megatron_ext.pipeline_parallel.schedules import get_attr_wrapped_model
from megatron_ext.tensor_parallel.utils import comm_device

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
    most ``bucket_bytes`` per dtype, scaled by 1 / the group size when ``average``, reduced with
    SUM (gloo has no AVG) and copied back. Parameters without a gradient are skipped (every rank
    must pass the same set).
    """
    if dist.get_world_size(group) == 1:
        return
    grads = [(str(i), g) for i, g in enumerate(_grad(p) for p in params) if g is not None]
    divisor = dist.get_world_size(group) if average else 1
    for bucket in partition_into_buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket.params])
        if divisor != 1:
            flat.mul_(1.0 / divisor)  # before the sum, as the DDP buckets are
        with reported(f"all-reduce of the gradients of bucket {bucket.index}", group, tensor=flat):
            dist.all_reduce(flat, group=group)
        for g, offset in zip(bucket.params, bucket.offsets):
            g.copy_(flat[offset : offset + g.numel()].view_as(g))


def allreduce_embedding_grads(
    model_chunks: list[torch.nn.Module],
    embd_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> None:
    """Sums the gradients of the tied word embedding over the first and last pipeline stage.

    ``embd_group`` / ``pp_group`` default to parallel_state's; a rank outside ``embd_group`` (an
    inner stage, or ``None``) has nothing to do."""
    if pp_group is None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        embd_group = parallel_state.get_embedding_group(check_initialized=False)
    pp_size = dist.get_world_size(pp_group)
    if pp_size == 1 or embd_group is None:
        return
    if dist.get_rank() not in dist.get_process_group_ranks(embd_group):
        return
    # The first stage's embedding is in this rank's first chunk, the last stage's copy in its last
    # chunk; in the V layout one rank holds both, whose gradients are summed here first.
    weights = []
    for model in dict.fromkeys([model_chunks[0], model_chunks[-1]]):
        try:  # look through wrappers such as DistributedDataParallel
            weight = get_attr_wrapped_model(model, "shared_embedding_or_output_weight")()
        except AttributeError:
            continue
        if weight is not None and getattr(weight, "shared_embedding", False):
            weights.append(weight)
    if not weights:
        return
    grads = []
    for weight in weights:
        grad = _grad(weight)
        if grad is None:
            grad = weight.grad = torch.zeros_like(weight)
        grads.append(grad)
    if len(grads) == 2:
        grads[0].add_(grads[1])
    with reported("all-reduce of the tied word embedding's gradient", embd_group, tensor=grads[0]):
        dist.all_reduce(grads[0], group=embd_group)
    for grad in grads[1:]:
        grad.copy_(grads[0])


def allreduce_layernorm_grads(
    model_chunks: list[torch.nn.Module], tp_group: dist.ProcessGroup | None = None
) -> None:
    """Sums over the tensor-parallel group the gradients of the parameters marked
    ``sequence_parallel`` (LayerNorms and row-parallel biases): under sequence parallelism each
    rank computed them from its own part of the sequence (Megatron-core's
    ``_allreduce_layernorm_grads``); and with ``config.qk_layernorm`` those of the query and key
    normalisations (``q_layernorm`` / ``k_layernorm`` in the name, Megatron's rule), which each
    rank computed from its own heads. ``tp_group`` defaults to parallel_state's."""
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(tp_group) == 1:
        return
    params = []
    for chunk in model_chunks:
        try:
            config = get_attr_wrapped_model(chunk, "config")
        except AttributeError:  # a plain module: no sequence parallelism
            continue
        sequence_parallel = getattr(config, "sequence_parallel", False)
        qk_layernorm = getattr(config, "qk_layernorm", False)
        params.extend(
            p
            for name, p in chunk.named_parameters()
            if p.requires_grad
            and (
                (sequence_parallel and getattr(p, "sequence_parallel", False))
                or (qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))
            )
        )
    if params:
        allreduce_gradients(params, tp_group, average=False)


def _find_ddp(model: torch.nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel that ``model`` is or wraps (through ``.module``), if any."""
    inner: Any = model
    while inner is not None:
        if isinstance(inner, DistributedDataParallel):
            return inner
        inner = getattr(inner, "module", None)
    return None


_PG_COLLECTION_FIELDS = ("tp", "pp", "embd", "pos_embd", "dp_cp")


def finalize_model_grads(
    model_chunks: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> None:
    """Averages gradients over the data-parallel group, sums the sequence-parallel LayerNorm and
    bias gradients over the tensor-parallel group and the tied embedding's over the embedding
    group: what must happen after every backward and before every optimizer step.

    A chunk that is (or wraps) a ``DistributedDataParallel`` has started its reductions during
    the backward: its ``finish_grad_sync()`` completes them. The gradients of other chunks are
    all-reduced here, after the backward.

    ``num_tokens`` (the schedules pass it under ``config.calculate_per_token_loss``) is this
    pipeline's count of loss tokens, known on the last stage: it is broadcast over the pipeline,
    summed over the data-parallel group, and every gradient becomes the data-parallel *sum*
    divided by that global count, as in Megatron-core. ``pg_collection`` (a
    ``ProcessGroupCollection`` with ``tp``, ``pp``, ``embd``, ``pos_embd`` and ``dp_cp``) replaces
    parallel_state's groups.
    """
    if pg_collection is not None:
        missing = [f for f in _PG_COLLECTION_FIELDS if not hasattr(pg_collection, f)]
        if missing:
            raise parallel_state.ParallelStateError(
                f"finalize_model_grads: pg_collection lacks {missing}; it needs {list(_PG_COLLECTION_FIELDS)} "
                "(set embd / pos_embd to None when there is no such group)"
            )
        tp_group, pp_group, embd_group = pg_collection.tp, pg_collection.pp, pg_collection.embd
        dp_group = pg_collection.dp_cp
    else:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        embd_group = parallel_state.get_embedding_group(check_initialized=False)
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)

    params = []
    for chunk in model_chunks:
        ddp = _find_ddp(chunk)
        if ddp is not None:
            # Passed only when set: wrappers written for the older signature take no keyword.
            ddp.finish_grad_sync(force_all_reduce=True) if force_all_reduce else ddp.finish_grad_sync()
        else:
            params.extend(p for p in chunk.parameters() if p.requires_grad)
    if params:
        allreduce_gradients(params, dp_group)
    allreduce_layernorm_grads(model_chunks, tp_group)
    allreduce_embedding_grads(model_chunks, embd_group, pp_group)

    if num_tokens is not None:
        _scale_by_global_tokens(model_chunks, num_tokens, pp_group, dp_group)


def _scale_by_global_tokens(
    model_chunks: list[torch.nn.Module],
    num_tokens: torch.Tensor,
    pp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup,
) -> None:
    if not isinstance(num_tokens, torch.Tensor):
        raise TypeError(f"finalize_model_grads: num_tokens must be a tensor, got {type(num_tokens).__name__}")
    # Only the last stage counted the tokens. The reductions above averaged over the data-parallel
    # group, so multiplying by its size gives back the sum Megatron-core divides by the count.
    total = num_tokens.detach().to(comm_device(pp_group), torch.float64).reshape(1).clone()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    with reported("broadcast of the number of loss tokens from the last stage", pp_group):
        dist.broadcast(total, src=pp_ranks[-1], group=pp_group)
    with reported("all-reduce of the number of loss tokens", dp_group):
        dist.all_reduce(total, group=dp_group)
    count = float(total.item())
    if count <= 0:
        return
    scale = dist.get_world_size(dp_group) / count
    for chunk in model_chunks:
        for p in chunk.parameters():
            grad = _grad(p)
            if grad is not None:
                grad.mul_(scale)
