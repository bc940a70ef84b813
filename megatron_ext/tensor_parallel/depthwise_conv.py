"""The short depthwise causal convolution of the recurrent layers (Mamba-2, Gated DeltaNet), its channels
split over the tensor-parallel ranks as Megatron-core splits them."""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_ext.fusions.causal_conv1d import causal_conv1d_fn
from megatron_ext.tensor_parallel.layers import ColumnParallelLinear, set_tensor_model_parallel_attributes


def split_parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
    """A parameter holding this rank's part of a tensor split along dim 0."""
    param = torch.nn.Parameter(tensor)
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
    return param


def local_blocks(full: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """This rank's part of each block of ``full`` along dim 0: the blocks laid out serially, each split
    over the tensor-parallel ranks, as Megatron-core splits (and checkpoints) the fused projections of
    its recurrent layers (``in_proj``: Mamba's [z, x, B, C, dt], Gated DeltaNet's [q, k, v, z, beta,
    alpha]; ``conv1d``)."""
    parts = []
    for block in torch.split(full, sizes, dim=0):
        per = block.shape[0] // world
        parts.append(block[rank * per : (rank + 1) * per])
    return torch.cat(parts, dim=0)


def _keep(weight: torch.Tensor) -> None:
    """The projection's own draw, replaced by ``block_column_parallel_linear``'s over all blocks."""


def block_column_parallel_linear(
    input_size: int, blocks: list[int], config: Any, bias: bool, tp_group: Any, rank: int, world: int
) -> ColumnParallelLinear:
    """A column-parallel projection to the concatenated ``blocks`` (Mamba's and Gated DeltaNet's
    ``in_proj``), each rank holding its part of every block (``local_blocks``), the weight drawn over
    all blocks with ``config.init_method`` in float32 (as the linears' CPU initialisation), so every
    tensor-parallel layout starts from the serial weight."""
    linear = ColumnParallelLinear(
        input_size,
        sum(blocks),
        config=config,
        init_method=_keep,
        gather_output=False,
        bias=bias,
        skip_bias_add=False,
        tp_group=tp_group,
    )
    with torch.no_grad():
        full = torch.empty(sum(blocks), input_size, dtype=torch.float32, device=linear.weight.device)
        if config.perform_initialization:
            config.init_method(full)
        linear.weight.copy_(local_blocks(full, blocks, rank, world))
    return linear


class DepthwiseConv(torch.nn.Module):
    """Megatron-core's ``conv1d`` (``nn.Conv1d(C, C, W, groups=C)``: weight ``[C, 1, W]``, bias ``[C]``)
    for this rank's part of each block of ``blocks`` channels, drawn over all of them as ``nn.Conv1d``
    draws (uniform within 1/sqrt(W), the weight within ``conv_init`` when given) from the CPU
    generator in float32, so every tensor-parallel layout starts from the serial weights. Computed by
    ``causal_conv1d_fn`` with SiLU: ``[b, l, C] -> [b, l, C]``."""

    def __init__(
        self,
        blocks: list[int],
        width: int,
        conv_init: float | None,
        bias: bool,
        rank: int,
        world: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        bound = 1 / math.sqrt(width)
        reach = bound if conv_init is None else conv_init
        with torch.no_grad():
            weight = torch.empty(sum(blocks), 1, width, dtype=torch.float32, device=device).uniform_(
                -reach, reach
            )
            self.weight = split_parameter(local_blocks(weight, blocks, rank, world).to(dtype))
            self.bias = None
            if bias:
                b = torch.empty(sum(blocks), dtype=torch.float32, device=device).uniform_(-bound, bound)
                self.bias = split_parameter(local_blocks(b, blocks, rank, world).to(dtype))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        y = causal_conv1d_fn(
            x.transpose(1, 2), self.weight.squeeze(1), self.bias, activation="silu", cu_seqlens=cu_seqlens
        )
        return y.transpose(1, 2)
