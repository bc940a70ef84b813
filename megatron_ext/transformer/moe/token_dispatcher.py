"""Token dispatchers: bring each token to the ranks holding its experts and the experts' outputs
back (Megatron-core's ``MoEAllGatherTokenDispatcher`` and ``MoEAlltoAllTokenDispatcher``).

Each runs in six steps the ``MoELayer`` calls in order: ``dispatch_preprocess`` (flatten,
permute), ``token_dispatch`` (communication), ``dispatch_postprocess`` (tokens grouped by local
expert), the experts, ``combine_preprocess``, ``token_combine`` (communication back) and
``combine_postprocess`` (unpermute, reshape). The router weights are applied inside the experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.resolve import group_rank, group_size
from megatron_ext.tensor_parallel.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_ext.transformer.moe.moe_utils import permute, unpermute
from megatron_ext.transformer.moe.router import moe_process_groups
from megatron_ext.transformer.moe.router_utils import get_capacity, sort_chunks_by_idxs


def _all_gather_rows(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along dim 0 without autograd (integer and bool tensors too)."""
    if group_size(group) == 1:
        return tensor
    as_int = tensor.to(torch.int64)
    parts = [torch.empty_like(as_int) for _ in range(group_size(group))]
    dist.all_gather(parts, as_int.contiguous(), group=group)
    return torch.cat(parts).to(tensor.dtype)


class MoETokenDispatcher:
    """What both dispatchers share: the expert groups (``ep``, ``expt_tp`` as ``tp_group``, and
    their product ``tp_ep``) and the configuration."""

    def __init__(self, config: Any, pg_collection: Any = None) -> None:
        self.config = config
        groups = moe_process_groups(pg_collection)
        self.ep_group = getattr(groups, "ep", None)
        self.tp_group = getattr(groups, "expt_tp", None)
        self.tp_ep_group = getattr(groups, "tp_ep", None)
        self.ep_size, self.tp_size = group_size(self.ep_group), group_size(self.tp_group)
        self.tp_rank = group_rank(self.tp_group)
        self.tp_ep_size = group_size(self.tp_ep_group)
        self.shared_experts = None

    def set_shared_experts(self, shared_experts: Any) -> None:
        self.shared_experts = shared_experts


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gathers every token (and its routing) over the expert tensor × expert-parallel group;
    each rank runs its local experts on the tokens routed to them and a reduce-scatter over the
    same group sums the experts' (and expert-tensor shards') outputs back to the tokens' ranks."""

    def __init__(
        self, num_local_experts: int, local_expert_indices: list[int], config: Any, pg_collection: Any = None
    ) -> None:
        super().__init__(config, pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.router_topk = config.moe_router_topk

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ):
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return hidden_states.reshape(-1, self.hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.tp_ep_size > 1:
            self.routing_map = _all_gather_rows(self.routing_map, self.tp_ep_group)
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_ep_group)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_ep_group)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        local_probs = probs[:, first:last].contiguous()
        tokens_per_expert = self.local_map.sum(dim=0).long().cpu()
        permuted, _, self.reversed_local_input_permutation_mapping = permute(
            hidden_states, self.local_map, num_out_tokens=int(tokens_per_expert.sum())
        )
        self.local_probs = local_probs.T.contiguous().masked_select(self.local_map.T.contiguous())
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return unpermute(
            hidden_states,
            self.reversed_local_input_permutation_mapping,
            restore_shape=self.hidden_shape_before_permute,
            routing_map=self.local_map,
        )

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.tp_ep_size > 1:
            hidden_states = reduce_scatter_to_sequence_parallel_region(hidden_states, group=self.tp_ep_group)
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self.hidden_shape)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """Sends each token only to the expert-parallel ranks of its experts: the counts per expert are
    exchanged first, then the permuted tokens go through an all-to-all with uneven splits over the
    expert-parallel group, and are all-gathered (uneven) over the expert-tensor-parallel group.
    The received chunks, ordered by (etp rank, ep rank, local expert), are regrouped by local
    expert. The way back reverses every step (the all-gather's reverse a reduce-scatter, which sums
    the expert-tensor shards' partial outputs).

    With ``moe_pad_expert_input_to_capacity`` every expert gets exactly its capacity of rows on
    every rank (padding rows carry weight 0), so the counts need no exchange."""

    def __init__(
        self, num_local_experts: int, local_expert_indices: list[int], config: Any, pg_collection: Any = None
    ) -> None:
        super().__init__(config, pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.drop_and_pad = bool(config.moe_pad_expert_input_to_capacity)
        chunks = torch.arange(self.num_experts * self.tp_size)
        self.sort_input_by_local_experts = chunks.reshape(-1, num_local_experts).T.ravel()
        self.restore_output_by_local_experts = chunks.reshape(num_local_experts, -1).T.ravel()

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """The counts: rows sent to each ep rank, received from each, and per local expert."""
        num_tokens = routing_map.shape[0]
        if self.drop_and_pad:
            self.capacity = get_capacity(
                num_tokens * self.config.moe_router_topk,
                self.num_experts,
                self.config.moe_expert_capacity_factor,
            )
            counts = torch.full((self.num_experts,), self.capacity, dtype=torch.int64)
        else:
            counts = routing_map.sum(dim=0).long().cpu()
        self.num_out_tokens = int(counts.sum())
        self.input_splits = counts.reshape(self.ep_size, self.num_local_experts).sum(dim=1).tolist()
        # [tp, ep, E]: every rank's counts, gathered over ep then over etp.
        everyone = _all_gather_rows(
            _all_gather_rows(counts.unsqueeze(0), self.ep_group).unsqueeze(0), self.tp_group
        )
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        local = everyone[:, :, first:last]  # [tp, ep, local experts]
        self.output_splits = local[self.tp_rank].sum(dim=-1).tolist()
        self.output_splits_tp = local.sum(dim=(1, 2)).tolist()
        self.num_global_tokens_per_local_expert = local.reshape(-1, self.num_local_experts)
        return local.sum(dim=(0, 1))

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = hidden_states.shape
        self.routing_map = routing_map
        self.tokens_per_expert = self.preprocess(routing_map)
        tokens, permuted_probs, self.reversed_local_input_permutation_mapping = permute(
            hidden_states,
            routing_map,
            probs=probs,
            num_out_tokens=self.num_out_tokens,
            drop_and_pad=self.drop_and_pad,
        )
        return tokens, permuted_probs

    def token_dispatch(self, permutated_local_input_tokens: torch.Tensor, permuted_probs: torch.Tensor):
        tokens, probs = permutated_local_input_tokens, permuted_probs
        if self.ep_size > 1:
            tokens = all_to_all(self.ep_group, tokens, self.output_splits, self.input_splits)
            probs = all_to_all(
                self.ep_group, probs.unsqueeze(-1), self.output_splits, self.input_splits
            ).squeeze(-1)
        return tokens, probs

    def dispatch_postprocess(self, global_input_tokens: torch.Tensor, global_probs: torch.Tensor):
        tokens, probs = global_input_tokens, global_probs
        if self.tp_size > 1:
            tokens = gather_from_sequence_parallel_region(
                tokens, group=self.tp_group, output_split_sizes=self.output_splits_tp
            )
            probs = gather_from_sequence_parallel_region(
                probs.unsqueeze(-1), group=self.tp_group, output_split_sizes=self.output_splits_tp
            ).squeeze(-1)
        if self.num_local_experts > 1:
            sizes = self.num_global_tokens_per_local_expert.ravel()
            tokens = sort_chunks_by_idxs(tokens, sizes, self.sort_input_by_local_experts)
            probs = sort_chunks_by_idxs(probs, sizes, self.sort_input_by_local_experts)
        return tokens, self.tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.num_local_experts > 1:
            sizes = self.num_global_tokens_per_local_expert.T.ravel()
            hidden_states = sort_chunks_by_idxs(hidden_states, sizes, self.restore_output_by_local_experts)
        if self.tp_size > 1:
            hidden_states = reduce_scatter_to_sequence_parallel_region(
                hidden_states, group=self.tp_group, input_split_sizes=self.output_splits_tp
            )
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.ep_size > 1:
            hidden_states = all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)
        return hidden_states

    def combine_postprocess(self, permutated_local_input_tokens: torch.Tensor) -> torch.Tensor:
        out = unpermute(
            permutated_local_input_tokens,
            self.reversed_local_input_permutation_mapping,
            restore_shape=self.hidden_shape_before_permute,
            routing_map=self.routing_map,
            drop_and_pad=self.drop_and_pad,
        )
        return out.view(self.hidden_shape)
