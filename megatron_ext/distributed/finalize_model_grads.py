"""Gradient reductions between the backward pass and the optimizer step (Megatron-core's
``megatron.core.distributed.finalize_model_grads``)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from megatron_ext.comm_errors import reported
from megatron_ext.distributed.distributed_data_parallel import (
    DEFAULT_BUCKET_SIZE_BYTES,
    DistributedDataParallel,
)
from megatron_ext.distributed.param_and_grad_buffer import _ParamAndGradBuffer, model_grad
from megatron_ext.process_groups_config import resolve_pg_collection
from megatron_ext.resolve import default_group, find_wrapper, get_attr_wrapped_model
from megatron_ext.tensor_parallel.utils import comm_device, resolve_tp_group

# The one default bucket size of the package (DistributedDataParallel's).
DEFAULT_BUCKET_BYTES = DEFAULT_BUCKET_SIZE_BYTES


def allreduce_gradients(
    params: Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup,
    average: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Sums (or averages) the gradients of ``params`` over ``group``, one all-reduce per bucket.

    The buckets are laid out as DistributedDataParallel's (``_ParamAndGradBuffer``, one buffer per
    dtype and device, at most about ``bucket_bytes`` each), scaled by 1 / the group size when
    ``average``, reduced with SUM (gloo has no AVG) and copied back. Parameters without a gradient
    are skipped (every rank must pass the same set).
    """
    grads = [g for g in (model_grad(p) for p in params) if g is not None]
    _allreduce_tensors(grads, group, average, bucket_bytes)


def _allreduce_tensors(
    tensors: list[torch.Tensor],
    group: dist.ProcessGroup,
    average: bool,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """``allreduce_gradients`` on the tensors themselves."""
    if dist.get_world_size(group) == 1:
        return
    divisor = dist.get_world_size(group) if average else 1
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, _), same_kind in by_kind.items():
        bucket_size = max(1, bucket_bytes // dtype.itemsize)
        buffer = _ParamAndGradBuffer(None, dtype, dtype, same_kind, group, bucket_size, {}, 1.0)
        for index, bucket in enumerate(buffer.buckets):
            for t in bucket.params_list:
                lo, hi = bucket.param_to_index[t]
                bucket.grad_data[lo:hi].copy_(t.reshape(-1))
            if divisor != 1:
                bucket.grad_data.mul_(1.0 / divisor)  # before the sum, as the DDP buckets are
            with reported(f"all-reduce of the gradients of bucket {index}", group, tensor=bucket.grad_data):
                dist.all_reduce(bucket.grad_data, group=group)
            for t in bucket.params_list:
                lo, hi = bucket.param_to_index[t]
                t.copy_(bucket.grad_data[lo:hi].view_as(t))


def allreduce_embedding_grads(
    model_chunks: list[torch.nn.Module],
    embd_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> None:
    """Sums the gradients of the tied word embedding over the first and last pipeline stage.

    ``embd_group`` / ``pp_group`` default to parallel_state's; a rank outside ``embd_group`` (an
    inner stage, or ``None``) has nothing to do."""
    if pp_group is None:
        pp_group, embd_group = default_group("pp"), default_group("embd", check_initialized=False)
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
    weights = [w for w in weights if w.requires_grad]  # a frozen embedding has no gradient
    if not weights:
        return
    grads = []
    for weight in weights:
        grad = model_grad(weight)
        if grad is None:
            grad = weight.grad = torch.zeros_like(weight)
        grads.append(grad)
    if len(grads) == 2:
        grads[0].add_(grads[1])
    with reported("all-reduce of the tied word embedding's gradient", embd_group, tensor=grads[0]):
        dist.all_reduce(grads[0], group=embd_group)
    for grad in grads[1:]:
        grad.copy_(grads[0])


def _reduce_tensor_parallel_grads(
    model_chunks: list[torch.nn.Module], config_of: Any, tp_group: dist.ProcessGroup | None
) -> None:
    tp_group = resolve_tp_group(tp_group)
    if dist.get_world_size(tp_group) == 1:
        return
    summed, averaged = [], []
    for chunk in model_chunks:
        config = config_of(chunk)
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        qk_layernorm = bool(getattr(config, "qk_layernorm", False))
        for name, p in chunk.named_parameters():
            if not p.requires_grad or model_grad(p) is None:
                continue
            if getattr(p, "average_gradients_across_tp_domain", False):
                averaged.append(p)
            elif (
                (sequence_parallel and getattr(p, "sequence_parallel", False))
                or (qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))
                or getattr(p, "partial_over_tensor_parallel", False)
            ):
                summed.append(p)
    if summed:
        allreduce_gradients(summed, tp_group, average=False)
    if averaged:
        allreduce_gradients(averaged, tp_group, average=True)


def _chunk_config(chunk: torch.nn.Module) -> Any:
    try:
        return get_attr_wrapped_model(chunk, "config")
    except AttributeError:  # a plain module: no sequence parallelism
        return None


def allreduce_layernorm_grads(
    model_chunks: list[torch.nn.Module], tp_group: dist.ProcessGroup | None = None
) -> None:
    """Reduces over the tensor-parallel group the gradients each tensor-parallel rank computed
    from its own part of the data: sums those of the parameters marked ``sequence_parallel``
    (LayerNorms and row-parallel biases) under ``config.sequence_parallel`` and of the
    ``q_layernorm`` / ``k_layernorm`` parameters under ``config.qk_layernorm`` and of those marked
    ``partial_over_tensor_parallel`` (a norm shared by heads split over the ranks, as Gated DeltaNet's
    ``out_norm``: Megatron-core leaves it unreduced without sequence parallelism), and averages those
    marked ``average_gradients_across_tp_domain`` (Megatron-core's
    ``_allreduce_non_tensor_model_parallel_grads``). Each chunk's own ``config`` is read;
    ``tp_group`` defaults to parallel_state's."""
    _reduce_tensor_parallel_grads(model_chunks, _chunk_config, tp_group)


def _allreduce_non_tensor_model_parallel_grads(
    model: list[torch.nn.Module], config: Any, tp_group: dist.ProcessGroup | None = None
) -> None:
    """Megatron-core's form of ``allreduce_layernorm_grads``: one ``config`` for every chunk."""
    _reduce_tensor_parallel_grads(model, lambda chunk: config, tp_group)


_allreduce_layernorm_grads = _allreduce_non_tensor_model_parallel_grads


def _allreduce_word_embedding_grads(
    model: list[torch.nn.Module],
    config: Any,
    embd_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> None:
    """Megatron-core's form of ``allreduce_embedding_grads`` (``config`` is not needed)."""
    embd_group = default_group("embd", embd_group, check_initialized=False)
    allreduce_embedding_grads(model, embd_group, default_group("pp", pp_group))


def _allreduce_position_embedding_grads(
    model: list[torch.nn.Module],
    config: Any,
    pos_emb_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
) -> None:
    """Sums the learned position embedding's gradient over ``pos_emb_group`` (the stages holding
    a copy; for a GPT only the first, so nothing to do)."""
    if pos_emb_group is None or dist.get_world_size(pos_emb_group) == 1:
        return
    if dist.get_rank() not in dist.get_process_group_ranks(pos_emb_group):
        return
    chunk = model[0] if dist.get_rank(default_group("pp", pp_group)) == 0 else model[-1]
    weight = get_attr_wrapped_model(chunk, "position_embeddings").weight
    grad = model_grad(weight)
    if grad is None:
        grad = weight.grad = torch.zeros_like(weight)
    with reported("all-reduce of the position embedding's gradient", pos_emb_group, tensor=grad):
        dist.all_reduce(grad, group=pos_emb_group)


def _allreduce_conditional_embedding_grads(
    model: list[torch.nn.Module], config: Any, pp_group: dist.ProcessGroup | None = None
) -> None:
    """Under ``config.has_cond_embedder``, sums over the pipeline group (and over this rank's
    chunks) the gradients of the parameters marked ``pipeline_parallel``: embedders replicated on
    every stage, such as a diffusion model's timestep embedder, stay equal."""
    pp_group = default_group("pp", pp_group)
    if dist.get_world_size(pp_group) == 1 or not getattr(config, "has_cond_embedder", False):
        return
    by_name: dict[str, list[torch.Tensor]] = {}
    for chunk in model:
        for name, p in get_attr_wrapped_model(chunk, "named_parameters")():
            if p.requires_grad and getattr(p, "pipeline_parallel", False) and model_grad(p) is not None:
                by_name.setdefault(name, []).append(model_grad(p))
    if not by_name:
        return
    firsts = []
    for grads in by_name.values():
        for other in grads[1:]:
            grads[0].add_(other)
        firsts.append(grads[0])
    _allreduce_tensors(firsts, pp_group, average=False)
    for grads in by_name.values():
        for other in grads[1:]:
            other.copy_(grads[0])


def _find_ddp(model: torch.nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel that ``model`` is or wraps (through ``.module``), if any."""
    return find_wrapper(model, DistributedDataParallel)


_PG_COLLECTION_FIELDS = ("tp", "pp", "embd", "pos_embd", "dp_cp")


def finalize_model_grads(
    model: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> None:
    """Averages gradients over the data-parallel group, reduces the tensor-parallel-replicated
    gradients (``allreduce_layernorm_grads``) over the tensor-parallel group, the tied embedding's
    over the embedding group, the position embedding's over its group and conditional embedders'
    over the pipeline: what must happen after every backward and before every optimizer step.

    A chunk that is (or wraps) a ``DistributedDataParallel`` has started its reductions during
    the backward: its ``finish_grad_sync()`` completes them. The gradients of other chunks are
    all-reduced here, after the backward.

    ``num_tokens`` (the schedules pass it under ``config.calculate_per_token_loss``) is this
    pipeline's count of loss tokens, known on the last stage: it is broadcast over the pipeline,
    summed over the data-parallel group, and every gradient becomes the data-parallel *sum*
    divided by that global count, as in Megatron-core. ``pg_collection`` (a
    ``ProcessGroupCollection`` with ``tp``, ``pp``, ``embd``, ``pos_embd`` and ``dp_cp``) replaces
    parallel_state's groups. ``model`` is the list of model chunks.
    """
    model_chunks = model
    pgs = resolve_pg_collection(pg_collection, _PG_COLLECTION_FIELDS, "finalize_model_grads")
    tp_group, pp_group, embd_group, pos_embd_group, dp_group = (
        pgs.tp, pgs.pp, pgs.embd, pgs.pos_embd, pgs.dp_cp
    )
    config = _chunk_config(model_chunks[0]) if model_chunks else None

    params = []
    for chunk in model_chunks:
        ddp = _find_ddp(chunk)
        if ddp is not None:
            # Passed only when set: wrappers written for the older signature take no keyword.
            ddp.finish_grad_sync(force_all_reduce=True) if force_all_reduce else ddp.finish_grad_sync()
        else:
            params.extend(p for p in chunk.parameters() if p.requires_grad)
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    params = [p for p in params if getattr(p, "allreduce", True)]
    if params:
        allreduce_gradients(params, dp_group)
    if experts:
        # Summed over the expert copies, scaled like the rest by 1 / the data-parallel size.
        allreduce_gradients(experts, default_group("expt_dp"), average=False)
        for p in experts:
            grad = model_grad(p)
            if grad is not None:
                grad.div_(dist.get_world_size(dp_group))
    _allreduce_conditional_embedding_grads(model_chunks, config, pp_group)
    allreduce_layernorm_grads(model_chunks, tp_group)
    allreduce_embedding_grads(model_chunks, embd_group, pp_group)
    _allreduce_position_embedding_grads(model_chunks, config, pos_embd_group, pp_group)

    if config is not None and getattr(config, "moe_router_enable_expert_bias", False):
        _update_router_expert_bias(model_chunks, config)
    for chunk in model_chunks:  # global_aux_loss counts tokens from one step to the next only
        for module in chunk.modules():
            if getattr(module, "global_tokens_per_expert", None) is not None:
                module.reset_global_aux_loss_tracker()

    if num_tokens is not None:
        _scale_by_global_tokens(model_chunks, num_tokens, pp_group, dp_group)


def updated_expert_bias(
    tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, update_rate: float, group: Any
) -> torch.Tensor:
    """The aux-loss-free balancing step: ``tokens_per_expert`` summed (in place) over ``group``,
    then each bias moved by ``update_rate`` towards the mean load (up for an expert below it)."""
    with torch.no_grad():
        if group is not None and dist.get_world_size(group) > 1:
            with reported("all-reduce of the routers' token counts", group):
                dist.all_reduce(tokens_per_expert, group=group)
        average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        return expert_bias + torch.sign(average - tokens_per_expert) * update_rate


def _update_router_expert_bias(model_chunks: list[torch.nn.Module], config: Any) -> None:
    """Moves every router's ``expert_bias`` from the tokens it counted since the last step (summed
    over the tensor × data × context-parallel group), then clears the counts (Megatron-core's
    ``_update_router_expert_bias``)."""
    routers = [m for c in model_chunks for m in c.modules() if getattr(m, "enable_expert_bias", False)]
    if not routers:
        return
    tokens = torch.stack([r.local_tokens_per_expert for r in routers])
    biases = torch.stack([r.expert_bias for r in routers])
    group = default_group("tp_dp_cp")
    updated = updated_expert_bias(tokens, biases, config.moe_router_bias_update_rate, group)
    for router, bias in zip(routers, updated):
        router.expert_bias.copy_(bias)
        router.local_tokens_per_expert.zero_()


def _scale_by_global_tokens(
    model_chunks: list[torch.nn.Module],
    num_tokens: torch.Tensor,
    pp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup,
) -> None:
    if not isinstance(num_tokens, torch.Tensor):
        raise TypeError(f"finalize_model_grads: num_tokens must be a tensor, got {type(num_tokens).__name__}")
    # Only the last stage counted the tokens. Gradients become the data-parallel sum over the
    # count: a DistributedDataParallel built with calculate_per_token_loss summed already, the
    # other reductions above averaged (times the group size gives back the sum).
    total = num_tokens.detach().to(comm_device(pp_group), torch.float64).reshape(1).clone()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    with reported("broadcast of the number of loss tokens from the last stage", pp_group):
        dist.broadcast(total, src=pp_ranks[-1], group=pp_group)
    with reported("all-reduce of the number of loss tokens", dp_group):
        dist.all_reduce(total, group=dp_group)
    count = float(total.item())
    if count <= 0:
        return
    for chunk in model_chunks:
        ddp = _find_ddp(chunk)
        summed = ddp is not None and ddp.grads_are_summed
        scale = (1.0 if summed else dist.get_world_size(dp_group)) / count
        for p in chunk.parameters():
            grad = model_grad(p)
            if grad is not None:
                grad.mul_(scale)
