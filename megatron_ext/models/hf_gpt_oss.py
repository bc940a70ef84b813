"""Hugging Face gpt-oss (transformers' ``GptOssForCausalLM``) and megatron_ext: the config both ways
and the experts' tensor layout; ``models.hf_config`` and ``models.hf`` call them.

gpt-oss is a mixture of experts in every layer with biases on every projection (attention, router,
experts), attention sinks (a learned logit per head, ``self_attn.sinks``: Megatron-core's
``softmax_type="learnable"`` and its ``softmax_offset``), sliding windows on the layers
``layer_types`` names (``models.hf_fields.layer_windows``), YaRN rotary embeddings, a router that
takes the softmax of the top-k logits (``moe_router_pre_softmax=False``) and experts computing
``(clamp(up, -limit, limit) + 1) * g * sigmoid(1.702 g)`` with ``g = clamp(gate, max=limit)``
(``quick_gelu``, ``glu_linear_offset=1``, ``activation_func_clamp_value=limit``).

transformers keeps each layer's experts fused, multiplied from the left (``x @ W``):
``gate_up_proj`` [E, h, 2 ffn] with gate and up columns interleaved (gate 0, up 0, gate 1, up 1,
...), ``gate_up_proj_bias`` [E, 2 ffn] likewise, ``down_proj`` [E, ffn, h] and ``down_proj_bias``
[E, h]; a megatron_ext expert holds fc1 [2 ffn, h] as ``[gate | up]`` rows and fc2 [h, ffn].
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_ext.fusions import quick_gelu
from megatron_ext.fusions.fused_bias_geglu import QUICK_GELU_ALPHA, sigmoid_gate_alpha
from megatron_ext.models.hf_fields import FULL, SLIDING, _field, _positive
from megatron_ext.transformer.transformer_layer import is_moe_layer
from megatron_ext.transformer.utils import layer_window, window_keys
from megatron_ext.transformer.yarn_rotary import yarn_arguments

# A MoE layer's fused expert tensors, in the order transformers' state dict holds them.
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def is_gpt_oss(config) -> bool:
    """Whether a model's experts are gpt-oss's (quick GEGLU experts): its tensors then take
    gpt-oss's names and layout."""
    return bool(config.num_moe_experts) and sigmoid_gate_alpha(config.activation_func) == QUICK_GELU_ALPHA


def _finite_positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(
            f"the Hugging Face config's {name!r} must be a positive finite number, got {value!r}"
        )
    return float(value)


def gpt_oss_fields(hf_config: Any) -> dict[str, Any]:
    """The TransformerConfig fields of a gpt-oss config besides the Llama-family ones; one
    ValueError naming the field that megatron_ext's config cannot express."""
    if _field(hf_config, "quantization_config"):
        raise ValueError(
            "the Hugging Face config has a 'quantization_config' (gpt-oss's MXFP4 experts): load a "
            "dequantized checkpoint (transformers' Mxfp4Config(dequantize=True), then save_pretrained)"
        )
    alpha = _field(hf_config, "swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise ValueError(
            f"the Hugging Face config's 'swiglu_alpha' must be {QUICK_GELU_ALPHA} (quick_gelu's gain, the "
            f"only one of Megatron-core's activations), got {alpha!r}"
        )
    if not _field(hf_config, "attention_bias", True):
        raise ValueError(
            "the Hugging Face config's 'attention_bias' must be true: gpt-oss's router and experts have "
            "biases, and Megatron-core's add_bias_linear puts them on every projection or on none"
        )
    experts = _positive(hf_config, "num_local_experts")
    topk = _positive(hf_config, "num_experts_per_tok")
    if topk > experts:
        raise ValueError(
            f"the Hugging Face config's 'num_experts_per_tok' ({topk}) exceeds num_local_experts ({experts})"
        )
    aux = _field(hf_config, "router_aux_loss_coef", 0.0) if _field(hf_config, "output_router_logits") else 0.0
    return dict(
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=_finite_positive(_field(hf_config, "swiglu_limit", 7.0), "swiglu_limit"),
        add_bias_linear=True,
        add_qkv_bias=True,
        softmax_type="learnable",
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=_field(hf_config, "intermediate_size"),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_aux_loss_coeff=float(aux or 0.0),
    )


def gpt_oss_rope(hf_config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """GPTModel's ``position_embedding_type``, ``rotary_base`` and ``rotary_percent`` of a gpt-oss
    config, and the config attributes YaRN reads (``yarn_*``, Megatron-core's, set on the config
    object): transformers' YaRN with ``truncate`` as ``yarn_correction_range_round_to_int``, its
    attention factor ``mscale / mscale_all_dim``'s when both are set, else ``0.1 ln(factor) + 1``
    (``yarn_mscale=1, yarn_mscale_all_dim=0``)."""
    params = _field(hf_config, "rope_parameters") or _field(hf_config, "rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", _field(hf_config, "rope_theta", 150000.0))
    theta = _finite_positive(theta, "rope_theta")
    partial = params.get("partial_rotary_factor", _field(hf_config, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(
            f"the Hugging Face config's 'partial_rotary_factor' must be 1 (YaRN rotates every channel), got "
            f"{partial!r}"
        )
    kwargs = dict(position_embedding_type="rope", rotary_base=theta, rotary_percent=1.0)
    if rope_type == "default":
        return kwargs, {}
    if rope_type != "yarn":
        raise ValueError(
            f"the Hugging Face config's 'rope_parameters' has rope type {rope_type!r}: gpt-oss maps "
            "'default' or 'yarn'"
        )
    original = params.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(
            f"the Hugging Face config's 'original_max_position_embeddings' (YaRN) must be a positive "
            f"integer, got {original!r}"
        )
    factor = params.get("factor") or _field(hf_config, "max_position_embeddings") / original
    if params.get("attention_factor") is not None:
        raise ValueError(
            "the Hugging Face config's 'attention_factor' (YaRN) is not expressible: Megatron-core derives "
            f"the factor from the scaling factor and mscale, got {params['attention_factor']!r}"
        )
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers then ignores both
        mscale, mscale_all_dim = 1.0, 0.0
    yarn = dict(
        yarn_rotary_scaling_factor=_finite_positive(factor, "factor"),
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=_finite_positive(params.get("beta_fast") or 32.0, "beta_fast"),
        yarn_beta_slow=_finite_positive(params.get("beta_slow") or 1.0, "beta_slow"),
        yarn_mscale=float(mscale),
        yarn_mscale_all_dim=float(mscale_all_dim),
        yarn_correction_range_round_to_int=bool(params.get("truncate", True)),
    )
    return dict(kwargs, position_embedding_type="yarn"), yarn


def _rope_parameters(model: torch.nn.Module) -> dict[str, Any]:
    """``rope_parameters`` of a model's rotary embedding; ValueError where transformers' YaRN
    computes another attention factor."""
    rope = model.rotary_pos_emb
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": float(rope.rotary_base)}
    if model.position_embedding_type != "yarn":
        return out
    yarn = yarn_arguments(model.config)
    mscale = 1.0 if yarn["mscale"] is None else yarn["mscale"]
    mscale_all_dim = 0.0 if yarn["mscale_all_dim"] is None else yarn["mscale_all_dim"]
    if (mscale, mscale_all_dim) != (1.0, 0.0) and not (mscale and mscale_all_dim):
        raise ValueError(
            f"the model's yarn_mscale={mscale} with yarn_mscale_all_dim={mscale_all_dim}: transformers' YaRN "
            "reads mscale only with mscale_all_dim, both nonzero (or 1 and 0: the plain factor)"
        )
    out.update(rope_type="yarn", factor=float(yarn["scaling_factor"]),
               original_max_position_embeddings=yarn["original_max_position_embeddings"],
               beta_fast=float(yarn["beta_fast"]), beta_slow=float(yarn["beta_slow"]),
               truncate=bool(yarn["correction_range_round_to_int"]))
    if mscale_all_dim:
        out.update(mscale=float(mscale), mscale_all_dim=float(mscale_all_dim))
    return out


def gpt_oss_config_dict(model: torch.nn.Module, vocab_size: int | None) -> dict[str, Any]:
    """``hf_config_dict`` of a model with gpt-oss's experts: a ``GptOssConfig``, or a ValueError
    naming every field transformers' gpt-oss cannot say. Without windowed layers every layer is
    ``full_attention`` and ``sliding_window`` (which transformers' gpt-oss reads whatever the layers)
    is ``max_position_embeddings``."""
    config = model.config
    layers = range(1, config.num_layers + 1)
    checks = {
        "normalization": (config.normalization, "RMSNorm"),
        "gated_linear_unit": (config.gated_linear_unit, True),
        "glu_linear_offset": (config.glu_linear_offset, 1.0),
        "activation_func_clamp_value is None": (config.activation_func_clamp_value is None, False),
        "add_bias_linear": (config.add_bias_linear, True),
        "qk_layernorm": (config.qk_layernorm, False),
        "softmax_type": (getattr(config, "softmax_type", "vanilla"), "learnable"),
        "position_embedding_type": (model.position_embedding_type,
                                    "yarn" if model.position_embedding_type == "yarn" else "rope"),
        "rotary_interleaved": (config.rotary_interleaved, False),
        "moe_layer_freq (every layer MoE)": ([is_moe_layer(config, n) for n in layers], [True] * len(layers)),
        "moe_router_score_function": (config.moe_router_score_function, "softmax"),
        "moe_router_pre_softmax": (config.moe_router_pre_softmax, False),
        "moe_router_topk_scaling_factor": (config.moe_router_topk_scaling_factor, None),
        "moe_router_enable_expert_bias": (config.moe_router_enable_expert_bias, False),
        "moe_router_num_groups": (config.moe_router_num_groups, None),
        "moe_shared_expert_intermediate_size": (config.moe_shared_expert_intermediate_size, None),
        "mtp_num_layers": (getattr(config, "mtp_num_layers", None), None),
    }
    differ = [f"{name}={got!r} (expected {want!r})" for name, (got, want) in checks.items() if got != want]
    if differ:
        raise ValueError("the model is not gpt-oss-shaped: " + ", ".join(differ))
    rope = model.rotary_pos_emb
    if rope.dim != config.kv_channels or rope.seq_len_interpolation_factor is not None:
        raise ValueError(
            "the model rotates part of each head or interpolates positions; a gpt-oss config cannot say so"
        )
    windows = [layer_window(config, n) for n in layers]
    coeff = config.moe_aux_loss_coeff
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": vocab_size or model.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.moe_ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "num_local_experts": config.num_moe_experts,
        "num_experts_per_tok": config.moe_router_topk,
        "max_position_embeddings": model.max_sequence_length,
        "rms_norm_eps": config.layernorm_epsilon,
        "rope_parameters": _rope_parameters(model),
        "sliding_window": window_keys(config.window_size) or model.max_sequence_length,
        "layer_types": [FULL if w is None else SLIDING for w in windows],
        "swiglu_alpha": QUICK_GELU_ALPHA,
        "swiglu_limit": float(config.activation_func_clamp_value),
        "attention_bias": True,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": bool(model.share_embeddings_and_output_weights),
        "router_aux_loss_coef": float(coeff if not isinstance(coeff, list) else sum(coeff)),
        "dtype": str(config.params_dtype).replace("torch.", ""),
    }


def expert_from_hf(gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                   down_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert's (fc1 weight [2 ffn, h] as ``[gate | up]``, fc2 weight [h, ffn], fc1 bias, fc2
    bias) from its slices of transformers' fused tensors (``gate_up`` [h, 2 ffn] interleaved)."""
    w1 = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1).t()
    b1 = torch.cat([gate_up_bias[0::2], gate_up_bias[1::2]])
    return w1, down.t(), b1, down_bias


def experts_to_hf(experts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """transformers' fused ``EXPERT_TENSORS`` of a layer's experts, each given as ``expert_from_hf``
    returns it (the inverse)."""
    out = []
    for w1, w2, b1, b2 in experts:
        gate, up = w1.chunk(2, dim=0)
        gate_bias, up_bias = b1.chunk(2)
        out.append((torch.stack([gate, up], dim=1).flatten(0, 1).t(),
                    torch.stack([gate_bias, up_bias], dim=1).flatten(), w2.t(), b2))
    return tuple(torch.stack(parts).contiguous() for parts in zip(*out))
