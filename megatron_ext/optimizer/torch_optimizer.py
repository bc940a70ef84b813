"""The torch optimizer inside Megatron-core's wrappers: built over the main parameters with
Megatron-core's per-group learning rate and weight decay (fused Adam on CUDA), its state's names
and step counters, and the copy of the updated main parameters back into the model."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext.optimizer.optimizer_config import OptimizerConfig
from megatron_ext.optimizer.parameters import _Slot


def _state_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return ("exp_avg", "exp_avg_sq")
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",)
    raise TypeError(f"unsupported torch optimizer {type(optimizer).__name__}")


def _scalar_step(value: int, like: torch.Tensor | None = None, fused: bool = False) -> torch.Tensor:
    # The dtype torch's Adam gives its step counters; the fused Adam keeps them on the
    # parameter's device (float32), the others on the host.
    if fused and like is not None:
        return torch.tensor(float(value), dtype=torch.float32, device=like.device)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(float(value), dtype=dtype)


def copy_into_model_params(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies each main parameter into its (16-bit) model parameter piece (flat views, made
    under ``torch.no_grad()``): one multi-tensor copy per (device, dtype) pair, not a kernel
    launch per parameter."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for model, main in pairs:
        key = (model.device, model.dtype, main.dtype)
        targets, sources = groups.setdefault(key, ([], []))
        targets.append(model)
        sources.append(main.detach().view(-1))
    for targets, sources in groups.values():
        torch._foreach_copy_(targets, sources)


def _fused_available(slots: list[_Slot]) -> bool:
    """torch's fused Adam (one kernel launch for many tensors) on CUDA; on the host the
    multi-tensor (foreach) implementation, torch's default, keeps the float64 tests exact."""
    return bool(slots) and all(s.main.is_cuda and s.main.is_floating_point() for s in slots)


def build_torch_optimizer(
    config: OptimizerConfig, slots: list[_Slot], param_groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """The torch optimizer over the slots' main parameters, one torch group per entry of
    ``param_groups`` (``_get_param_groups``' output: every group kept, empty ones too, so all
    ranks have the same groups) holding the main parameters of its model parameters, with
    ``weight_decay = config.weight_decay * wd_mult`` and ``lr = max_lr * lr_mult`` (``max_lr``
    defaults to ``config.lr``; a learning-rate scheduler sets both per step from the group's
    values, as Megatron-core's does). Without ``config.lr`` a group's learning rate is None until
    something sets it; ``step()`` refuses to run before."""
    group_of = {p: i for i, group in enumerate(param_groups) for p in group["params"]}
    mains: list[list[torch.Tensor]] = [[] for _ in param_groups]
    for s in slots:
        mains[group_of[s.model_param]].append(s.main)
    groups = []
    for group, params in zip(param_groups, mains):
        settings = {k: v for k, v in group.items() if k != "params"}
        max_lr = group.get("max_lr")
        lr = config.lr if max_lr is None else max_lr
        settings["lr"] = None if lr is None else lr * group.get("lr_mult", 1.0)
        settings["weight_decay"] = config.weight_decay * group.get("wd_mult", 1.0)
        groups.append({**settings, "params": params})
    if not groups:
        # A rank without trainable parameters: a placeholder keeps the API uniform.
        groups = [{"params": [], "weight_decay": 0.0, "wd_mult": 0.0, "lr": config.lr}]
    default_lr = 0.0 if config.lr is None else config.lr  # every group sets its own
    if config.optimizer == "adam":
        cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        fused = {"fused": True} if _fused_available(slots) else {}
        return cls(groups, lr=default_lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                   **fused)
    return torch.optim.SGD(groups, lr=default_lr, momentum=config.sgd_momentum)
