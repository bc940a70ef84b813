"""Multi-latent attention (DeepSeek-V2/V3's MLA, Megatron-core's ``MLASelfAttention``): the keys
and values expanded per head from one low-rank latent per token, a rotated part of the key shared
by all heads, the query optionally through a low-rank latent too."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_ext import parallel_state, tensor_parallel
from megatron_ext.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_ext.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron_ext.tensor_parallel.utils import divide, param_device
from megatron_ext.transformer.context_parallel import ContextParallelDotProductAttention
from megatron_ext.transformer.rotary import RotaryEmbedding, apply_rotary_pos_emb
from megatron_ext.transformer.utils import layer_norm, selectively_recomputed
from megatron_ext.transformer.yarn_rotary import YarnRotaryEmbedding, yarn_mscale

# The latent norms' names here -> Megatron-core's checkpoint keys (TransformerEngine's spec, which
# Megatron's DeepSeek recipes train with: each norm stored with the up projection it feeds).
MLA_KEYS = {
    "q_latent_norm.": "linear_q_up_proj.layer_norm_",
    "kv_latent_norm.": "linear_kv_up_proj.layer_norm_",
}


class DuplicatedLinear(torch.nn.Module):
    """``x @ weight.T`` with the whole weight on every tensor-parallel rank (TransformerEngine's
    ``parallel_mode="duplicated"``, how Megatron-core's MLA builds its down projections): under
    sequence parallelism each rank projects its own tokens, so the weight's gradient is a partial
    sum that ``finalize_model_grads`` all-reduces (``sequence_parallel`` is set on it); without, every
    rank projects the same tokens and computes the same gradient. Drawn whole with
    ``config.init_method``, so every layout starts from the serial weight. Returns ``(out, None)``."""

    saves_megatron_extra_state = True

    def __init__(self, input_size: int, output_size: int, config) -> None:
        super().__init__()
        device = param_device(config.use_cpu_initialization)
        weight = torch.empty(output_size, input_size, dtype=config.params_dtype, device=device)
        if config.perform_initialization:
            config.init_method(weight)
        self.weight = torch.nn.Parameter(weight)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None


class MLASelfAttention(torch.nn.Module):
    """Multi-latent self-attention over ``[s, b, h]`` hidden states (``config``: an
    ``MLATransformerConfig``).

    Per token: the query ``W_uq norm(W_dq x)`` (or ``W_q x`` with ``q_lora_rank`` None), heads of
    ``qk_head_dim + qk_pos_emb_head_dim`` channels; the latent ``[c | k_r] = W_dkv x`` with
    ``c`` of ``kv_lora_rank`` channels; keys ``[W_uk norm(c) | rope(k_r)]`` (the rotated part shared
    by all heads), values ``W_uv norm(c)`` of ``v_head_dim`` channels. The norms exist with
    ``config.qk_layernorm`` (as in Megatron-core's specs; DeepSeek's models have them). Rotary
    embeddings (``rope_type`` "rope" or "yarn", DeepSeek's interleaved channel pairs, see
    ``rotary.apply_rotary_pos_emb``) on the last ``qk_pos_emb_head_dim`` channels of the queries
    and keys; softmax scale ``yarn_mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(qk_head_dim
    + qk_pos_emb_head_dim)``.

    Tensor parallelism: the down projections are whole on every rank (``DuplicatedLinear``), the
    up projections column-parallel (each rank its heads), the output projection row-parallel. Under
    sequence parallelism the down projections and the latent norms run on this rank's ``s / tp``
    tokens and the up projections all-gather the sequence. The attention is megatron_ext's
    ``ContextParallelDotProductAttention`` with ``k_channels`` != ``v_channels``: the attention op's
    log-sum-exp blocks, at any context-parallel size and comm type, no ``[s, s]`` scores.

    Selective recomputation: ``"core_attn"`` keeps q, k, v only; ``"mla_up_proj"`` frees the up
    projections' outputs and the rotated queries and keys after the attention has read them and
    recomputes them (from the latents) when the attention's backward starts, as Megatron-core does.
    Returns ``(output, output_bias)`` with the bias not yet added."""

    def __init__(self, config, layer_number: int = 1, cp_comm_type: str | None = None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        heads = config.num_attention_heads
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.num_attention_heads_per_partition = divide(heads, self.tp_size)
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        mscale = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim or 0.0)
        self.softmax_scale = mscale * mscale / math.sqrt(self.q_head_dim)
        self.cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        if config.rope_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.qk_pos_emb_head_dim, config.rotary_percent, rotary_base=config.rotary_base,
                cp_group=self.cp_group,
            )
        else:
            self.rotary_pos_emb = YarnRotaryEmbedding(
                config.qk_pos_emb_head_dim, rotary_base=config.rotary_base,
                scaling_factor=config.rotary_scaling_factor,
                original_max_position_embeddings=config.original_max_position_embeddings,
                beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                mscale_all_dim=config.mscale_all_dim, cp_group=self.cp_group,
            )
        self.core_attention = ContextParallelDotProductAttention(
            config, layer_number, "causal", "self", softmax_scale=self.softmax_scale,
            k_channels=self.q_head_dim, v_channels=config.v_head_dim, cp_comm_type=cp_comm_type,
        )
        self.linear_proj = RowParallelLinear(
            heads * config.v_head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=bool(config.add_bias_linear),
            input_is_parallel=True, skip_bias_add=True,
        )
        norms = bool(getattr(config, "qk_layernorm", False))
        column = dict(config=config, init_method=config.init_method, bias=False, gather_output=False)
        if config.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(config.hidden_size, heads * self.q_head_dim, **column)
        else:
            self.linear_q_down_proj = DuplicatedLinear(config.hidden_size, config.q_lora_rank, config)
            self.linear_q_up_proj = ColumnParallelLinear(
                config.q_lora_rank, heads * self.q_head_dim, **column
            )
        self.linear_kv_down_proj = DuplicatedLinear(
            config.hidden_size, config.kv_lora_rank + config.qk_pos_emb_head_dim, config
        )
        self.linear_kv_up_proj = ColumnParallelLinear(
            config.kv_lora_rank, heads * (config.qk_head_dim + config.v_head_dim), **column
        )
        self.q_latent_norm = layer_norm(config, config.q_lora_rank) if norms and config.q_lora_rank else None
        self.kv_latent_norm = layer_norm(config, config.kv_lora_rank) if norms else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states`` ``[s, b, h]`` (``[s / tp, b, h]`` under sequence parallelism); causal,
        so ``attention_mask`` must be None; ``rotary_pos_emb`` must be None too (the layer computes
        its own angles). ``packed_seq_params``: a row of packed sequences (``qkv_format="thd"``)."""
        if attention_mask is not None:
            raise ValueError(
                "MLASelfAttention is causal and takes no attention_mask (the attention op applies the causal "
                f"mask itself); got a mask of shape {tuple(attention_mask.shape)}"
            )
        if rotary_pos_emb is not None:
            raise ValueError("MLASelfAttention computes its own rotary embeddings; pass rotary_pos_emb=None")
        q_input, kv_latent, k_rotary = self.latents(hidden_states)
        cu_seqlens = _packed_boundaries(packed_seq_params)
        training = self.training and torch.is_grad_enabled()
        up_checkpoint = None
        if training and selectively_recomputed(self.config, "mla_up_proj"):
            up_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            query, key, value = up_checkpoint.checkpoint(
                self.up_projections, q_input, kv_latent, k_rotary, cu_seqlens
            )
        else:
            query, key, value = self.up_projections(q_input, kv_latent, k_rotary, cu_seqlens)
        if training and selectively_recomputed(self.config, "core_attn"):
            context = tensor_parallel.checkpoint(
                self.core_attention, False, query, key, value, None, None, None, packed_seq_params
            )
        else:
            context = self.core_attention(query, key, value, None, packed_seq_params=packed_seq_params)
        if up_checkpoint is not None:
            up_checkpoint.discard_output_and_register_recompute(context)
        return self.linear_proj(context)

    def latents(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query's input (its normalised latent, or the hidden states), the normalised key/value
        latent (this rank's tokens) and the key's unrotated shared part (the whole sequence, under
        sequence parallelism gathered)."""
        config = self.config
        if config.q_lora_rank is None:
            q_input = hidden_states
        else:
            q_input, _ = self.linear_q_down_proj(hidden_states)
            if self.q_latent_norm is not None:
                q_input = self.q_latent_norm(q_input)
        combined, _ = self.linear_kv_down_proj(hidden_states)
        kv_latent, k_rotary = combined.split([config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
        if self.kv_latent_norm is not None:
            kv_latent = self.kv_latent_norm(kv_latent)
        if self.tp_size > 1:
            # Every rank's heads read the shared part: its gradient sums over the ranks (the
            # gather's reduce-scatter under sequence parallelism, an all-reduce without).
            group = self.linear_kv_up_proj.tp_group
            if config.sequence_parallel:
                k_rotary = gather_from_sequence_parallel_region(k_rotary, group=group)
            else:
                k_rotary = copy_to_tensor_model_parallel_region(k_rotary, group=group)
        return q_input, kv_latent, k_rotary

    def up_projections(
        self, q_input: torch.Tensor, kv_latent: torch.Tensor, k_rotary: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[s, b, heads / tp, qk_head_dim + qk_pos_emb_head_dim]``, keys of the same width
        and values ``[s, b, heads / tp, v_head_dim]`` of this rank's heads, rotated."""
        config, heads = self.config, self.num_attention_heads_per_partition
        up = self.linear_q_proj if config.q_lora_rank is None else self.linear_q_up_proj
        q, _ = up(q_input)
        kv, _ = self.linear_kv_up_proj(kv_latent)
        s, b = q.shape[:2]
        q_plain, q_rotary = q.view(s, b, heads, self.q_head_dim).split(
            [config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1
        )
        k_plain, value = kv.view(s, b, heads, config.qk_head_dim + config.v_head_dim).split(
            [config.qk_head_dim, config.v_head_dim], dim=-1
        )
        freqs, mscale = self._rotary_angles(s, q.device, cu_seqlens)
        q_rotary = apply_rotary_pos_emb(
            q_rotary, freqs, config, cu_seqlens, mscale=mscale, cp_group=self.cp_group
        )
        k_rotary = apply_rotary_pos_emb(
            k_rotary.unsqueeze(-2), freqs, config, cu_seqlens, mscale=mscale, cp_group=self.cp_group
        )
        query = torch.cat([q_plain, q_rotary], dim=-1)
        key = torch.cat([k_plain, k_rotary.expand(-1, -1, heads, -1)], dim=-1)
        return query, key, value.contiguous()

    def _rotary_angles(
        self, s: int, device: torch.device, cu_seqlens: torch.Tensor | None
    ) -> tuple[torch.Tensor, float]:
        """The angles of this rank's ``s`` rows (of a packed row: of the longest sequence's positions)
        and the factor on their cosines and sines."""
        if cu_seqlens is not None:
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            out = self._rotary(longest, device, packed_seq=True)
        else:
            cp = self.cp_group.size() if self.cp_group is not None else 1
            out = self._rotary(s * cp, device)
        return out if isinstance(out, tuple) else (out, 1.0)

    def _rotary(self, positions: int, device: torch.device, packed_seq: bool = False):
        if isinstance(self.rotary_pos_emb, YarnRotaryEmbedding):
            return self.rotary_pos_emb(positions, packed_seq=packed_seq, device=device)
        return self.rotary_pos_emb(positions, device=device, packed_seq=packed_seq)


def _packed_boundaries(packed_seq_params) -> torch.Tensor | None:
    """The boundaries of a packed row on the whole row (``cu_seqlens_q_padded`` where given)."""
    if packed_seq_params is None:
        return None
    padded = packed_seq_params.cu_seqlens_q_padded
    return padded if padded is not None else packed_seq_params.cu_seqlens_q
