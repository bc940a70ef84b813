"""Linear-recurrence layers (Megatron-core's ``megatron.core.ssm``)."""

from megatron_ext.ssm.gated_delta_net import GatedDeltaNet
from megatron_ext.ssm.mamba_hybrid_layer_allocation import (
    Symbols,
    allocate_layers,
    get_layer_indices_for_pipeline_stage,
    get_layer_maps_from_layer_type_list,
)
from megatron_ext.ssm.mamba_layer import MambaLayer
from megatron_ext.ssm.mamba_mixer import MambaMixer

__all__ = [
    "GatedDeltaNet",
    "MambaLayer",
    "MambaMixer",
    "Symbols",
    "allocate_layers",
    "get_layer_indices_for_pipeline_stage",
    "get_layer_maps_from_layer_type_list",
]
