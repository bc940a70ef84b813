"""The tensor-parallel MLP: column-parallel h -> ffn, GeLU, row-parallel ffn -> h."""

from __future__ import annotations

import torch

from megatron_ext.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_ext.transformer.transformer_config import TransformerConfig


class ParallelMLP(torch.nn.Module):
    """Y = GeLU(X A + a) B + b with A split by columns and B by rows across tensor-parallel ranks.

    Forward needs one all-reduce (after B), backward one (of the input gradient of A). Returns
    ``(output, output_bias)`` with the bias of B not yet added, as Megatron-core does, so the caller
    can fuse it into bias-dropout-add.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size,
            config.ffn_hidden_size,
            config=config,
            init_method=config.init_method,
            bias=True,
            gather_output=False,
            skip_bias_add=True,
        )
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=True,
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        intermediate, bias = self.dense_h_to_4h(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        intermediate = torch.nn.functional.gelu(intermediate)
        return self.dense_4h_to_h(intermediate)
