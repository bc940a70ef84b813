"""Configuration of the parallel transformer, named as Megatron-core's TransformerConfig."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_ext.model_parallel_config import ModelParallelConfig


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Initialises a tensor in place from N(0, sigma^2)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / sqrt(2 * num_layers))^2): the output projections of the residual branches."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


@dataclass
class TransformerConfig(ModelParallelConfig):
    """What the transformer layers read, on top of the model-parallel settings."""

    num_layers: int = 0
    num_attention_heads: int = 0
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    init_method: Callable | None = None
    output_layer_init_method: Callable | None = None
    apply_residual_connection_post_layernorm: bool = False
    attention_softmax_in_fp32: bool = True
    recompute_granularity: str | None = None  # None or "full"
    # Not in Megatron-core: GPTModel computes the loss with the fused output layer +
    # cross-entropy (tensor_parallel.vocab_parallel_linear_cross_entropy), which never holds the
    # [s, b, vocab / tp] logits; same losses and gradients. Only the loss path (labels given).
    fused_output_cross_entropy: bool = False

    def __post_init__(self) -> None:
        if hasattr(super(), "__post_init__"):
            super().__post_init__()
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerConfig.{name} must be a positive integer, got {value!r}")
        tp = self.tensor_model_parallel_size
        if self.num_attention_heads % tp != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"tensor_model_parallel_size ({tp})"
            )
        if self.hidden_size % self.num_attention_heads != 0 and self.kv_channels is None:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) unless kv_channels is given"
            )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.ffn_hidden_size % tp != 0:
            raise ValueError(
                f"ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by "
                f"tensor_model_parallel_size ({tp})"
            )
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.recompute_granularity not in (None, "full"):
            raise ValueError(f"recompute_granularity must be None or 'full', got {self.recompute_granularity!r}")
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)
