"""``GlobalMemoryBuffer``: Megatron-core's named scratch buffers (``parallel_state`` keeps one)."""

from __future__ import annotations

import math
from typing import Callable

import torch


class GlobalMemoryBuffer:
    """Named scratch buffers reused across calls so that a hot loop does not allocate.

    ``get_tensor(shape, dtype, name)`` returns a view of the buffer ``(name, dtype)``, grown when
    too small; callers must not use two tensors of the same name at once.
    """

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self,
        tensor_shape: tuple[int, ...] | list[int],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable | None = None,
    ) -> torch.Tensor:
        numel = math.prod(tensor_shape)
        key = (name, dtype)
        if key not in self.buffer or self.buffer[key].numel() < numel:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            if mem_alloc_context is None:
                self.buffer[key] = torch.empty(numel, dtype=dtype, device=device)
            else:
                with mem_alloc_context():
                    self.buffer[key] = torch.empty(numel, dtype=dtype, device=device)
        return self.buffer[key][:numel].view(*tensor_shape)
