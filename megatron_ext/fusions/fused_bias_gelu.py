"""GeLU(input + bias) in one kernel, forward and backward (``torch.ops.megatron_ext.bias_gelu``)."""

from __future__ import annotations

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)


def bias_gelu(input: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``torch.nn.functional.gelu(input + bias, approximate=approximate)``, fused; ``bias`` has the
    shape of the input's last dim. ``approximate`` is ``"none"`` (erf) or ``"tanh"``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return torch.ops.megatron_ext.bias_gelu(input, bias, approximate == "tanh")


def bias_gelu_impl(input: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Megatron-core's ``bias_gelu_impl``: the tanh approximation of GeLU(input + bias)."""
    return bias_gelu(input, bias, "tanh")
