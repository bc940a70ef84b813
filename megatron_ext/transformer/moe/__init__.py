"""Mixture of experts."""

from megatron_ext.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron_ext.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron_ext.transformer.moe.router import TopKRouter
from megatron_ext.transformer.moe.shared_experts import SharedExpertMLP
from megatron_ext.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
    MoETokenDispatcher,
)

__all__ = [
    "GroupedMLP",
    "MoEAllGatherTokenDispatcher",
    "MoEAlltoAllTokenDispatcher",
    "MoELayer",
    "MoESubmodules",
    "MoETokenDispatcher",
    "SequentialMLP",
    "SharedExpertMLP",
    "TopKRouter",
]
