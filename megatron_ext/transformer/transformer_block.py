"""The stack of transformer layers held by one pipeline stage."""

from __future__ import annotations

import contextlib

import torch

from megatron_ext import parallel_state, tensor_parallel
from megatron_ext.transformer.transformer_config import TransformerConfig
from megatron_ext.transformer.transformer_layer import ParallelTransformerLayer
from megatron_ext.transformer.utils import initialization_seed, layer_norm


class ParallelTransformer(torch.nn.Module):
    """This pipeline stage's ``num_layers / pp`` layers, and the final LayerNorm on the last stage.

    On stages other than the first, the input comes from ``set_input_tensor`` (the activation
    received from the previous stage), as in Megatron-core. With
    ``config.recompute_granularity == "full"`` each layer's activations are recomputed in the
    backward pass through ``tensor_parallel.checkpoint``, which replays the forward's RNG states.

    Under ``config.sequence_parallel`` the hidden states are ``[s / tp, b, h]`` and the whole
    stack runs on the model-parallel RNG stream (Megatron-core's TransformerBlock): dropout on
    sequence-sharded activations must differ across tensor-parallel ranks.

    ``init_seed``: when given, layer ``i`` (global index) is built from the CPU generator seeded
    with ``init_seed + i + 1`` so that its weights do not depend on the pipeline layout.
    """

    def __init__(
        self,
        config: TransformerConfig,
        pre_process: bool = True,
        post_process: bool = True,
        init_seed: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.input_tensor: torch.Tensor | None = None
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if config.num_layers % pp != 0:
            raise ValueError(
                f"num_layers ({config.num_layers}) must be divisible by pipeline_model_parallel_size ({pp})"
            )
        per_stage = config.num_layers // pp
        offset = parallel_state.get_pipeline_model_parallel_rank() * per_stage
        layers = []
        for i in range(offset, offset + per_stage):
            with initialization_seed(init_seed, i + 1):
                layers.append(ParallelTransformerLayer(config, layer_number=i + 1))
        self.layers = torch.nn.ModuleList(layers)
        if post_process:
            self.final_layernorm = layer_norm(config, config.hidden_size)

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        self.input_tensor = input_tensor

    def forward(self, hidden_states: torch.Tensor | None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if not self.pre_process:
            hidden_states = self.input_tensor
        if hidden_states is None:
            raise RuntimeError("ParallelTransformer: no input (on a later pipeline stage call set_input_tensor first)")
        rng_context = (
            tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else contextlib.nullcontext()
        )
        with rng_context:
            return self._run_layers(hidden_states, attention_mask)

    def _run_layers(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        recompute = self.config.recompute_granularity == "full" and self.training
        for layer in self.layers:
            if recompute:
                hidden_states = tensor_parallel.checkpoint(
                    lambda h, layer=layer: layer(h, attention_mask), False, hidden_states
                )
            else:
                hidden_states = layer(hidden_states, attention_mask)
        if self.post_process:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
