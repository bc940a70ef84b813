"""The checks of the two settings DeepSeek-V3-class models add to the transformer: multi-latent
attention (``MLATransformerConfig``'s fields) and multi-token prediction (``mtp_num_layers``). Each
bad value raises a ValueError naming it (the same on every rank: it reads only the config)."""

from __future__ import annotations

import math
from typing import Any

# The fields MLATransformerConfig adds, which multi-latent attention reads.
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
              "rotary_base", "rotary_percent", "rotary_scaling_factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_mla_config(config: Any) -> None:
    """With ``multi_latent_attention``: the latent ranks and head dims positive integers (the
    rotated part of a head an even number of channels: they rotate in pairs), one key per query
    head, ``rope_type`` "rope" or "yarn" with finite YaRN numbers, and Megatron-core's refusals
    (``rotary_interleaved``: the layout is MLA's own; ``apply_rope_fusion`` only with YaRN)."""
    if not getattr(config, "multi_latent_attention", False):
        return
    missing = [name for name in MLA_FIELDS if not hasattr(config, name)]
    if missing:
        raise ValueError(
            "multi_latent_attention=True needs the fields of MLATransformerConfig, which "
            f"{type(config).__name__} lacks ({', '.join(missing)}): build the config as an "
            "MLATransformerConfig"
        )
    q_rank = config.q_lora_rank
    if q_rank is not None and not (_is_int(q_rank) and q_rank >= 1):
        raise ValueError(
            f"q_lora_rank must be a positive integer or None (no query compression), got {q_rank!r}"
        )
    for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim", "qk_pos_emb_head_dim"):
        value = getattr(config, name)
        if not (_is_int(value) and value >= 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    percent = config.rotary_percent
    if not (_is_number(percent) and 0 < percent <= 1):
        raise ValueError(f"rotary_percent must be in (0, 1], got {percent!r}")
    rotated = config.qk_pos_emb_head_dim if percent == 1 else int(config.qk_pos_emb_head_dim * percent)
    if rotated < 2 or rotated % 2:
        raise ValueError(
            f"qk_pos_emb_head_dim ({config.qk_pos_emb_head_dim}) x rotary_percent ({percent}) = {rotated} "
            "rotated channels; the rotary embedding rotates channel pairs: expected an even number >= 2"
        )
    groups = config.num_query_groups
    if groups is not None and groups != config.num_attention_heads:
        raise ValueError(
            f"num_query_groups ({groups}) must equal num_attention_heads ({config.num_attention_heads}) with "
            "multi_latent_attention: every query head has its own key and value, expanded from the latent"
        )
    if config.rope_type not in ("rope", "yarn"):
        raise ValueError(
            f"Unsupported RoPE type: {config.rope_type!r}, supported types are 'rope' and 'yarn'"
        )
    if getattr(config, "rotary_interleaved", False):
        raise ValueError("rotary_interleaved does not work with multi_latent_attention.")
    if getattr(config, "apply_rope_fusion", False) and config.rope_type != "yarn":
        raise ValueError("apply_rope_fusion for MLA only works with YARN RoPE.")
    if getattr(config, "cache_mla_latents", False):
        raise NotImplementedError(
            "cache_mla_latents (the latent cache of Megatron-core's dynamic inference) is not supported"
        )
    if not (_is_number(config.rotary_base) and config.rotary_base > 0):
        raise ValueError(f"rotary_base must be a positive finite number, got {config.rotary_base!r}")
    if not (_is_number(config.rotary_scaling_factor) and config.rotary_scaling_factor > 0):
        raise ValueError(
            f"rotary_scaling_factor must be a positive finite number, got {config.rotary_scaling_factor!r}"
        )
    original = config.original_max_position_embeddings
    if not (_is_int(original) and original >= 1):
        raise ValueError(f"original_max_position_embeddings must be a positive integer, got {original!r}")
    for name in ("beta_fast", "beta_slow"):
        if not _is_number(getattr(config, name)):
            raise ValueError(f"{name} must be a finite number, got {getattr(config, name)!r}")
    for name in ("mscale", "mscale_all_dim"):
        value = getattr(config, name)
        if value is not None and not _is_number(value):
            raise ValueError(f"{name} must be a finite number or None, got {value!r}")


def check_mtp_config(config: Any) -> None:
    """With ``mtp_num_layers``: a positive number of depths, a finite ``mtp_loss_scaling_factor``
    >= 0, and what the depths' layers need (built like the last decoder layer; per-layer lists
    have no entry for them)."""
    depths = getattr(config, "mtp_num_layers", None)
    if depths is None:
        return
    if not (_is_int(depths) and depths >= 1):
        raise ValueError(f"mtp_num_layers must be a positive integer or None, got {depths!r}")
    factor = config.mtp_loss_scaling_factor
    if not (_is_number(factor) and factor >= 0):
        raise ValueError(f"mtp_loss_scaling_factor must be a finite number >= 0, got {factor!r}")
    for name in ("cp_comm_type", "window_attn_skip_freq"):
        if isinstance(getattr(config, name, None), (list, tuple)):
            raise ValueError(
                f"{name} as a per-layer list has no entry for the mtp_num_layers={depths} multi-token "
                "prediction layers; give one value for every layer"
            )
    if (getattr(config, "recompute_granularity", None) == "full" and config.recompute_method == "uniform"
            and config.recompute_num_layers != 1):
        raise ValueError(
            "mtp_num_layers with recompute_granularity='full' and recompute_method='uniform' needs "
            f"recompute_num_layers=1 (each multi-token prediction layer is recomputed on its own), got "
            f"{config.recompute_num_layers}"
        )
