"""Auxiliary losses that join the backward of the main loss without being added to it (the
mixture-of-experts balance and z losses, the multi-token-prediction loss): the schedules set the
factor their gradient carries, the one the main loss's gradient carries."""

from __future__ import annotations

import sys
from typing import Any

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)


class MoEAuxLossAutoScaler:
    """Megatron-core's class: ``apply(output, aux_loss)`` returns ``output`` unchanged, and its
    backward also gives ``aux_loss`` the gradient ``main_loss_backward_scale`` (1 unless set), so the
    auxiliary loss joins the backward of the main loss without being added to it. The node is C++
    (the ``moe_aux_loss_scaler`` op); the scale is read when the backward runs."""

    main_loss_backward_scale: torch.Tensor | None = None

    @classmethod
    def apply(cls, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        scale = cls.main_loss_backward_scale
        if scale is None:
            scale = torch.tensor(1.0, device=aux_loss.device)
            cls.main_loss_backward_scale = scale
        return torch.ops.megatron_ext.moe_aux_loss_scaler(output, aux_loss, scale)

    @classmethod
    def set_loss_scale(cls, scale: torch.Tensor) -> None:
        """The factor the main loss's gradient carries (1 / micro-batches, a loss scale...)."""
        if cls.main_loss_backward_scale is None:
            cls.main_loss_backward_scale = scale
        else:
            cls.main_loss_backward_scale.copy_(scale)


# The classes whose scale the schedules set: (module, class name, the config field that says the
# model has such losses). Megatron-core's own are set when its modules are loaded (its MoE router
# or MTP block on megatron_ext's schedules); nothing here imports them.
_AUX_LOSS_SCALERS = (
    ("megatron_ext.pipeline_parallel.aux_loss", "MoEAuxLossAutoScaler", "num_moe_experts"),
    ("megatron.core.transformer.moe.moe_utils", "MoEAuxLossAutoScaler", "num_moe_experts"),
    ("megatron_ext.transformer.multi_token_prediction", "MTPLossAutoScaler", "mtp_num_layers"),
    ("megatron.core.transformer.multi_token_prediction", "MTPLossAutoScaler", "mtp_num_layers"),
)


def set_aux_loss_scale(config: Any, num_microbatches: int, cp_group_size: int = 1) -> None:
    """The gradient scale of the auxiliary losses, as Megatron-core's ``forward_step_calc_loss``
    sets it: ``grad_scale_func(1)`` (the loss scale, 1 without one), over ``num_microbatches``
    unless ``calculate_per_token_loss``; the MoE losses also times ``cp_group_size`` (each
    context-parallel rank's share of a loss over the whole sequence, whose gradient the
    data-parallel average over dp x cp divides by cp, as it does the main loss's). Set on
    megatron_ext's autoscalers and on Megatron-core's when its modules are loaded, for the models
    with such losses (``config.num_moe_experts``, ``config.mtp_num_layers``)."""
    one = torch.ones(1, dtype=torch.float64)
    grad_scale_func = getattr(config, "grad_scale_func", None)
    base = (grad_scale_func(one) if grad_scale_func is not None else one).reshape(()).detach()
    per_token = getattr(config, "calculate_per_token_loss", False)
    for module_name, class_name, field in _AUX_LOSS_SCALERS:
        module = sys.modules.get(module_name)
        if module is None or getattr(config, field, None) is None:
            continue
        scale = base
        if not per_token:
            scale = scale * (cp_group_size if field == "num_moe_experts" else 1) / num_microbatches
        getattr(module, class_name).set_loss_scale(scale.clone())
