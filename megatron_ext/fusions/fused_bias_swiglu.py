"""SwiGLU (bias optional) in one kernel, forward and backward (``torch.ops.megatron_ext.swiglu``), with
Megatron-core's names (``megatron.core.fusions.fused_bias_swiglu``). The same kernel computes the
gated sigmoid units around it: ``gate * sigmoid(alpha * gate) * (up + linear_offset)`` with the
halves clamped (gpt-oss's experts: quick GELU, ``alpha`` 1.702, see ``fused_bias_geglu``)."""

from __future__ import annotations

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)


def bias_swiglu(
    y: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    alpha: float = 1.0,
    linear_offset: float = 0.0,
    clamp_value: float | None = None,
) -> torch.Tensor:
    """``F.silu(gate) * up`` with ``(gate, up) = torch.chunk(y + bias, 2, -1)``: ``y`` [..., 2f] (and
    ``bias`` [2f], optional, of y's dtype) give [..., f]. Computed in float32 for 16-bit y (float64 for
    float64) and rounded once. The backward gives y its gradient [..., 2f] and the bias the sum of
    that gradient over every leading dim. ``y`` of any strides is read as a contiguous copy.

    In general ``g * sigmoid(alpha * g) * (u + linear_offset)`` with ``g = gate.clamp(max=c)`` and
    ``u = up.clamp(-c, c)`` for ``clamp_value`` c (positive and finite; None: no clamp), the clamp
    after the bias; a clamped value's gradient is 0, at the bounds too (as torch 2.14's clamp)."""
    return torch.ops.megatron_ext.swiglu(y, bias, alpha, linear_offset, clamp_value)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``bias_swiglu(y, None)``: ``F.silu(y1) * y2`` of the halves of y's last dim."""
    return torch.ops.megatron_ext.swiglu(y, None)


def bias_swiglu_impl(
    input: torch.Tensor,
    bias: torch.Tensor | None,
    fp8_input_store: bool = False,
    cpu_offload_input: bool = False,
) -> torch.Tensor:
    """Megatron-core's ``bias_swiglu_impl``: ``bias_swiglu(input, bias)`` (for inputs of any rank, not
    only 2 or 3). Keeping the input for backward in float8 and marking it for CPU offloading are not
    supported: either flag set raises NotImplementedError."""
    if fp8_input_store:
        raise NotImplementedError(
            "bias_swiglu_impl: fp8_input_store=True (keeping the input in float8) is not supported"
        )
    if cpu_offload_input:
        raise NotImplementedError(
            "bias_swiglu_impl: cpu_offload_input=True (activation offloading) is not supported"
        )
    return bias_swiglu(input, bias)
