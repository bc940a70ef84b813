"""Hugging Face weights in and out of a (tensor / pipeline / virtual-pipeline) parallel GPTModel.

Llama-family checkpoints (``LlamaForCausalLM``, and Mistral, Qwen2 and Qwen3, which only add
fields that map) become a ``TransformerConfig`` with RMSNorm, a gated MLP, rotary embeddings and
grouped-query attention. The tensors map one to one, except two that megatron_ext fuses:

- ``q_proj``, ``k_proj``, ``v_proj`` -> ``self_attention.query_key_value``, laid out group by
  group: each key/value head follows the query heads that share it;
- ``gate_proj``, ``up_proj`` -> ``mlp.dense_h_to_4h`` as ``[gate | up]``, dealt to
  tensor-parallel ranks with stride 2 so each rank holds matching rows of both.

Everything runs on whatever parallel layout the model was built for: a rank reads only the
tensors of its own layers (from a dict, or a directory of safetensors files opened lazily) and
keeps its shard of each. ``transformers`` and ``safetensors`` are imported only when a function
here needs them.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext import parallel_state
from megatron_ext.dist_checkpointing.core import _agree
from megatron_ext.resolve import module_with
from megatron_ext.transformer import TransformerConfig

_ACTIVATIONS: dict[str, Callable] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
    theta = params.get("rope_theta", _field(hf_config, "rope_theta", 10000.0))
    percent = params.get("partial_rotary_factor", _field(hf_config, "partial_rotary_factor", 1.0))
    return float(theta), float(percent)


def config_from_hf(
    hf_config: Any, make_vocab_size_divisible_by: int = 1, **config_overrides: Any
) -> tuple[TransformerConfig, dict[str, Any]]:
    """The ``TransformerConfig`` of a Hugging Face Llama-family config (a ``PretrainedConfig`` or
    its ``config.json`` as a dict), and the ``GPTModel`` keyword arguments it needs besides:
    ``vocab_size`` (rounded up to a multiple of ``make_vocab_size_divisible_by``; padded rows load
    as zeros), ``max_sequence_length`` (capped at a sliding window, which then never applies),
    ``position_embedding_type``, ``rotary_base``, ``rotary_percent`` and
    ``share_embeddings_and_output_weights``. ``config_overrides`` set further TransformerConfig
    fields (the parallel sizes, ``params_dtype``, ...); ``pipeline_dtype`` defaults to
    ``params_dtype``, which defaults to the checkpoint's dtype (float32 when it names none)::

        config, kwargs = config_from_hf(LlamaConfig.from_pretrained(path), tensor_model_parallel_size=2)
        model = GPTModel(config, **kwargs)
    """
    model_type = _field(hf_config, "model_type")
    if model_type not in _MODEL_TYPES:
        raise NotImplementedError(f"model_type {model_type!r} is not supported: one of {list(_MODEL_TYPES)}")
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
    if model_type in ("qwen2", "qwen3"):
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
    fields = dict(
        num_layers=_field(hf_config, "num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=_field(hf_config, "num_key_value_heads") or heads,
        kv_channels=_field(hf_config, "head_dim") or hidden // heads,
        ffn_hidden_size=_field(hf_config, "intermediate_size"),
        normalization="RMSNorm",
        layernorm_epsilon=_field(hf_config, "rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=_ACTIVATIONS[act],
        add_bias_linear=linear_bias,
        add_qkv_bias=qkv_bias,
        qk_layernorm=model_type == "qwen3",
        hidden_dropout=0.0,
        attention_dropout=float(_field(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=_field(hf_config, "initializer_range", 0.02),
        params_dtype=dtype,
    )
    fields.update(config_overrides)
    fields.setdefault("pipeline_dtype", fields["params_dtype"])
    vocab = _field(hf_config, "vocab_size")
    vocab = -(-vocab // make_vocab_size_divisible_by) * make_vocab_size_divisible_by
    max_length = _field(hf_config, "max_position_embeddings")
    window = _field(hf_config, "sliding_window")
    if window and (model_type == "mistral" or _field(hf_config, "use_sliding_window", False)):
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


def hf_config_dict(model_chunks, vocab_size: int | None = None) -> dict[str, Any]:
    """A ``LlamaConfig``'s ``config.json`` for a Llama-shaped GPTModel (RMSNorm, a SiLU gated MLP,
    rotary embeddings, biases on every linear or none, no query/key norms): what
    ``transformers.AutoModelForCausalLM.from_pretrained`` needs beside ``export_hf_state_dict``'s
    tensors. ``vocab_size`` drops padded vocabulary rows. ValueError for other models."""
    model = _chunks(model_chunks)[0]
    config = model.config
    checks = {
        "normalization": (config.normalization, "RMSNorm"),
        "gated_linear_unit": (config.gated_linear_unit, True),
        "activation_func": (config.activation_func, F.silu),
        "position_embedding_type": (model.position_embedding_type, "rope"),
        "qk_layernorm": (config.qk_layernorm, False),
        "rotary_interleaved": (config.rotary_interleaved, False),
        "add_qkv_bias": (config.add_qkv_bias and not config.add_bias_linear, False),
    }
    differ = [f"{name}={got!r} (expected {want!r})" for name, (got, want) in checks.items() if got != want]
    if differ:
        raise ValueError("the model is not Llama-shaped: " + ", ".join(differ))
    rope = model.rotary_pos_emb
    if rope.dim != config.kv_channels or rope.seq_len_interpolation_factor is not None:
        raise ValueError(
            "the model rotates part of each head or interpolates positions; a LlamaConfig cannot say so"
        )
    return {
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


# --- name and layout mapping ----------------------------------------------------------------------

_LAYER_NAMES = {  # megatron_ext name inside a layer -> Hugging Face name inside model.layers.{i}
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.dense.weight": "self_attn.o_proj.weight",
    "self_attention.dense.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
    "mlp.dense_4h_to_h.bias": "mlp.down_proj.bias",
}
_FUSED = {  # fused megatron_ext tensors and the Hugging Face tensors they hold, in order
    "self_attention.query_key_value": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.dense_h_to_4h": ("mlp.gate_proj", "mlp.up_proj"),
}
_GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    model = module_with(chunk, "decoder")  # through DistributedDataParallel and other wrappers
    if model is None:
        raise TypeError(f"expected megatron_ext GPTModel chunks, got {type(chunk).__name__}")
    return model


def _hf_sources(name: str, model: torch.nn.Module) -> tuple[str, ...]:
    """The Hugging Face tensors behind the megatron_ext parameter ``name`` of GPTModel ``model``."""
    if name in _GLOBAL_NAMES:
        return (_GLOBAL_NAMES[name],)
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        raise KeyError(f"no Hugging Face tensor for {name!r}")
    layer = model.decoder.layers[int(parts[2])]
    prefix = f"model.layers.{layer.layer_number - 1}."
    inner = ".".join(parts[3:])
    module, _, kind = inner.rpartition(".")
    if module in _FUSED:
        return tuple(f"{prefix}{source}.{kind}" for source in _FUSED[module])
    if inner not in _LAYER_NAMES:
        raise KeyError(f"no Hugging Face tensor for {name!r}")
    return (prefix + _LAYER_NAMES[inner],)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config) -> torch.Tensor:
    """``[q heads | k | v]`` per key/value group, along dim 0 (weights and biases alike)."""
    groups = config.num_query_groups
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(fused: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // groups * d
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, per_group + 2 * d, *rest).split([per_group, d, d], dim=1)
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))


def _local_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of the global tensor ``full`` as ``param``'s partition attributes deal it:
    ``tp * stride`` pieces along ``partition_dim``, rank r holding pieces r, r + tp, ..."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    dim = param.partition_dim % full.dim()
    pieces = full.chunk(tp * param.partition_stride, dim)
    return torch.cat(pieces[rank::tp], dim)


def _gather_global(param: torch.Tensor) -> torch.Tensor:
    """The global tensor of a tensor-parallel parameter (the inverse of ``_local_shard``)."""
    if not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    local = param.detach().contiguous()
    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local, group=group)
    dim, stride = param.partition_dim % local.dim(), param.partition_stride
    pieces = [shard.chunk(stride, dim) for shard in shards]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(tp)], dim)


def _read_json(file: str) -> dict:
    """A JSON object from ``file``; a ValueError naming the file when it is not one."""
    try:
        with open(file) as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file!r} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{file!r} holds a JSON {type(value).__name__}, expected an object")
    return value


def _safetensors_keys(file: str) -> list[str]:
    """The tensor names of a safetensors file; a ValueError naming the file when it is missing,
    truncated or not a safetensors file."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(file):
        raise ValueError(f"{file!r}: no such safetensors file")
    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise ValueError(f"{file!r} is not a readable safetensors file: {e}") from e


class _TensorSource:
    """Hugging Face tensors by name, from a dict or a directory / file of safetensors, read on demand."""

    def __init__(self, source: Mapping[str, torch.Tensor] | str | os.PathLike):
        self._dict = source if isinstance(source, Mapping) else None
        self._files: dict[str, str] = {}
        if self._dict is None:
            path = os.fspath(source)
            if os.path.isfile(path):
                files = [path]
            elif os.path.isdir(path):
                index = os.path.join(path, "model.safetensors.index.json")
                single = os.path.join(path, "model.safetensors")
                if os.path.isfile(index) and os.path.isfile(single):
                    raise ValueError(
                        f"{path!r} holds both {os.path.basename(index)} and {os.path.basename(single)}: two "
                        "models, one sharded and one in a single file; remove one of them"
                    )
                if os.path.isfile(index):
                    weight_map = _read_json(index).get("weight_map")
                    if not isinstance(weight_map, dict):
                        raise ValueError(f"{index!r} has no 'weight_map' (tensor name -> shard file)")
                    self._files = {k: os.path.join(path, v) for k, v in weight_map.items()}
                    for file in sorted(set(self._files.values())):
                        _safetensors_keys(file)  # each shard present and whole
                    return
                files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
            else:
                raise FileNotFoundError(f"{path!r}: no such file or directory of safetensors files")
            if not files:
                raise FileNotFoundError(f"{path!r} holds no .safetensors file")
            for file in files:
                self._files.update(dict.fromkeys(_safetensors_keys(file), file))

    def keys(self) -> list[str]:
        return list(self._dict if self._dict is not None else self._files)

    def __contains__(self, name: str) -> bool:
        return name in (self._dict if self._dict is not None else self._files)

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._dict is not None:
            return self._dict[name]
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as f:
            return f.get_tensor(name)


def hf_config_of(path: str | os.PathLike) -> dict:
    """The ``config.json`` of Hugging Face model directory ``path`` as a dict; a ValueError naming
    the file when it is not a JSON object."""
    return _read_json(os.path.join(os.fspath(path), "config.json"))


def hf_tensor_names(path: str | os.PathLike) -> list[str]:
    """The tensor names of the Hugging Face model in directory (or safetensors file) ``path``, after
    checking that its files are there, whole and one model (an index and a single-file model side
    by side are refused); a ValueError naming the file otherwise."""
    return _TensorSource(path).keys()


def _chunks(model_chunks) -> list[torch.nn.Module]:
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [_unwrap(c) for c in chunks]


def _parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The parameters that hold Hugging Face tensors: all but a tied embedding's copy on the last stage."""
    for name, param in model.named_parameters():
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            continue  # the first stage's embedding (same values, kept equal by the embedding group)
        yield name, param


@torch.no_grad()
def load_hf_state_dict(model_chunks, hf_state_dict: Mapping[str, torch.Tensor] | str | os.PathLike) -> None:
    """Fills this rank's shards of a GPTModel (or list of virtual-pipeline chunks, plain or wrapped
    in DistributedDataParallel) from a full Hugging Face state dict, or a directory of safetensors
    files (``model.safetensors`` or shards with their index), reading only the tensors of this
    rank's layers. A tied embedding's copy on the last pipeline stage is filled with the
    embedding. Every parameter is filled and every tensor of this rank's layers is used, or every
    rank raises the same ValueError naming what is missing or left over (collective: every rank
    calls it)."""
    error = None
    try:
        _load(_chunks(model_chunks), _TensorSource(hf_state_dict))
    except (KeyError, ValueError, OSError) as e:
        error = f"rank {dist.get_rank()}: {e.args[0] if isinstance(e, KeyError) else e}"
    _agree(error, "load_hf_state_dict: ", ValueError)


def _load(chunks: list[torch.nn.Module], source: _TensorSource) -> None:
    used: set[str] = set()
    layers: set[int] = set()
    for model in chunks:
        layers.update(layer.layer_number - 1 for layer in model.decoder.layers)
        config = model.config
        for name, param in model.named_parameters():
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                hf_names = ("model.embed_tokens.weight",)
            else:
                hf_names = _hf_sources(name, model)
            missing = [n for n in hf_names if n not in source]
            if missing:
                raise KeyError(f"the Hugging Face state dict has no {missing[0]!r} (for {name})")
            used.update(hf_names)
            tensors = [source[n] for n in hf_names]
            if name.endswith("query_key_value.weight") or name.endswith("query_key_value.bias"):
                full = _fuse_qkv(*tensors, config)
            else:
                full = torch.cat(tensors, dim=0)
            if "word_embeddings" in name or name == "output_layer.weight":
                full = _pad_rows(full, model.vocab_size)
            local = _local_shard(full, param)
            if local.shape != param.shape:
                raise ValueError(
                    f"{name}: the Hugging Face tensors {list(hf_names)} give a shard of shape "
                    f"{tuple(local.shape)} "
                    f"for a parameter of shape {tuple(param.shape)}: the model was not built from this config"
                )
            param.copy_(local)
    unused = [n for n in source.keys() if n.startswith("model.layers.") and int(n.split(".")[2]) in layers
              and n not in used and not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ValueError(f"tensors the model has no place for, e.g. {unused[:3]}: the model was not built "
                         "from this checkpoint's config")


def _pad_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    if full.shape[0] > rows:
        raise ValueError(f"a vocabulary of {full.shape[0]} rows does not fit the model's vocab_size {rows}")
    return (
        torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
        if full.shape[0] < rows
        else full
    )


@torch.no_grad()
def export_hf_state_dict(model_chunks, vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """The full Hugging Face state dict of a parallel GPTModel, gathered over tensor- and
    pipeline-parallel ranks and returned on every rank (collective: every rank calls it).
    ``vocab_size`` drops padded vocabulary rows. A tied model's ``lm_head.weight`` is the
    embedding, as ``PreTrainedModel.state_dict()`` reports it."""
    chunks = _chunks(model_chunks)
    local: dict[str, torch.Tensor] = {}
    tied = False
    for model in chunks:
        config = model.config
        tied = model.share_embeddings_and_output_weights
        for name, param in _parameters(model):
            full = _gather_global(param).cpu()
            hf_names = _hf_sources(name, model)
            if name.endswith("query_key_value.weight") or name.endswith("query_key_value.bias"):
                parts = _split_qkv(full, config)
            elif len(hf_names) > 1:
                parts = full.chunk(len(hf_names), dim=0)
            else:
                parts = (full,)
            for hf_name, part in zip(hf_names, parts):
                if vocab_size is not None and hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
                    part = part[:vocab_size]
                local[hf_name] = part.clone()
    gathered: list[dict[str, torch.Tensor]] = [{}] * parallel_state.get_pipeline_model_parallel_world_size()
    if len(gathered) > 1:
        dist.all_gather_object(gathered, local, group=parallel_state.get_pipeline_model_parallel_group())
    else:
        gathered = [local]
    out: dict[str, torch.Tensor] = {}
    for part in gathered:
        out.update(part)
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return dict(sorted(out.items(), key=lambda item: _hf_order(item[0])))


_LAYER_ORDER = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
    "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
    "post_attention_layernorm",
)


def _hf_order(name: str) -> tuple:
    """transformers' order: embedding, layers by index (modules as LlamaDecoderLayer defines them,
    weight before bias), final norm, output layer."""
    if name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        module, _, kind = rest.rpartition(".")
        return (1, int(index), _LAYER_ORDER.index(module), kind != "weight")
    return ({"model.embed_tokens.weight": 0, "model.norm.weight": 2}.get(name, 3), 0, 0, False)
