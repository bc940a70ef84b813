"""Which process group and which model: the one place that decides.

- A group argument left ``None`` means parallel_state's group of its kind: ``default_group(kind,
  group)``, with ``DEFAULT_GROUPS`` naming the getter of every kind (the fields of Megatron-core's
  ``ProcessGroupCollection``).
- An optional group (``None``: a group of this process alone) has ``group_size`` / ``group_rank``.
- A model may sit inside wrappers that keep it as ``.module`` (DistributedDataParallel,
  Float16Module, torch's DDP): ``wrapper_chain`` walks them, ``unwrap_model`` gives the innermost,
  ``get_attr_wrapped_model`` the first that has an attribute, ``find_wrapper`` the first of a class,
  ``strip_wrapper_prefix`` a parameter name without the wrappers' ``module.`` prefixes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch.distributed as dist

from megatron_ext import parallel_state


class GroupGetter(NamedTuple):
    """The parallel_state getter that gives a group kind's default, its keywords, and whether it
    takes ``check_initialized``."""

    name: str
    kwargs: dict[str, Any]
    checks_initialized: bool = True


DEFAULT_GROUPS: dict[str, GroupGetter] = {
    "tp": GroupGetter("get_tensor_model_parallel_group", {}),
    "pp": GroupGetter("get_pipeline_model_parallel_group", {}),
    "mp": GroupGetter("get_model_parallel_group", {}),
    "embd": GroupGetter("get_embedding_group", {}),
    "pos_embd": GroupGetter("get_position_embedding_group", {}),
    "cp": GroupGetter("get_context_parallel_group", {}),
    "tp_cp": GroupGetter("get_tensor_and_context_parallel_group", {}),
    "hcp": GroupGetter("get_hierarchical_context_parallel_groups", {}),
    "ep": GroupGetter("get_expert_model_parallel_group", {}),
    "expt_tp": GroupGetter("get_expert_tensor_parallel_group", {}),
    "tp_ep": GroupGetter("get_expert_tensor_and_model_parallel_group", {}),
    "tp_ep_pp": GroupGetter("get_expert_tensor_model_pipeline_parallel_group", {}),
    "tp_dp_cp": GroupGetter("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    "dp": GroupGetter("get_data_parallel_group", {}, checks_initialized=False),
    "dp_cp": GroupGetter(
        "get_data_parallel_group", {"with_context_parallel": True}, checks_initialized=False
    ),
    "expt_dp": GroupGetter("get_expert_data_parallel_group", {}),
    "intra_dp_cp": GroupGetter(
        "get_data_parallel_group",
        {"with_context_parallel": True, "partial_data_parallel": True},
        checks_initialized=False,
    ),
    "intra_expt_dp": GroupGetter("get_expert_data_parallel_group", {"partial_expert_data_parallel": True}),
    "inter_dist_opt": GroupGetter("get_inter_distributed_optimizer_instance_group", {}),
    "intra_dist_opt": GroupGetter("get_intra_distributed_optimizer_instance_group", {}),
}


def default_group(kind: str, group: Any = None, check_initialized: bool = True) -> Any:
    """``group``, or when it is None parallel_state's group of ``kind`` (a key of
    ``DEFAULT_GROUPS``); ``check_initialized=False`` gives None instead of raising where that
    group was not created (for the getters that take the flag)."""
    if group is not None:
        return group
    if kind not in DEFAULT_GROUPS:
        raise ValueError(f"unknown process group kind {kind!r}; expected one of {list(DEFAULT_GROUPS)}")
    getter = DEFAULT_GROUPS[kind]
    kwargs = dict(getter.kwargs)
    if getter.checks_initialized and not check_initialized:
        kwargs["check_initialized"] = False
    return getattr(parallel_state, getter.name)(**kwargs)


def group_size(group: Any) -> int:
    """The size of ``group``; 1 for None (this process alone) or without torch.distributed."""
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank in ``group``; 0 for None (this process alone) or without
    torch.distributed."""
    return 0 if group is None or not dist.is_initialized() else dist.get_rank(group)


def wrapper_chain(model: Any) -> Iterator[Any]:
    """``model``, then the module each wrapper keeps as ``.module``, outermost first."""
    yield model
    while getattr(model, "module", None) is not None:
        model = model.module
        yield model


def unwrap_model(model: Any) -> Any:
    """The model inside every wrapper (``model`` itself when it wraps nothing); a list of model
    chunks gives the list of their models."""
    if isinstance(model, list):
        return [unwrap_model(chunk) for chunk in model]
    *_, inner = wrapper_chain(model)
    return inner


def module_with(model: Any, attr: str) -> Any:
    """The first of ``model`` and the modules it wraps that has ``attr``, or None."""
    return next((inner for inner in wrapper_chain(model) if hasattr(inner, attr)), None)


def get_attr_wrapped_model(model: Any, attr: str) -> Any:
    """``model.<attr>``, looking through wrappers (DDP, Float16Module) that keep ``.module``."""
    inner = module_with(model, attr)
    if inner is None:
        raise AttributeError(f"{type(model).__name__} (or the module it wraps) has no attribute {attr!r}")
    return getattr(inner, attr)


def find_wrapper(model: Any, cls: type) -> Any:
    """The first of ``model`` and the modules it wraps that is a ``cls``, or None."""
    return next((inner for inner in wrapper_chain(model) if isinstance(inner, cls)), None)


def strip_wrapper_prefix(name: str) -> str:
    """A parameter name of a wrapped model without the wrappers' leading ``module.`` prefixes."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name
