"""Megatron-core's ``megatron.core.optimizer_param_scheduler``: the learning-rate and
weight-decay scheduler ``OptimizerParamScheduler`` that sets every parameter group's ``lr`` and
``weight_decay`` per step, and the per-parameter-group overrides ``get_megatron_optimizer``'s
``config_overrides`` hold (``ParamGroupOverride`` and its helpers)."""

from __future__ import annotations

import logging
import math
from typing import Any, TypedDict

import torch.distributed

logger = logging.getLogger(__name__)


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


def get_canonical_lr_for_logging(param_groups: list[dict]) -> float | None:
    """The ``lr`` of the first group with ``default_config`` true (those groups share one schedule;
    empty alignment groups count, the scheduler sets their ``lr`` too), or None when there is none."""
    for group in param_groups:
        if group.get("default_config", False):
            return group.get("lr")
    return None


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def _log(message: str) -> None:
    """Info on the first rank only (Megatron-core's ``log_single_rank``), so a data-parallel run
    logs each line once."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logger.info(message)


class OptimizerParamScheduler:
    """Megatron-core 0.16.1's learning-rate and weight-decay schedule, same constructor, methods,
    state dict and numbers. ``step(increment)`` advances the step count and writes every parameter
    group's ``lr`` and ``weight_decay``; the constructor writes those of step 0.

    Learning rate at step ``n`` for a group (``max_lr`` / ``min_lr``: the group's own keys when
    present, as ``get_megatron_optimizer``'s groups always carry them, else the scheduler's):

    * warmup, ``lr_warmup_steps > 0`` and ``n <= lr_warmup_steps``:
      ``init_lr + (max_lr - init_lr) * n / lr_warmup_steps``;
    * ``constant``: ``max_lr``; otherwise past ``lr_decay_steps``: ``min_lr``;
    * ``inverse-square-root``: ``max(min_lr, max_lr * sqrt(max(lr_warmup_steps, 1)) / sqrt(max(n, 1)))``;
    * else ``min_lr + coeff * (max_lr - min_lr)`` with ``r = (n - warmup) / (decay_steps - warmup)``:
      ``linear`` ``1 - r``, ``cosine`` ``(cos(pi r) + 1) / 2``; ``WSD`` 1 up to
      ``lr_decay_steps - wsd_decay_steps``, then with ``q`` the fraction of the last
      ``wsd_decay_steps`` steps gone, ``lr_wsd_decay_style`` ``linear`` ``1 - q``, ``cosine``
      ``(cos(pi q) + 1) / 2``, ``exponential`` ``2 * 0.5**q - 1``, ``minus_sqrt`` ``1 - sqrt(q)``.

    The group's ``lr`` is that times its ``lr_mult`` (default 1; Megatron-core 0.16.1's scheduler
    does not read ``lr_mult`` at all, see docs/megatron_core.md). Weight decay: ``end_wd`` past
    ``wd_incr_steps`` and for ``constant``, else ``start_wd + coeff * (end_wd - start_wd)`` with
    ``r = n / wd_incr_steps``: ``linear`` ``r``, ``cosine`` ``(cos(pi (1 - r)) + 1) / 2``
    (``start_wd`` / ``end_wd`` again per group when the group has them), times the group's
    ``wd_mult``.

    Errors: ValueError, naming the value, where Megatron-core asserts (``min_lr >= 0``,
    ``max_lr >= min_lr``, ``init_lr <= max_lr``, ``lr_decay_steps > 0``,
    ``lr_warmup_steps < lr_decay_steps``, ``wsd_decay_steps`` given for WSD, ``start_wd >= 0``,
    ``end_wd >= start_wd``, not both ``override_opt_param_scheduler`` and
    ``use_checkpoint_opt_param_scheduler``, a constant weight decay with ``start_wd == end_wd``, a
    checkpoint value equal to the class value when neither flag is set) and where it raises
    ``Exception`` (an unknown decay or increment style; ValueError is an Exception). Also
    ValueError, where Megatron-core would fail later with a TypeError / ZeroDivisionError or
    silently use a meaningless value: an unknown style checked at construction (Megatron-core
    finds it when the style is first used), ``lr_wsd_decay_style`` not one of the four for WSD,
    ``init_lr``, ``lr_warmup_steps``, ``wsd_decay_steps`` or ``wd_incr_steps`` negative,
    ``wd_incr_steps == 0`` with a linear or cosine increment, a negative ``increment``, a group
    whose ``max_lr`` (or, unless the style is constant, ``min_lr``) is None (``OptimizerConfig.lr``
    / ``min_lr`` left unset).
    """

    def __init__(
        self,
        optimizer: Any,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool | None = True,
        override_opt_param_scheduler: bool | None = False,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: str | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.num_steps = 0
        self.lr_decay_steps = lr_decay_steps
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.lr_decay_style = lr_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "OptimizerParamScheduler: override_opt_param_scheduler=True and "
                "use_checkpoint_opt_param_scheduler=True exclude each other (set one to False)"
            )
        self._check()
        self.step(0)
        _log(f"> learning rate decay style: {self.lr_decay_style}")

    def _check(self) -> None:
        """The settings' constraints, at construction and after a checkpoint replaced them."""
        def refuse(condition: bool, message: str) -> None:
            if condition:
                raise ValueError(f"OptimizerParamScheduler: {message}")

        refuse(self.init_lr < 0.0, f"init_lr={self.init_lr!r} must be >= 0")
        refuse(self.min_lr < 0.0, f"min_lr={self.min_lr!r} must be >= 0")
        refuse(self.max_lr < self.min_lr, f"max_lr={self.max_lr!r} must be >= min_lr={self.min_lr!r}")
        refuse(self.init_lr > self.max_lr, f"init_lr={self.init_lr!r} must be <= max_lr={self.max_lr!r}")
        refuse(self.lr_decay_steps <= 0, f"lr_decay_steps={self.lr_decay_steps!r} must be > 0")
        refuse(self.lr_warmup_steps < 0, f"lr_warmup_steps={self.lr_warmup_steps!r} must be >= 0")
        refuse(
            self.lr_warmup_steps >= self.lr_decay_steps,
            f"lr_warmup_steps={self.lr_warmup_steps!r} must be < lr_decay_steps={self.lr_decay_steps!r}",
        )
        refuse(
            self.lr_decay_style not in LR_DECAY_STYLES,
            f"lr_decay_style={self.lr_decay_style!r} is not one of {LR_DECAY_STYLES}",
        )
        if self.lr_decay_style == "WSD":
            refuse(
                self.wsd_decay_steps is None or self.wsd_decay_steps < 0,
                f"lr_decay_style='WSD' needs wsd_decay_steps >= 0, got {self.wsd_decay_steps!r}",
            )
            refuse(
                self.lr_wsd_decay_style not in LR_WSD_DECAY_STYLES,
                f"lr_wsd_decay_style={self.lr_wsd_decay_style!r} is not one of {LR_WSD_DECAY_STYLES}",
            )
        refuse(self.start_wd < 0.0, f"start_wd={self.start_wd!r} must be >= 0")
        refuse(self.end_wd < self.start_wd, f"end_wd={self.end_wd!r} must be >= start_wd={self.start_wd!r}")
        refuse(
            self.wd_incr_style not in WD_INCR_STYLES,
            f"wd_incr_style={self.wd_incr_style!r} is not one of {WD_INCR_STYLES}",
        )
        refuse(self.wd_incr_steps < 0, f"wd_incr_steps={self.wd_incr_steps!r} must be >= 0")
        refuse(
            self.wd_incr_style != "constant" and self.wd_incr_steps == 0,
            f"wd_incr_style={self.wd_incr_style!r} needs wd_incr_steps > 0, got 0",
        )

    def get_wd(self, param_group: dict | None = None) -> float:
        """The weight decay at the current step, before the group's ``wd_mult`` (the group's own
        ``start_wd`` / ``end_wd`` when it has them)."""
        start_wd, end_wd = self.start_wd, self.end_wd
        if param_group is not None:
            start_wd = param_group.get("start_wd", start_wd)
            end_wd = param_group.get("end_wd", end_wd)
        if self.num_steps > self.wd_incr_steps:
            return end_wd
        if self.wd_incr_style == "constant":
            if start_wd != end_wd:
                raise ValueError(
                    f"OptimizerParamScheduler: wd_incr_style='constant' needs start_wd == end_wd, "
                    f"got start_wd={start_wd!r} and end_wd={end_wd!r}"
                )
            return end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        elif self.wd_incr_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        else:
            raise ValueError(
                f"OptimizerParamScheduler: wd_incr_style={self.wd_incr_style!r} is not supported"
            )
        return start_wd + coeff * (end_wd - start_wd)

    def get_lr(self, param_group: dict) -> float:
        """The group's learning rate at the current step, before its ``lr_mult`` (the formulas of
        the class docstring, from https://openreview.net/pdf?id=BJYwwY9ll p. 4 for cosine)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        if max_lr is None or (min_lr is None and self.lr_decay_style != "constant"):
            raise ValueError(
                f"OptimizerParamScheduler: a parameter group has max_lr={max_lr!r}, min_lr={min_lr!r}; "
                f"lr_decay_style={self.lr_decay_style!r} needs numbers (set OptimizerConfig.lr and "
                "min_lr, which get_megatron_optimizer copies into its groups, or the group's keys)"
            )
        steps = self.num_steps
        warmup = self.lr_warmup_steps
        if warmup > 0 and steps <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * float(steps) / float(warmup)
        style = self.lr_decay_style
        if style == "constant":
            return max_lr
        if steps > self.lr_decay_steps:
            return min_lr
        if style == "inverse-square-root":
            return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / (max(steps, 1) ** 0.5))
        ratio = float(steps - warmup) / float(self.lr_decay_steps - warmup)
        if style == "linear":
            coeff = 1.0 - ratio
        elif style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        elif style == "WSD":
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            coeff = 1.0 if steps <= anneal_start else self._wsd_coeff(
                float(steps - anneal_start) / float(self.wsd_decay_steps)
            )
        else:
            raise ValueError(f"OptimizerParamScheduler: lr_decay_style={style!r} is not supported")
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, ratio: float) -> float:
        style = self.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - ratio
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        if style == "minus_sqrt":
            return 1.0 - math.sqrt(ratio)
        raise ValueError(f"OptimizerParamScheduler: lr_wsd_decay_style={style!r} is not supported")

    def step(self, increment: int) -> None:
        """Advances ``increment`` steps (Megatron-LM: the global batch size, one iteration's
        samples) and writes every group's ``lr`` and ``weight_decay``, the empty groups' too
        (``get_canonical_lr_for_logging`` reads them)."""
        if increment < 0:
            raise ValueError(f"OptimizerParamScheduler.step: increment={increment!r} must be >= 0")
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        """Megatron-core's keys: the schedule's settings and ``num_steps``."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value: Any, sd_value: Any, name: str) -> Any:
        """The value to use for ``name``: the class value under ``override_opt_param_scheduler``,
        else the checkpoint's (ValueError when they differ and ``use_checkpoint_opt_param_scheduler``
        is off)."""
        if self.override_opt_param_scheduler:
            _log(f" > overriding {name} value to {cls_value}")
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(
                f"OptimizerParamScheduler: class input value {cls_value!r} and checkpoint value "
                f"{sd_value!r} for {name} do not match (set use_checkpoint_opt_param_scheduler or "
                "override_opt_param_scheduler to pick one)"
            )
        _log(f" > using checkpoint value {sd_value} for {name}")
        return sd_value

    def load_state_dict(self, state_dict: dict) -> None:
        """Takes the settings and the step count of ``state_dict`` (``state_dict()``'s, or the
        older key names Megatron-core reads: ``start_lr``, ``warmup_iter`` / ``warmup_steps``,
        ``end_iter`` / ``decay_steps``, ``decay_style``, ``num_iters``; a checkpoint without
        ``start_wd`` keeps the class's weight-decay settings), then writes the groups' ``lr`` and
        ``weight_decay`` of that step. Differs from Megatron-core 0.16.1 in two cases it never meets
        on a freshly built scheduler with the checkpoint's settings (Megatron-LM's resume): the
        step count becomes the checkpoint's (Megatron-core adds it to the count so far), and the
        weight decay written is that of the loaded settings (Megatron-core writes it with the
        class's ``start_wd`` / ``end_wd`` / ``wd_incr_*``, loaded only after, until the next
        ``step``)."""

        def first(*keys: str) -> Any:
            return next(state_dict[k] for k in keys if k in state_dict)

        self.max_lr = self._check_and_set(self.max_lr, first("start_lr", "max_lr"), "learning rate")
        self.min_lr = self._check_and_set(self.min_lr, state_dict["min_lr"], "minimum learning rate")
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps, first("warmup_iter", "warmup_steps", "lr_warmup_steps"), "warmup iterations"
        )
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps,
            first("end_iter", "decay_steps", "lr_decay_steps"),
            "total number of iterations",
        )
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style, first("decay_style", "lr_decay_style"), "learning rate decay style"
        )
        num_steps = first("num_iters", "num_steps")
        if "start_wd" in state_dict:
            self.start_wd = self._check_and_set(self.start_wd, state_dict["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, state_dict["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(
                self.wd_incr_steps, state_dict["wd_incr_steps"], "total number of weight decay iterations"
            )
            self.wd_incr_style = self._check_and_set(
                self.wd_incr_style, state_dict["wd_incr_style"], "weight decay incr style"
            )
        self._check()
        if num_steps < 0:
            raise ValueError(f"OptimizerParamScheduler.load_state_dict: num_steps={num_steps!r} must be >= 0")
        self.num_steps = 0
        self.step(num_steps)
