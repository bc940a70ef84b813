"""The optimizer's view of the model's parameters: a slot per parameter (what the torch optimizer
updates and where its gradient comes from), the names of parameters across model chunks, a model
state dict's tensors by those names, and ``ProxyDict`` (several optimizers' states as one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_ext.distributed.param_and_grad_buffer import SIXTEEN_BIT, model_grad
from megatron_ext.resolve import strip_wrapper_prefix


@dataclass
class _Slot:
    """``main`` is what the torch optimizer updates: ``model_param.view(-1)[start:end]`` (the
    whole parameter, reshaped like it, outside the distributed optimizer)."""

    name: str
    model_param: torch.nn.Parameter
    start: int
    end: int
    main: torch.Tensor
    grad_source: Callable[[], torch.Tensor | None]
    # Where ``main`` is written back to: ``model_param.view(-1)[start:end]`` unless given (a fully
    # sharded parameter's shard).
    model_piece: torch.Tensor | None = None

    def piece(self) -> torch.Tensor:
        if self.model_piece is not None:
            return self.model_piece
        return self.model_param.view(-1)[self.start : self.end]


def chunk_prefix(index: int, num_chunks: int) -> str:
    """What the names of model chunk ``index``'s parameters start with in the optimizer's state
    (and the checkpoints): ``chunk{index}.`` when there are several chunks, nothing otherwise."""
    return f"chunk{index}." if num_chunks > 1 else ""


def named_model_parameters(model_chunks: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable parameters by name as in ``chunk.named_parameters()``, prefixed ``chunk{i}.``
    when there are several chunks (the names of ``param_state_by_name``)."""
    out = []
    for i, chunk in enumerate(model_chunks):
        prefix = chunk_prefix(i, len(model_chunks))
        out.extend((prefix + n, p) for n, p in chunk.named_parameters() if p.requires_grad)
    return out


def _state_dict_params(
    state_dict: dict[str, Any], model_chunks: list[torch.nn.Module]
) -> dict[str, torch.Tensor]:
    """``state_dict``'s tensors under the slot names (``named_model_parameters``)."""
    if len(model_chunks) > 1 or "model0" in state_dict or "model_0" in state_dict:
        prefix = "model_" if "model_0" in state_dict else "model"
        per_chunk = []
        for i in range(len(model_chunks)):
            if f"{prefix}{i}" not in state_dict:
                raise ValueError(f"reload_model_params: no {prefix}{i} in the state_dict (model chunk {i})")
            per_chunk.append(state_dict[f"{prefix}{i}"])
    else:
        per_chunk = [state_dict.get("model", state_dict)]
    out = {}
    for i, (chunk, sd) in enumerate(zip(model_chunks, per_chunk)):
        by_name = {strip_wrapper_prefix(k): v for k, v in sd.items()}
        prefix = chunk_prefix(i, len(model_chunks))
        for name, _ in chunk.named_parameters():
            if strip_wrapper_prefix(name) in by_name:
                out[prefix + name] = by_name[strip_wrapper_prefix(name)]
    return out


def _plain_slots(named: list[tuple[str, torch.nn.Parameter]], copy_16bit: bool) -> list[_Slot]:
    slots = []
    for name, p in named:
        if copy_16bit and p.dtype in SIXTEEN_BIT:
            main = p.detach().float().clone()
        else:
            main = p
        slots.append(_Slot(name, p, 0, p.numel(), main, lambda p=p: model_grad(p)))
    return slots


class ProxyDict:
    """Several dicts seen as one, keyed ``(index of the dict, key)``: ``ChainedOptimizer.state``.
    Reads and writes go to the underlying dicts."""

    def __init__(self, inner_dicts: list[dict]) -> None:
        self._inner_dicts = inner_dicts

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        index, inner_key = key
        return self._inner_dicts[index].get(inner_key)

    def __setitem__(self, key: tuple[int, Any], value: Any) -> None:
        index, inner_key = key
        self._inner_dicts[index][inner_key] = value

    def __len__(self) -> int:
        return sum(len(d) for d in self._inner_dicts)

    def __iter__(self):
        for index, d in enumerate(self._inner_dicts):
            for inner_key in d:
                yield index, inner_key

    def items(self):
        for index, d in enumerate(self._inner_dicts):
            for inner_key, value in d.items():
                yield (index, inner_key), value
