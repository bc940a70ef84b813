"""The router's arithmetic: top-k selection over softmax or sigmoid scores, the load-balancing and
z losses with the autograd node that adds them to the gradient, capacity-based token dropping,
the expert-bias update and the per-layer tracker of the auxiliary losses for logging.

Megatron-core 0.16.1's names, signatures and numbers (``megatron.core.transformer.moe.moe_utils``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.distributed.finalize_model_grads import updated_expert_bias
from megatron_ext.pipeline_parallel.aux_loss import MoEAuxLossAutoScaler  # noqa: F401  (Megatron-core's home)
from megatron_ext.resolve import default_group, group_size
from megatron_ext.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron_ext.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron_ext.transformer.transformer_config import check_group_limited_routing


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the experts, in float32 at least (float64 stays float64)."""
    return torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
    fused: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch Transformer's balance loss ``coeff * E * sum_i f_i * P_i``: ``f_i`` the fraction of
    the ``total_num_tokens * topk`` assignments that went to expert i (``tokens_per_expert``,
    counted over the whole batch), ``P_i`` the mean score of expert i. ``probs`` may be this
    rank's share of the tokens: the losses of the ranks then add up to the batch's."""
    if padding_mask is not None:
        probs = probs * padding_mask.unsqueeze(-1)
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * scale


def z_loss_func(
    logits: torch.Tensor, z_loss_coeff: float, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """ST-MoE's router z-loss: ``coeff * mean(logsumexp(logits)^2)`` over the (non-padding)
    tokens; ``padding_mask`` is True at padding."""
    values = torch.square(torch.logsumexp(logits, dim=-1))
    if padding_mask is None:
        return values.mean() * z_loss_coeff
    valid = ~padding_mask
    return (values * valid).sum() / torch.clamp(valid.sum(), min=1.0) * z_loss_coeff


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """S-BASE's balanced assignment: ``exp(cost)`` scaled by row and column factors until the
    mean change of the column factors falls to ``tol`` (Megatron-core's iteration)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def get_tokens_per_expert_and_token_count(
    routing_map: torch.Tensor, reduce_group: Any, topk: int | None = None, with_padding_mask: bool = False
) -> tuple[torch.Tensor, Any, Any]:
    """``(tokens per expert summed over reduce_group, local tokens, tokens over the group)``. With
    a padding mask (``routing_map`` then has no entry for a padding token) the token counts are
    the assignments over ``topk``, so padding counts nowhere."""
    local = routing_map.sum(dim=0)
    total = local
    if group_size(reduce_group) > 1:
        total = reduce_from_tensor_model_parallel_region(local, reduce_group)
    if with_padding_mask:
        return total, local.sum() / topk, total.sum() / topk
    return total, routing_map.shape[0], routing_map.shape[0] * group_size(reduce_group)


def apply_random_logits(logits: torch.Tensor) -> torch.Tensor:
    """``moe_router_force_load_balancing``: random normal logits in place of the gate's (drawn on
    the expert-parallel RNG stream, so each expert-parallel rank draws its own), the gradient
    passed straight through to the gate: the random values plus a zero that carries the graph."""
    with torch.no_grad(), get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
        random = torch.empty_like(logits).normal_()
    return random + (logits - logits.detach())


def get_capacity(
    num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int | None = None
) -> int:
    """Tokens per expert: ``ceil(num_tokens / num_experts * capacity_factor)``, at least
    ``min_capacity``."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    return max(capacity, min_capacity) if min_capacity is not None else capacity


def group_limited_topk(
    scores: torch.Tensor,
    topk: int,
    num_tokens: int,
    num_experts: int,
    num_groups: int,
    group_topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of each token's ``topk`` best ``scores`` [num_tokens, num_experts]
    among the experts of its ``group_topk`` best groups: the experts form ``num_groups`` groups of
    consecutive indices, and a group scores the sum of its ``topk // group_topk`` best scores
    (DeepSeek's device- and node-limited routing)."""
    per_group = num_experts // num_groups
    best_in_group = scores.view(num_tokens, num_groups, per_group).topk(topk // group_topk, dim=-1).values
    chosen_groups = best_in_group.sum(dim=-1).topk(group_topk, dim=-1, sorted=False).indices
    allowed = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
    allowed = allowed.scatter(1, chosen_groups, True).repeat_interleave(per_group, dim=1)
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def topk_routing_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    fused: bool = False,
    router_replay: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)``, both [num_tokens, num_experts]: each token's top-k experts
    (True in the map) and their weights (0 elsewhere).

    softmax: top-k of the logits then a softmax over the k (or, ``use_pre_softmax``, top-k of
    the softmax); sigmoid: top-k of ``sigmoid(logits) (+ expert_bias)``, the k sigmoid scores
    (without the bias) normalised to sum 1 when k > 1. ``scaling_factor`` multiplies the weights.
    With ``group_topk`` the top-k is ``group_limited_topk`` of the values the plain top-k would
    take (the logits, the softmax, or the sigmoid scores plus the expert bias)."""
    if logits.dim() != 2:
        raise ValueError(f"topk_routing_with_score_function: logits must be 2-D, got {tuple(logits.shape)}")
    if router_replay is not None:
        raise NotImplementedError("routing replay is not supported")
    num_tokens, num_experts = logits.shape
    if group_topk:
        check_group_limited_routing(num_experts, topk, num_groups, group_topk)

    def choose(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            return group_limited_topk(values, topk, num_tokens, num_experts, num_groups, group_topk)
        return torch.topk(values, k=topk, dim=1)

    if score_function == "softmax":
        if use_pre_softmax:
            probs, top_indices = choose(_softmax(logits).type_as(logits))
        else:
            top_logits, top_indices = choose(logits)
            probs = _softmax(top_logits).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32))).type_as(logits)
        if expert_bias is not None:
            _, top_indices = choose(scores + expert_bias)
            scores = torch.gather(scores, dim=1, index=top_indices)
        else:
            scores, top_indices = choose(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def compute_routing_scores_for_aux_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    fused: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_map, scores)`` the balance loss reads: the scores over all experts (softmax,
    or sigmoid normalised per token) and their top-k, without the expert bias."""
    if score_function == "softmax":
        scores = _softmax(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, top_indices, 1).bool()
    if padding_mask is not None:
        valid = (~padding_mask).unsqueeze(-1)
        routing_map = routing_map * valid
        scores = scores * valid
    return routing_map, scores


def apply_router_token_dropping(
    routing_probs: torch.Tensor,
    routing_map: torch.Tensor,
    router_topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keeps at most ``get_capacity(tokens * topk, experts, capacity_factor)`` tokens per expert:
    those of highest weight (``drop_policy="probs"``) or, ``"position"``, routed tokens as
    ``torch.topk`` of the 0/1 map picks them (Megatron-core's rule: the same tokens, not always the
    first ones). With ``pad_to_capacity`` every expert gets exactly its capacity (the map then
    also selects tokens of weight 0)."""
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        capacity_mask = torch.ones_like(routing_map, dtype=torch.bool)
    else:
        if drop_policy == "probs":
            _, kept = torch.topk(routing_probs, k=capacity, dim=0, sorted=False)
            capacity_mask = torch.zeros_like(routing_map, dtype=torch.bool).scatter(0, kept, True)
        elif drop_policy == "position":
            # Megatron-core's rule, kept as is so that both drop the same tokens: torch.topk of the
            # 0/1 map picks ``capacity`` rows per expert, routed ones first (with padding, unrouted
            # rows fill the rest), in the order torch.topk breaks its ties.
            _, kept = torch.topk(routing_map.int(), k=capacity, dim=0, sorted=False)
            capacity_mask = torch.zeros_like(routing_map, dtype=torch.bool).scatter(0, kept, True)
        else:
            raise ValueError(f"moe_token_drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return routing_probs * final_map, final_map


def sort_chunks_by_idxs(
    input: torch.Tensor, split_sizes: torch.Tensor, sorted_idxs: torch.Tensor, fused: bool = False
) -> torch.Tensor:
    """Cuts ``input`` into chunks of ``split_sizes`` rows and concatenates them in the order
    ``sorted_idxs``."""
    chunks = torch.split(input, split_sizes.tolist(), dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs.tolist()], dim=0)


def get_updated_expert_bias(
    tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, expert_bias_update_rate: float
) -> torch.Tensor:
    """The aux-loss-free balance step: each expert's bias moves by ``expert_bias_update_rate``
    towards the mean load (up when below it). ``tokens_per_expert`` is summed in place over the
    tensor × data × context-parallel group first."""
    group = default_group("tp_dp_cp") if parallel_state.model_parallel_is_initialized() else None
    return updated_expert_bias(tokens_per_expert, expert_bias, expert_bias_update_rate, group)


# Per-layer auxiliary losses for logging -----------------------------------------------------------

_MOE_LAYER_WISE_LOGGING_TRACKER: dict[str, dict[str, Any]] = {}


def get_moe_layer_wise_logging_tracker() -> dict:
    """``{loss name: {"values": [num_layers] tensor, "reduce_group", "avg_group", ...}}``."""
    return _MOE_LAYER_WISE_LOGGING_TRACKER


def save_to_aux_losses_tracker(
    name: str,
    loss: torch.Tensor,
    layer_number: int | None,
    num_layers: int,
    reduce_group: Any = None,
    avg_group: Any = None,
    reduce_group_has_dp: bool = False,
) -> None:
    """Adds ``loss`` (detached) to layer ``layer_number``'s entry (1-based) of ``name``. An entry
    made for fewer layers (a shallower model built earlier in the process) grows to
    ``num_layers``, keeping its values."""
    if layer_number is None:
        return
    entry = get_moe_layer_wise_logging_tracker().setdefault(name, {})
    kept = entry.get("values")
    if kept is None or kept.numel() < num_layers:
        entry["values"] = torch.zeros(num_layers, device=loss.device, dtype=torch.float64)
        if kept is not None:
            entry["values"][: kept.numel()] = kept
    entry["values"][layer_number - 1] += loss.detach().to(torch.float64)
    entry.update(reduce_group=reduce_group, avg_group=avg_group, reduce_group_has_dp=reduce_group_has_dp)


def clear_aux_losses_tracker() -> None:
    """Zeroes every tracked loss."""
    for entry in get_moe_layer_wise_logging_tracker().values():
        entry["values"].zero_()


def reduce_aux_losses_tracker_across_ranks(
    track_names: list[str] | None = None, pg_collection: Any = None
) -> None:
    """Sums the tracked losses over the pipeline stages and each loss's reduce group, then averages
    them over the data-parallel group (unless the reduce group spans it)."""
    tracker = get_moe_layer_wise_logging_tracker()
    if not dist.is_initialized():
        return
    if pg_collection is None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False)
    else:
        pp_group, dp_group = pg_collection.pp, pg_collection.dp
    for name in track_names if track_names is not None else list(tracker):
        values = tracker[name]["values"]
        dist.all_reduce(values, group=pp_group)
        reduce_group = tracker[name].get("reduce_group")
        if reduce_group is not None:
            dist.all_reduce(values, group=reduce_group)
            if not tracker[name].get("reduce_group_has_dp", False):
                dist.all_reduce(values, group=dp_group)  # gloo has no AVG
                values /= group_size(dp_group)
        avg_group = tracker[name].get("avg_group")
        if avg_group is not None:
            dist.all_reduce(values, group=avg_group)
            values /= group_size(avg_group)


def track_moe_metrics(
    loss_scale: float,
    iteration: int,
    writer: Any = None,
    wandb_writer: Any = None,
    total_loss_dict: dict[str, torch.Tensor] | None = None,
    per_layer_logging: bool = False,
    force_initialize: bool = False,
    track_names: list[str] | None = None,
    num_layers: int | None = None,
    moe_layer_freq: int | list[int] | None = None,
    mtp_num_layers: int | None = None,
    pg_collection: Any = None,
) -> None:
    """Reduces the tracked losses over the ranks, adds each one's mean over the MoE layers (times
    ``loss_scale``) to ``total_loss_dict`` and the writers, then clears the tracker.

    ``force_initialize`` with ``track_names`` makes the entries a rank has not tracked (a pipeline
    stage of dense layers only), so that every rank reduces the same ones: reduced as the routers
    reduce theirs (over the tensor × context-parallel group, then averaged over data-parallel
    ranks), every rank logs the same values (Megatron-core's such entries skip that reduction, and
    only its last stage logs right)."""
    tracker = get_moe_layer_wise_logging_tracker()
    if force_initialize and track_names is not None:
        reduce_group = (
            default_group("tp_cp") if pg_collection is None and parallel_state.model_parallel_is_initialized()
            else getattr(pg_collection, "tp_cp", None)
        )
        for key in track_names:
            tracker.setdefault(key, {"values": torch.zeros(num_layers or 1, dtype=torch.float64),
                                     "reduce_group": reduce_group})
    reduce_aux_losses_tracker_across_ranks(track_names, pg_collection=pg_collection)
    if moe_layer_freq is None:
        num_moe_layers = num_layers
    elif isinstance(moe_layer_freq, int):
        num_moe_layers = sum(1 for i in range(num_layers) if i % moe_layer_freq == 0)
    else:
        num_moe_layers = sum(moe_layer_freq)
    if mtp_num_layers is not None:
        num_moe_layers += mtp_num_layers
    for name, entry in tracker.items():
        values = entry["values"] * loss_scale
        mean = values.sum() / num_moe_layers
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict.get(name, 0) + mean
        if writer is not None:
            writer.add_scalar(name, mean, iteration)
            if per_layer_logging:
                for i, value in enumerate(values.tolist()):
                    writer.add_scalar(f"moe/{name}_layer_{i}", value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({name: mean}, iteration)
    clear_aux_losses_tracker()
