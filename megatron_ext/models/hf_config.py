"""Hugging Face model configs and megatron_ext's: ``config_from_hf`` reads a Llama-family or
mixture-of-experts ``config.json`` (or ``PretrainedConfig``) into a ``TransformerConfig``;
``hf_config_dict`` writes one for a model. The weights are in :mod:`megatron_ext.models.hf`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from megatron_ext.resolve import module_with
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.transformer_layer import is_moe_layer
from megatron_ext.transformer.utils import window_keys

_ACTIVATIONS: dict[str, Callable] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *_MOE_TYPES)
# The config.json fields that size the model: each a positive integer.
_SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings")


def _field(hf_config: Any, name: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(name, default)
    return getattr(hf_config, name, default)


def _rope(hf_config: Any) -> tuple[float, float]:
    """(rotary_base, rotary_percent); refuses rope types other than the plain one."""
    params = _field(hf_config, "rope_parameters") or _field(hf_config, "rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(
            f"rope type {rope_type!r} ({params}) is not supported: only the plain rotary embedding "
            "('default')"
        )
    numbers = []
    for name, default in (("rope_theta", 10000.0), ("partial_rotary_factor", 1.0)):
        value = params.get(name, _field(hf_config, name, default))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(
                f"the Hugging Face config's {name!r} must be a positive finite number, got {value!r}"
            )
        numbers.append(float(value))
    return numbers[0], numbers[1]


def config_from_hf(
    hf_config: Any, make_vocab_size_divisible_by: int = 1, **config_overrides: Any
) -> tuple[TransformerConfig, dict[str, Any]]:
    """The ``TransformerConfig`` of a Hugging Face Llama-family config (a ``PretrainedConfig`` or
    its ``config.json`` as a dict), and the ``GPTModel`` keyword arguments it needs besides:
    ``vocab_size`` (rounded up to a multiple of ``make_vocab_size_divisible_by``; padded rows load
    as zeros), ``max_sequence_length`` (for Qwen2's sliding window capped at it, which then never
    applies; Mistral's and Mixtral's ``sliding_window`` W becomes ``window_size=(W - 1, 0)``),
    ``position_embedding_type``, ``rotary_base``, ``rotary_percent`` and
    ``share_embeddings_and_output_weights``. ``config_overrides`` set further TransformerConfig
    fields (the parallel sizes, ``params_dtype``, ...); ``pipeline_dtype`` defaults to
    ``params_dtype``, which defaults to the checkpoint's dtype (float32 when it names none)::

        config, kwargs = config_from_hf(LlamaConfig.from_pretrained(path), tensor_model_parallel_size=2)
        model = GPTModel(config, **kwargs)
    """
    model_type = _field(hf_config, "model_type")
    if model_type not in _MODEL_TYPES:
        what = "the Hugging Face config has no 'model_type', expected" if model_type is None else (
            f"model_type {model_type!r} is not supported:"
        )
        raise NotImplementedError(f"{what} one of {list(_MODEL_TYPES)}")
    for name in _SIZE_FIELDS:
        value = _field(hf_config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"the Hugging Face config's {name!r} must be a positive integer, got "
                + ("nothing (the field is missing)" if value is None else repr(value))
            )
    act = _field(hf_config, "hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise NotImplementedError(f"hidden_act {act!r} is not supported: one of {list(_ACTIVATIONS)}")
    if model_type == "qwen2_moe":
        qkv_bias, linear_bias = bool(_field(hf_config, "qkv_bias", True)), False
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
        qkv_bias = model_type == "qwen2" or bool(_field(hf_config, "attention_bias", False))
        linear_bias = False
    else:
        attention_bias = bool(_field(hf_config, "attention_bias", False))
        linear_bias = bool(_field(hf_config, "mlp_bias", False))
        if attention_bias != linear_bias:
            raise NotImplementedError(
                f"attention_bias={attention_bias} with mlp_bias={linear_bias} is not supported: biases on "
                "all "
                "linear layers or on none"
            )
        qkv_bias = attention_bias
    heads = _field(hf_config, "num_attention_heads")
    hidden = _field(hf_config, "hidden_size")
    rotary_base, rotary_percent = _rope(hf_config)
    dtype = _field(hf_config, "dtype") or _field(hf_config, "torch_dtype") or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    groups = _positive(hf_config, "num_key_value_heads", heads)
    if heads % groups != 0:
        raise ValueError(
            f"the Hugging Face config's 'num_key_value_heads' ({groups}) must divide 'num_attention_heads' "
            f"({heads})"
        )
    fields = dict(
        num_layers=_field(hf_config, "num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=_positive(hf_config, "head_dim", hidden // heads),
        ffn_hidden_size=_field(hf_config, "intermediate_size"),
        normalization="RMSNorm",
        layernorm_epsilon=_field(hf_config, "rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=_ACTIVATIONS[act],
        add_bias_linear=linear_bias,
        add_qkv_bias=qkv_bias,
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=float(_field(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=_field(hf_config, "initializer_range", 0.02),
        params_dtype=dtype,
    )
    if model_type in _MOE_TYPES:
        fields.update(_moe_fields(hf_config, model_type))
    fields.update(config_overrides)
    fields.setdefault("pipeline_dtype", fields["params_dtype"])
    vocab = _field(hf_config, "vocab_size")
    vocab = -(-vocab // make_vocab_size_divisible_by) * make_vocab_size_divisible_by
    max_length = _field(hf_config, "max_position_embeddings")
    window = _field(hf_config, "sliding_window")
    if window and model_type in ("mistral", "mixtral"):
        # transformers' sliding window: query i sees keys i - window < j <= i, itself included.
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(
                f"the Hugging Face config's 'sliding_window' must be a positive integer, got {window!r}"
            )
        fields.setdefault("window_size", (window - 1, 0))
    elif window and _field(hf_config, "use_sliding_window", False):
        max_length = min(max_length, window)
    model_kwargs = dict(
        vocab_size=vocab,
        max_sequence_length=max_length,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        rotary_percent=rotary_percent,
        share_embeddings_and_output_weights=bool(_field(hf_config, "tie_word_embeddings", False)),
    )
    return TransformerConfig(**fields), model_kwargs


def _positive(hf_config: Any, name: str, default: Any = None) -> int:
    """The field, or ``default`` where it is missing or null; refused unless a positive integer."""
    value = _field(hf_config, name)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"the Hugging Face config's {name!r} must be a positive integer, got "
            + ("nothing (the field is missing)" if value is None else repr(value))
        )
    return value


def _moe_fields(hf_config: Any, model_type: str) -> dict[str, Any]:
    """The mixture-of-experts TransformerConfig fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.

    Routing: both take the top-k of a softmax over all experts; Mixtral renormalises the k
    weights (= a softmax over the top-k logits: ``moe_router_pre_softmax=False``), Qwen does when
    ``norm_topk_prob`` (else the weights stay the full softmax's: ``moe_router_pre_softmax=True``).
    Qwen's layer i is an MoE layer unless it is in ``mlp_only_layers`` or ``(i + 1)`` is not a
    multiple of ``decoder_sparse_step``; the others are dense MLPs of ``intermediate_size``."""
    layers = _field(hf_config, "num_hidden_layers")
    experts_field = "num_local_experts" if model_type == "mixtral" else "num_experts"
    experts = _positive(hf_config, experts_field)
    topk = _positive(hf_config, "num_experts_per_tok")
    if topk > experts:
        raise ValueError(
            f"the Hugging Face config's num_experts_per_tok ({topk}) exceeds {experts_field} ({experts})"
        )
    aux = _field(hf_config, "router_aux_loss_coef", 0.0) if _field(hf_config, "output_router_logits") else 0.0
    fields: dict[str, Any] = dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_router_score_function="softmax",
        moe_aux_loss_coeff=float(aux or 0.0),
    )
    if model_type == "mixtral":
        fields.update(moe_ffn_hidden_size=_field(hf_config, "intermediate_size"),
                      moe_router_pre_softmax=False)
        return fields
    step = _positive(hf_config, "decoder_sparse_step", 1)
    dense = _field(hf_config, "mlp_only_layers") or []
    if not isinstance(dense, (list, tuple)) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in dense
    ):
        raise ValueError(
            f"the Hugging Face config's 'mlp_only_layers' must list layer indices below {layers}, "
            f"got {dense!r}"
        )
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise ValueError(
            "the Hugging Face config makes no layer a mixture of experts "
            f"(decoder_sparse_step={step}, mlp_only_layers={list(dense)})"
        )
    fields.update(
        moe_ffn_hidden_size=_positive(hf_config, "moe_intermediate_size"),
        moe_router_pre_softmax=not _field(hf_config, "norm_topk_prob", False),
        moe_layer_freq=1 if all(pattern) else pattern,
    )
    if model_type == "qwen2_moe":
        fields.update(
            moe_shared_expert_intermediate_size=_positive(hf_config, "shared_expert_intermediate_size"),
            moe_shared_expert_gate=True,
        )
    return fields


def _moe_model_type(config) -> str:
    """The Hugging Face model type a mixture-of-experts GPTModel's tensors are named for: Qwen2-MoE
    with shared experts, Qwen3-MoE with query/key norms, else Mixtral."""
    if config.moe_shared_expert_intermediate_size is not None:
        return "qwen2_moe"
    return "qwen3_moe" if config.qk_layernorm else "mixtral"


def _moe_pattern(config) -> list[int]:
    return [int(is_moe_layer(config, n)) for n in range(1, config.num_layers + 1)]


def hf_config_dict(model_chunks, vocab_size: int | None = None) -> dict[str, Any]:
    """A Hugging Face ``config.json`` for a GPTModel with RMSNorm, a SiLU gated MLP and rotary
    embeddings: what ``transformers.AutoModelForCausalLM.from_pretrained`` needs beside
    ``export_hf_state_dict``'s tensors. ``vocab_size`` drops padded vocabulary rows. A dense model
    becomes a ``LlamaConfig`` (biases on every linear or none, no query/key norms), or with a
    sliding window on every layer a ``MistralConfig`` (no biases); a mixture of
    experts (softmax routing, no biases) a ``MixtralConfig`` (every layer MoE, the top-k weights
    renormalised), a ``Qwen2MoeConfig`` (gated shared experts) or a ``Qwen3MoeConfig`` (query/key
    norms). ValueError for other models."""
    model = _chunks(model_chunks)[0]
    config = model.config
    moe_type = _moe_model_type(config) if config.num_moe_experts else None
    checks = {
        "normalization": (config.normalization, "RMSNorm"),
        "gated_linear_unit": (config.gated_linear_unit, True),
        "activation_func": (config.activation_func, F.silu),
        "position_embedding_type": (model.position_embedding_type, "rope"),
        "qk_layernorm": (config.qk_layernorm, moe_type == "qwen3_moe"),
        "rotary_interleaved": (config.rotary_interleaved, False),
    }
    if moe_type is None:
        checks["add_qkv_bias"] = (config.add_qkv_bias and not config.add_bias_linear, False)
    else:
        checks["add_bias_linear"] = (config.add_bias_linear, False)
        if moe_type != "qwen2_moe":
            checks["add_qkv_bias"] = (config.add_qkv_bias, False)
        else:
            checks["moe_shared_expert_gate"] = (bool(config.moe_shared_expert_gate), True)
        checks["moe_router_score_function"] = (config.moe_router_score_function, "softmax")
        checks["moe_router_topk_scaling_factor"] = (config.moe_router_topk_scaling_factor, None)
        checks["moe_router_enable_expert_bias"] = (config.moe_router_enable_expert_bias, False)
        if moe_type == "mixtral":
            checks["moe_router_pre_softmax"] = (config.moe_router_pre_softmax, False)
            checks["moe_layer_freq"] = (_moe_pattern(config), [1] * config.num_layers)
    # A sliding window on every layer is Mistral's (or Mixtral's); sinks and windows on some layers
    # only have no config here.
    window = window_keys(getattr(config, "window_size", None))
    checks["softmax_type"] = (getattr(config, "softmax_type", "vanilla"), "vanilla")
    if window is not None:
        checks["window_attn_skip_freq"] = (getattr(config, "window_attn_skip_freq", None), None)
        if moe_type is None:
            checks["add_bias_linear"] = (config.add_bias_linear, False)
        elif moe_type != "mixtral":
            checks["window_size"] = (config.window_size, None)
    differ = [f"{name}={got!r} (expected {want!r})" for name, (got, want) in checks.items() if got != want]
    if differ:
        shape = "Llama-shaped" if moe_type is None else f"a {moe_type} model"
        raise ValueError(f"the model is not {shape}: " + ", ".join(differ))
    rope = model.rotary_pos_emb
    if rope.dim != config.kv_channels or rope.seq_len_interpolation_factor is not None:
        raise ValueError(
            "the model rotates part of each head or interpolates positions; a Hugging Face config cannot "
            "say so"
        )
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size or model.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_sequence_length,
        "rms_norm_eps": config.layernorm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rope.rotary_base)},
        "attention_bias": bool(config.add_bias_linear),
        "mlp_bias": bool(config.add_bias_linear),
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": bool(model.share_embeddings_and_output_weights),
        "dtype": str(config.params_dtype).replace("torch.", ""),
    }
    if moe_type is None and window is not None:
        del out["attention_bias"], out["mlp_bias"]
        out.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    if moe_type is None:
        return out
    del out["mlp_bias"]
    out["model_type"] = moe_type
    out["num_experts_per_tok"] = config.moe_router_topk
    coeff = config.moe_aux_loss_coeff
    out["router_aux_loss_coef"] = float(coeff if not isinstance(coeff, list) else sum(coeff))
    if moe_type == "mixtral":
        out.update(architectures=["MixtralForCausalLM"], intermediate_size=config.moe_ffn_hidden_size,
                   num_local_experts=config.num_moe_experts, sliding_window=window)
        return out
    out.update(
        architectures=["Qwen2MoeForCausalLM" if moe_type == "qwen2_moe" else "Qwen3MoeForCausalLM"],
        num_experts=config.num_moe_experts,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        norm_topk_prob=not config.moe_router_pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(_moe_pattern(config)) if not moe],
        use_sliding_window=False,
    )
    if moe_type == "qwen2_moe":
        del out["attention_bias"]
        out.update(qkv_bias=bool(config.add_qkv_bias),
                   shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size)
    return out


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    model = module_with(chunk, "decoder")  # through DistributedDataParallel and other wrappers
    if model is None:
        raise TypeError(f"expected megatron_ext GPTModel chunks, got {type(chunk).__name__}")
    return model


def _chunks(model_chunks) -> list[torch.nn.Module]:
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [_unwrap(c) for c in chunks]
