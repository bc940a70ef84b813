"""The mixture-of-experts layer (Megatron-core's ``MoELayer``): route, dispatch, run the local
experts, combine, and add the shared experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_ext import tensor_parallel
from megatron_ext.resolve import group_rank, group_size
from megatron_ext.transformer.transformer_config import MOE_DISPATCHERS, check_moe_config
from megatron_ext.tensor_parallel.sharded_state import module_sharded_state_dict, renamed_sharded_state_dict
from megatron_ext.transformer.mlp import MLP_KEYS
from megatron_ext.transformer.moe.experts import GroupedMLP, SequentialMLP, experts_sharded_state_dict
from megatron_ext.transformer.moe.router import TopKRouter, moe_process_groups
from megatron_ext.transformer.moe.shared_experts import SharedExpertMLP
from megatron_ext.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron_ext.transformer.utils import selectively_recomputed

DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}
assert tuple(DISPATCHERS) == MOE_DISPATCHERS


@dataclass
class MoESubmodules:
    """The classes the layer builds (None: ``SequentialMLP`` or ``GroupedMLP`` by
    ``moe_grouped_gemm``, ``SharedExpertMLP``)."""

    experts: Any = None
    shared_experts: Any = None


class MoELayer(torch.nn.Module):
    """``forward(hidden_states [s, b, h], padding_mask=None) -> (output [s, b, h], None)``;
    ``padding_mask`` [b, s] (True at padding, Megatron-core's layout) keeps the padding tokens out
    of the router's losses and counts.

    Experts are split over the expert-parallel group (rank r holds experts
    ``r * E/ep .. (r+1) * E/ep - 1``) and each expert's ffn over the expert-tensor-parallel group;
    attention's tensor, context and data parallelism fold into the expert groups as
    ``parallel_state`` lays them out. With tensor parallelism, training needs sequence parallelism
    (the tokens of each rank are then its own), as in Megatron-core."""

    def __init__(
        self,
        config: Any,
        submodules: MoESubmodules | None = None,
        layer_number: int | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        check_moe_config(config)
        self.config = config
        self.submodules = submodules or MoESubmodules()
        groups = moe_process_groups(pg_collection)
        self.tp_group = getattr(groups, "tp", None)
        ep_group = getattr(groups, "ep", None)
        ep = group_size(ep_group)
        if config.num_moe_experts % ep:
            raise ValueError(
                f"num_moe_experts ({config.num_moe_experts}) must be divisible by the expert-parallel "
                f"size ({ep})"
            )
        self.expert_parallel_size = ep
        self.num_local_experts = config.num_moe_experts // ep
        first = group_rank(ep_group) * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.layer_number = layer_number
        self.router = TopKRouter(config=config, pg_collection=groups)
        self.router.set_layer_number(layer_number)
        self.token_dispatcher = DISPATCHERS[config.moe_token_dispatcher_type](
            self.num_local_experts, self.local_expert_indices, config=config, pg_collection=groups
        )
        experts_cls = self.submodules.experts or (GroupedMLP if config.moe_grouped_gemm else SequentialMLP)
        self.experts = experts_cls(self.num_local_experts, config, pg_collection=groups)
        self.use_shared_expert = config.moe_shared_expert_intermediate_size is not None
        self.shared_experts = None
        if self.use_shared_expert:
            shared_cls = self.submodules.shared_experts or SharedExpertMLP
            self.shared_experts = shared_cls(
                config, gate=bool(config.moe_shared_expert_gate), pg_collection=groups
            )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron-core's keys: ``router.weight`` (and ``bias``, ``expert_bias``) replicated,
        ``shared_experts.linear_fc1/2.*`` split like the MLP, the routed experts by global index
        (``experts.linear_fc1.weight`` ..., see ``experts_sharded_state_dict``)."""
        out = module_sharded_state_dict(
            self, prefix, sharded_offsets, skip=("experts", "shared_experts"), metadata=metadata
        )
        if self.shared_experts is not None:
            out.update(
                renamed_sharded_state_dict(
                    self.shared_experts, f"{prefix}shared_experts.", sharded_offsets, MLP_KEYS, metadata
                )
            )
        out.update(experts_sharded_state_dict(self.experts, f"{prefix}experts.", sharded_offsets, metadata))
        return out

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    def forward(
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        if self.training and group_size(self.tp_group) > 1 and not self.config.sequence_parallel:
            raise ValueError(
                "MoELayer: training with tensor_model_parallel_size > 1 needs sequence_parallel=True"
            )
        if padding_mask is not None:  # [b, s] as GPTModel passes it, to the tokens' [s, b]
            if padding_mask.dim() != 2 or tuple(padding_mask.shape[::-1]) != tuple(hidden_states.shape[:2]):
                raise ValueError(
                    f"MoELayer: padding_mask must be [batch, seq] = {tuple(hidden_states.shape[1::-1])} "
                    f"for hidden_states {tuple(hidden_states.shape)}, got {tuple(padding_mask.shape)}"
                )
            padding_mask = padding_mask.transpose(0, 1).bool()
        if self.training and selectively_recomputed(self.config, "moe"):
            # Only the input is kept; the router's losses and token counts are taken in the
            # recomputation (they need gradients), as in Megatron-core.
            return tensor_parallel.checkpoint(self._forward, False, hidden_states, padding_mask), None
        return self._forward(hidden_states, padding_mask), None

    def _forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        dispatcher = self.token_dispatcher
        shared = None
        if self.shared_experts is not None:
            if self.training and selectively_recomputed(self.config, "shared_experts"):
                shared = tensor_parallel.checkpoint(self.shared_experts, False, hidden_states)
            else:
                shared = self.shared_experts(hidden_states)
        probs, routing_map = self.router(hidden_states, padding_mask)
        tokens, probs = dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)
        tokens, probs = dispatcher.token_dispatch(tokens, probs)
        tokens, tokens_per_expert, probs = dispatcher.dispatch_postprocess(tokens, probs)
        expert_output, _ = self.experts(tokens, tokens_per_expert, probs)
        output = dispatcher.combine_postprocess(
            dispatcher.token_combine(dispatcher.combine_preprocess(expert_output))
        )
        if shared is not None:
            output = output + shared
        return output
