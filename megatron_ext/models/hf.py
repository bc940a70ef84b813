"""Hugging Face weights in and out of a (tensor / pipeline / virtual-pipeline) parallel GPTModel.

Llama-family checkpoints (``LlamaForCausalLM``, and Mistral, Qwen2 and Qwen3, which only add
fields that map) become a ``TransformerConfig`` with RMSNorm, a gated MLP, rotary embeddings and
grouped-query attention. The tensors map one to one, except two that megatron_ext fuses:

- ``q_proj``, ``k_proj``, ``v_proj`` -> ``self_attention.query_key_value``, laid out group by
  group: each key/value head follows the query heads that share it;
- ``gate_proj``, ``up_proj`` -> ``mlp.dense_h_to_4h`` as ``[gate | up]``, dealt to
  tensor-parallel ranks with stride 2 so each rank holds matching rows of both.

Mixtral, Qwen2-MoE and Qwen3-MoE add mixture-of-experts layers: the router (``gate``) ->
``mlp.router``, Qwen2-MoE's shared expert and its sigmoid gate -> ``mlp.shared_experts``, and
each routed expert, by global index, -> the local expert of the expert-parallel rank that holds
it, ``[gate | up]`` and ``down`` split over the expert-tensor-parallel group like the dense MLP.
The experts are read from transformers' in-memory fused tensors (``mlp.experts.gate_up_proj``,
``down_proj``) or the files' per-expert ones, and exported under the files' names. gpt-oss
(``hf_gpt_oss``) adds the attention sinks (``self_attn.sinks`` -> ``self_attention.softmax_offset``),
the router's bias (``mlp.router``) and experts fused with their biases, gate and up interleaved.

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

from megatron_ext import parallel_state
from megatron_ext.dist_checkpointing.core import _agree
from megatron_ext.resolve import group_rank, group_size
from megatron_ext.transformer.moe.moe_layer import MoELayer
from megatron_ext.models.hf_gpt_oss import EXPERT_TENSORS, expert_from_hf, experts_to_hf, is_gpt_oss
from megatron_ext.models.hf_config import (  # noqa: F401  (config_from_hf, hf_config_dict: public here too)
    _chunks,
    _moe_model_type,
    _unwrap,
    config_from_hf,
    hf_config_dict,
)

# --- name and layout mapping ----------------------------------------------------------------------

_LAYER_NAMES = {  # megatron_ext name inside a layer -> Hugging Face name inside model.layers.{i}
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.dense.weight": "self_attn.o_proj.weight",
    "self_attention.dense.bias": "self_attn.o_proj.bias",
    "self_attention.softmax_offset": "self_attn.sinks",  # gpt-oss's attention sinks
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
    "mlp.dense_4h_to_h.bias": "mlp.down_proj.bias",
    "mlp.shared_experts.dense_4h_to_h.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    # multi-latent attention (DeepSeek-V2/V3)
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_latent_norm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_latent_norm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
}
# A multi-token prediction depth's own tensors (DeepSeek-V3's files: the depth is layer
# num_hidden_layers + k, its final norm ``shared_head.norm``) besides its transformer layer's.
_MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
# The copies of the embedding and output weight the files keep with each depth.
_MTP_COPIES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
}
_FUSED = {  # fused megatron_ext tensors and the Hugging Face tensors they hold, in order
    "self_attention.query_key_value": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.dense_h_to_4h": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.shared_experts.dense_h_to_4h": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
}
# A routed expert's (gate, up, down) projections in the files of each naming (Mixtral's, Qwen's).
_EXPERT_NAMES = {
    "block_sparse_moe": ("w1", "w3", "w2"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
_GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _moe_block(config) -> str:
    """The module that holds a MoE layer's router and experts in the files: Mixtral's
    ``block_sparse_moe``, Qwen's and gpt-oss's ``mlp``."""
    return "block_sparse_moe" if not is_gpt_oss(config) and _moe_model_type(config) == "mixtral" else "mlp"


def _router_module(config, block: str | None = None) -> str:
    """A MoE layer's router in the files: gpt-oss's ``mlp.router``, the others' ``{block}.gate``."""
    return "mlp.router" if is_gpt_oss(config) else f"{block or _moe_block(config)}.gate"


def _expert_names(prefix: str, block: str, expert: int) -> tuple[str, str, str]:
    return tuple(f"{prefix}{block}.experts.{expert}.{p}.weight" for p in _EXPERT_NAMES[block])


def _layer_of(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module | None, str]:
    """The transformer layer a parameter ``name`` of GPTModel ``model`` lies in (a decoder layer or
    a multi-token prediction depth's) and its name inside it; ``(None, name)`` for others."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        return model.decoder.layers[int(parts[2])], ".".join(parts[3:])
    if parts[:2] == ["mtp", "layers"] and parts[3] == "transformer_layer":
        return model.mtp.layers[int(parts[2])].transformer_layer, ".".join(parts[4:])
    return None, name


def _hf_sources(name: str, model: torch.nn.Module, block: str | None = None) -> tuple[str, ...]:
    """The Hugging Face tensors behind the megatron_ext parameter ``name`` of GPTModel ``model``
    (the routed experts aside: ``_load_experts``, ``_export_experts``); ``block`` names a MoE
    layer's router module (default: the model type's)."""
    if name in _GLOBAL_NAMES:
        return (_GLOBAL_NAMES[name],)
    parts = name.split(".")
    if parts[:2] == ["mtp", "layers"] and parts[3] in ("enorm", "hnorm", "eh_proj", "final_layernorm"):
        depth = model.config.num_layers + int(parts[2])
        return (f"model.layers.{depth}.{_MTP_NAMES['.'.join(parts[3:])]}",)
    layer, inner = _layer_of(model, name)
    if layer is None:
        raise KeyError(f"no Hugging Face tensor for {name!r}")
    prefix = f"model.layers.{layer.layer_number - 1}."
    if inner in ("mlp.router.weight", "mlp.router.bias"):
        return (f"{prefix}{_router_module(model.config, block)}.{inner.rsplit('.', 1)[1]}",)
    module, _, kind = inner.rpartition(".")
    if module in _FUSED:
        names = tuple(f"{prefix}{source}.{kind}" for source in _FUSED[module])
    elif inner in _LAYER_NAMES:
        names = (prefix + _LAYER_NAMES[inner],)
    else:
        raise KeyError(f"no Hugging Face tensor for {name!r}")
    if _is_deepseek(model.config):  # DeepSeek's shared experts: ``mlp.shared_experts.*``
        names = tuple(n.replace(".mlp.shared_expert.", ".mlp.shared_experts.") for n in names)
    return names


def _is_deepseek(config) -> bool:
    return bool(getattr(config, "multi_latent_attention", False))


def _transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers and its multi-token prediction depths' layers."""
    if not getattr(model, "mtp_process", False):
        return list(model.decoder.layers)
    mtp = [depth.transformer_layer for depth in model.mtp.layers]
    return list(model.decoder.layers) + mtp


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


def _shard(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full``: ``size * stride`` pieces along ``dim``, rank r holding
    pieces r, r + size, ..."""
    pieces = full.chunk(size * stride, dim)
    return torch.cat(pieces[rank::size], dim)


def _gather(local: torch.Tensor, dim: int, stride: int, group: Any) -> torch.Tensor:
    """The inverse of ``_shard`` over ``group`` (collective)."""
    size = group_size(group)
    if size == 1:
        return local.detach()
    local = local.detach().contiguous()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local, group=group)
    pieces = [shard.chunk(stride, dim) for shard in shards]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(size)], dim)


def _local_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of the global tensor ``full`` as ``param``'s partition attributes deal it
    over the tensor-parallel group."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    return _shard(
        full, param.partition_dim % full.dim(), param.partition_stride,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def _gather_global(param: torch.Tensor) -> torch.Tensor:
    """The global tensor of a tensor-parallel parameter (the inverse of ``_local_shard``)."""
    if not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    return _gather(
        param, param.partition_dim % param.dim(), param.partition_stride,
        parallel_state.get_tensor_model_parallel_group(),
    )


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
                    bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
                    if bad or not weight_map:
                        raise ValueError(
                            f"{index!r}: 'weight_map' must map tensor names to shard file names, got "
                            + (f"{weight_map[bad[0]]!r} for {bad[0]!r}" if bad else "an empty map")
                        )
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
        config = model.config
        if getattr(model, "mtp_process", False):
            _check_mtp_tensors(model, source, used)
        for layer in _transformer_layers(model):
            layers.add(layer.layer_number - 1)
            if isinstance(layer.mlp, MoELayer):
                _load_experts(layer, source, used)
                _load_expert_bias(layer, source, used)
        for name, param in model.named_parameters():
            if ".mlp.experts." in name:  # _load_experts
                continue
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                hf_names = ("model.embed_tokens.weight",)
            elif name.endswith(".mlp.router.weight") and not is_gpt_oss(config):
                hf_names = (_router_name(source, _layer_of(model, name)[0]),)
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


def _check_mtp_tensors(model: torch.nn.Module, source: _TensorSource, used: set[str]) -> None:
    """The multi-token prediction depths are in the files (DeepSeek-V3's layers ``num_hidden_layers
    + k``), with their copies of the embedding and output weight equal to the model's own."""
    first = f"model.layers.{model.config.num_layers}.eh_proj.weight"
    if first not in source:
        raise KeyError(
            f"the Hugging Face state dict has no multi-token prediction layers ({first!r}): transformers' "
            "models hold none; build the model with mtp_num_layers=None, or load a checkpoint that has them"
        )
    for depth in range(model.config.mtp_num_layers):
        for copy, main in _MTP_COPIES.items():
            name = f"model.layers.{model.config.num_layers + depth}.{copy}"
            if name not in source:
                continue
            main = main if main in source else "model.embed_tokens.weight"  # a tied output weight
            if not torch.equal(source[name], source[main]):
                raise ValueError(f"{name} differs from {main}: multi-token prediction shares the model's own")
            used.add(name)


def _load_expert_bias(layer: torch.nn.Module, source: _TensorSource, used: set[str]) -> None:
    """A router's expert bias (Megatron-core's ``expert_bias``) from DeepSeek-V3's
    ``mlp.gate.e_score_correction_bias``."""
    router = layer.mlp.router
    if router.expert_bias is None:
        return
    name = f"model.layers.{layer.layer_number - 1}.mlp.gate.e_score_correction_bias"
    if name not in source:
        raise KeyError(f"the Hugging Face state dict has no {name!r} (for the router's expert bias)")
    bias = source[name]
    if bias.shape != router.expert_bias.shape:
        raise ValueError(
            f"{name} has shape {tuple(bias.shape)}, the router's expert bias "
            f"{tuple(router.expert_bias.shape)}: the model was not built from this config"
        )
    router.expert_bias.copy_(bias)
    used.add(name)


def _router_name(source: _TensorSource, layer: torch.nn.Module) -> str:
    """A MoE layer's router in ``source``: Mixtral's files name it ``block_sparse_moe.gate``,
    transformers' in-memory state dicts and Qwen's files ``mlp.gate``, gpt-oss ``mlp.router``."""
    prefix = f"model.layers.{layer.layer_number - 1}."
    if is_gpt_oss(layer.config):
        return f"{prefix}mlp.router.weight"
    for block in _EXPERT_NAMES:
        if f"{prefix}{block}.gate.weight" in source:
            return f"{prefix}{block}.gate.weight"
    return f"{prefix}{_moe_block(layer.config)}.gate.weight"


def _experts_in(source: _TensorSource, layer: torch.nn.Module, used: set[str]) -> Callable[[int], tuple]:
    """For a MoE layer: checks that ``source`` holds as many experts as the model (the router's
    rows, the fused tensors' first dimension, no expert past the last), marks them all used (each
    has a place, on this rank or another expert-parallel rank) and returns ``expert -> (W1 [gate |
    up], W2, b1, b2)``, from the files' per-expert tensors or transformers' fused ones; the biases
    are gpt-oss's (``hf_gpt_oss``), None for the other families."""
    config, index = layer.config, layer.layer_number - 1
    prefix, experts = f"model.layers.{index}.", config.num_moe_experts
    router = _router_name(source, layer)
    counts = {router: source[router].shape[0]} if router in source else {}
    gpt_oss = is_gpt_oss(config)
    names = EXPERT_TENSORS if gpt_oss else ("gate_up_proj", "down_proj")
    fused = tuple(f"{prefix}mlp.experts.{name}" for name in names)
    read = functools.cache(lambda name: source[name])  # a fused tensor read once for all experts
    if all(n in source for n in fused):
        counts.update({n: read(n).shape[0] for n in fused})
        used.update(fused)
    for block in () if gpt_oss else _EXPERT_NAMES:
        if _expert_names(prefix, block, 0)[0] in source:
            held = 0
            while _expert_names(prefix, block, held)[0] in source:
                held += 1
            counts[f"{prefix}{block}.experts.{{e}}.{_EXPERT_NAMES[block][0]}.weight"] = held
            used.update(n for e in range(experts) for n in _expert_names(prefix, block, e))
    wrong = {n: c for n, c in counts.items() if c != experts}
    if wrong:
        raise ValueError(
            f"layer {index} of the Hugging Face checkpoint has a different number of experts than the "
            f"model's num_moe_experts={experts}: " + ", ".join(f"{n} gives {c}" for n, c in wrong.items())
        )

    def expert(e: int) -> tuple:
        if gpt_oss:
            missing = [n for n in fused if n not in source]
            if missing:
                raise KeyError(
                    f"the Hugging Face state dict has no {missing[0]!r}: expert {e} of layer {index}"
                )
            return expert_from_hf(*(read(n)[e] for n in fused))
        for block in _EXPERT_NAMES:
            names = _expert_names(prefix, block, e)
            if all(n in source for n in names):
                gate, up, down = (source[n] for n in names)
                return torch.cat([gate, up]), down, None, None
        if all(n in source for n in fused):
            return read(fused[0])[e], read(fused[1])[e], None, None
        raise KeyError(
            f"the Hugging Face state dict has no {_expert_names(prefix, _moe_block(config), e)[0]!r} (nor "
            f"{fused[0]!r}): expert {e} of layer {index}"
        )

    return expert


def _load_experts(layer: torch.nn.Module, source: _TensorSource, used: set[str]) -> None:
    """Fills a MoE layer's local experts (its global experts ``local_expert_indices``), each
    split over the expert-tensor-parallel group like the dense MLP (W1 ``[gate | up]`` and its bias
    by rows with stride 2, W2 by columns; the second bias whole on every rank)."""
    mlp, index = layer.mlp, layer.layer_number - 1
    expert = _experts_in(source, layer, used)
    group = mlp.experts.tp_group
    rank, size = group_rank(group), group_size(group)
    biases = mlp.experts.expert_biases() or [(None, None)] * len(mlp.local_expert_indices)
    for e, (w1, w2), (b1, b2) in zip(mlp.local_expert_indices, mlp.experts.expert_weights(), biases):
        full_w1, full_w2, full_b1, full_b2 = expert(e)
        if (b1 is None) != (full_b1 is None):
            raise KeyError(
                f"expert {e} of layer {index}: the model's experts have "
                f"{'no biases' if b1 is None else 'biases'}, the Hugging Face checkpoint's "
                f"{'do' if b1 is None else 'none'}: the model was not built from this config"
            )
        pairs = [(w1, _shard(full_w1, 0, 2, rank, size)), (w2, _shard(full_w2, 1, 1, rank, size))]
        if b1 is not None:
            pairs += [(b1, _shard(full_b1, 0, 2, rank, size)), (b2, full_b2)]
        for param, local in pairs:
            if local.shape != param.shape:
                raise ValueError(
                    f"expert {e} of layer {index}: the Hugging Face tensors give a shard of shape "
                    f"{tuple(local.shape)} for a tensor of shape {tuple(param.shape)}: the model was not "
                    "built from this config"
                )
            param.copy_(local)


def _export_experts(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A MoE layer's routed experts under their file names (gpt-oss's fused tensors with their
    biases, the others' per expert), gathered over the expert-tensor- and the expert-parallel group
    (collective over both)."""
    mlp, config = layer.mlp, layer.config
    group = mlp.experts.tp_group
    prefix, block = f"model.layers.{layer.layer_number - 1}.", _moe_block(config)
    biases = mlp.experts.expert_biases() or [(None, None)] * len(mlp.local_expert_indices)
    local: dict[int, tuple[torch.Tensor, ...]] = {}
    for e, (w1, w2), (b1, b2) in zip(mlp.local_expert_indices, mlp.experts.expert_weights(), biases):
        parts = [_gather(w1, 0, 2, group), _gather(w2, 1, 1, group)]
        if b1 is not None:
            parts += [_gather(b1, 0, 2, group), b2.detach()]
        local[e] = tuple(t.cpu().clone() for t in parts)
    ep_group = mlp.experts.ep_group
    if group_size(ep_group) > 1:
        gathered: list[dict[int, tuple]] = [{}] * group_size(ep_group)
        dist.all_gather_object(gathered, local, group=ep_group)
        local = {e: parts for part in gathered for e, parts in part.items()}
    if is_gpt_oss(config):
        if biases[0][0] is None:
            raise ValueError("gpt-oss's experts have biases; the model's have none (add_bias_linear=False)")
        tensors = experts_to_hf([local[e] for e in range(config.num_moe_experts)])
        return {f"{prefix}mlp.experts.{name}": t for name, t in zip(EXPERT_TENSORS, tensors)}
    out: dict[str, torch.Tensor] = {}
    for e, (w1, w2, *_) in sorted(local.items()):
        gate, up = w1.chunk(2, dim=0)
        out.update(zip(_expert_names(prefix, block, e), (gate.clone(), up.clone(), w2)))
    return out


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
        for layer in _transformer_layers(model):
            if isinstance(layer.mlp, MoELayer):
                local.update(_export_experts(layer))
                if layer.mlp.router.expert_bias is not None:
                    name = f"model.layers.{layer.layer_number - 1}.mlp.gate.e_score_correction_bias"
                    local[name] = layer.mlp.router.expert_bias.detach().cpu().clone()
        for name, param in _parameters(model):
            if ".mlp.experts." in name:
                continue
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
    config = chunks[0].config
    for depth in range(getattr(config, "mtp_num_layers", None) or 0):  # DeepSeek-V3's copies per depth
        for copy, main in _MTP_COPIES.items():
            out[f"model.layers.{config.num_layers + depth}.{copy}"] = out[main].clone()
    return dict(sorted(out.items(), key=lambda item: _hf_order(item[0])))


_LAYER_ORDER = (
    "embed_tokens", "enorm", "hnorm", "eh_proj", "self_attn", "self_attn.q_proj", "self_attn.q_a_proj",
    "self_attn.q_a_layernorm", "self_attn.q_b_proj", "self_attn.k_proj", "self_attn.v_proj",
    "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "block_sparse_moe.gate", "mlp.gate", "mlp.router", "experts", "mlp.experts",
    "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
    "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj",
    "input_layernorm", "post_attention_layernorm", "shared_head.norm", "shared_head.head",
)


def _hf_order(name: str) -> tuple:
    """transformers' order: embedding, layers by index (modules as the decoder layers define them,
    the routed experts by index, weight before bias), final norm, output layer."""
    if name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        module, _, kind = rest.rpartition(".")
        parts = module.split(".")
        if len(parts) == 4 and parts[1] == "experts":  # {block}.experts.{e}.{projection}
            block = _EXPERT_NAMES[parts[0]]
            return (1, int(index), _LAYER_ORDER.index("experts"), int(parts[2]), block.index(parts[3]), kind)
        if module == "mlp.experts":  # gpt-oss's fused experts
            return (1, int(index), _LAYER_ORDER.index(module), 0, EXPERT_TENSORS.index(kind), False)
        return (1, int(index), _LAYER_ORDER.index(module), 0, 0, kind != "weight")
    return ({"model.embed_tokens.weight": 0, "model.norm.weight": 2}.get(name, 3), 0, 0, 0, 0, False)
