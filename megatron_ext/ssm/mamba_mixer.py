"""The Mamba-2 mixer (Megatron-core's ``MambaMixer``, the recurrent layers of Nemotron-H, Granite 4 and
Mamba-2 models) on megatron_ext's ops: the short causal convolution, the SSD scan and the gated
RMSNorm over groups."""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_ext import tensor_parallel
from megatron_ext.fusions.gated_rms_norm import rms_norm_gated
from megatron_ext.fusions.mamba_ssd import mamba_chunk_scan_combined
from megatron_ext.packed_seq_params import PackedSeqParams
from megatron_ext.tensor_parallel.depthwise_conv import (
    DepthwiseConv,
    block_column_parallel_linear,
    split_parameter,
)
from megatron_ext.tensor_parallel.utils import param_device, tp_group_size_rank


class _GatedNorm(torch.nn.Module):
    """Megatron-core's ``norm`` of the mixer (``RMSNormGated`` over groups, gate after the norm's input
    unless ``norm_before_gate``): its weight is this rank's channels, its groups within the rank."""

    def __init__(self, weight: torch.Tensor, group_size: int, norm_before_gate: bool, eps: float) -> None:
        super().__init__()
        self.weight = split_parameter(weight)
        self.group_size, self.norm_before_gate, self.eps = group_size, norm_before_gate, eps

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return rms_norm_gated(x, self.weight, None, z, self.eps, self.group_size, self.norm_before_gate)


class MambaMixer(torch.nn.Module):
    """Megatron-core's ``MambaMixer(config, submodules, d_model, d_conv=4, conv_init=None, expand=2,
    A_init_range=(1, 16), D_has_hdim=False, rmsnorm=True, norm_before_gate=False, dt_min=0.001,
    dt_max=0.1, dt_init="random", dt_scale=1.0, dt_init_floor=1e-4, bias=False, conv_bias=True,
    chunk_size=128, layer_number=None, use_mem_eff_path=None, d_state=None, headdim=None,
    ngroups=None, pg_collection=None, pp_layer_offset=0)``: ``[s, b, d_model]`` in, ``(out, bias)`` out.

    ``in_proj`` (column-parallel) projects to the blocks [z, x, B, C, dt]: ``mamba_num_heads`` heads
    (or ``expand * d_model / mamba_head_dim``) of ``mamba_head_dim`` channels, ``mamba_num_groups``
    groups of B and C of ``mamba_state_dim``; x, B and C go through the depthwise causal convolution
    and SiLU, then the SSD scan with ``A = -exp(A_log)``, ``dt`` through softplus with ``dt_bias``
    and the ``D`` skip; the gated RMSNorm over each group's channels (``norm``, gate ``silu(z)``
    applied before it, Megatron-core's ``norm_before_gate=False``) and ``out_proj`` (row-parallel).
    Heads and groups are split over the tensor-parallel ranks (each rank its part of every block); every
    weight is drawn over all heads and split, so every layout starts from the serial weights
    (``A_log`` and ``D`` in float32, float64 for a float64 model). ``packed_seq_params`` (batch 1)
    restarts the convolution and the state at each sequence.

    ``submodules`` must be None (megatron_ext builds its own ``in_proj`` and ``out_proj``); the
    arguments Megatron-core deprecates (``use_mem_eff_path``, ``d_state``, ``headdim``, ``ngroups``)
    must be None or equal the config's."""

    def __init__(
        self,
        config: Any,
        submodules: Any = None,
        d_model: int | None = None,
        d_conv: int = 4,
        conv_init: float | None = None,
        expand: int = 2,
        A_init_range: tuple[float, float] = (1, 16),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 128,
        layer_number: int | None = None,
        use_mem_eff_path: bool | None = None,
        d_state: int | None = None,
        headdim: int | None = None,
        ngroups: int | None = None,
        pg_collection: Any = None,
        pp_layer_offset: int = 0,
    ) -> None:
        super().__init__()
        name = "MambaMixer"
        if submodules is not None:
            raise NotImplementedError(
                f"{name}: submodules must be None (megatron_ext builds its own in_proj and out_proj), "
                f"got {submodules!r}"
            )
        for what, given, field in (
            ("d_state", d_state, "mamba_state_dim"),
            ("headdim", headdim, "mamba_head_dim"),
            ("ngroups", ngroups, "mamba_num_groups"),
        ):
            if given is not None and given != getattr(config, field):
                raise ValueError(
                    f"{name}: {what}={given} differs from config.{field}={getattr(config, field)}"
                )
        if dt_init != "random" or dt_scale != 1.0:
            raise NotImplementedError(
                f"{name}: dt_init={dt_init!r}, dt_scale={dt_scale} (Megatron-core draws "
                "dt at random and ignores these): only the defaults are accepted"
            )
        if bias or norm_before_gate:
            raise ValueError(f"{name}: bias and norm_before_gate must be False, as Megatron-core requires")
        if not (0 < A_init_range[0] <= A_init_range[1]):
            raise ValueError(
                f"{name}: A_init_range must be (low, high) with 0 < low <= high, got {A_init_range}"
            )
        self.config = config
        self.d_model = config.hidden_size if d_model is None else d_model
        self.d_conv, self.conv_init, self.expand = d_conv, conv_init, expand
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.chunk_size, self.layer_number, self.pp_layer_offset = chunk_size, layer_number, pp_layer_offset
        self.d_state, self.headdim = config.mamba_state_dim, config.mamba_head_dim
        self.ngroups = config.mamba_num_groups
        for field in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups"):
            value = getattr(config, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: config.{field} must be a positive integer, got {value!r}")
        if config.mamba_num_heads is not None:
            self.nheads = config.mamba_num_heads
            self.d_inner = self.nheads * self.headdim
        else:
            self.d_inner = int(expand * self.d_model)
            if self.d_inner % self.headdim:
                raise ValueError(
                    f"{name}: d_inner = expand * d_model = {self.d_inner} is not divisible by "
                    f"mamba_head_dim={self.headdim}"
                )
            self.nheads = self.d_inner // self.headdim
        self.tp_group, tp, rank = tp_group_size_rank(getattr(pg_collection, "tp", None))
        for what, value in (("the number of heads", self.nheads), ("mamba_num_groups", self.ngroups)):
            if value % tp:
                raise ValueError(
                    f"{name}: {what} ({value}) must be divisible by the tensor-model-parallel size {tp}"
                )
        if self.nheads % self.ngroups:
            raise ValueError(
                f"{name}: the number of heads ({self.nheads}) must be divisible by "
                f"mamba_num_groups={self.ngroups}"
            )
        if getattr(config, "context_parallel_size", 1) > 1:
            raise NotImplementedError(f"{name}: context parallelism is not supported by megatron_ext yet")
        self.tp_size = tp
        self.nheads_local_tp, self.d_inner_local_tp = self.nheads // tp, self.d_inner // tp
        self.ngroups_local_tp = self.ngroups // tp
        groups = self.ngroups * self.d_state
        self._in_blocks = [self.d_inner, self.d_inner, groups, groups, self.nheads]  # z x B C dt
        self._conv_blocks = [self.d_inner, groups, groups]  # x B C

        dtype = config.params_dtype
        wide = torch.promote_types(dtype, torch.float32)
        device = param_device(config.use_cpu_initialization)
        self.in_proj = block_column_parallel_linear(
            self.d_model, self._in_blocks, config, False, self.tp_group, rank, tp
        )
        with torch.no_grad():
            self.conv1d = DepthwiseConv(
                self._conv_blocks, d_conv, conv_init, conv_bias, rank, tp, dtype, device
            )
            heads = slice(rank * self.nheads_local_tp, (rank + 1) * self.nheads_local_tp)
            dt = torch.exp(
                torch.rand(self.nheads, dtype=wide, device=device) * (math.log(dt_max) - math.log(dt_min))
                + math.log(dt_min)
            ).clamp(min=dt_init_floor)
            self.dt_bias = split_parameter((dt + torch.log(-torch.expm1(-dt)))[heads].to(dtype))
            A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(*A_init_range)
            self.A_log = split_parameter(torch.log(A)[heads].to(wide))
            self.D = split_parameter(
                torch.ones(
                    self.d_inner_local_tp if D_has_hdim else self.nheads_local_tp, dtype=wide, device=device
                )
            )
        self.norm = None
        if rmsnorm:
            self.norm = _GatedNorm(
                torch.ones(self.d_inner_local_tp, dtype=dtype, device=device),
                self.d_inner_local_tp // self.ngroups_local_tp,
                norm_before_gate,
                1e-5,
            )
        self.out_proj = tensor_parallel.RowParallelLinear(
            self.d_inner,
            self.d_model,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=self.tp_group,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        inference_context: Any = None,
        *,
        inference_params: Any = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        name = "MambaMixer"
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(f"{name}: inference is not supported by megatron_ext (training only)")
        cu_seqlens = None if packed_seq_params is None else packed_seq_params.cu_seqlens_q
        zxbcdt, _ = self.in_proj(hidden_states)  # [s, b, local blocks], the whole sequence
        zxbcdt = zxbcdt.transpose(0, 1)
        batch, length = zxbcdt.shape[:2]
        if cu_seqlens is not None and batch != 1:
            raise ValueError(f"{name}: packed rows (packed_seq_params) need batch size 1, got {batch}")
        n = self.d_state
        inner, groups = self.d_inner_local_tp, self.ngroups_local_tp
        z, xbc, dt = torch.split(zxbcdt, [inner, inner + 2 * groups * n, self.nheads_local_tp], dim=-1)
        x, B, C = torch.split(self.conv1d(xbc, cu_seqlens), [inner, groups * n, groups * n], dim=-1)
        D = self.D.reshape(self.nheads_local_tp, self.headdim) if self.D_has_hdim else self.D
        y = mamba_chunk_scan_combined(
            x.reshape(batch, length, -1, self.headdim),
            dt,
            -torch.exp(self.A_log),
            B.reshape(batch, length, -1, n),
            C.reshape(batch, length, -1, n),
            self.chunk_size,
            D=D,
            z=None if self.rmsnorm else z.reshape(batch, length, -1, self.headdim),
            dt_bias=self.dt_bias,
            dt_softplus=True,
            cu_seqlens=cu_seqlens,
        ).reshape(batch, length, -1)
        if self.norm is not None:
            y = self.norm(y, z)
        return self.out_proj(y.transpose(0, 1).contiguous())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        raise NotImplementedError(
            "MambaMixer: distributed checkpoints of the Mamba layers are not supported yet"
        )
