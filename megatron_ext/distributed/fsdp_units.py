"""The units of ``FullyShardedDataParallel``: which modules they are, the parameters each holds and
the order they finish their backward."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext.distributed.param_and_grad_buffer import (  # noqa: F401  (re-exported)
    _ParamAndGradBucket,
    _ParamAndGradBuffer,
    allocate,
    free,
    is_allocated,
)

# The classes whose instances are units by default: megatron_ext's transformer layers and, by
# name (this floor imports no model code), Megatron-core's.
DEFAULT_UNIT_CLASS_NAMES = (
    "ParallelTransformerLayer", "TransformerLayer", "MultiTokenPredictionLayer", "MambaLayer",
)


class Unit:
    """One unit's buffers and where it stands: gathered or not, gathers and reductions in
    flight, the parameters whose gradient arrived since its last reduction. ``module`` is None
    for the root (every parameter outside the units)."""

    def __init__(self, name: str, module: torch.nn.Module | None) -> None:
        self.name = name
        self.module = module
        self.buffers: list[_ParamAndGradBuffer] = []
        self.params: list[torch.nn.Parameter] = []
        self.gather_works: list[Any] = []
        self.gathered = False
        self.held = False  # gathered for a state dict: kept until the next forward or reshard
        self.arrived: set[torch.nn.Parameter] = set()
        self.reductions: list[tuple[Any, torch.Tensor, torch.Tensor, float]] = []

    @property
    def buckets(self) -> list[_ParamAndGradBucket]:
        return [b for buffer in self.buffers for b in buffer.buckets]


def unit_classes(fsdp_unit_modules: Any) -> tuple:
    """``fsdp_unit_modules`` checked (module classes or class names), or the default."""
    if fsdp_unit_modules is None:
        return DEFAULT_UNIT_CLASS_NAMES
    if not isinstance(fsdp_unit_modules, (list, tuple)) or not all(
        isinstance(c, (type, str)) for c in fsdp_unit_modules
    ):
        raise TypeError(
            "fsdp_unit_modules must be a list of module classes (or class names), got "
            f"{fsdp_unit_modules!r}"
        )
    return tuple(fsdp_unit_modules)


def class_names(classes: Any) -> list[str]:
    return [c if isinstance(c, str) else c.__name__ for c in classes]


def _is_unit(module: torch.nn.Module, classes: tuple) -> bool:
    names = {cls.__name__ for cls in type(module).__mro__}
    return any((c in names) if isinstance(c, str) else isinstance(module, c) for c in classes)


def find_units(root_module: torch.nn.Module, classes: tuple) -> tuple[list[Unit], dict, dict]:
    """The units of ``root_module`` (the outermost module of ``classes`` on each path; the root
    last) and, for each trainable parameter and each unit module, its unit."""
    units: list[Unit] = []
    unit_of: dict[torch.nn.Parameter, Unit] = {}
    unit_of_module: dict[torch.nn.Module, Unit] = {}
    root = Unit("(root)", None)

    def visit(module: torch.nn.Module, prefix: str, owner: Unit) -> None:
        if owner is root and module is not root_module and _is_unit(module, classes):
            owner = Unit(prefix or type(module).__name__, module)
            units.append(owner)
            unit_of_module[module] = owner
        for p in module.parameters(recurse=False):
            if p.requires_grad and p not in unit_of:
                unit_of[p] = owner
                owner.params.append(p)
        for name, child in module.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name, owner)

    visit(root_module, "", root)
    units.append(root)
    return units, unit_of, unit_of_module


def backward_order(units: list[Unit], forward_order: list[Unit]) -> list[Unit]:
    """The order units finish their backward: the reverse of the forward (of registration
    before a forward has run), the root last."""
    modules = [u for u in units if u.module is not None]
    ordered = list(reversed(forward_order))
    return ordered + [u for u in modules[::-1] if u not in ordered] + [units[-1]]


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in output_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in output_tensors(item)]
    return []
