"""Fused kernels of the transformer layer, as C++/CUDA ops (``torch.ops.megatron_ext``)."""

from megatron_ext.fusions.causal_conv1d import causal_conv1d_fn
from megatron_ext.fusions.fused_bias_dropout import (
    bias_dropout_add_fused_inference,
    bias_dropout_add_fused_train,
    bias_dropout_add_unfused,
    get_bias_dropout_add,
)
from megatron_ext.fusions.fused_bias_geglu import quick_gelu, quick_geglu, weighted_bias_quick_geglu_impl
from megatron_ext.fusions.fused_bias_gelu import bias_gelu, bias_gelu_impl
from megatron_ext.fusions.fused_bias_swiglu import bias_swiglu, bias_swiglu_impl, swiglu
from megatron_ext.fusions.fused_rms_norm import fused_rms_norm
from megatron_ext.fusions.fused_rope import fused_apply_rotary_pos_emb
from megatron_ext.fusions.gated_delta_rule import chunk_gated_delta_rule
from megatron_ext.fusions.gated_rms_norm import rms_norm_gated
from megatron_ext.fusions.mamba_ssd import mamba_chunk_scan_combined

__all__ = [
    "bias_dropout_add_fused_inference",
    "bias_dropout_add_fused_train",
    "bias_dropout_add_unfused",
    "bias_gelu",
    "bias_gelu_impl",
    "bias_swiglu",
    "bias_swiglu_impl",
    "causal_conv1d_fn",
    "chunk_gated_delta_rule",
    "fused_apply_rotary_pos_emb",
    "fused_rms_norm",
    "get_bias_dropout_add",
    "mamba_chunk_scan_combined",
    "quick_geglu",
    "quick_gelu",
    "rms_norm_gated",
    "swiglu",
    "weighted_bias_quick_geglu_impl",
]
