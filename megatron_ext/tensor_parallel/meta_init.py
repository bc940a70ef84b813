"""Modules built on the meta device (``init_model_with_meta_device``) and drawn later, one at a time.

A module built without storage keeps the function that built it. ``materialize`` calls that
function again outside the meta device, under the same seeds, and moves the values it draws into
the meta tensors, so the weights are those the module would have had if built directly; a wrapper
that shards the model (``FullyShardedDataParallel``) draws one unit, keeps its shard and frees the
rest before drawing the next, so no rank ever holds the whole model.
"""

from __future__ import annotations

import itertools
from typing import Callable, TypeVar

import torch

M = TypeVar("M", bound=torch.nn.Module)


def has_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def remember_build(module: M, build: Callable[[], M]) -> M:
    """Returns ``module``; if it was built on the meta device, ``materialize`` will draw its values by
    calling ``build()`` again."""
    if has_meta_tensors(module):
        module._megatron_ext_build = build
    return module


def _swap_in(tensor: torch.Tensor, values: torch.Tensor) -> None:
    """Gives the meta ``tensor`` (same Python object, its attributes kept) the storage of ``values``."""
    attributes = dict(tensor.__dict__)
    new = (
        torch.nn.Parameter(values, requires_grad=tensor.requires_grad)
        if isinstance(tensor, torch.nn.Parameter)
        else values
    )
    torch.utils.swap_tensors(tensor, new)
    tensor.__dict__.update(attributes)


def _fill(module: torch.nn.Module, name: str, device: torch.device, params: set[int] | None) -> None:
    # Drawn where a model built directly draws (the CPU generator, whatever the target device).
    with torch.device("cpu"):
        fresh = module._megatron_ext_build()
    mine = dict(itertools.chain(module.named_parameters(), module.named_buffers()))
    drawn = dict(itertools.chain(fresh.named_parameters(), fresh.named_buffers()))
    if mine.keys() != drawn.keys():
        raise RuntimeError(
            f"materialize: {name or type(module).__name__} built again has tensors {sorted(drawn)}, "
            f"the meta one {sorted(mine)}"
        )
    with torch.no_grad():
        for key, tensor in mine.items():
            if not tensor.is_meta or (
                params is not None and isinstance(tensor, torch.nn.Parameter) and id(tensor) not in params
            ):
                continue
            values = drawn[key].detach().to(device)
            if values.shape != tensor.shape or values.dtype != tensor.dtype:
                raise RuntimeError(
                    f"materialize: {name}.{key} built again is {tuple(values.shape)} {values.dtype}, the "
                    f"meta one {tuple(tensor.shape)} {tensor.dtype}"
                )
            _swap_in(tensor, values)
    if not has_meta_tensors(module):
        del module._megatron_ext_build


def materialize(
    module: torch.nn.Module, device: torch.device | str, skip: tuple = (), params: list | None = None
) -> None:
    """Draws every meta tensor under ``module`` (outside the modules in ``skip``; of the parameters,
    only those in ``params`` when given) on ``device``: each module built by a remembered function is
    built again and its values moved in. A meta tensor no remembered build covers is refused, named."""
    device = torch.device(device)
    skipped = {id(m) for m in skip}
    wanted = None if params is None else {id(p) for p in params}

    def walk(m: torch.nn.Module, name: str) -> None:
        if id(m) in skipped:
            return
        if getattr(m, "_megatron_ext_build", None) is not None and has_meta_tensors(m):
            _fill(m, name, device, wanted)
            return
        for child_name, child in m.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name)
        left = [
            key
            for key, p in m.named_parameters(recurse=False)
            if p.is_meta and (wanted is None or id(p) in wanted)
        ]
        left += [key for key, b in m.named_buffers(recurse=False) if b.is_meta]
        if left:
            raise RuntimeError(
                f"materialize: {name + '.' if name else ''}{left[0]} is on the meta device and no module "
                "around it can be built again; build the model with config.init_model_with_meta_device "
                "(megatron_ext's layers then put their own parameters on the meta device), not inside a "
                "torch.device('meta') context"
            )

    walk(module, "")
