"""Fused epilogues of the transformer layer, as C++/CUDA ops (``torch.ops.megatron_ext``)."""

from megatron_ext.fusions.fused_bias_dropout import (
    bias_dropout_add_fused_inference,
    bias_dropout_add_fused_train,
    bias_dropout_add_unfused,
    get_bias_dropout_add,
)
from megatron_ext.fusions.fused_bias_gelu import bias_gelu, bias_gelu_impl

__all__ = [
    "bias_dropout_add_fused_inference",
    "bias_dropout_add_fused_train",
    "bias_dropout_add_unfused",
    "bias_gelu",
    "bias_gelu_impl",
    "get_bias_dropout_add",
]
