"""Parameter groups from per-parameter overrides (Megatron-core's ``_get_param_groups``,
``get_standard_config_overrides`` and ``check_config_overrides_consistency``).

``config_overrides`` maps ``ParamKey`` s to ``ParamGroupOverride`` s. Every parameter takes the
union of the overrides whose keys match it; parameters with equal unions share a group. Groups are
aligned over all ranks (a rank holds every group some rank has, possibly empty), ordered with the
group without override first and the others by their sorted overrides, and carry
``wd_mult`` / ``lr_mult`` = 1, ``is_decoupled_lr`` = False, ``max_lr`` = ``config.lr``,
``min_lr`` = ``config.min_lr``, ``is_expert_parallel`` and ``default_config`` (no learning-rate
override), then the override's own values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed

from megatron_ext.optimizer.optimizer_config import (
    OptimizerConfig,
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
)
from megatron_ext.optimizer_param_scheduler import (
    ParamGroupOverride,
    combine_param_group_overrides,
    param_group_override_to_tuple,
)


def get_standard_config_overrides(config: OptimizerConfig) -> dict[ParamKey, ParamGroupOverride]:
    """Megatron's default: no weight decay on biases and 1-D parameters (with
    ``apply_wd_to_qk_layernorm``, except the q/k LayerNorms'), and with ``decoupled_lr`` that
    learning rate (and ``decoupled_min_lr``) for parameters marked ``is_embedding_or_output_parameter``."""
    overrides: dict[ParamKey, ParamGroupOverride] = {}
    if config.apply_wd_to_qk_layernorm:
        no_decay = ParamKey(
            with_name_predicate=ParamWithNamePredicate(
                name="s1_not_qkln",
                fn=lambda param, name: (
                    (len(param.shape) == 1 or name.endswith(".bias"))
                    and not ("q_layernorm." in name or "k_layernorm." in name)
                ),
            )
        )
    else:
        no_decay = ParamKey(
            name="*.bias",
            predicate=ParamPredicate(name="param_len_1", fn=lambda param: len(param.shape) == 1),
        )
    overrides[no_decay] = ParamGroupOverride(wd_mult=0.0)
    if config.decoupled_lr is not None:
        decoupled = ParamGroupOverride(max_lr=config.decoupled_lr)
        if config.decoupled_min_lr is not None:
            decoupled["min_lr"] = config.decoupled_min_lr
        overrides[ParamKey(attr="is_embedding_or_output_parameter")] = decoupled
    return overrides


def check_config_overrides_consistency(
    config: OptimizerConfig, config_overrides: dict[ParamKey, ParamGroupOverride] | None
) -> bool:
    """Overrides may not change ``optimizer``, ``optimizer_cpu_offload`` or
    ``overlap_param_gather_with_optimizer_step`` (one optimizer serves every group): ValueError."""
    for override in (config_overrides or {}).values():
        for name in ("overlap_param_gather_with_optimizer_step", "optimizer", "optimizer_cpu_offload"):
            if name in override and override[name] != getattr(config, name, None):
                raise ValueError(f"Field {name} should not be overriden in a config override.")
    return True


def _get_param_groups(
    model_chunks: list[torch.nn.Module],
    config: OptimizerConfig,
    config_overrides: dict[ParamKey, ParamGroupOverride] | None,
) -> list[dict[str, Any]]:
    """The parameter groups (dicts with ``params`` and the settings above) of the trainable
    parameters of ``model_chunks``. ``config_overrides=None`` means the standard overrides
    (``get_standard_config_overrides``); ``{}`` means none. Gathers the group keys of every rank
    (a collective over the world when torch.distributed is initialized with several ranks)."""
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    params_by_key: dict[tuple, list[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            matched = [override for key, override in config_overrides.items() if key.matches(param, name)]
            combined = combine_param_group_overrides(matched) if matched else None
            key = (param_group_override_to_tuple(combined), not getattr(param, "allreduce", True))
            params_by_key.setdefault(key, []).append(param)

    keys = list(params_by_key)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, keys)
        for rank_keys in gathered:
            for key in rank_keys:
                if key not in keys:
                    keys.append(key)

    groups = []
    for key in sorted(keys, key=lambda k: (k[0] is not None, k[0] or ())):
        override_tuple, is_expert_parallel = key
        override = dict(override_tuple or ())
        if "params" in override:
            raise ValueError("'params' is a protected key and cannot be overridden")
        groups.append(
            {
                "params": params_by_key.get(key, []),
                "is_expert_parallel": is_expert_parallel,
                "default_config": not any("lr" in k for k in override),
                "wd_mult": 1.0,
                "lr_mult": 1.0,
                "is_decoupled_lr": False,
                "max_lr": config.lr,
                "min_lr": config.min_lr,
                **override,
            }
        )
    return groups
