"""Token permutation for the experts: sort tokens by expert, and scatter them back.

``permute`` lays the tokens out expert-major (all of expert 0's tokens in token order, then
expert 1's, ...), ``unpermute`` adds each token's copies back into its row, weighted by the
router's probabilities when given; Megatron-core 0.16.1's semantics and numbers.
"""

from __future__ import annotations

import torch


def _check_routing(tokens: torch.Tensor, routing_map: torch.Tensor, where: str) -> None:
    if tokens.dim() != 2:
        raise ValueError(f"{where}: tokens must be [num_tokens, hidden], got shape {tuple(tokens.shape)}")
    if routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"{where}: routing_map must be [num_tokens={tokens.shape[0]}, num_experts], "
            f"got shape {tuple(routing_map.shape)}"
        )


def _capacity_indices(routing_map: torch.Tensor, capacity: int) -> torch.Tensor:
    """[num_experts * capacity]: each expert's tokens in token order, padded with the tokens it
    was not routed (in token order) up to ``capacity``."""
    by_expert = routing_map.to(torch.int8).T.contiguous()
    return by_expert.argsort(dim=-1, descending=True, stable=True)[:, :capacity].reshape(-1)


def _probs_at(probs: torch.Tensor, sorted_indices: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return probs[sorted_indices, experts]


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
    _check_routing(tokens, routing_map, "permute")
    num_tokens = tokens.shape[0]
    num_experts = routing_map.shape[1]
    if drop_and_pad and num_out_tokens is not None:
        if num_out_tokens < 0:
            raise ValueError(f"permute: num_out_tokens must be >= 0, got {num_out_tokens}")
        capacity = num_out_tokens // num_experts
        sorted_indices = _capacity_indices(routing_map, capacity)
        experts = torch.arange(num_experts, device=tokens.device).repeat_interleave(capacity)
    else:
        experts, sorted_indices = routing_map.bool().T.nonzero(as_tuple=True)
    permuted_probs = None
    if probs is not None:
        if tuple(probs.shape) != (num_tokens, num_experts):
            raise ValueError(
                f"permute: probs must be [{num_tokens}, {num_experts}] like routing_map, "
                f"got shape {tuple(probs.shape)}"
            )
        permuted_probs = _probs_at(probs, sorted_indices, experts)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


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
    tokens' dtype."""
    num_tokens, hidden = restore_shape
    dtype = permuted_tokens.dtype
    if probs is not None:
        if routing_map is None:
            raise ValueError("unpermute: probs need the routing_map they were permuted with")
        num_experts = routing_map.shape[1]
        if drop_and_pad:
            capacity = sorted_indices.numel() // num_experts
            experts = torch.arange(num_experts, device=probs.device).repeat_interleave(capacity)
        else:
            experts, _ = routing_map.bool().T.nonzero(as_tuple=True)
        permuted_tokens = permuted_tokens * _probs_at(probs, sorted_indices, experts).unsqueeze(-1)
    out = permuted_tokens.new_zeros((num_tokens, hidden))
    out.index_add_(0, sorted_indices, permuted_tokens)
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
