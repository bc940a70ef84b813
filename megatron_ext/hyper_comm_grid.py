"""``HyperCommGrid``: process groups over named dimensions of a rank grid (Megatron-core's
``megatron.core.hyper_comm_grid``), e.g. to fill a ``ProcessGroupCollection`` by hand.

Ranks are laid out with the first dimension varying fastest, as ``initialize_model_parallel``'s
``order``: ``HyperCommGrid([2, 1, 2], ["tp", "pp", "dp"])`` puts ranks 0 and 1 in one
tensor-parallel group, 0 and 2 in one data-parallel group.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist


class HyperCommGrid:
    """A grid of ``prod(shape)`` ranks starting at ``rank_offset``, one named dimension per entry of
    ``shape``. ``create_pg(dims)`` creates (once per set of dimensions) the groups spanning
    ``dims`` and returns this rank's; ``get_pg(dims)`` returns it later; ``get_rank_enum(dims)``
    lists every group's ranks."""

    def __init__(
        self, shape: list[int], dim_names: list[str], rank_offset: int = 0, backend: str | None = None
    ) -> None:
        if len(shape) != len(dim_names):
            raise ValueError(f"len(shape) {shape} != len(dim_names) {dim_names}")
        if "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
        elif dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            raise RuntimeError(
                "HyperCommGrid cannot determine the world size: set WORLD_SIZE or initialize "
                "torch.distributed first"
            )
        if rank_offset < 0:
            raise ValueError(f"rank_offset must be non-negative, got {rank_offset}")
        self.size = math.prod(shape)
        if self.size > world_size - rank_offset:
            raise RuntimeError(
                f"Grid shape {shape} is over sized with world size {world_size} and rank offset {rank_offset}"
            )
        self.shape = list(shape)
        self.dim_names = list(dim_names)
        self.rank_offset = rank_offset
        self.backend = backend
        self._pgs: dict[str, dist.ProcessGroup] = {}

    def _order_dims(self, dims: str | list[str]) -> tuple[list[str], str]:
        """``dims`` in the grid's order, slowest first, and the key naming their groups."""
        dims = [dims] if isinstance(dims, str) else list(dims)
        unknown = [d for d in dims if d not in self.dim_names]
        if unknown:
            raise ValueError(f"unknown dimensions {unknown}; the grid has {self.dim_names}")
        ordered = [d for d in self.dim_names[::-1] if d in dims]
        return ordered, "-".join(ordered)

    def get_rank_enum(self, dims: str | list[str]) -> list[list[int]]:
        """The ranks of every group spanning ``dims``: one list per combination of the other
        dimensions, each in increasing order of its position in the grid."""
        ordered, _ = self._order_dims(dims)
        reversed_names = self.dim_names[::-1]
        grid = torch.arange(self.rank_offset, self.rank_offset + self.size).reshape(
            [self.shape[self.dim_names.index(d)] for d in reversed_names]
        )
        others = [reversed_names.index(d) for d in reversed_names if d not in ordered]
        spanned = [reversed_names.index(d) for d in ordered]
        group_size = math.prod(self.shape[self.dim_names.index(d)] for d in ordered)
        return grid.permute(others + spanned).reshape(-1, group_size).tolist()

    def create_pg(self, dims: str | list[str], **kwargs: Any) -> dist.ProcessGroup | None:
        """Creates the groups spanning ``dims`` (a collective over the world; ``kwargs`` go to
        ``torch.distributed.new_subgroups_by_enumeration``) and returns this rank's. KeyError when
        they were created before."""
        _, key = self._order_dims(dims)
        if key in self._pgs:
            raise KeyError(f"Process group {dims} has already been created")
        group, _ = dist.new_subgroups_by_enumeration(self.get_rank_enum(dims), backend=self.backend, **kwargs)
        self._pgs[key] = group
        return group

    def get_pg(self, dims: str | list[str]) -> dist.ProcessGroup:
        """This rank's group spanning ``dims``, created before by ``create_pg``."""
        _, key = self._order_dims(dims)
        if key not in self._pgs:
            raise KeyError(f"Process group for {key} hasn't been created. Call create_pg first.")
        return self._pgs[key]
