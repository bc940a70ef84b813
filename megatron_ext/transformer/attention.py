"""Causal self-attention with heads split across tensor-parallel ranks."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from megatron_ext import parallel_state
from megatron_ext.tensor_parallel import ColumnParallelLinear, RowParallelLinear, get_cuda_rng_tracker
from megatron_ext.tensor_parallel.utils import divide
from megatron_ext.transformer.transformer_config import TransformerConfig


class ParallelAttention(torch.nn.Module):
    """Self-attention over ``[s, b, h]`` hidden states.

    The fused QKV projection is column-parallel: its output features are laid out head by head
    (``[head][q | k | v][kv_channels]``), so each rank's contiguous slice holds whole heads and
    attends with them alone. The output projection is row-parallel and sums the heads' partial
    outputs. The attention itself is ``torch.nn.functional.scaled_dot_product_attention`` with the
    causal mask as a flag (flash or memory-efficient kernels on GPUs, the fused kernel on CPUs):
    its memory grows linearly with the sequence, the ``[b, heads, s, s]`` scores are never held.
    ``config.attention_backend`` ``"unfused"`` or ``"local"`` (Megatron-core's names for its
    unfused attention) computes the scores, softmax and dropout one by one instead. Attention
    dropout runs inside the RNG tracker's fork, since each rank drops different heads (under
    sequence parallelism the whole block already runs inside it).
    Under sequence parallelism the input and output are ``[s / tp, b, h]``: the QKV projection
    all-gathers the sequence, the output projection reduce-scatters it. Returns
    ``(output, output_bias)`` with the bias not yet added.
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 1):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.num_heads_per_partition = divide(config.num_attention_heads, tp)
        self.head_dim = config.kv_channels
        backend = getattr(config.attention_backend, "name", config.attention_backend)
        self.unfused = backend in ("unfused", "local")
        projection_size = config.kv_channels * config.num_attention_heads
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size,
            3 * projection_size,
            config=config,
            init_method=config.init_method,
            bias=True,
            gather_output=False,
        )
        self.dense = RowParallelLinear(
            projection_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=True,
        )

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``attention_mask`` (optional, boolean, True = masked out) is broadcast to
        ``[b, heads, s, s]`` and combined with the causal mask."""
        qkv, _ = self.query_key_value(hidden_states)
        s, b, _ = qkv.shape  # the full sequence, also under sequence parallelism
        qkv = qkv.view(s, b, self.num_heads_per_partition, 3 * self.head_dim)
        query, key, value = (t.permute(1, 2, 0, 3) for t in qkv.split(self.head_dim, dim=-1))  # [b, n, s, d]
        context = self.core_attention(query, key, value, attention_mask)
        context = context.permute(2, 0, 1, 3).reshape(s, b, self.num_heads_per_partition * self.head_dim)
        return self.dense(context)

    def core_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), causal and ``attention_mask``) v with dropout, over
        ``[b, heads, s, d]`` tensors."""
        s = query.shape[-2]
        p = self.config.attention_dropout if self.training else 0.0
        # Each rank drops its own heads. Under sequence parallelism the block already runs on the
        # model-parallel stream, and forking it again would replay the stream's saved state.
        # Without a draw there is nothing to fork, which also keeps the layer traceable by
        # torch.compile(fullgraph=True) (the fork reads the generator's state).
        fork = p > 0 and not self.config.sequence_parallel
        with get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            if self.unfused:
                context = self._unfused_attention(query, key, value, attention_mask, p)
            else:
                mask = None
                if attention_mask is not None:  # SDPA's boolean mask says who takes part
                    mask = ~(_causal_mask(s, query.device) | attention_mask.to(torch.bool))
                context = F.scaled_dot_product_attention(
                    query, key, value, attn_mask=mask, dropout_p=p, is_causal=mask is None)
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
