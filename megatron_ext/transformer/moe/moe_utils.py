"""Token permutation for the experts: sort tokens by expert, and scatter them back.

``permute`` lays the tokens out expert-major (all of expert 0's tokens in token order, then
expert 1's, ...), ``unpermute`` adds each token's copies back into its row, weighted by the
router's probabilities when given; Megatron-core 0.16.1's semantics and numbers. Both run as C++
ops with C++ autograd nodes over CPU and CUDA kernels (``torch.ops.megatron_ext.moe_*``).
"""

from __future__ import annotations

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)

_ops = torch.ops.megatron_ext


def _experts_of_rows(routing_map: torch.Tensor, num_rows: int, drop_and_pad: bool) -> torch.Tensor:
    """The expert of each permuted row."""
    num_experts = routing_map.shape[1]
    if drop_and_pad:
        capacity = num_rows // num_experts
        return torch.arange(num_experts, device=routing_map.device).repeat_interleave(capacity)
    return _ops.moe_sort_by_expert(routing_map, None)[1]


def _permuted_probs(probs: torch.Tensor, sorted_indices: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``probs[sorted_indices[i], experts[i]]`` for each permuted row i (with autograd)."""
    flat = sorted_indices * probs.shape[1] + experts
    return _ops.moe_permute(probs.reshape(-1, 1), flat, None).view(-1)


def permute(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    fused: bool = False,
    drop_and_pad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Groups ``tokens`` [num_tokens, hidden] by expert following ``routing_map``
    [num_tokens, num_experts] (bool or 0/1).

    Returns the permuted tokens, the permuted ``probs`` [num_tokens, num_experts] (None without
    them) and ``sorted_indices``, the source token of each permuted row. With ``drop_and_pad``
    and ``num_out_tokens``, each expert gets exactly ``num_out_tokens // num_experts`` rows (its
    tokens, then padding rows taken from tokens it was not routed). ``fused`` is accepted for
    Megatron-core's signature; the permutation is always this library's own.
    """
    if tokens.dim() != 2:
        raise ValueError(f"permute: tokens must be [num_tokens, hidden], got shape {tuple(tokens.shape)}")
    if routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"permute: routing_map must be [num_tokens={tokens.shape[0]}, num_experts], "
            f"got shape {tuple(routing_map.shape)}"
        )
    num_experts = routing_map.shape[1]
    capacity = None
    if drop_and_pad and num_out_tokens is not None:
        if num_out_tokens < 0:
            raise ValueError(f"permute: num_out_tokens must be >= 0, got {num_out_tokens}")
        capacity = num_out_tokens // num_experts
    sorted_indices, experts = _ops.moe_sort_by_expert(routing_map, capacity)
    permuted_probs = None
    if probs is not None:
        if tuple(probs.shape) != tuple(routing_map.shape):
            raise ValueError(
                f"permute: probs must be [{routing_map.shape[0]}, {num_experts}] like routing_map, "
                f"got shape {tuple(probs.shape)}"
            )
        permuted_probs = _permuted_probs(probs, sorted_indices, experts)
    return _ops.moe_permute(tokens, sorted_indices, None), permuted_probs, sorted_indices


def unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: torch.Size,
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    fused: bool = False,
    drop_and_pad: bool = False,
) -> torch.Tensor:
    """Adds each permuted row back into row ``sorted_indices[i]`` of a zero tensor of
    ``restore_shape`` [num_tokens, hidden], scaled by its router probability when ``probs``
    [num_tokens, num_experts] (with ``routing_map``) is given; the result has the permuted
    tokens' dtype (the sum is taken in the wider of the two dtypes, as Megatron-core does)."""
    num_tokens, hidden = restore_shape
    if permuted_tokens.dim() != 2 or permuted_tokens.shape[1] != hidden:
        raise ValueError(
            f"unpermute: permuted_tokens must be [rows, hidden={hidden}] for restore_shape "
            f"{tuple(restore_shape)}, got shape {tuple(permuted_tokens.shape)}"
        )
    dtype = permuted_tokens.dtype
    permuted_probs = None
    if probs is not None:
        if routing_map is None:
            raise ValueError("unpermute: probs need the routing_map they were permuted with")
        experts = _experts_of_rows(routing_map, sorted_indices.numel(), drop_and_pad)
        if experts.numel() != sorted_indices.numel():
            raise ValueError(
                f"unpermute: routing_map routes {experts.numel()} rows, but sorted_indices has "
                f"{sorted_indices.numel()}"
            )
        common = torch.promote_types(dtype, probs.dtype)
        permuted_probs = _permuted_probs(probs.to(common), sorted_indices, experts)
        permuted_tokens = permuted_tokens.to(common)
    out = _ops.moe_unpermute(permuted_tokens, sorted_indices, permuted_probs, num_tokens)
    return out.to(dtype)


# The router's helpers live in router_utils; Megatron-core code imports them from here.
from megatron_ext.transformer.moe.router_utils import (  # noqa: E402,F401
    MoEAuxLossAutoScaler,
    apply_router_token_dropping,
    clear_aux_losses_tracker,
    compute_routing_scores_for_aux_loss,
    get_capacity,
    get_moe_layer_wise_logging_tracker,
    get_updated_expert_bias,
    reduce_aux_losses_tracker_across_ranks,
    save_to_aux_losses_tracker,
    sort_chunks_by_idxs,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    track_moe_metrics,
    z_loss_func,
)
