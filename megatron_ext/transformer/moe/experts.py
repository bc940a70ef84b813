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
from megatron_ext.transformer.moe.grouped_gemm_util import ops
from megatron_ext.transformer.moe.router import moe_process_groups
from megatron_ext.transformer.utils import selectively_recomputed


def _activation(config: Any, gated: bool):
    act = config.activation_func

    def apply(x: torch.Tensor) -> torch.Tensor:
        if gated:
            gate, up = x.chunk(2, dim=-1)
            return act(gate) * up
        return act(x)

    return apply


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


class ExpertMLP(torch.nn.Module):
    """One expert: ``linear_fc1`` then the activation, times the router weight, then
    ``linear_fc2``. ``linear_fc2``'s bias (replicated over expert-tensor-parallel ranks, added on
    rank 0 only) is weighted by the router weight too, so the layer computes
    ``sum_e p_e * expert_e(x)``."""

    def __init__(self, config: Any, w1: torch.Tensor, w2: torch.Tensor, gated: bool, etp_rank: int) -> None:
        super().__init__()
        bias = bool(getattr(config, "add_bias_linear", False))
        stride = 2 if gated else 1
        self.linear_fc1 = _ExpertLinear(
            w1, torch.zeros(w1.shape[0], dtype=w1.dtype) if bias else None, 0, stride
        )
        self.linear_fc2 = _ExpertLinear(w2, torch.zeros(w2.shape[0], dtype=w2.dtype) if bias else None, 1, 1)
        self.activation = _activation(config, gated)
        self.add_output_bias = etp_rank == 0

    def forward(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(hidden_states, self.linear_fc1.weight, self.linear_fc1.bias)
        h = (self.activation(h) * probs.unsqueeze(-1)).to(hidden_states.dtype)
        out = torch.nn.functional.linear(h, self.linear_fc2.weight)
        if self.linear_fc2.bias is not None and self.add_output_bias:
            out = out + probs.unsqueeze(-1).to(out.dtype) * self.linear_fc2.bias
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
            ExpertMLP(config, weights.w1[i].clone(), weights.w2[i].clone(), weights.gated, weights.etp_rank)
            for i in range(num_local_experts)
        )

    def expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each local expert's ``(W1 [ffn*g/etp, h], W2 [h, ffn/etp])`` (the parameters)."""
        return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in self.local_experts]

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
    (``grouped_gemm_util.ops.gmm``). No biases, as in Megatron-core."""

    def __init__(self, num_local_experts: int, config: Any, pg_collection: Any = None) -> None:
        super().__init__()
        _check_ffn(config)
        if getattr(config, "add_bias_linear", False):
            raise ValueError("GroupedMLP (moe_grouped_gemm=True) has no biases: set add_bias_linear=False")
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
        self.activation = _activation(config, weights.gated)

    def expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each local expert's ``(W1 [ffn*g/etp, h], W2 [h, ffn/etp])``, as views of
        ``weight1`` and ``weight2``."""
        h, n = self.config.hidden_size, self.num_local_experts
        w1 = self.weight1.view(n, h, -1).transpose(1, 2)
        w2 = self.weight2.view(n, -1, h).transpose(1, 2)
        return [(w1[e], w2[e]) for e in range(n)]

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
        if not (self.training and selectively_recomputed(self.config, "moe_act")):
            return ops.gmm(self._weighted_activation(fc1, permuted_probs), w2, sizes, trans_b=False), None
        # recompute_modules "moe_act": the activation's output is freed once the second GEMM has
        # it, and recomputed from fc1 when that GEMM's backward needs it.
        checkpoint = tensor_parallel.CheckpointWithoutOutput()
        act = checkpoint.checkpoint(self._weighted_activation, fc1, permuted_probs)
        out = ops.gmm(act, w2, sizes, trans_b=False)
        checkpoint.discard_output_and_register_recompute(out)
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
    ffn], and the biases), whatever ep, etp and the implementation: a checkpoint loads at another
    ep or etp, and a SequentialMLP's into a GroupedMLP. Replicas: the expert-data-parallel ranks."""
    groups, config = experts.groups, experts.config
    etp_group, ep_group, edp_group = (getattr(groups, n, None) for n in ("expt_tp", "ep", "expt_dp"))
    etp, etp_rank = group_size(etp_group), group_rank(etp_group)
    n = experts.num_local_experts
    total, first = n * group_size(ep_group), group_rank(ep_group) * n
    replica_id = (0, 0, group_rank(edp_group))
    stride = 2 if getattr(config, "gated_linear_unit", False) else 1
    out = {}

    def add(state_key: str, name: str, data: torch.Tensor, pieces_of, assemble, first_expert, count, dim, s):
        build = partial(
            _expert_build, pieces_of, first_expert, total, dim, s, etp_rank, etp, tuple(sharded_offsets)
        )
        del count
        out[state_key] = ShardedTensorFactory(
            f"{prefix}{name}", data, build, partial(_expert_merge, assemble, dim, s), replica_id
        )

    if isinstance(experts, GroupedMLP):
        h = config.hidden_size
        add(
            f"{prefix}weight1",
            "linear_fc1.weight",
            experts.weight1,
            lambda w: [p.T for p in w.view(n, h, -1)],
            lambda ps: torch.stack([p.T for p in ps]).contiguous().view(h, -1),
            first,
            n,
            0,
            stride,
        )
        add(
            f"{prefix}weight2",
            "linear_fc2.weight",
            experts.weight2,
            lambda w: [p.T for p in w.view(n, -1, h)],
            lambda ps: torch.stack([p.T for p in ps]).contiguous().view(-1, h),
            first,
            n,
            1,
            1,
        )
        return out
    for i, expert in enumerate(experts.local_experts):
        local = f"{prefix}local_experts.{i}."
        for name, param in expert.named_parameters():
            if param.dim() == 2:
                dim, s = (0, stride) if name.startswith("linear_fc1") else (1, 1)
            else:  # fc1's bias is split like its rows, fc2's replicated over etp
                dim, s = (0, stride) if name.startswith("linear_fc1") else (0, 1)
            if param.dim() == 1 and name.startswith("linear_fc2"):
                build = partial(
                    _expert_build, lambda t: [t], first + i, total, 0, 1, 0, 1, tuple(sharded_offsets)
                )
                out[local + name] = ShardedTensorFactory(
                    f"{prefix}{name}",
                    param,
                    build,
                    partial(_expert_merge, lambda ps: ps[0], 0, 1),
                    (0, etp_rank, group_rank(edp_group)),
                )
                continue
            add(local + name, name, param, lambda t: [t], lambda ps: ps[0], first + i, 1, dim, s)
    return out
