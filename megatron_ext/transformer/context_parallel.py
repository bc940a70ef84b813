"""Context parallelism: attention over a sequence split across the context-parallel (cp) group.

The sequence is cut into ``2 * cp`` chunks and cp rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r`` (Megatron's load-balanced layout: every rank does the same causal work); the
batch is sliced so by ``megatron_ext.utils.get_batch_on_this_cp_rank`` and the rotary angles by
``get_pos_emb_on_this_cp_rank``. The attention is the C++ op ``megatron_ext::context_parallel_attention``
(csrc/ops/context_parallel_attention.cpp), with ``cp_comm_type`` ``"p2p"`` (ring), ``"all_gather"``
or ``"a2a"`` (Ulysses). The same op, at any cp size, computes sliding windows, attention sinks,
packed sequences (each split into ``2 * cp`` chunks on its own, ``get_thd_batch_on_this_cp_rank``)
and value heads of another width than the query/key heads (docs/attention.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_ext._ops  # noqa: F401  (the ops' fake kernels)
from megatron_ext import parallel_state
from megatron_ext.tensor_parallel.sharded_state import module_sharded_state_dict
from megatron_ext.transformer.utils import is_layer_window_attention, make_softmax_offset, window_keys

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
    context-parallel group (one rank when parallel_state is not initialised); ``softmax_scale`` to
    ``1 / sqrt(d)``. ``window_size`` ``(left, 0)``
    (Megatron-core's and TransformerEngine's convention, causal only): each query sees itself and
    the ``left`` keys before it. ``sinks`` ``[heads]``: one more logit per head in every row's
    softmax (Megatron-core's ``softmax_offset``), with its gradient. ``cu_seqlens``: the boundaries
    ``[0, .., cp * s]`` of packed sequences on the whole row, which never attend to each other; each
    rank holds chunks ``r`` and ``2 * cp - 1 - r`` of every sequence. The backward sends the key/value
    gradients back to their ranks. Errors (odd ``s`` under a causal mask, heads not divisible by cp
    for ``"a2a"``, a bad window or ``cu_seqlens``) are raised on every rank before any communication.
    """
    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
    name, size, rank = ("", 1, 0)  # no group (parallel_state not initialised): one rank
    if cp_group is not None:
        name, size, rank = cp_group.group_name, cp_group.size(), cp_group.rank()
    return torch.ops.megatron_ext.context_parallel_attention(
        query,
        key,
        value,
        name,
        size,
        rank,
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


def packed_cu_seqlens(packed_seq_params, is_causal: bool) -> torch.Tensor | None:
    """The boundaries the attention op takes from Megatron-core's ``PackedSeqParams`` (None: no
    packing): ``cu_seqlens_q_padded`` where given (the row's layout), else ``cu_seqlens_q``. Padding
    sits at the end of each sequence, after its real tokens, so under the causal mask no real token
    sees it; without the mask padded sequences are refused. Only ``qkv_format="thd"`` and
    self-attention (the key boundaries equal the query ones)."""
    if packed_seq_params is None:
        return None
    params = packed_seq_params
    if params.qkv_format != "thd":
        raise NotImplementedError(
            f"packed_seq_params with qkv_format={params.qkv_format!r}: only packed rows ('thd') are supported"
        )
    if params.local_cp_size is not None or params.cp_group is not None:
        raise NotImplementedError(
            "packed_seq_params.local_cp_size / cp_group (dynamic context parallelism) are not supported"
        )
    query = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    key = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    if query is None:
        raise ValueError("packed_seq_params (qkv_format='thd') needs cu_seqlens_q")
    if key is not None and not torch.equal(query.cpu(), key.cpu()):
        raise ValueError(
            "packed_seq_params: self-attention over a packed row needs equal query and key boundaries, got "
            f"cu_seqlens_q {query.tolist()} and cu_seqlens_kv {key.tolist()}"
        )
    padded = params.cu_seqlens_q_padded
    if not is_causal and padded is not None and params.cu_seqlens_q is not None and not torch.equal(
        padded.cpu(), params.cu_seqlens_q.cpu()
    ):
        raise NotImplementedError(
            "packed sequences with padding (cu_seqlens_q_padded != cu_seqlens_q) need the causal mask: "
            "without it a sequence's tokens would see its padding"
        )
    return query


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
    """Megatron-core's ``core_attention`` submodule over the attention op, so a Megatron-core layer
    spec can name it and train with context parallelism, sliding windows, attention sinks and
    packed sequences without TransformerEngine. Its constructor is ``TEDotProductAttention``'s
    (Megatron-core 0.16.1: ``k_channels`` / ``v_channels`` as multi-latent attention passes them,
    ``num_splits``), its forward ``DotProductAttention``'s.

    ``forward`` takes query ``[sq, b, heads / tp, k_channels]``, key ``[sk, b, groups / tp,
    k_channels]`` and value ``[sk, b, groups / tp, v_channels]`` (this cp rank's tokens, in
    Megatron's layout) and returns ``[sq, b, heads / tp * v_channels]``; with ``packed_seq_params``
    (``qkv_format="thd"``) ``[t, heads / tp, ·]`` in and ``[t, heads / tp * v_channels]`` out, as
    Megatron-core's attention hands them over. Mask types ``causal`` and ``no_mask`` (and their
    ``padding_`` forms for packed rows); as TransformerEngine's attention with a causal mask type,
    an ``attention_mask`` tensor is not read. ``cp_comm_type`` defaults to the config's (per layer).
    The window is ``config.window_size`` on the layers ``config.window_attn_skip_freq`` picks
    (``transformer.utils.is_layer_window_attention``); ``config.softmax_type`` "off-by-one" adds a
    zero sink logit per head, "learnable" the parameter ``softmax_offset`` (this tensor-parallel
    rank's heads, drawn with ``config.init_method``). No attention dropout in training, no attention
    bias.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        num_splits: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        mask = getattr(attn_mask_type, "name", attn_mask_type)
        if mask not in _MASK_TYPES:
            raise ValueError(
                f"ContextParallelDotProductAttention: attn_mask_type {mask!r} is not supported; expected "
                f"one of {sorted(_MASK_TYPES)}"
            )
        self.is_causal = _MASK_TYPES[mask]
        if num_splits not in (None, 1):
            raise NotImplementedError(
                f"ContextParallelDotProductAttention: num_splits={num_splits} (flash-attention's split "
                "of the keys) is not supported"
            )
        self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group(
            check_initialized=False
        )
        tp = getattr(pg_collection, "tp", None) or parallel_state.get_tensor_model_parallel_group()
        # As TransformerEngine: both channel counts given, or the config's kv_channels for both.
        if k_channels is None or v_channels is None:
            k_channels = v_channels = config.kv_channels
        self.hidden_size_per_partition = v_channels * config.num_attention_heads // tp.size()
        self.softmax_scale = softmax_scale if softmax_scale is not None else k_channels**-0.5
        if getattr(config, "apply_query_key_layer_scaling", False):
            self.softmax_scale /= self.layer_number
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_comm_type = cp_comm_type or cp_comm_type_of(config, self.layer_number)
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}")
        window = getattr(config, "window_size", None)
        skip_freq = getattr(config, "window_attn_skip_freq", None)
        self.window_size = window if is_layer_window_attention(window, skip_freq, layer_number) else None
        if window_keys(self.window_size) is not None and not self.is_causal:
            raise ValueError(
                f"ContextParallelDotProductAttention: window_size={window} slides over causal attention; "
                f"attn_mask_type is {mask!r}"
            )
        offset = make_softmax_offset(config, tp.size(), tp.rank())
        if isinstance(offset, torch.nn.Parameter):
            self.softmax_offset = offset
        else:  # off-by-one's zeros follow the module's device, unsaved, as Megatron-core's
            self.register_buffer("softmax_offset", offset, persistent=False)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron's checkpointing API: a learnable ``softmax_offset`` split over tensor-parallel
        ranks along its heads; nothing else."""
        return module_sharded_state_dict(self, prefix, sharded_offsets, metadata=metadata)

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
        if attention_bias is not None:
            raise ValueError("ContextParallelDotProductAttention takes no attention_bias")
        if self.training and self.attention_dropout > 0:
            raise NotImplementedError(
                "ContextParallelDotProductAttention: attention_dropout="
                f"{self.attention_dropout} is not supported"
            )
        mask = getattr(attn_mask_type, "name", attn_mask_type)
        causal = self.is_causal if mask is None else _MASK_TYPES.get(mask, mask)
        if causal not in (True, False):
            raise ValueError(f"ContextParallelDotProductAttention: attn_mask_type {mask!r} is not supported")
        cu_seqlens = packed_cu_seqlens(packed_seq_params, causal)
        thd = cu_seqlens is not None and query.dim() == 3
        if thd:  # [t, n, d] -> [1, n, t, d]
            q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
        else:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        context = context_parallel_attention(
            q, k, v, self.cp_group, causal, self.cp_comm_type, self.softmax_scale,
            window_size=self.window_size if causal else None, sinks=self.softmax_offset,
            cu_seqlens=cu_seqlens,
        )
        if thd:
            return context[0].permute(1, 0, 2).reshape(query.shape[0], self.hidden_size_per_partition)
        sq, b = query.shape[:2]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


# Megatron-core's mask types this attention takes, and whether each is causal (the padding forms
# are TransformerEngine's names for packed rows).
_MASK_TYPES = {"causal": True, "no_mask": False, "padding_causal": True, "padding": False}
