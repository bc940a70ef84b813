"""The routed experts: ``SequentialMLP`` (a loop over the local experts) and ``GroupedMLP`` (one
grouped GEMM per projection), Megatron-core's names and parameter layouts.

Both take ``(permuted_local_hidden_states, tokens_per_expert, permuted_probs)``: the tokens
grouped by local expert, and compute ``act(x W1) * p`` then ``@ W2`` (the router weight ``p``
applied before the second projection, as Megatron-core does), each expert's ffn split over the
expert-tensor-parallel ranks (W1 by columns, ``[gate_r | up_r]`` when gated, W2 by rows): the
partial outputs are summed by the dispatcher's combine. Expert parameters carry
``allreduce=False``: their gradients are reduced over the expert-data-parallel group.

With ``config.use_cpu_initialization`` every rank draws the full weights of all experts, expert
0 first (W1 then W2), and keeps its part, so the weights do not depend on ep or etp and are the
same for both implementations.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from megatron_ext import tensor_parallel
from megatron_ext.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron_ext.resolve import group_rank, group_size
from megatron_ext.tensor_parallel.layers import _initialize_affine_weight_cpu
from megatron_ext.transformer.mlp import check_fusable_glu, fused_glu, glu
from megatron_ext.transformer.moe.grouped_gemm_util import ops
from megatron_ext.transformer.moe.router import moe_process_groups
from megatron_ext.transformer.utils import selectively_recomputed


def _activation(config: Any, gated: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """fc1's output (its bias added) -> the activation: the gated unit of the dense MLP (with
    ``glu_linear_offset`` and ``activation_func_clamp_value``; one kernel under
    ``bias_activation_fusion``), or ``activation_func``."""
    if not gated:
        return config.activation_func
    if getattr(config, "bias_activation_fusion", False):
        check_fusable_glu(config)
        return partial(fused_glu, config)
    return partial(glu, config)


def _mark_expert(param: torch.Tensor) -> None:
    param.allreduce = False


class _ExpertWeights:
    """The local shards of experts ``first .. first + count - 1``: W1 [count, ffn*g/etp, h] and
    W2 [count, h, ffn/etp] (float32 master draws, then ``params_dtype``)."""

    def __init__(self, config: Any, num_local_experts: int, groups: Any) -> None:
        self.gated = bool(getattr(config, "gated_linear_unit", False))
        self.ffn = config.moe_ffn_hidden_size
        etp_group, ep_group = getattr(groups, "expt_tp", None), getattr(groups, "ep", None)
        self.etp, self.etp_rank = group_size(etp_group), group_rank(etp_group)
        ep_rank = group_rank(ep_group)
        if self.ffn % self.etp:
            raise ValueError(
                f"moe_ffn_hidden_size ({self.ffn}) must be divisible by the expert-tensor-parallel size "
                f"({self.etp})"
            )
        self.ffn_local = self.ffn // self.etp
        g = 2 if self.gated else 1
        h, count = config.hidden_size, num_local_experts
        first = ep_rank * count
        self.w1 = torch.empty(count, g * self.ffn_local, h, dtype=config.params_dtype)
        self.w2 = torch.empty(count, h, self.ffn_local, dtype=config.params_dtype)
        if not getattr(config, "perform_initialization", True):
            return
        total = config.num_moe_experts
        for e in range(total):
            fc1, fc2 = torch.empty(g * self.ffn_local, h), torch.empty(h, self.ffn_local)
            _initialize_affine_weight_cpu(
                fc1,
                g * self.ffn,
                h,
                g * self.ffn_local,
                0,
                config.init_method,
                stride=g,
                params_dtype=config.params_dtype,
                rank=self.etp_rank,
                world_size=self.etp,
            )
            _initialize_affine_weight_cpu(
                fc2,
                h,
                self.ffn,
                self.ffn_local,
                1,
                config.output_layer_init_method,
                params_dtype=config.params_dtype,
                rank=self.etp_rank,
                world_size=self.etp,
            )
            if first <= e < first + count:
                self.w1[e - first].copy_(fc1)
                self.w2[e - first].copy_(fc2)


def _set_parallel(param: torch.Tensor, dim: int, stride: int) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride
    _mark_expert(param)


class _ExpertLinear(torch.nn.Module):
    """One projection of one expert: ``weight`` (and ``bias``), no communication."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dim: int, stride: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        _set_parallel(self.weight, dim, stride)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = torch.nn.Parameter(bias)
            if dim == 0:
                _set_parallel(self.bias, 0, stride)
            else:
                _mark_expert(self.bias)


def _add_output_bias(
    out: torch.Tensor, bias: torch.Tensor, probs: torch.Tensor, etp_group: Any, etp_rank: int,
    sizes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out + probs * bias`` per row (each expert's bias, its rows ``sizes`` when ``bias`` stacks
    several experts' rows, times the row's router weight), counted once in the sum of the
    expert-tensor-parallel ranks' partial outputs that the combine takes: added on etp rank 0 (0
    times the bias elsewhere). Every rank holds the bias and gets its whole gradient (summed over
    the etp ranks in the backward), so the copies stay equal."""
    if group_size(etp_group) > 1:
        bias = tensor_parallel.copy_to_tensor_model_parallel_region(bias, etp_group)
        if etp_rank != 0:
            probs = torch.zeros_like(probs)
    if sizes is not None:
        bias = bias.repeat_interleave(sizes, dim=0, output_size=probs.shape[0])
    return torch.addcmul(out, probs.unsqueeze(-1).to(out.dtype), bias)


class ExpertMLP(torch.nn.Module):
    """One expert: ``linear_fc1`` then the activation, times the router weight, then
    ``linear_fc2``. ``linear_fc2``'s bias (replicated over expert-tensor-parallel ranks) is
    weighted by the router weight too, so the layer computes ``sum_e p_e * expert_e(x)`` (as
    Megatron-core's TEGroupedMLP and Hugging Face's gpt-oss)."""

    def __init__(
        self, config: Any, w1: torch.Tensor, w2: torch.Tensor, gated: bool, etp_group: Any, etp_rank: int
    ) -> None:
        super().__init__()
        bias = bool(getattr(config, "add_bias_linear", False))
        stride = 2 if gated else 1
        self.linear_fc1 = _ExpertLinear(
            w1, torch.zeros(w1.shape[0], dtype=w1.dtype) if bias else None, 0, stride
        )
        self.linear_fc2 = _ExpertLinear(w2, torch.zeros(w2.shape[0], dtype=w2.dtype) if bias else None, 1, 1)
        self.activation = _activation(config, gated)
        self.etp_group, self.etp_rank = etp_group, etp_rank

    def forward(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(hidden_states, self.linear_fc1.weight, self.linear_fc1.bias)
        h = (self.activation(h) * probs.unsqueeze(-1)).to(hidden_states.dtype)
        out = torch.nn.functional.linear(h, self.linear_fc2.weight)
        if self.linear_fc2.bias is not None:
            out = _add_output_bias(out, self.linear_fc2.bias, probs, self.etp_group, self.etp_rank)
        return out


def _check_ffn(config: Any) -> None:
    if config.moe_ffn_hidden_size is None:
        raise ValueError("the experts need config.moe_ffn_hidden_size (or ffn_hidden_size)")


class SequentialMLP(torch.nn.Module):
    """The local experts as ``local_experts[i]`` (``ExpertMLP``), run one after the other on their
    tokens."""

    def __init__(
        self, num_local_experts: int, config: Any, submodules: Any = None, pg_collection: Any = None
    ) -> None:
        super().__init__()
        _check_ffn(config)
        self.config = config
        self.num_local_experts = num_local_experts
        groups = self.groups = moe_process_groups(pg_collection)
        self.ep_group, self.tp_group = getattr(groups, "ep", None), getattr(groups, "expt_tp", None)
        self.dp_group = getattr(groups, "expt_dp", None)
        weights = _ExpertWeights(config, num_local_experts, groups)
        self.local_experts = torch.nn.ModuleList(
            ExpertMLP(
                config, weights.w1[i].clone(), weights.w2[i].clone(), weights.gated, self.tp_group,
                weights.etp_rank,
            )
            for i in range(num_local_experts)
        )

    def expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each local expert's ``(W1 [ffn*g/etp, h], W2 [h, ffn/etp])`` (the parameters)."""
        return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in self.local_experts]

    def expert_biases(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each local expert's ``(b1 [ffn*g/etp], b2 [h])``; none without ``add_bias_linear``."""
        experts = [e for e in self.local_experts if e.linear_fc1.bias is not None]
        return [(e.linear_fc1.bias, e.linear_fc2.bias) for e in experts]

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        sizes = [int(n) for n in tokens_per_expert.tolist()]
        tokens = torch.split(permuted_local_hidden_states, sizes)
        probs = torch.split(permuted_probs, sizes)
        outputs = [expert(t, p) for expert, t, p in zip(self.local_experts, tokens, probs)]
        return torch.cat(outputs, dim=0), None


class GroupedMLP(torch.nn.Module):
    """The local experts' weights stacked: ``weight1`` [h, experts * ffn*g/etp] and ``weight2``
    [experts * ffn/etp, h] (Megatron-core's layout), each projection one grouped GEMM
    (``grouped_gemm_util.ops.gmm``). With ``add_bias_linear`` (Megatron-core's GroupedMLP has
    none; its TEGroupedMLP has), ``bias1`` [experts, ffn*g/etp] (split like fc1's rows) and
    ``bias2`` [experts, h] (weighted by the router, as ``ExpertMLP``'s), stored in checkpoints
    under the same keys as ``SequentialMLP``'s biases."""

    def __init__(self, num_local_experts: int, config: Any, pg_collection: Any = None) -> None:
        super().__init__()
        _check_ffn(config)
        self.config = config
        self.num_local_experts = num_local_experts
        groups = self.groups = moe_process_groups(pg_collection)
        self.ep_group, self.tp_group = getattr(groups, "ep", None), getattr(groups, "expt_tp", None)
        self.dp_group = getattr(groups, "expt_dp", None)
        weights = _ExpertWeights(config, num_local_experts, groups)
        h = config.hidden_size
        # Megatron-core's memory layout: expert after expert, each W^T ([h, ffn] and [ffn, h]).
        self.weight1 = torch.nn.Parameter(weights.w1.transpose(1, 2).contiguous().view(h, -1))
        self.weight2 = torch.nn.Parameter(weights.w2.transpose(1, 2).reshape(-1, h).contiguous())
        _set_parallel(self.weight1, 1, 2 if weights.gated else 1)
        _set_parallel(self.weight2, 0, 1)
        self.etp_rank = weights.etp_rank
        if getattr(config, "add_bias_linear", False):
            dtype = config.params_dtype
            self.bias1 = torch.nn.Parameter(torch.zeros(num_local_experts, weights.w1.shape[1], dtype=dtype))
            self.bias2 = torch.nn.Parameter(torch.zeros(num_local_experts, h, dtype=dtype))
            _set_parallel(self.bias1, 1, 2 if weights.gated else 1)
            _mark_expert(self.bias2)
        else:
            self.register_parameter("bias1", None)
            self.register_parameter("bias2", None)
        self.activation = _activation(config, weights.gated)

    def expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each local expert's ``(W1 [ffn*g/etp, h], W2 [h, ffn/etp])``, as views of
        ``weight1`` and ``weight2``."""
        h, n = self.config.hidden_size, self.num_local_experts
        w1 = self.weight1.view(n, h, -1).transpose(1, 2)
        w2 = self.weight2.view(n, -1, h).transpose(1, 2)
        return [(w1[e], w2[e]) for e in range(n)]

    def expert_biases(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each local expert's ``(b1 [ffn*g/etp], b2 [h])``, views of ``bias1`` and ``bias2``; none
        without ``add_bias_linear``."""
        if self.bias1 is None:
            return []
        return [(self.bias1[e], self.bias2[e]) for e in range(self.num_local_experts)]

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        h, n = self.config.hidden_size, self.num_local_experts
        w1 = self.weight1.view(n, h, -1)
        w2 = self.weight2.view(n, -1, h)
        sizes = tokens_per_expert.to(torch.int64).cpu()
        fc1 = ops.gmm(permuted_local_hidden_states, w1, sizes, trans_b=False)
        rows = sizes.to(fc1.device)  # each expert's bias repeated over its rows
        if self.bias1 is not None:
            fc1 = fc1 + self.bias1.repeat_interleave(rows, dim=0, output_size=fc1.shape[0])
        if not (self.training and selectively_recomputed(self.config, "moe_act")):
            out = ops.gmm(self._weighted_activation(fc1, permuted_probs), w2, sizes, trans_b=False)
        else:
            # recompute_modules "moe_act": the activation's output is freed once the second GEMM
            # has it, and recomputed from fc1 when that GEMM's backward needs it.
            checkpoint = tensor_parallel.CheckpointWithoutOutput()
            act = checkpoint.checkpoint(self._weighted_activation, fc1, permuted_probs)
            out = ops.gmm(act, w2, sizes, trans_b=False)
            checkpoint.discard_output_and_register_recompute(out)
        if self.bias2 is not None:
            out = _add_output_bias(out, self.bias2, permuted_probs, self.tp_group, self.etp_rank, rows)
        return out, None

    def _weighted_activation(self, fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return (self.activation(fc1) * probs.unsqueeze(-1)).to(fc1.dtype)


def _expert_build(
    pieces_of: Callable[[torch.Tensor], list[torch.Tensor]],
    first_expert: int,
    num_experts: int,
    dim: int,
    stride: int,
    etp_rank: int,
    etp: int,
    offsets: tuple,
    key: str,
    data: torch.Tensor,
    replica_id: Any,
    _flat: Any,
) -> list[ShardedTensor]:
    """Each local expert's shard as ShardedTensors of the global ``[*offsets, E, ...]`` tensor:
    the expert axis after ``offsets``, the etp split (stride ``stride``) along ``dim``."""
    prepend = len(offsets) + 1
    out = []
    for i, piece in enumerate(pieces_of(data)):
        for k, part in enumerate(piece.detach().chunk(stride, dim)):
            out.append(
                ShardedTensor.from_rank_offsets(
                    key,
                    part,  # a view: checkpoints load in place
                    *offsets,
                    (len(offsets), first_expert + i, num_experts),
                    (prepend + dim, k * etp + etp_rank, etp * stride),
                    replica_id=replica_id,
                    prepend_axis_num=prepend,
                )
            )
    return out


def _expert_merge(
    assemble: Callable[[list[torch.Tensor]], torch.Tensor], dim: int, stride: int, parts: list[torch.Tensor]
) -> torch.Tensor:
    experts = [torch.cat(parts[i : i + stride], dim) for i in range(0, len(parts), stride)]
    return assemble(experts)


def experts_sharded_state_dict(
    experts: torch.nn.Module, prefix: str, sharded_offsets: tuple, metadata: dict | None = None
) -> dict:
    """The experts stored by global expert index under Megatron-core's keys
    (``<prefix>linear_fc1.weight`` [*layers, E, ffn*g, h], ``linear_fc2.weight`` [*layers, E, h,
    ffn], ``linear_fc1.bias`` [*layers, E, ffn*g], ``linear_fc2.bias`` [*layers, E, h]), whatever
    ep, etp and the implementation: a checkpoint loads at another ep or etp, and a SequentialMLP's
    into a GroupedMLP. Replicas: the expert-data-parallel ranks (and for fc2's bias the etp ranks)."""
    groups, config = experts.groups, experts.config
    etp_group, ep_group, edp_group = (getattr(groups, n, None) for n in ("expt_tp", "ep", "expt_dp"))
    etp, etp_rank, edp_rank = group_size(etp_group), group_rank(etp_group), group_rank(edp_group)
    n = experts.num_local_experts
    total, first = n * group_size(ep_group), group_rank(ep_group) * n
    glu_stride = 2 if getattr(config, "gated_linear_unit", False) else 1
    out = {}

    def add(state_key: str, name: str, data: torch.Tensor, pieces_of, assemble, first_expert: int,
            dim: int, stride: int, replicated: bool = False) -> None:
        """``data``'s experts (``pieces_of(data)``, one tensor each) as shards of the global
        tensor: split over etp along ``dim`` (with ``stride``), or ``replicated`` over etp."""
        split = (0, 1) if replicated else (etp_rank, etp)
        build = partial(
            _expert_build, pieces_of, first_expert, total, dim, stride, *split, tuple(sharded_offsets)
        )
        replica_id = (0, etp_rank if replicated else 0, edp_rank)
        out[state_key] = ShardedTensorFactory(
            f"{prefix}{name}", data, build, partial(_expert_merge, assemble, dim, stride), replica_id
        )

    if isinstance(experts, GroupedMLP):
        h = config.hidden_size
        rows, stack = (lambda t: list(t)), torch.stack
        add(f"{prefix}weight1", "linear_fc1.weight", experts.weight1,
            lambda w: [p.T for p in w.view(n, h, -1)],
            lambda ps: torch.stack([p.T for p in ps]).contiguous().view(h, -1), first, 0, glu_stride)
        add(f"{prefix}weight2", "linear_fc2.weight", experts.weight2,
            lambda w: [p.T for p in w.view(n, -1, h)],
            lambda ps: torch.stack([p.T for p in ps]).contiguous().view(-1, h), first, 1, 1)
        if experts.bias1 is not None:
            add(f"{prefix}bias1", "linear_fc1.bias", experts.bias1, rows, stack, first, 0, glu_stride)
            add(f"{prefix}bias2", "linear_fc2.bias", experts.bias2, rows, stack, first, 0, 1, replicated=True)
        return out
    # name -> (dim of the etp split, its stride, replicated over etp)
    layout = {"linear_fc1.weight": (0, glu_stride, False), "linear_fc1.bias": (0, glu_stride, False),
              "linear_fc2.weight": (1, 1, False), "linear_fc2.bias": (0, 1, True)}
    for i, expert in enumerate(experts.local_experts):
        for name, param in expert.named_parameters():
            dim, stride, replicated = layout[name]
            add(f"{prefix}local_experts.{i}.{name}", name, param, lambda t: [t], lambda ps: ps[0], first + i,
                dim, stride, replicated)
    return out
