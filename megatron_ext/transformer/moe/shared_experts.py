"""Shared experts: a dense MLP every token goes through beside the routed experts
(Megatron-core's ``SharedExpertMLP``), tensor-parallel like the dense MLP."""

from __future__ import annotations

import copy
from typing import Any

import torch

from megatron_ext.transformer.mlp import ParallelMLP


class SharedExpertMLP(ParallelMLP):
    """``ParallelMLP`` of width ``moe_shared_expert_intermediate_size``; with ``gate`` its output
    is scaled per token by ``sigmoid(x . gate_weight)``. Returns the output with its bias added."""

    def __init__(
        self, config: Any, submodules: Any = None, gate: bool = False, pg_collection: Any = None
    ) -> None:
        shared_config = copy.copy(config)
        shared_config.ffn_hidden_size = config.moe_shared_expert_intermediate_size
        super().__init__(shared_config)
        self.use_shared_expert_gate = gate
        if gate:
            self.gate_weight = torch.nn.Parameter(
                torch.zeros(1, config.hidden_size, dtype=config.params_dtype)
            )
            config.init_method(self.gate_weight.data)
            self.gate_weight.sequence_parallel = bool(config.sequence_parallel)
        else:
            self.gate_weight = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, bias = super().forward(hidden_states)
        if bias is not None:
            out = out + bias
        if self.gate_weight is not None:
            out = out * torch.sigmoid(torch.nn.functional.linear(hidden_states, self.gate_weight))
        return out
