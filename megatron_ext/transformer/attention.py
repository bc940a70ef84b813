"""Causal self-attention with heads (and key/value groups) split across tensor-parallel ranks."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from megatron_ext import parallel_state, tensor_parallel
from megatron_ext.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_gather_last_dim_from_tensor_parallel_region,
    get_cuda_rng_tracker,
)
from megatron_ext.tensor_parallel.sharded_state import renamed_sharded_state_dict
from megatron_ext.tensor_parallel.utils import divide
from megatron_ext.transformer.context_parallel import (
    context_parallel_attention,
    cp_comm_type_of,
    packed_cu_seqlens,
)
from megatron_ext.transformer.rotary import apply_rotary_pos_emb
from megatron_ext.transformer.transformer_config import TransformerConfig
from megatron_ext.transformer.utils import (
    is_layer_window_attention,
    layer_norm,
    make_softmax_offset,
    selectively_recomputed,
    window_keys,
)
from megatron_ext.transformer.yarn_rotary import yarn_concentration_of

# The submodules' names here -> Megatron-core's checkpoint keys.
ATTENTION_KEYS = {
    "query_key_value.": "linear_qkv.",
    "dense.": "linear_proj.",
    "softmax_offset": "core_attention.softmax_offset",
}


class ParallelAttention(torch.nn.Module):
    """Self-attention over ``[s, b, h]`` hidden states, with grouped-query attention.

    ``config.num_query_groups`` groups of ``num_attention_heads / num_query_groups`` query heads
    share one key and value head (groups == heads: multi-head attention). The fused QKV
    projection is column-parallel, its output features laid out group by group, Megatron-core's
    ``[group][q_1 .. q_{heads/groups} | k | v][kv_channels]``: with ``groups >= tp`` each rank's
    contiguous slice holds whole groups and attends with them alone. With ``tp > groups`` (each
    group's key and value serve several ranks) the projection's outputs are all-gathered, every
    rank takes its group's key and value and its ``heads / tp`` query heads, and the gather's
    backward reduce-scatters the gradients back to their owners, as Megatron-core does. The output
    projection is row-parallel and sums the heads' partial outputs.

    Biases on the projections with ``config.add_bias_linear`` (on QKV also with
    ``config.add_qkv_bias``); with ``config.qk_layernorm`` each query and key head is normalised
    (``config.normalization``) over its channels; rotary embeddings when the caller passes
    ``rotary_pos_emb`` (``transformer.rotary``), their cosines and sines times YaRN's attention
    factor when the config has Megatron-core's ``yarn_*`` attributes (``transformer.yarn_rotary``).

    The attention itself is ``torch.nn.functional.scaled_dot_product_attention`` with the
    causal mask as a flag (flash or memory-efficient kernels on GPUs, the fused kernel on CPUs):
    its memory grows linearly with the sequence, the ``[b, heads, s, s]`` scores are never held.
    ``config.attention_backend`` ``"unfused"`` or ``"local"`` (Megatron-core's names for its
    unfused attention) computes the scores, softmax and dropout one by one instead. Attention
    dropout runs inside the RNG tracker's fork, since each rank drops different heads (under
    sequence parallelism the whole block already runs inside it).
    With ``config.context_parallel_size`` > 1 the sequence is this context-parallel rank's chunks
    (``transformer.context_parallel``) and the attention is the context-parallel op with the
    layer's ``cp_comm_type``; causal, no ``attention_mask``, no attention dropout. The same op (at
    any cp size, whatever ``attention_backend``) computes a sliding window (``config.window_size``
    on the layers ``config.window_attn_skip_freq`` picks), attention sinks
    (``config.softmax_type`` "off-by-one" or "learnable": the ``softmax_offset`` of this rank's
    heads, a parameter for "learnable") and packed sequences (``packed_seq_params``); see
    docs/attention.md.
    Under sequence parallelism the input and output are ``[s / tp, b, h]``: the QKV projection
    all-gathers the sequence, the output projection reduce-scatters it. Returns
    ``(output, output_bias)`` with the bias not yet added.
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 1):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        tp = parallel_state.get_tensor_model_parallel_world_size()
        heads, groups = config.num_attention_heads, config.num_query_groups
        self.tp_size = tp
        self.num_heads_per_partition = divide(heads, tp)
        self.heads_per_group = divide(heads, groups)
        # With tp > groups every rank attends with one whole group's key and value.
        self.groups_per_partition = divide(groups, tp) if groups >= tp else 1
        self.head_dim = config.kv_channels
        backend = getattr(config.attention_backend, "name", config.attention_backend)
        self.unfused = backend in ("unfused", "local")
        self.cp_size = getattr(config, "context_parallel_size", 1)
        # YaRN's attention factor on the cosines and sines, from the config's yarn_* attributes.
        self.rotary_mscale = yarn_concentration_of(config)
        window = getattr(config, "window_size", None)
        skip_freq = getattr(config, "window_attn_skip_freq", None)
        self.window_size = window if window_keys(window) and is_layer_window_attention(
            window, skip_freq, layer_number) else None
        offset = make_softmax_offset(config, tp, parallel_state.get_tensor_model_parallel_rank())
        if isinstance(offset, torch.nn.Parameter):
            self.softmax_offset = offset
        else:  # off-by-one's zeros follow the module's device, unsaved, as Megatron-core's
            self.register_buffer("softmax_offset", offset, persistent=False)
        bias = bool(config.add_bias_linear)
        # Megatron-core's attention_output_gate: each group's block holds its heads' gates after their
        # queries ([q, gate, k, v] per group), the attention's output scaled by sigmoid(gate).
        self.output_gate = bool(getattr(config, "attention_output_gate", False))
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size,
            config.kv_channels * (heads * (2 if self.output_gate else 1) + 2 * groups),
            config=config,
            init_method=config.init_method,
            bias=bias or bool(getattr(config, "add_qkv_bias", False)),
            gather_output=False,
        )
        if getattr(config, "qk_layernorm", False):
            self.q_layernorm = layer_norm(config, self.head_dim)
            self.k_layernorm = layer_norm(config, self.head_dim)
            for param in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
                # Each rank normalises its own heads: the gradients are partial sums over
                # tensor-parallel ranks (summed by finalize_model_grads), whatever the sequence does.
                param.sequence_parallel = False
        else:
            self.q_layernorm = self.k_layernorm = None
        self.dense = RowParallelLinear(
            config.kv_channels * heads,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=True,
        )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron's checkpointing API: each tensor as a ShardedTensor (as the layers inside are split)
        under Megatron-core's keys (``linear_qkv``, ``linear_proj``)."""
        return renamed_sharded_state_dict(self, prefix, sharded_offsets, ATTENTION_KEYS, metadata)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``attention_mask`` (optional, boolean, True = masked out) is broadcast to
        ``[b, heads, s, s]`` and combined with the causal mask; ``rotary_pos_emb`` (optional,
        ``[>= s, 1, 1, dim]`` angles) rotates the queries and keys. ``packed_seq_params``
        (Megatron-core's ``PackedSeqParams``, ``qkv_format="thd"``): the sequence dim is a row of
        packed sequences that never attend to each other, each rotated from position 0
        (``rotary_pos_emb`` then holds the angles of the longest sequence's positions)."""
        cu_seqlens = packed_cu_seqlens(packed_seq_params, is_causal=True)
        if attention_mask is not None and self.cp_size > 1:
            raise ValueError(
                f"ParallelAttention: with context_parallel_size={self.cp_size} the attention is causal and "
                "takes no attention_mask (the sequence is split over the context-parallel ranks); got a mask "
                f"of shape {tuple(attention_mask.shape)}"
            )
        if attention_mask is not None and self._fused_op_reasons(cu_seqlens):
            raise ValueError(
                f"ParallelAttention: {self._fused_op_reasons(cu_seqlens)} run in the causal attention op, "
                f"which takes no attention_mask; got a mask of shape {tuple(attention_mask.shape)}"
            )
        query, key, value, *gate = self.query_key_value_heads(hidden_states)  # [s, b, heads or groups, d]
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary_pos_emb is not None:
            cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
            query, key = (apply_rotary_pos_emb(t, rotary_pos_emb, self.config, cu_seqlens, self.rotary_mscale,
                                               cp_group=cp_group) for t in (query, key))
        s, b = query.shape[:2]
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        if self.training and selectively_recomputed(self.config, "core_attn"):
            # Keep q, k, v only; the attention (its scores and dropout mask when unfused) is
            # recomputed in the backward under the forward's random states.
            context = tensor_parallel.checkpoint(
                self.core_attention, False, query, key, value, attention_mask, cu_seqlens
            )
        else:
            context = self.core_attention(query, key, value, attention_mask, cu_seqlens)
        context = context.permute(2, 0, 1, 3).reshape(s, b, self.num_heads_per_partition * self.head_dim)
        if gate:
            wide = torch.promote_types(context.dtype, torch.float32)
            gate = torch.sigmoid(gate[0].reshape(context.shape).to(wide))
            context = (context.to(wide) * gate).to(context.dtype)
        return self.dense(context)

    def query_key_value_heads(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's query heads ``[s, b, heads / tp, d]`` and its groups' keys and values
        ``[s, b, groups / tp (or 1), d]``, from the fused projection; with the output gate also the
        query heads' gates (a fourth tensor, shaped as the queries)."""
        qkv, _ = self.query_key_value(hidden_states)
        s, b, _ = qkv.shape  # the full sequence, also under sequence parallelism
        gated = 2 if self.output_gate else 1
        per_group = (gated * self.heads_per_group + 2) * self.head_dim
        groups = self.config.num_query_groups
        rank = parallel_state.get_tensor_model_parallel_rank()
        if groups < self.tp_size:
            ranks_per_group = self.tp_size // groups
            qkv = all_gather_last_dim_from_tensor_parallel_region(qkv, group=self.query_key_value.tp_group)
            group = rank // ranks_per_group
            qkv = qkv[..., group * per_group : (group + 1) * per_group]
        qkv = qkv.view(s, b, self.groups_per_partition, per_group)
        heads = self.heads_per_group * self.head_dim
        query, *gate, key, value = qkv.split([heads] * gated + [self.head_dim, self.head_dim], dim=-1)
        query, *gate = (t.reshape(s, b, -1, self.head_dim) for t in (query, *gate))
        if groups < self.tp_size:
            first = (rank % ranks_per_group) * self.num_heads_per_partition
            query, *gate = (t[:, :, first : first + self.num_heads_per_partition] for t in (query, *gate))
        return (query, key, value, *gate)

    def _fused_op_reasons(self, cu_seqlens: torch.Tensor | None) -> str:
        """What makes the layer attend through the attention op rather than SDPA ("" for nothing)."""
        reasons = [
            ("context parallelism", self.cp_size > 1),
            ("sliding windows", self.window_size is not None),
            ("attention sinks", self.softmax_offset is not None),
            ("packed sequences", cu_seqlens is not None),
        ]
        return " and ".join(name for name, used in reasons if used)

    def core_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), causal and ``attention_mask``) v with dropout, over
        ``[b, heads, s, d]`` queries and ``[b, groups, s, d]`` keys and values (each group serving
        ``heads / groups`` consecutive query heads); with context parallelism, a window, sinks or
        packed sequences (``cu_seqlens``) the attention op, causal, without dropout."""
        s = query.shape[-2]
        gqa = key.shape[1] != query.shape[1]
        p = self.config.attention_dropout if self.training else 0.0
        reasons = self._fused_op_reasons(cu_seqlens)
        if reasons:
            if p > 0:
                raise NotImplementedError(
                    f"ParallelAttention: attention_dropout={p} with {reasons} is not supported; "
                    "set attention_dropout=0"
                )
            return context_parallel_attention(
                query,
                key,
                value,
                parallel_state.get_context_parallel_group(check_initialized=False),
                True,
                cp_comm_type_of(self.config, self.layer_number),
                window_size=self.window_size,
                sinks=self.softmax_offset,
                cu_seqlens=cu_seqlens,
            )
        # Each rank drops its own heads. Under sequence parallelism the block already runs on the
        # model-parallel stream, and forking it again would replay the stream's saved state.
        # Without a draw there is nothing to fork, which also keeps the layer traceable by
        # torch.compile(fullgraph=True) (the fork reads the generator's state).
        fork = p > 0 and not self.config.sequence_parallel
        with get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            if self.unfused:
                if gqa:
                    repeats = query.shape[1] // key.shape[1]
                    key, value = (
                        key.repeat_interleave(repeats, dim=1),
                        value.repeat_interleave(repeats, dim=1),
                    )
                context = self._unfused_attention(query, key, value, attention_mask, p)
            else:
                mask = None
                if attention_mask is not None:  # SDPA's boolean mask says who takes part
                    mask = ~(_causal_mask(s, query.device) | attention_mask.to(torch.bool))
                context = F.scaled_dot_product_attention(
                    query, key, value, attn_mask=mask, dropout_p=p, is_causal=mask is None, enable_gqa=gqa)
        return context

    def _unfused_attention(self, query, key, value, attention_mask, p: float) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + mask) v with the ``[b, n, s, s]`` scores in memory."""
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_dim)
        mask = _causal_mask(scores.shape[-1], scores.device)
        if attention_mask is not None:
            mask = mask | attention_mask.to(torch.bool)
        scores = scores.masked_fill(mask, float("-inf"))
        if self.config.attention_softmax_in_fp32 and scores.dtype in (torch.float16, torch.bfloat16):
            probs = torch.softmax(scores.float(), dim=-1).to(scores.dtype)
        else:
            probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, p=p, training=p > 0)
        return torch.matmul(probs, value)  # [b, n, s, d]


def _causal_mask(s: int, device: torch.device) -> torch.Tensor:
    """True above the diagonal: the positions a query may not see."""
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
