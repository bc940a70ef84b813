"""Context parallelism: attention over a sequence split across the context-parallel (cp) group.

The sequence is cut into ``2 * cp`` chunks and cp rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r`` (Megatron's load-balanced layout: every rank does the same causal work); the
batch is sliced so by ``megatron_ext.utils.get_batch_on_this_cp_rank`` and the rotary angles by
``get_pos_emb_on_this_cp_rank``. The attention is the C++ op ``megatron_ext::context_parallel_attention``
(csrc/ops/context_parallel_attention.cpp), with ``cp_comm_type`` ``"p2p"`` (ring), ``"all_gather"``
or ``"a2a"`` (Ulysses).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_ext._ops  # noqa: F401  (the ops' fake kernels)
from megatron_ext import parallel_state
from megatron_ext.transformer.utils import window_keys

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cp_group: dist.ProcessGroup | None = None,
    is_causal: bool = True,
    cp_comm_type: str = "p2p",
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale, mask) v over the whole sequence, each rank holding its tokens.

    ``query`` ``[b, heads, s, d]``, ``key`` ``[b, groups, s, d]`` and ``value`` ``[b, groups, s, dv]``
    (``heads / groups`` consecutive query heads share a key/value head), ``s`` this rank's tokens in
    the layout above; returns ``[b, heads, s, dv]``. ``cp_group`` defaults to parallel_state's
    context-parallel group; ``softmax_scale`` to ``1 / sqrt(d)``. ``window_size`` ``(left, 0)``
    (Megatron-core's and TransformerEngine's convention, causal only): each query sees itself and
    the ``left`` keys before it. ``sinks`` ``[heads]``: one more logit per head in every row's
    softmax (Megatron-core's ``softmax_offset``), with its gradient. ``cu_seqlens``: the boundaries
    ``[0, .., cp * s]`` of packed sequences on the whole row, which never attend to each other; each
    rank holds chunks ``r`` and ``2 * cp - 1 - r`` of every sequence. The backward sends the key/value
    gradients back to their ranks. Errors (odd ``s`` under a causal mask, heads not divisible by cp
    for ``"a2a"``, a bad window or ``cu_seqlens``) are raised on every rank before any communication.
    """
    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group()
    return torch.ops.megatron_ext.context_parallel_attention(
        query,
        key,
        value,
        cp_group.group_name,
        cp_group.size(),
        cp_group.rank(),
        is_causal,
        cp_comm_type,
        softmax_scale,
        window_keys(window_size),
        sinks,
        cu_seqlens,
    )


def get_pos_emb_on_this_cp_rank(
    pos_emb: torch.Tensor, seq_dim: int, cp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The rows of ``pos_emb`` (along ``seq_dim``) of this cp rank's chunks ``r`` and
    ``2 * cp - 1 - r`` (Megatron-core's ``rope_utils.get_pos_emb_on_this_cp_rank``; ``cp_group``
    defaults to parallel_state's)."""
    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group()
    cp, rank = cp_group.size(), cp_group.rank()
    if cp == 1:
        return pos_emb
    chunks = pos_emb.unflatten(seq_dim, (2 * cp, -1))
    index = torch.tensor([rank, 2 * cp - 1 - rank], device=pos_emb.device)
    return chunks.index_select(seq_dim, index).flatten(seq_dim, seq_dim + 1)


def cp_comm_type_of(config, layer_number: int) -> str:
    """The ``cp_comm_type`` of layer ``layer_number`` (1-based): the config's string, or its entry
    in a per-layer list."""
    comm = getattr(config, "cp_comm_type", None) or "p2p"
    if isinstance(comm, (list, tuple)):
        comm = comm[layer_number - 1]
    return comm


def check_context_parallel_config(config) -> None:
    """Megatron-core's checks of ``cp_comm_type`` (a str, or one per layer), as ValueErrors, and what
    the comm types need: ``"a2a"`` splits each tensor-parallel rank's query heads and key/value groups
    over the cp ranks."""
    cp = config.context_parallel_size
    if cp == 1:
        return
    comm = config.cp_comm_type
    if isinstance(comm, (list, tuple)):
        if len(comm) != config.num_layers:
            raise ValueError(
                f"cp_comm_type has {len(comm)} entries; a per-layer list needs one per transformer layer "
                f"(num_layers={config.num_layers})"
            )
        types = list(comm)
    elif comm is None or isinstance(comm, str):
        types = [comm or "p2p"]
    else:
        raise ValueError(f"cp_comm_type must be a str or a list of str, got {comm!r}")
    for value in types:
        if value == "a2a+p2p":
            raise NotImplementedError(
                "cp_comm_type='a2a+p2p' (hierarchical context parallelism) is not supported; use 'p2p', "
                "'all_gather' or 'a2a'"
            )
        if value not in CP_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type must be one of {CP_COMM_TYPES} (or a list of them), got {value!r}"
            )
    if "a2a" in types:
        tp = config.tensor_model_parallel_size
        heads = config.num_attention_heads // tp
        groups = config.num_query_groups // tp if config.num_query_groups >= tp else 1
        if heads % cp or groups % cp:
            raise ValueError(
                f"cp_comm_type 'a2a' splits the attention heads over context_parallel_size={cp} ranks, but "
                f"each tensor-parallel rank has {heads} query heads and {groups} key/value groups "
                f"(num_attention_heads={config.num_attention_heads}, num_query_groups="
                f"{config.num_query_groups}, tensor_model_parallel_size={tp}); both must divide by {cp}"
            )


class ContextParallelDotProductAttention(torch.nn.Module):
    """Megatron-core's ``core_attention`` submodule (its ``DotProductAttention`` constructor and
    forward) over the context-parallel op, so a Megatron-core layer spec can name it and train with
    ``context_parallel_size`` > 1 without TransformerEngine.

    ``forward`` takes query ``[sq, b, heads / tp, d]`` and key, value ``[sk, b, groups / tp, d]``
    (this cp rank's tokens, in Megatron's layout) and returns ``[sq, b, heads / tp * d]``. Mask types
    ``causal`` and ``no_mask``; as TransformerEngine's attention with a causal mask type, an
    ``attention_mask`` tensor is not read. ``cp_comm_type`` defaults to the config's (per layer).
    No attention dropout in training, no packed sequences, no attention bias.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        mask = getattr(attn_mask_type, "name", attn_mask_type)
        if mask not in ("causal", "no_mask"):
            raise ValueError(
                f"ContextParallelDotProductAttention: attn_mask_type {mask!r} is not supported; expected "
                "causal or no_mask"
            )
        self.is_causal = mask == "causal"
        self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        tp = getattr(pg_collection, "tp", None) or parallel_state.get_tensor_model_parallel_group()
        self.hidden_size_per_partition = config.kv_channels * config.num_attention_heads // tp.size()
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        if getattr(config, "apply_query_key_layer_scaling", False):
            self.softmax_scale /= self.layer_number
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_comm_type = cp_comm_type or cp_comm_type_of(config, self.layer_number)
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(
                "ContextParallelDotProductAttention takes no packed_seq_params and no attention_bias"
            )
        if self.training and self.attention_dropout > 0:
            raise NotImplementedError(
                "ContextParallelDotProductAttention: attention_dropout="
                f"{self.attention_dropout} is not supported"
            )
        mask = getattr(attn_mask_type, "name", attn_mask_type)
        causal = self.is_causal if mask is None else mask == "causal"
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        context = context_parallel_attention(
            q, k, v, self.cp_group, causal, self.cp_comm_type, self.softmax_scale
        )
        sq, b = query.shape[:2]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
