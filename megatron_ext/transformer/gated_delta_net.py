"""Gated DeltaNet linear attention (Megatron-core's ``GatedDeltaNet``, the linear layers of Qwen3-Next
and Qwen3.5) on megatron_ext's ops: the short causal convolution and the chunked gated delta rule."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_ext import tensor_parallel
from megatron_ext.fusions.gated_delta_rule import chunk_gated_delta_rule
from megatron_ext.packed_seq_params import PackedSeqParams
from megatron_ext.tensor_parallel.depthwise_conv import (
    DepthwiseConv,
    block_column_parallel_linear,
    split_parameter,
)
from megatron_ext.tensor_parallel.utils import param_device, tp_group_size_rank
from megatron_ext.transformer.utils import layer_norm


class GatedDeltaNet(torch.nn.Module):
    """Megatron-core's ``GatedDeltaNet(config, submodules, layer_number=None, bias=False,
    conv_bias=False, conv_init=None, use_qk_l2norm=True, A_init_range=(1, 16), pg_collection=None)``:
    ``[s, b, h]`` in, ``(out [s, b, h], bias)`` out.

    ``in_proj`` (column-parallel) projects to the blocks [q, k, v, z, beta, alpha] of
    ``linear_num_key_heads`` key heads (``linear_key_head_dim``) and ``linear_num_value_heads`` value
    heads (``linear_value_head_dim``); q, k and v go through a depthwise causal convolution
    (``linear_conv_kernel_dim``) and ``config.activation_func`` (SiLU), then the gated delta rule with
    q and k L2-normalised, the decay ``g = -exp(A_log) softplus(alpha + dt_bias)`` and the write
    strength ``beta = sigmoid(beta)``; each value head's output is normalised over its channels
    (``out_norm``), gated by ``act(z)`` and projected back (``out_proj``, row-parallel). The heads are
    split over the tensor-parallel ranks (each rank its part of every block); every weight is drawn
    over all heads and split, so each layout starts from the serial weights. Packed rows
    (``packed_seq_params``) restart the convolution and the state at each sequence.

    ``submodules`` (Megatron-core's spec of in_proj, out_norm and out_proj) must be None: megatron_ext
    builds its own."""

    def __init__(
        self,
        config: Any,
        submodules: Any = None,
        layer_number: int | None = None,
        bias: bool = False,
        conv_bias: bool = False,
        conv_init: float | None = None,
        use_qk_l2norm: bool = True,
        A_init_range: tuple[float, float] = (1, 16),
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        name = "GatedDeltaNet"
        if submodules is not None:
            raise NotImplementedError(
                f"{name}: submodules must be None (megatron_ext builds its own in_proj, out_norm and "
                f"out_proj), got {submodules!r}"
            )
        self.config = config
        self.layer_number = layer_number
        self.bias, self.conv_bias, self.conv_init = bias, conv_bias, conv_init
        self.use_qk_l2norm = use_qk_l2norm
        if not (0 <= A_init_range[0] <= A_init_range[1]):
            raise ValueError(
                f"{name}: A_init_range must be (low, high) with 0 <= low <= high, got {A_init_range}"
            )
        self.A_init_range = A_init_range
        self.tp_group, tp, rank = tp_group_size_rank(getattr(pg_collection, "tp", None))
        self.tp_size = tp
        self.sp_size = tp if config.sequence_parallel else 1
        self.act_fn = config.activation_func
        activation = getattr(self.act_fn, "__name__", repr(self.act_fn))
        if activation not in ("silu", "swish"):
            raise ValueError(f"{name}: config.activation_func must be SiLU (F.silu), got {activation}")
        self.hidden_size = config.hidden_size
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        for field in ("linear_num_key_heads", "linear_num_value_heads"):
            heads = getattr(config, field)
            if not isinstance(heads, int) or heads < 1 or heads % tp:
                raise ValueError(
                    f"{name}: config.{field}={heads!r} must be a positive multiple of the "
                    f"tensor-model-parallel size {tp}"
                )
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"{name}: config.linear_num_value_heads={self.num_value_heads} must be a multiple of "
                f"linear_num_key_heads={self.num_key_heads}"
            )
        if not 1 <= self.conv_kernel_dim <= 8:
            raise ValueError(
                f"{name}: config.linear_conv_kernel_dim must be 1..8, got {self.conv_kernel_dim}"
            )
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.in_proj_dim = 2 * self.qk_dim + 2 * self.v_dim + 2 * self.num_value_heads
        self.conv_dim = 2 * self.qk_dim + self.v_dim
        self._in_blocks = [
            self.qk_dim,
            self.qk_dim,
            self.v_dim,
            self.v_dim,
            self.num_value_heads,
            self.num_value_heads,
        ]
        self._conv_blocks = self._in_blocks[:3]

        self.in_proj = block_column_parallel_linear(
            self.hidden_size, self._in_blocks, config, bias, self.tp_group, rank, tp
        )
        dtype = config.params_dtype
        device = param_device(config.use_cpu_initialization)
        with torch.no_grad():
            self.conv1d = DepthwiseConv(
                self._conv_blocks, self.conv_kernel_dim, conv_init, conv_bias, rank, tp, dtype, device
            )
            heads = self.num_value_heads // tp
            A = torch.empty(self.num_value_heads, dtype=torch.float32, device=device).uniform_(*A_init_range)
            self.A_log = split_parameter(torch.log(A[rank * heads : (rank + 1) * heads]).to(dtype))
            self.dt_bias = split_parameter(torch.ones(heads, dtype=dtype, device=device))
        self.out_norm = layer_norm(config, self.value_head_dim)
        for p in self.out_norm.parameters():
            # Shared by the heads, which are split: each rank's gradient is its heads' part, summed by
            # finalize_model_grads with or without sequence parallelism.
            p.partial_over_tensor_parallel = True
        self.out_proj = tensor_parallel.RowParallelLinear(
            self.v_dim,
            self.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=self.tp_group,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        name = "GatedDeltaNet"
        for what, value in (
            ("key_value_states", key_value_states),
            ("inference_context", inference_context),
            ("inference_params", inference_params),
            ("attention_bias", attention_bias),
            ("sequence_len_offset", sequence_len_offset),
        ):
            if value is not None:
                raise NotImplementedError(f"{name}: {what} is not supported (training only, self-attention)")
        if attention_mask is not None:
            raise ValueError(
                f"{name}: the recurrence is causal and takes no attention_mask; got one of shape "
                f"{tuple(attention_mask.shape)} (give packed rows as packed_seq_params)"
            )
        if kwargs:
            raise TypeError(f"{name}.forward got unexpected arguments {sorted(kwargs)}")
        cu_seqlens = None
        if packed_seq_params is not None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        qkvzba, _ = self.in_proj(hidden_states)  # [s, b, local blocks], the whole sequence
        qkvzba = qkvzba.transpose(0, 1)
        batch, seq_len = qkvzba.shape[:2]
        if cu_seqlens is not None and batch != 1:
            raise ValueError(f"{name}: packed rows (packed_seq_params) need batch size 1, got {batch}")
        tp = self.tp_size
        qkv, gate, beta, alpha = torch.split(
            qkvzba,
            [self.conv_dim // tp, self.v_dim // tp, self.num_value_heads // tp, self.num_value_heads // tp],
            dim=-1,
        )
        qkv = self.conv1d(qkv, cu_seqlens)
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = query.reshape(batch, seq_len, -1, self.key_head_dim)
        key = key.reshape(batch, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        # The decay in float32 at least (Megatron-core: float32), float64 for a float64 model.
        wide = torch.promote_types(alpha.dtype, torch.float32)
        g = -self.A_log.to(wide).exp() * F.softplus(alpha.to(wide) + self.dt_bias.to(wide))
        out, _ = chunk_gated_delta_rule(
            query,
            key,
            value,
            g=g,
            beta=beta.sigmoid(),
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=self.use_qk_l2norm,
        )
        gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)
        normed = (self.out_norm(out) * self.act_fn(gate.to(wide))).to(out.dtype)
        normed = normed.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()
        return self.out_proj(normed)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        raise NotImplementedError(
            "GatedDeltaNet: distributed checkpoints of the linear-attention layers are not supported yet"
        )
