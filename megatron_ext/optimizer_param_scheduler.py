"""Per-parameter-group overrides of the optimizer settings (Megatron-core's
``megatron.core.optimizer_param_scheduler`` names used by ``get_megatron_optimizer``'s
``config_overrides``). The learning-rate scheduler itself belongs to the training loop."""

from __future__ import annotations

from typing import Any, TypedDict


class ParamGroupOverride(TypedDict, total=False):
    """Values a parameter group takes instead of the config's: ``max_lr`` / ``min_lr`` (the
    learning-rate range of the group), ``start_wd`` / ``end_wd``, ``wd_mult`` (weight decay is
    ``weight_decay * wd_mult``), ``lr_mult``; other keys are kept in the group as given."""

    max_lr: float
    min_lr: float
    start_wd: float
    end_wd: float
    wd_mult: float


def param_group_override_to_tuple(param_group_override: ParamGroupOverride | None) -> tuple | None:
    """The override as a sorted tuple of (key, value): hashable, and equal for equal overrides
    whatever their key order."""
    if param_group_override is None:
        return None
    return tuple(sorted(param_group_override.items()))


def combine_param_group_overrides(
    param_group_overrides: list[ParamGroupOverride | None],
) -> ParamGroupOverride:
    """The union of several overrides matching one parameter; ValueError when two give a key
    different values."""
    combined: dict[str, Any] = {}
    for override in param_group_overrides:
        for key, value in (override or {}).items():
            if key in combined and combined[key] != value:
                raise ValueError(
                    f"conflicting overrides for one parameter: {key}={combined[key]!r} and {key}={value!r}"
                )
            combined[key] = value
    return ParamGroupOverride(**combined)
