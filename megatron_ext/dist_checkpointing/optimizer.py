"""Optimizer state keyed by the model's sharding (Megatron-core's
``dist_checkpointing.optimizer``): a state tensor shaped like a parameter is saved as that
parameter's ShardedTensor (or factory) with the key ``<prefix>.<parameter's key>`` and the
parameter's replica ids, so it reshards across layouts exactly as the parameter does.

The model's sharded state dict may hold megatron_ext's classes or Megatron-core's own (its model
code over megatron_ext's optimizers): they are recognised by their fields, and what is made from
them is of their classes, so either package's ``save`` / ``load`` takes the result."""

from __future__ import annotations

from dataclasses import replace

import sys
from typing import Any

import torch

from megatron_ext.dist_checkpointing.dict_utils import nested_values
from megatron_ext.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

KEEP_VARS_HINT = (
    "the model's sharded state dict must hold the parameters themselves (as the modules' "
    "sharded_state_dict() do), not copies"
)


def sharded_params_by_tensor(model_sharded_state_dict: ShardedStateDict) -> dict[int, Any]:
    """``id(tensor)`` -> the model's ShardedTensor or factory holding that tensor (the first one
    where several do)."""
    out: dict[int, Any] = {}
    for sh in nested_values(model_sharded_state_dict):
        if _is_sharded(sh) and isinstance(sh.data, torch.Tensor):
            out.setdefault(id(sh.data), sh)
    return out


def _is_sharded(x: Any) -> bool:
    """A ShardedTensor, ShardedObject or factory, of this package or Megatron-core."""
    return not isinstance(x, torch.Tensor) and all(hasattr(x, a) for a in ("key", "data", "replica_id"))


def local_nonpersistent(like: Any, value: Any) -> Any:
    """``value`` as a LocalNonpersistentObject of the package ``like`` (a sharded tensor) is from."""
    cls = getattr(sys.modules.get(type(like).__module__), "LocalNonpersistentObject", None)
    return (cls or LocalNonpersistentObject)(value)


def make_sharded_optimizer_tensor(
    model_param: ShardedTensor | ShardedTensorFactory, optim_param: torch.Tensor, prefix: str
) -> ShardedTensor | ShardedTensorFactory:
    """``optim_param`` (of the parameter's local shape) sharded as ``model_param``, under the key
    ``<prefix>.<model_param.key>``."""
    key = f"{prefix}.{model_param.key}"
    if hasattr(model_param, "build_fn"):  # a ShardedTensorFactory
        return replace(model_param, key=key, data=optim_param)
    if tuple(optim_param.shape) != tuple(model_param.local_shape):
        raise ValueError(
            f"{key}: optimizer tensor of shape {tuple(optim_param.shape)}, the parameter's local shape "
            f"is {tuple(model_param.local_shape)}"
        )
    return replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepends ``prefix`` to the key of every sharded leaf (in place)."""
    for sh in nested_values(sharded_state_dict):
        if _is_sharded(sh):
            sh.key = prefix + sh.key
