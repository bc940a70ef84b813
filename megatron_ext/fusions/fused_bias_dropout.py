"""``residual + dropout(x + bias)`` in one kernel, forward and backward.

The fused op draws its dropout mask from a Philox stream seeded from the device's default
generator (the generator the RNG tracker forks and activation checkpointing replays), so a
recomputed forward drops the same elements. Its masks differ from ``torch.nn.functional.dropout``'s
for the same generator state; the unfused path keeps torch's.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)

XWithBias = tuple[torch.Tensor, torch.Tensor | None]


def _bias_dropout_add_func(x_with_bias: XWithBias, residual: torch.Tensor, prob: float, training: bool):
    x, bias = x_with_bias
    residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)
    if bias is not None:
        x = x + bias
    return residual + torch.nn.functional.dropout(x, p=prob, training=training)


def _fused(x_with_bias: XWithBias, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    x, bias = x_with_bias
    # Mixed precision may hand an fp32 residual to a 16-bit branch: the output keeps x's dtype.
    residual = residual if residual.dtype == x.dtype else residual.to(x.dtype)
    return torch.ops.megatron_ext.bias_dropout_add(x, bias, residual, float(prob), bool(training))


def bias_dropout_add_unfused(training: bool) -> Callable[[XWithBias, torch.Tensor, float], torch.Tensor]:
    def _bias_dropout_add(x_with_bias: XWithBias, residual: torch.Tensor, prob: float) -> torch.Tensor:
        return _bias_dropout_add_func(x_with_bias, residual, prob, training)

    return _bias_dropout_add


def bias_dropout_add_fused_train(x_with_bias: XWithBias, residual: torch.Tensor, prob: float) -> torch.Tensor:
    return _fused(x_with_bias, residual, prob, True)


def bias_dropout_add_fused_inference(
    x_with_bias: XWithBias, residual: torch.Tensor, prob: float
) -> torch.Tensor:
    return _fused(x_with_bias, residual, prob, False)


def get_bias_dropout_add(
    training: bool, fused: bool
) -> Callable[[XWithBias, torch.Tensor, float], torch.Tensor]:
    """Megatron-core's selector: ``f((x, bias), residual, prob)``."""
    if not fused:
        return bias_dropout_add_unfused(training)
    return bias_dropout_add_fused_train if training else bias_dropout_add_fused_inference
