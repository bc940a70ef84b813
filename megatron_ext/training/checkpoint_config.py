"""The model configuration a training checkpoint records (``checkpoint.json``'s ``model_config``)
and the check of a loading model against it."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext.dist_checkpointing.sharding import model_chunks
from megatron_ext.resolve import unwrap_model


def model_config(model: torch.nn.Module | list[torch.nn.Module]) -> dict[str, Any] | None:
    """The hyperparameters that give the stored tensors their meaning, read from the model's
    ``config`` (a TransformerConfig) and, for a GPTModel, its vocabulary and sequence length;
    None for a model without a config."""
    # the model inside the wrappers: FullyShardedDataParallel keeps the config too, without the
    # model's vocabulary and sequence length
    inner = unwrap_model(model_chunks(model)[0])
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "num_layers"):
        return None
    activation = getattr(config, "activation_func", None)
    return {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": getattr(config, "num_query_groups", None) or config.num_attention_heads,
        "kv_channels": getattr(config, "kv_channels", None),
        "ffn_hidden_size": getattr(config, "ffn_hidden_size", None),
        "vocab_size": getattr(inner, "vocab_size", None),
        "max_sequence_length": getattr(inner, "max_sequence_length", None),
        "normalization": getattr(config, "normalization", None),
        "activation": getattr(activation, "__name__", repr(activation)),
        "gated_linear_unit": getattr(config, "gated_linear_unit", None),
        "add_bias_linear": getattr(config, "add_bias_linear", None),
        "qk_layernorm": getattr(config, "qk_layernorm", None),
        "rotary_interleaved": getattr(config, "rotary_interleaved", None),
        "position_embedding_type": getattr(inner, "position_embedding_type", None),
        "share_embeddings_and_output_weights": getattr(inner, "share_embeddings_and_output_weights", None),
        "params_dtype": str(getattr(config, "params_dtype", None)).replace("torch.", ""),
    }


# Fields that may differ between the saved and the loading model: the values are converted.
CONVERTIBLE_CONFIG_FIELDS = ("params_dtype",)


def check_config(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> list[str]:
    if saved is None or current is None:  # a checkpoint or a model without a config
        return []
    differ = [
        field
        for field in current
        if field in saved and field not in CONVERTIBLE_CONFIG_FIELDS and saved[field] != current[field]
    ]
    if not differ:
        return []
    return [
        "the checkpoint was saved with " + ", ".join(f"{f}={saved[f]!r}" for f in differ)
        + "; this model has " + ", ".join(f"{f}={current[f]!r}" for f in differ)
    ]
