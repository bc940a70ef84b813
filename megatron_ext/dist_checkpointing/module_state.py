"""``sharded_state_dict()`` of megatron_ext's modules: each tensor as a ShardedTensor that says
where this rank's copy lies in the global tensor, read from the attributes the layers set
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``).

A tensor-parallel tensor split with stride s (a fused ``[gate | up]`` weight, s = 2) is, on TP
rank r of tp, pieces r, r + tp, ... of the global tensor cut into tp * s: a
:class:`ShardedTensorFactory` of s ShardedTensors, the layout of the serial tensor whatever tp,
as ``save_checkpoint`` stores it.

Transformer layers follow Megatron-core's ``TransformerBlock.sharded_state_dict``: by default
(``metadata`` without ``non_homogeneous_layers`` / ``singleton_local_shards``) every layer tensor
is one global tensor ``decoder.layers.<name>`` with a leading layer axis (the sharded offset
``(0, layer_number - 1, num_layers)``); with either flag, ``decoder.layers.<N>.<name>`` per
global layer N. Layer numbers are global, so pipeline stages and virtual chunks name theirs alike.

Keys are Megatron-core's (its local layer spec's): the modules keep Megatron's earlier names
(``query_key_value``, ``dense``, ``dense_h_to_4h``, ``dense_4h_to_h``, ``post_attention_layernorm``)
in ``state_dict()``, and ``sharded_state_dict()`` stores them as ``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``, and the layer norms under the linear they feed
(``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``), as
Megatron-core's local and Transformer Engine specs both store them. Each column- or
row-parallel linear in a layer adds the empty ``_extra_state`` object Megatron-core's linears
save (its load asks for them); the linears' load pre-hook drops it
(``tensor_parallel.layers.drop_extra_state``). The global tensors'
layouts already agree: the fused QKV rows are grouped per query group ``[q.. k v]``, a gated
``linear_fc1`` is stored ``[gate | up]`` (with ``singleton_local_shards`` as two tensors,
``linear_fc1.weight_w`` and ``linear_fc1.weight_v``). So a whole GPT moves by key between the two
libraries.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from megatron_ext import parallel_state
from megatron_ext.dist_checkpointing.dict_utils import nested_values
from megatron_ext.dist_checkpointing.mapping import (
    ReplicaId,
    ShardedBase,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron_ext.dist_checkpointing.sharding import TIED_EMBEDDING_NAME
from megatron_ext.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint


def _strided_build(
    dim: int,
    stride: int,
    prepend_offsets: tuple,
    split_keys: bool,
    key: str,
    data: torch.Tensor,
    replica_id: ReplicaId,
    _flat: Any,
) -> list[ShardedTensor]:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    axis = dim + len(prepend_offsets)
    return [
        ShardedTensor.from_rank_offsets(
            f"{key}_{'wv'[k]}" if split_keys else key,
            piece,
            *prepend_offsets,
            (axis, rank, tp) if split_keys else (axis, k * tp + rank, tp * stride),
            replica_id=replica_id,
            prepend_axis_num=len(prepend_offsets),
        )
        for k, piece in enumerate(data.detach().chunk(stride, dim))
    ]


def _strided_merge(dim: int, pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces, dim)


def sharded_tensor_like(
    tensor: torch.Tensor,
    key: str,
    like: torch.Tensor,
    prepend_offsets: tuple = (),
    replica_id: ReplicaId | None = None,
    singleton_local_shards: bool = False,
    **kwargs: Any,
) -> ShardedBase:
    """``tensor`` (of ``like``'s local shape) as the ShardedTensor (or, for a strided split, the
    factory) of global tensor ``key``, sharded as parameter ``like`` is. A stride-2 split with
    ``singleton_local_shards`` stores its halves as two global tensors ``key_w`` and ``key_v``
    (Megatron-core's gated ``linear_fc1`` under that flag)."""
    if not getattr(like, "tensor_model_parallel", False):
        return make_sharded_tensor_for_checkpoint(tensor, key, prepend_offsets, replica_id, **kwargs)
    dim = like.partition_dim % tensor.dim()
    stride = getattr(like, "partition_stride", 1)
    if stride == 1:
        return make_tp_sharded_tensor_for_checkpoint(tensor, key, dim, replica_id, prepend_offsets, **kwargs)
    if tensor.shape[dim] % stride:
        raise ValueError(
            f"{key}: size {tensor.shape[dim]} along dim {dim} does not split into stride {stride}"
        )
    if replica_id is None:
        replica_id = (0, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return ShardedTensorFactory(
        key,
        tensor,
        partial(_strided_build, dim, stride, tuple(prepend_offsets), singleton_local_shards and stride == 2),
        partial(_strided_merge, dim),
        replica_id,
    )


def module_sharded_state_dict(
    module: torch.nn.Module,
    prefix: str = "",
    sharded_offsets: tuple = (),
    skip: tuple[str, ...] = (),
    metadata: dict | None = None,
) -> ShardedStateDict:
    """Every tensor of ``module.state_dict()`` (but the submodules named in ``skip``) under
    ``prefix + name``, both as the key of the dict and of the ShardedTensor (``metadata``: its
    ``singleton_local_shards``, see ``sharded_tensor_like``)."""
    singleton = bool((metadata or {}).get("singleton_local_shards"))
    out: ShardedStateDict = {}
    for name, tensor in module.state_dict(prefix="", keep_vars=True).items():
        if (
            name.split(".", 1)[0] in skip
            or name.endswith("_extra_state")
            or not isinstance(tensor, torch.Tensor)
        ):
            continue
        out[prefix + name] = sharded_tensor_like(
            tensor, prefix + name, tensor, sharded_offsets, singleton_local_shards=singleton
        )
    return out


# megatron_ext's module names -> Megatron-core's keys, by the prefix of a name inside the module.
ATTENTION_KEYS = {"query_key_value.": "linear_qkv.", "dense.": "linear_proj."}
MLP_KEYS = {"dense_h_to_4h.": "linear_fc1.", "dense_4h_to_h.": "linear_fc2."}
LAYER_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "post_attention_layernorm.": "mlp.linear_fc1.layer_norm_",
    **{f"self_attention.{k}": f"self_attention.{v}" for k, v in ATTENTION_KEYS.items()},
    **{f"mlp.{k}": f"mlp.{v}" for k, v in MLP_KEYS.items()},
}


def _renamed(name: str, keys: dict[str, str]) -> str:
    for old, new in keys.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def megatron_core_name(name: str) -> str:
    """A GPTModel tensor's name (``decoder.layers.<N>.<name>`` or stacked ``decoder.layers.<name>``)
    as Megatron-core's key."""
    head, sep, rest = name.partition("decoder.layers.")
    if not sep:
        return name
    number, dot, inner = rest.partition(".")
    if not (number.isdigit() and dot):
        number, dot, inner = "", "", rest
    return f"{head}{sep}{number}{dot}{_renamed(inner, LAYER_KEYS)}"


def renamed_sharded_state_dict(
    module: torch.nn.Module,
    prefix: str,
    sharded_offsets: tuple,
    keys: dict[str, str],
    metadata: dict | None = None,
) -> ShardedStateDict:
    """``module_sharded_state_dict`` under Megatron-core's keys: a name inside ``module`` starting
    with a key of ``keys`` is stored under its value instead (the dict keeps the module's names),
    and each column- or row-parallel linear (``module`` itself included) adds an empty
    ``_extra_state`` object, as Megatron-core's linears do."""
    from megatron_ext.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_ext.transformer.utils import make_sharded_object_for_checkpoint

    out = module_sharded_state_dict(module, prefix, sharded_offsets, metadata=metadata)
    for name, sub in module.named_modules():
        if isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
            key = f"{prefix}{name}{'.' if name else ''}_extra_state"
            out[key] = make_sharded_object_for_checkpoint(None, key, sharded_offsets)
    for sh in out.values():
        sh.key = prefix + _renamed(sh.key[len(prefix) :], keys)
    return out


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Renames the ShardedTensor / factory / object keys starting with ``old_prefix`` (in place;
    the dict's own keys stay)."""
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedBase):
            if not sh.key.startswith(old_prefix):
                raise ValueError(f"key {sh.key!r} does not start with {old_prefix!r}")
            sh.key = new_prefix + sh.key[len(old_prefix) :]


def _per_layer_keys(metadata: dict | None) -> bool:
    metadata = metadata or {}
    return bool(metadata.get("non_homogeneous_layers") or metadata.get("singleton_local_shards"))


def block_sharded_state_dict(
    block: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
) -> ShardedStateDict:
    """``ParallelTransformer.sharded_state_dict``: the layers by global layer number (see the
    module docstring), then the block's other tensors (the final norm)."""
    if sharded_offsets:
        raise ValueError(f"a transformer block takes no sharded_offsets, got {sharded_offsets}")
    out: ShardedStateDict = {}
    num_layers = block.config.num_layers
    for local_index, layer in enumerate(block.layers):
        number = layer.layer_number - 1
        state_prefix = f"{prefix}layers.{local_index}."
        if _per_layer_keys(metadata):
            sharded_prefix, offsets = f"{prefix}layers.{number}.", ()
        else:
            sharded_prefix, offsets = f"{prefix}layers.", ((0, number, num_layers),)
        layer_dict = layer.sharded_state_dict(state_prefix, offsets, metadata)
        replace_prefix_for_sharding(layer_dict, state_prefix, sharded_prefix)
        out.update(layer_dict)
    out.update(module_sharded_state_dict(block, prefix, skip=("layers",)))
    return out


def gpt_sharded_state_dict(
    model: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
) -> ShardedStateDict:
    """``GPTModel.sharded_state_dict``: embedding, decoder (``block_sharded_state_dict``), output
    layer. The last stage's copy of a tied word embedding is a non-main replica of the first
    stage's ``embedding.word_embeddings.weight`` (loaded, not saved), as in Megatron-core."""
    if sharded_offsets:
        raise ValueError(f"GPTModel takes no sharded_offsets, got {sharded_offsets}")
    out = module_sharded_state_dict(model, prefix, skip=("decoder", "output_layer"))
    out.update(model.decoder.sharded_state_dict(f"{prefix}decoder.", (), metadata))
    output_layer = getattr(model, "output_layer", None)
    if output_layer is None:
        return out
    out.update(module_sharded_state_dict(output_layer, f"{prefix}output_layer."))
    weight_key = f"{prefix}output_layer.weight"
    if model.share_embeddings_and_output_weights and weight_key in out and not model.pre_process:
        weight = output_layer.weight
        out[weight_key] = make_tp_sharded_tensor_for_checkpoint(
            weight,
            prefix + TIED_EMBEDDING_NAME,
            weight.partition_dim % weight.dim(),
            replica_id=(1, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True)),
        )
    return out
