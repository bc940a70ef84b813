"""``torch.optim.Adam`` behind the optimizer interface the checkpoints read and write.

The interface is that of ``megatron_ext.optimizer``'s optimizers: ``step()`` returns
``(update_successful, grad_norm, num_zeros_in_grad)``, ``state_dict()`` holds ``"step"``, and
``param_state_by_name()`` / ``load_param_state_by_name()`` exchange each parameter's ``param``,
``exp_avg`` and ``exp_avg_sq`` by parameter name (``chunk{i}.`` prefixed with several model
chunks), with the shape of the local parameter.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext.dist_checkpointing.sharding import model_chunks


def _step_dtype() -> torch.dtype:
    # The dtype Adam gives its per-parameter step counters.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class NamedAdam:
    """Plain (not data-parallel sharded) Adam over every parameter of ``model``."""

    def __init__(self, model: torch.nn.Module | list[torch.nn.Module], **adam_kwargs: Any):
        chunks = model_chunks(model)
        self.named_params: dict[str, torch.nn.Parameter] = {}
        for i, chunk in enumerate(chunks):
            prefix = f"chunk{i}." if len(chunks) > 1 else ""
            for name, param in chunk.named_parameters():
                self.named_params[prefix + name] = param
        self.optimizer = torch.optim.Adam(list(self.named_params.values()), **adam_kwargs)
        self.iteration = 0

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> tuple[bool, float | None, int | None]:
        self.optimizer.step()
        self.iteration += 1
        return True, None, None

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.iteration = int(state_dict["step"])
        for state in self.optimizer.state.values():
            state["step"] = torch.tensor(float(self.iteration), dtype=_step_dtype())

    def param_state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for name, param in self.named_params.items():
            state = self.optimizer.state.get(param, {})
            out[name] = {
                "param": param.detach(),
                "exp_avg": state.get("exp_avg", torch.zeros_like(param)).detach(),
                "exp_avg_sq": state.get("exp_avg_sq", torch.zeros_like(param)).detach(),
            }
        return out

    def load_param_state_by_name(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        missing = sorted(set(self.named_params) - set(state))
        if missing:
            raise ValueError(
                f"optimizer state is missing parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
        for name, param in self.named_params.items():
            entry = state[name]
            with torch.no_grad():
                param.copy_(entry["param"])
            self.optimizer.state[param] = {
                "step": torch.tensor(float(self.iteration), dtype=_step_dtype()),
                "exp_avg": entry["exp_avg"].to(param.dtype).clone(),
                "exp_avg_sq": entry["exp_avg_sq"].to(param.dtype).clone(),
            }
