"""Auxiliary losses that join the backward of the main loss without being added to it (the
mixture-of-experts balance and z losses): the schedules set the factor their gradient carries,
the one the main loss's gradient carries (loss scale / micro-batches)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)


class MoEAuxLossAutoScaler:
    """Megatron-core's class: ``apply(output, aux_loss)`` returns ``output`` unchanged, and its
    backward also gives ``aux_loss`` the gradient ``main_loss_backward_scale`` (1 unless set), so the
    auxiliary loss joins the backward of the main loss without being added to it. The node is C++
    (the ``moe_aux_loss_scaler`` op); the scale is read when the backward runs."""

    main_loss_backward_scale: torch.Tensor | None = None

    @staticmethod
    def apply(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            scale = torch.tensor(1.0, device=aux_loss.device)
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale
        return torch.ops.megatron_ext.moe_aux_loss_scaler(output, aux_loss, scale)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """The factor the main loss's gradient carries (1 / micro-batches, a loss scale...)."""
        if MoEAuxLossAutoScaler.main_loss_backward_scale is None:
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale
        else:
            MoEAuxLossAutoScaler.main_loss_backward_scale.copy_(scale)


def set_aux_loss_scale(config: Any, num_microbatches: int) -> None:
    """For a mixture-of-experts model (``config.num_moe_experts``): the auxiliary losses' gradient
    scale, ``grad_scale_func(1)`` (the loss scale, 1 without one) over ``num_microbatches`` (not
    divided under ``calculate_per_token_loss``), as Megatron-core's schedules set it."""
    if getattr(config, "num_moe_experts", None) is None:
        return
    one = torch.ones(1, dtype=torch.float64)
    grad_scale_func = getattr(config, "grad_scale_func", None)
    scale = grad_scale_func(one) if grad_scale_func is not None else one
    if not getattr(config, "calculate_per_token_loss", False):
        scale = scale / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(scale.reshape(()).detach().clone())
