"""Quick GELU and its gated unit, gpt-oss's expert activation, with Megatron-core's names
(``megatron.core.fusions.fused_bias_geglu``): ``quick_gelu(x) = x * sigmoid(1.702 x)``, and
``quick_gelu(gate) * (up + linear_offset)`` of the halves, clamped by ``activation_func_clamp_value``
(the fused form is ``fused_bias_swiglu.bias_swiglu``'s kernel with ``alpha`` 1.702)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_ext.fusions.fused_bias_swiglu import bias_swiglu

QUICK_GELU_ALPHA = 1.702


def quick_gelu(y: torch.Tensor) -> torch.Tensor:
    """``y * sigmoid(1.702 * y)``, the sigmoid approximation of GeLU."""
    return y * torch.sigmoid(QUICK_GELU_ALPHA * y)


def quick_geglu(y: torch.Tensor, linear_offset: float = 0.0) -> torch.Tensor:
    """``quick_gelu(y1) * (y2 + linear_offset)`` of the halves of y's last dim."""
    gate, up = torch.chunk(y, 2, dim=-1)
    return quick_gelu(gate) * (up + linear_offset)


def sigmoid_gate_alpha(activation_func: Any) -> float | None:
    """``alpha`` of an activation ``x * sigmoid(alpha * x)``: 1 for ``F.silu``, 1.702 for
    ``quick_gelu`` (this module's or Megatron-core's), None for any other."""
    if activation_func is F.silu:
        return 1.0
    if activation_func is quick_gelu or (
        getattr(activation_func, "__name__", None) == "quick_gelu"
        and str(getattr(activation_func, "__module__", "")).endswith("fused_bias_geglu")
    ):
        return QUICK_GELU_ALPHA
    return None


def weighted_bias_quick_geglu_impl(
    input: torch.Tensor,
    bias: torch.Tensor | None,
    weights: torch.Tensor,
    fp8_input_store: bool = False,
    linear_offset: float = 0.0,
    clamp_value: float | None = None,
) -> torch.Tensor:
    """Megatron-core's token-weighted quick GEGLU: ``quick_geglu`` of ``input + bias`` (the halves
    clamped by ``clamp_value``) times ``weights`` [tokens, 1], in ``input``'s dtype, as one kernel
    and a product. The clamp comes after the bias, as in gpt-oss and Megatron-core's unfused path
    (Megatron-core's function here clamps before adding ``bias``). ``fp8_input_store`` raises
    NotImplementedError."""
    if fp8_input_store:
        raise NotImplementedError(
            "weighted_bias_quick_geglu_impl: fp8_input_store=True (keeping the input in float8) is not "
            "supported"
        )
    out = bias_swiglu(
        input, bias, alpha=QUICK_GELU_ALPHA, linear_offset=linear_offset, clamp_value=clamp_value
    )
    return (out * weights).to(input.dtype)
