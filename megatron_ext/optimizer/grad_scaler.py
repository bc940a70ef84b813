"""Loss scalers for fp16 training, named as Megatron-core's (``megatron.core.optimizer.grad_scaler``)."""

from __future__ import annotations

from typing import Any

import torch


class MegatronGradScaler:
    """The loss is multiplied by ``scale`` before the backward; the optimizer divides the
    gradients by it (``inv_scale``) and tells the scaler whether any was inf/NaN (``update``)."""

    def __init__(self, initial_scale: float) -> None:
        if not initial_scale > 0.0:
            raise ValueError(f"initial loss scale must be > 0, got {initial_scale!r}")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (``OptimizerConfig.loss_scale``)."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron-core's dynamic loss scale: after ``hysteresis`` steps with inf/NaN gradients in a
    row the scale is multiplied by ``backoff_factor`` (not below ``min_scale``); after
    ``growth_interval`` clean steps in a row it is multiplied by ``growth_factor``."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
    ) -> None:
        super().__init__(initial_scale)
        checks = [
            (
                0.0 < min_scale <= initial_scale,
                f"min_scale must be in (0, initial_scale={initial_scale}], got {min_scale}",
            ),
            (growth_factor > 1.0, f"growth_factor must be > 1, got {growth_factor}"),
            (0.0 < backoff_factor < 1.0, f"backoff_factor must be in (0, 1), got {backoff_factor}"),
            (growth_interval > 0, f"growth_interval must be > 0, got {growth_interval}"),
            (hysteresis > 0, f"hysteresis must be > 0, got {hysteresis}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"DynamicGradScaler: {message}")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float32)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float32)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale = state_dict["scale"].detach().clone().float().cpu()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
