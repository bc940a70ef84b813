"""RMSNorm in one kernel, forward and backward (``torch.ops.megatron_ext.rms_norm``)."""

from __future__ import annotations

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.nn.functional.rms_norm(x, (h,), weight, eps)`` (what ``torch.nn.RMSNorm``, Megatron-core's
    local RMSNorm, runs): ``x * rsqrt(mean(x * x over the last dim) + eps) * weight``, of x's shape and dtype.

    ``weight`` has shape ``[h]`` and x's dtype. The statistics, and the product before its one rounding
    to x's dtype, are float32 for 16-bit x (float64 for float64). The backward gives x and the weight
    their gradients; the weight's is summed over every leading dim in that accumulation dtype, then
    rounded. ``x`` of any strides is read as a contiguous copy."""
    return torch.ops.megatron_ext.rms_norm(x, weight, float(eps))
