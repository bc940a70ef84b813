"""Hugging Face model configs and megatron_ext's: ``config_from_hf`` reads a Llama-family,
mixture-of-experts, DeepSeek or gpt-oss ``config.json`` (or ``PretrainedConfig``) into a
``TransformerConfig``; ``hf_config_dict`` writes one for a model. The weights are in
:mod:`megatron_ext.models.hf`, gpt-oss's own mapping in :mod:`megatron_ext.models.hf_gpt_oss`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from megatron_ext.models.hf_fields import _field, _positive, layer_windows, window_fields
from megatron_ext.models.hf_gpt_oss import gpt_oss_config_dict, gpt_oss_fields, gpt_oss_rope, is_gpt_oss
from megatron_ext.resolve import module_with
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.transformer_config import MLATransformerConfig
from megatron_ext.transformer.transformer_layer import is_moe_layer
from megatron_ext.transformer.utils import window_keys

_ACTIVATIONS: dict[str, Callable] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *_MOE_TYPES, *DEEPSEEK_TYPES, "gpt_oss")
# The config.json fields that size the model: each a positive integer.
_SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings")


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
    as zeros), ``max_sequence_length``, ``position_embedding_type`` (gpt-oss's YaRN: "yarn", its
    settings set on the config as Megatron-core's ``yarn_*`` attributes), ``rotary_base``,
    ``rotary_percent`` and ``share_embeddings_and_output_weights``. transformers' sliding window W
    becomes ``window_size=(W - 1, 0)`` on the layers it windows (``window_attn_skip_freq`` a list
    where only some are: ``hf_fields.layer_windows``). ``config_overrides`` set further TransformerConfig
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
    gpt_oss = model_type == "gpt_oss"  # its experts' activation is its own, whatever hidden_act says
    if act not in _ACTIVATIONS and not gpt_oss:
        raise NotImplementedError(f"hidden_act {act!r} is not supported: one of {list(_ACTIVATIONS)}")
    if model_type == "qwen2_moe":
        qkv_bias, linear_bias = bool(_field(hf_config, "qkv_bias", True)), False
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
        qkv_bias = model_type == "qwen2" or bool(_field(hf_config, "attention_bias", False))
        linear_bias = False
    elif model_type in DEEPSEEK_TYPES:
        for name in ("attention_bias", "mlp_bias"):
            if _field(hf_config, name, False):
                raise NotImplementedError(
                    f"{name}=True is not supported for {model_type}: Megatron-core's multi-latent attention "
                    "and MLPs have no biases there"
                )
        qkv_bias = linear_bias = False
    elif gpt_oss:
        qkv_bias = linear_bias = True  # refused otherwise (gpt_oss_fields)
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
    deepseek = model_type in DEEPSEEK_TYPES
    yarn: dict[str, Any] = {}
    if gpt_oss:
        rope_kwargs, yarn = gpt_oss_rope(hf_config)
    else:
        rotary_base, rotary_percent = (10000.0, 1.0) if deepseek else _rope(hf_config)
        rope_kwargs = dict(position_embedding_type="rope", rotary_base=rotary_base,
                           rotary_percent=rotary_percent)
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
        activation_func=_ACTIVATIONS.get(act),
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
    if gpt_oss:
        fields.update(gpt_oss_fields(hf_config))
    if deepseek:
        fields.update(_deepseek_fields(hf_config, model_type))
        # transformers routes in float32 whatever the model's dtype: so do 16-bit models here.
        if config_overrides.get("params_dtype", dtype) in (torch.bfloat16, torch.float16):
            fields["moe_router_dtype"] = "fp32"
    fields.update(config_overrides)
    fields.setdefault("pipeline_dtype", fields["params_dtype"])
    vocab = _field(hf_config, "vocab_size")
    vocab = -(-vocab // make_vocab_size_divisible_by) * make_vocab_size_divisible_by
    # transformers' sliding window W: query i sees keys i - W < j <= i, itself included.
    for name, value in window_fields(layer_windows(hf_config, model_type)).items():
        fields.setdefault(name, value)
    model_kwargs = dict(
        vocab_size=vocab,
        max_sequence_length=_field(hf_config, "max_position_embeddings"),
        **rope_kwargs,
        share_embeddings_and_output_weights=bool(_field(hf_config, "tie_word_embeddings", False)),
    )
    config = (MLATransformerConfig if deepseek else TransformerConfig)(**fields)
    for name, value in yarn.items():  # Megatron-core's YaRN settings are config attributes, not fields
        setattr(config, name, value)
    return config, model_kwargs


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


def _mla_rope(hf_config: Any) -> dict[str, Any]:
    """MLATransformerConfig's rotary fields of a DeepSeek config: the plain rotary embedding, or YaRN
    (``rope_type`` "yarn": factor, original positions, betas, mscale, mscale_all_dim). transformers
    ignores ``mscale`` unless ``mscale_all_dim`` is set too; Megatron-core does not: mapped so that both
    compute the same factors, and refused where no Megatron-core setting does."""
    params = _field(hf_config, "rope_parameters") or _field(hf_config, "rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", _field(hf_config, "rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise ValueError(
            f"the Hugging Face config's 'rope_theta' must be a positive finite number, got {theta!r}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1 is not supported with multi-latent attention")
    if rope_type == "default":
        return dict(rope_type="rope", rotary_base=float(theta), mscale_all_dim=0.0)
    if rope_type != "yarn":
        raise NotImplementedError(
            f"rope type {rope_type!r} is not supported for DeepSeek models: 'default' or 'yarn'"
        )
    original = params.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(
            f"YaRN's 'original_max_position_embeddings' must be a positive integer, got {original!r}"
        )
    factor = params.get("factor") or _field(hf_config, "max_position_embeddings") / original
    if params.get("truncate", True) is False:
        raise NotImplementedError(
            "YaRN with truncate=False is not supported (Megatron-core rounds the ramp's ends)"
        )
    if params.get("attention_factor") is not None:
        raise NotImplementedError("YaRN with an explicit attention_factor is not supported")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise NotImplementedError(
            f"YaRN with mscale_all_dim={mscale_all_dim} but mscale={mscale!r}: transformers then scales the "
            "rotary factor as mscale 1 and the softmax with mscale_all_dim, which no Megatron-core "
            "setting does"
        )
    if not mscale_all_dim:
        mscale, mscale_all_dim = 1.0, 0.0
    return dict(rope_type="yarn", rotary_base=float(theta), rotary_scaling_factor=float(factor),
                original_max_position_embeddings=original, beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), mscale=float(mscale),
                mscale_all_dim=float(mscale_all_dim))


def _deepseek_fields(hf_config: Any, model_type: str) -> dict[str, Any]:
    """The multi-latent attention and DeepSeek mixture-of-experts fields of a DeepSeek-V2 / V3 config
    (transformers' defaults where a field is missing). Routing: V3 takes the top-k of sigmoid scores
    plus ``e_score_correction_bias`` (the expert bias) within its ``topk_group`` best of ``n_group``
    groups, a group scored by its best two experts, the k scores renormalised; V2 the top-k of a
    softmax over all experts (``group_limited_greedy``: within the groups with the best single
    experts), not renormalised. Both times ``routed_scaling_factor``. Megatron-core scores a group by
    its best ``topk // group_topk`` experts: the configs where that differs are refused. The first
    ``first_k_dense_replace`` layers are dense MLPs of ``intermediate_size``; shared experts of
    ``n_shared_experts x moe_intermediate_size``. transformers' models have no multi-token
    prediction layers: ``mtp_num_layers`` stays None unless the caller sets it."""
    v3 = model_type == "deepseek_v3"
    heads, layers = _field(hf_config, "num_attention_heads"), _field(hf_config, "num_hidden_layers")
    if v3 and _field(hf_config, "rope_interleave", True) is False:
        raise NotImplementedError(
            "rope_interleave=False is not supported: Megatron-core's multi-latent attention rotates "
            "DeepSeek's interleaved channel pairs"
        )
    eps = _field(hf_config, "rms_norm_eps", 1e-6)
    if eps != 1e-6:
        raise NotImplementedError(
            f"rms_norm_eps={eps} is not supported for {model_type}: transformers' DeepSeek models normalise "
            "the latents with epsilon 1e-6 whatever rms_norm_eps says, Megatron-core's with "
            "layernorm_epsilon as the other norms; they agree at rms_norm_eps 1e-6 (DeepSeek's own value)"
        )
    q_rank = _field(hf_config, "q_lora_rank", 1536)
    fields: dict[str, Any] = dict(
        q_lora_rank=None if q_rank is None else _positive(hf_config, "q_lora_rank"),
        kv_lora_rank=_positive(hf_config, "kv_lora_rank", 512),
        qk_head_dim=_positive(hf_config, "qk_nope_head_dim", 128),
        qk_pos_emb_head_dim=_positive(hf_config, "qk_rope_head_dim", 64),
        v_head_dim=_positive(hf_config, "v_head_dim", 128),
        qk_layernorm=True,
        num_query_groups=_positive(hf_config, "num_key_value_heads", heads),
        **_mla_rope(hf_config),
    )
    dense = _field(hf_config, "first_k_dense_replace", 3 if v3 else 0)
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise ValueError(
            f"the Hugging Face config's 'first_k_dense_replace' must be an integer >= 0, got {dense!r}"
        )
    if dense >= layers:
        return fields  # every layer dense
    experts = _positive(hf_config, "n_routed_experts", 256 if v3 else 64)
    topk = _positive(hf_config, "num_experts_per_tok", 8 if v3 else None)
    if topk > experts:
        raise ValueError(
            f"the Hugging Face config's num_experts_per_tok ({topk}) exceeds n_routed_experts ({experts})"
        )
    groups, group_topk = _deepseek_groups(hf_config, model_type, experts, topk)
    scaling = float(_field(hf_config, "routed_scaling_factor", 2.5 if v3 else 1.0))
    shared = _field(hf_config, "n_shared_experts", 1 if v3 else 2)
    width = _positive(hf_config, "moe_intermediate_size", 2048 if v3 else 1407)
    fields.update(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=width,
        moe_layer_freq=[0] * dense + [1] * (layers - dense) if dense else 1,
        moe_shared_expert_intermediate_size=width * shared if shared else None,
        moe_router_num_groups=groups,
        moe_router_group_topk=group_topk,
        moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
        moe_router_score_function="sigmoid" if v3 else "softmax",
        moe_router_enable_expert_bias=v3,
        moe_router_pre_softmax=not v3,
        moe_aux_loss_coeff=0.0,
    )
    if v3 and bool(_field(hf_config, "norm_topk_prob", True)) != (topk > 1):
        raise NotImplementedError(
            f"norm_topk_prob={_field(hf_config, 'norm_topk_prob', True)} with num_experts_per_tok={topk} is "
            "not supported for deepseek_v3: Megatron-core renormalises the sigmoid scores of a top-k with "
            "k > 1, and only then"
        )
    return fields


def _deepseek_groups(hf_config: Any, model_type: str, experts: int, topk: int) -> tuple[Any, Any]:
    """(moe_router_num_groups, moe_router_group_topk) of a DeepSeek config's group-limited routing."""
    if model_type == "deepseek_v2":
        method = _field(hf_config, "topk_method", "greedy")
        if method == "greedy":
            return None, None
        if method != "group_limited_greedy":
            raise NotImplementedError(
                f"topk_method {method!r} is not supported for deepseek_v2: 'greedy' or 'group_limited_greedy'"
            )
        best_per_group = 1  # transformers' V2 scores a group by its best expert
    else:
        best_per_group = 2  # and V3 by its best two
    v3 = model_type == "deepseek_v3"
    groups = _field(hf_config, "n_group", 8 if v3 else None)
    group_topk = _field(hf_config, "topk_group", 4 if v3 else None)
    if model_type == "deepseek_v3" and (groups is None or groups <= 1):
        return None, None  # one group: every expert may be chosen
    for name, value in (("n_group", groups), ("topk_group", group_topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"the Hugging Face config's {name!r} must be a positive integer, got {value!r}")
    if experts % groups:
        raise ValueError(
            f"the Hugging Face config's n_routed_experts ({experts}) is not divisible by n_group ({groups})"
        )
    if topk // group_topk != best_per_group:
        raise NotImplementedError(
            f"{model_type}'s router scores a group by its best {best_per_group} expert(s), Megatron-core's "
            f"by its best num_experts_per_tok // topk_group = {topk} // {group_topk} = "
            f"{topk // group_topk}: not supported"
        )
    return groups, group_topk


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
    norms); a multi-latent attention model a ``DeepseekV3Config`` (sigmoid routing) or
    ``DeepseekV2Config`` (softmax routing); a mixture of quick-GEGLU experts a ``GptOssConfig``
    (``hf_gpt_oss.gpt_oss_config_dict``). ValueError for other models."""
    model = _chunks(model_chunks)[0]
    config = model.config
    if getattr(config, "multi_latent_attention", False):
        return _deepseek_config_dict(model, vocab_size)
    if is_gpt_oss(config):
        return gpt_oss_config_dict(model, vocab_size)
    moe_type = _moe_model_type(config) if config.num_moe_experts else None
    checks = {
        "normalization": (config.normalization, "RMSNorm"),
        "gated_linear_unit": (config.gated_linear_unit, True),
        "activation_func": (config.activation_func, F.silu),
        "position_embedding_type": (model.position_embedding_type, "rope"),
        "qk_layernorm": (config.qk_layernorm, moe_type == "qwen3_moe"),
        "rotary_interleaved": (config.rotary_interleaved, False),
        "mtp_num_layers": (getattr(config, "mtp_num_layers", None), None),
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


def _deepseek_config_dict(model: torch.nn.Module, vocab_size: int | None) -> dict[str, Any]:
    """``hf_config_dict`` of a multi-latent attention model: the inverse of ``_deepseek_fields``;
    ValueError naming what transformers' DeepSeek models cannot say."""
    config = model.config
    moe = config.num_moe_experts is not None and any(_moe_pattern(config))
    v3 = not moe or config.moe_router_score_function == "sigmoid"
    pattern = _moe_pattern(config) if moe else [0] * config.num_layers
    dense = pattern.index(1) if moe else config.num_layers
    checks = {
        "normalization": (config.normalization, "RMSNorm"),
        "gated_linear_unit": (config.gated_linear_unit, True),
        "activation_func": (config.activation_func, F.silu),
        "add_bias_linear": (config.add_bias_linear, False),
        "qk_layernorm": (config.qk_layernorm, True),
        "moe_layer_freq (dense layers first, then MoE layers)":
            (pattern, [0] * dense + [1] * (len(pattern) - dense)),
        "softmax_type": (getattr(config, "softmax_type", "vanilla"), "vanilla"),
        "window_size": (getattr(config, "window_size", None), None),
    }
    if moe:
        shared = config.moe_shared_expert_intermediate_size
        checks.update({
            "moe_shared_expert_intermediate_size (a multiple of moe_ffn_hidden_size)":
                ((shared or 0) % config.moe_ffn_hidden_size, 0),
            "moe_shared_expert_gate": (bool(config.moe_shared_expert_gate), False),
            "moe_router_pre_softmax": (config.moe_router_pre_softmax, not v3),
        })
        if config.moe_router_group_topk:
            per_group = config.moe_router_topk // config.moe_router_group_topk
            checks["moe_router_topk // moe_router_group_topk"] = (per_group, 2 if v3 else 1)
    differ = [f"{name}={got!r} (expected {want!r})" for name, (got, want) in checks.items() if got != want]
    if differ:
        raise ValueError("the model is not DeepSeek-shaped: " + ", ".join(differ))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rotary_base)}
    if config.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=float(config.rotary_scaling_factor),
                    original_max_position_embeddings=config.original_max_position_embeddings,
                    beta_fast=float(config.beta_fast), beta_slow=float(config.beta_slow),
                    mscale=float(config.mscale), mscale_all_dim=float(config.mscale_all_dim))
    out: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "vocab_size": vocab_size or model.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_head_dim,
        "qk_rope_head_dim": config.qk_pos_emb_head_dim,
        "v_head_dim": config.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_sequence_length,
        "rms_norm_eps": config.layernorm_epsilon,
        "rope_parameters": rope,
        "attention_bias": False,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": bool(model.share_embeddings_and_output_weights),
        "dtype": str(config.params_dtype).replace("torch.", ""),
        "first_k_dense_replace": dense,
    }
    if v3:
        out.update(rope_interleave=True, num_nextn_predict_layers=config.mtp_num_layers or 0)
    if not moe:
        return out
    out.update(
        n_routed_experts=config.num_moe_experts,
        num_experts_per_tok=config.moe_router_topk,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        n_shared_experts=(config.moe_shared_expert_intermediate_size or 0) // config.moe_ffn_hidden_size,
        routed_scaling_factor=float(config.moe_router_topk_scaling_factor or 1.0),
        n_group=config.moe_router_num_groups or 1,
        topk_group=config.moe_router_group_topk or 1,
    )
    if v3:
        out["norm_topk_prob"] = config.moe_router_topk > 1
    else:
        out["topk_method"] = "group_limited_greedy" if config.moe_router_group_topk else "greedy"
    return out


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    model = module_with(chunk, "decoder")  # through DistributedDataParallel and other wrappers
    if model is None:
        raise TypeError(f"expected megatron_ext GPTModel chunks, got {type(chunk).__name__}")
    return model


def _chunks(model_chunks) -> list[torch.nn.Module]:
    listed = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    chunks = [_unwrap(c) for c in listed]
    for model in chunks:  # layers no Hugging Face mapping of megatron_ext covers yet
        config = model.config
        for what, used in (("attention_output_gate", getattr(config, "attention_output_gate", False)),
                           ("experimental_attention_variant",
                            getattr(config, "experimental_attention_variant", None)),
                           ("a hybrid layer pattern (MambaModel)", getattr(model, "_layer_types", None))):
            if used:
                raise NotImplementedError(f"Hugging Face weights of models with {what} are not supported yet")
    return chunks
