"""The parallel transformer: attention, MLP, layer and the per-stage stack."""

from megatron_ext.transformer.attention import ParallelAttention
from megatron_ext.transformer.mlp import ParallelMLP
from megatron_ext.transformer.transformer_block import ParallelTransformer
from megatron_ext.transformer.transformer_config import (
    TransformerConfig,
    init_method_normal,
    scaled_init_method_normal,
)
from megatron_ext.transformer.transformer_layer import ParallelTransformerLayer

__all__ = [
    "ParallelAttention",
    "ParallelMLP",
    "ParallelTransformer",
    "ParallelTransformerLayer",
    "TransformerConfig",
    "init_method_normal",
    "scaled_init_method_normal",
]
