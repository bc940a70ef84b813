"""Tensor-parallel layers: column- and row-parallel linears and the vocabulary-parallel embedding.

Constructor signatures, weight layouts and return conventions are Megatron-core's:

===========================  ======================  ==========================================
layer                        weight (per rank)       forward returns
===========================  ======================  ==========================================
ColumnParallelLinear         [output / tp, input]    (output, output_bias)
RowParallelLinear            [output, input / tp]    (output, output_bias)
VocabParallelEmbedding       [vocab / tp, dim]       output
===========================  ======================  ==========================================

Parameters live on the current GPU, or on the CPU when ``config.use_cpu_initialization`` is set or
no GPU is available.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parameter import Parameter

from megatron_ext import parallel_state
from megatron_ext.model_parallel_config import ModelParallelConfig, check_model_parallel_config, config_field
from megatron_ext.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_ext.tensor_parallel.linear import (  # noqa: F401  (Megatron-core's names in layers)
    LinearWithFrozenWeight,
    LinearWithGradAccumulationAndAsyncCommunication,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron_ext.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron_ext.tensor_parallel.sharded_state import module_sharded_state_dict, renamed_sharded_state_dict
from megatron_ext.tensor_parallel.utils import (
    VocabUtility,
    divide,
    param_device,
    tp_group_size_rank,
)

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}

InitMethod = Callable[[torch.Tensor], Any]


# --- tensor-parallel attributes of parameters -------------------------------------------------


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> bool:
    """True if ``param`` is a shard (differs across TP ranks) or this is rank 0 of ``tp_group``
    (None: the tensor-parallel group): the parameters to count once when reducing over the
    model-parallel group (e.g. for the gradient norm)."""
    if hasattr(param, "tensor_model_parallel") and param.tensor_model_parallel:
        return True
    if tp_group is not None:
        return tp_group.rank() == 0
    return parallel_state.get_tensor_model_parallel_rank() == 0


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Marks ``tensor`` as split along ``dim`` with ``stride`` (attributes must not be set yet)."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise RuntimeError(f"set_tensor_model_parallel_attributes: the tensor already has {attribute!r}")
    setattr(tensor, "tensor_model_parallel", is_parallel)
    setattr(tensor, "partition_dim", dim)
    setattr(tensor, "partition_stride", stride)


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Gives ``tensor`` the attributes of a replicated parameter where it has none."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copies the attributes ``source_tensor`` has onto ``destination_tensor``."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


# --- weight initialisation ------------------------------------------------------------------------


def _initialize_affine_weight_gpu(
    weight: torch.Tensor, init_method: InitMethod, partition_dim: int, stride: int = 1,
    is_expert: bool = False,
) -> None:
    """Initialises this rank's shard in place on the model-parallel random stream (an expert's on
    the expert-parallel one)."""
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    tracker = get_cuda_rng_tracker()
    with tracker.fork(get_expert_parallel_rng_tracker_name()) if is_expert else tracker.fork():
        init_method(weight)


def _initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: InitMethod,
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.Tensor | None:
    """Builds the full ``[output_size, input_size]`` fp32 weight from the global CPU generator and
    copies this rank's part into ``weight``, so the weights are the same at every TP size.

    With ``stride`` s the partition dim is cut into chunks of ``per_partition_size / s`` and the
    chunks are dealt round-robin: rank r gets chunks r, r + tp, r + 2 tp, ... (a fused QKV weight
    keeps one third of each of Q, K and V on every rank).
    """
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    master_weight = torch.empty(output_size, input_size, dtype=torch.float32, requires_grad=False)
    init_method(master_weight)
    master_weight = master_weight.to(dtype=params_dtype)
    if rank is None:
        rank = parallel_state.get_tensor_model_parallel_rank()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
    per_stride = divide(per_partition_size, stride)
    chunks = torch.split(master_weight, per_stride, dim=partition_dim)
    with torch.no_grad():
        weight.copy_(torch.cat(chunks[rank::world_size], dim=partition_dim))
    return master_weight if return_master_weight else None


# --- helpers shared by the layers -----------------------------------------------------------------


class _Settings(NamedTuple):
    """What the layers read from their config."""

    params_dtype: torch.dtype
    perform_initialization: bool
    use_cpu_initialization: bool
    sequence_parallel: bool
    gradient_accumulation_fusion: bool
    deterministic_mode: bool


def _check_config(config: Any, layer: str) -> _Settings:
    # Any object with the fields read (Megatron-core's configs included); missing ones read as the
    # defaults of ModelParallelConfig.
    check_model_parallel_config(config, layer)
    return _Settings(*(config_field(config, name) for name in _Settings._fields))


def _check_init_method(init_method: Any, settings: _Settings, layer: str) -> None:
    if settings.perform_initialization and not callable(init_method):
        raise ValueError(
            f"{layer}: init_method must be a callable that fills a weight tensor in place "
            "(e.g. torch.nn.init.xavier_normal_) when config.perform_initialization is True, got "
            f"{init_method!r}"
        )


def _split_size(size: int, world_size: int, what: str, layer: str) -> int:
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{layer}: {what} must be a positive integer, got {size!r}")
    if size % world_size != 0:
        raise ValueError(
            f"{layer}: {what}={size} is not divisible by the tensor-model-parallel size {world_size}"
        )
    return size // world_size


def _sequence_parallel(settings: _Settings, world_size: int) -> bool:
    # Sequence parallelism over one rank is the identity; the layer runs without it.
    return settings.sequence_parallel and world_size > 1


def _expert_group_size_rank(
    tp_group: dist.ProcessGroup | None, is_expert: bool, config: Any
) -> tuple[dist.ProcessGroup, int, int, bool, bool]:
    """The layer's group, its size and this rank in it (an expert layer's default group is the
    expert-tensor-parallel group), whether the expert parallelism is on (``config``'s
    ``expert_model_parallel_size > 1``), and Megatron's ``explicit_expert_comm``: the token
    dispatcher, not the layer, does an expert layer's tensor-parallel communication."""
    if is_expert and tp_group is None:
        tp_group = parallel_state.get_expert_tensor_parallel_group()
    group, world_size, rank = tp_group_size_rank(tp_group)
    expert_parallel = getattr(config, "expert_model_parallel_size", 1) > 1
    return group, world_size, rank, expert_parallel, is_expert and (world_size > 1 or expert_parallel)


def _reject(layer: str, **unsupported: Any) -> None:
    for name, value in unsupported.items():
        if value:
            raise NotImplementedError(f"{layer}: {name}={value!r} is not supported by megatron_ext")


# --- layers ------------------------------------------------------------------------------------------


def drop_extra_state(module: torch.nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """A load_state_dict pre-hook of the linears: drops the ``_extra_state`` entry Megatron-core's
    linears save (empty in its local layers; megatron_ext's linears keep none)."""
    state_dict.pop(f"{prefix}_extra_state", None)


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding whose vocabulary rows are split across the tensor-parallel group.

    Forward: ids outside this rank's rows ``[vocab_start_index, vocab_end_index)`` read row 0 and
    are zeroed, then the partial lookups are summed over the group (all-reduce), or, with
    ``reduce_scatter_embeddings``, transposed from ``[b, s, h]`` to ``[s, b, h]`` and
    reduce-scattered along the sequence. Backward: the gradient reaches only the rows this rank holds.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod | None,
        reduce_scatter_embeddings: bool = False,
        config: ModelParallelConfig,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        name = "VocabParallelEmbedding"
        settings = _check_config(config, name)
        _check_init_method(init_method, settings, name)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.deterministic_mode = settings.deterministic_mode
        self.tp_group, world_size, rank = tp_group_size_rank(tp_group)
        self.tensor_model_parallel_size = world_size
        self.num_embeddings_per_partition = _split_size(num_embeddings, world_size, "num_embeddings", name)
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_per_partition_vocab_size(
            self.num_embeddings_per_partition, rank, world_size
        )

        self.weight = Parameter(
            torch.empty(
                self.num_embeddings_per_partition,
                embedding_dim,
                dtype=settings.params_dtype,
                device=param_device(settings.use_cpu_initialization),
            )
        )
        if settings.perform_initialization:
            if settings.use_cpu_initialization:
                _initialize_affine_weight_cpu(
                    self.weight, num_embeddings, embedding_dim, self.num_embeddings_per_partition, 0,
                    init_method, params_dtype=settings.params_dtype, rank=rank, world_size=world_size,
                )
            else:
                _initialize_affine_weight_gpu(self.weight, init_method, partition_dim=0, stride=1)
        else:
            set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron's checkpointing API: each tensor as a ShardedTensor (the weight split along the
        vocabulary, dim 0)."""
        return module_sharded_state_dict(self, prefix, sharded_offsets)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        # Every rank holds the same ids, so every rank raises alike; without this check an id
        # outside the vocabulary would silently embed to zeros at TP > 1.
        out_of_range = (input_ < 0) | (input_ >= self.num_embeddings)
        if bool(out_of_range.any()):
            raise ValueError(
                f"VocabParallelEmbedding: token id {input_[out_of_range].flatten()[0].item()} is outside "
                f"[0, {self.num_embeddings}) ({int(out_of_range.sum())} ids out of range)"
            )
        if self.tensor_model_parallel_size > 1:
            local_ids, outside = torch.ops.megatron_ext.vocab_range_mask(
                input_, self.vocab_start_index, self.vocab_end_index
            )
        else:
            local_ids, outside = input_, None
        if self.deterministic_mode:
            output_parallel = self.weight[local_ids]
        else:
            output_parallel = torch.nn.functional.embedding(local_ids, self.weight)
        if outside is not None:
            output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output dim: rank i holds ``A_i``
    ``[output_size / tp, input_size]`` and computes ``Y_i = X A_i^T + b_i``.

    Forward: the input is replicated (or, under sequence parallelism, sequence-sharded along dim 0
    and all-gathered inside the linear); the output is this rank's ``Y_i``, or the full ``Y``
    (all-gathered along the last dim) when ``gather_output``. Backward: the input gradient is summed
    over the group (all-reduce, or reduce-scatter along dim 0 under sequence parallelism),
    overlapped with the weight-gradient GEMM.

    ``forward(input_, weight=None)`` returns ``(output, output_bias)``: ``output_bias`` is the bias
    when ``skip_bias_add`` (so the caller can fuse the add), else None.
    """

    # Megatron-core's linears save an empty ``_extra_state`` object; sharded_state_dict adds it too.
    saves_megatron_extra_state = True

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: InitMethod | None,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: list | None = None,
        grad_output_buffer: list | None = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.register_load_state_dict_pre_hook(drop_extra_state)
        name = "ColumnParallelLinear"
        settings = _check_config(config, name)
        _reject(
            name,
            embedding_activation_buffer=embedding_activation_buffer,
            grad_output_buffer=grad_output_buffer,
            disable_grad_reduce=disable_grad_reduce,
        )
        if not skip_weight_param_allocation:
            _check_init_method(init_method, settings, name)
        self.config = config
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.stride = stride
        self.is_expert = is_expert
        self.tp_group, world_size, rank, self.expert_parallel, self.explicit_expert_comm = (
            _expert_group_size_rank(tp_group, is_expert, config)
        )
        # Under expert parallelism an expert's parameters are reduced over expert-dp, not dp.
        allreduce = not (is_expert and self.expert_parallel)
        self.tensor_model_parallel_size = world_size
        self.output_size_per_partition = _split_size(output_size, world_size, "output_size", name)
        if self.output_size_per_partition % stride != 0:
            raise ValueError(
                f"{name}: the per-rank output size {self.output_size_per_partition} "
                f"(output_size={output_size} "
                f"/ tp={world_size}) is not divisible by stride={stride}"
            )
        self.sequence_parallel = _sequence_parallel(settings, world_size)
        if self.sequence_parallel and gather_output:
            raise ValueError(f"{name}: gather_output=True cannot be combined with sequence parallelism")
        self.gradient_accumulation_fusion = settings.gradient_accumulation_fusion
        # Megatron's rule: the input gradient is all-reduced inside the linear unless sequence
        # parallelism reduce-scatters it instead.
        self.allreduce_dgrad = world_size > 1 and not self.sequence_parallel

        device = param_device(settings.use_cpu_initialization)
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = Parameter(
                torch.empty(
                    self.output_size_per_partition, input_size, dtype=settings.params_dtype, device=device
                )
            )
            if settings.perform_initialization:
                if settings.use_cpu_initialization:
                    self.master_weight = _initialize_affine_weight_cpu(
                        self.weight, output_size, input_size, self.output_size_per_partition, 0, init_method,
                        stride=stride, return_master_weight=keep_master_weight_for_test,
                        params_dtype=settings.params_dtype, rank=rank, world_size=world_size,
                    )
                else:
                    _initialize_affine_weight_gpu(
                        self.weight, init_method, partition_dim=0, stride=stride, is_expert=is_expert
                    )
            else:
                set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=stride)
            self.weight.allreduce = allreduce

        if bias:
            self.bias = Parameter(
                torch.zeros(self.output_size_per_partition, dtype=settings.params_dtype, device=device)
            )
            set_tensor_model_parallel_attributes(self.bias, is_parallel=True, dim=0, stride=stride)
            self.bias.allreduce = allreduce
        else:
            self.register_parameter("bias", None)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron's checkpointing API: each tensor as a ShardedTensor (weight and bias split
        along the output, dim 0, with the layer's stride), and Megatron-core's empty
        ``_extra_state`` object."""
        return renamed_sharded_state_dict(self, prefix, sharded_offsets, {}, metadata)

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    "ColumnParallelLinear: weight was not passed to forward and the layer was built with "
                    "skip_weight_param_allocation=True"
                )
            weight = self.weight
        else:
            expected = (self.output_size_per_partition, self.input_size)
            if tuple(weight.shape) != expected:
                raise ValueError(
                    f"ColumnParallelLinear: the weight passed to forward has shape {tuple(weight.shape)}, "
                    f"expected {expected}"
                )
        bias = self.bias if not self.skip_bias_add else None
        if (
            self.allreduce_dgrad or self.sequence_parallel or self.explicit_expert_comm
            or self.tensor_model_parallel_size == 1
        ):
            input_parallel = input_
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        output_parallel = linear_with_grad_accumulation_and_async_allreduce(
            input_parallel,
            weight,
            bias,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=self.allreduce_dgrad and not self.explicit_expert_comm,
            sequence_parallel=self.sequence_parallel and not self.explicit_expert_comm,
            tp_group=self.tp_group,
        )
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output:
            if self.sequence_parallel:
                raise ValueError(
                    "ColumnParallelLinear: gather_output cannot be combined with sequence parallelism"
                )
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


class RowParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input dim: rank i holds ``A_i``
    ``[output_size, input_size / tp]`` and the matching slice ``X_i`` of the input's last dim.

    Forward: ``X_i`` is the input itself when ``input_is_parallel``, else split off a replicated
    input; the partial products ``X_i A_i^T`` are summed over the group (all-reduce, or
    reduce-scatter along dim 0 under sequence parallelism) and the bias is added after the sum.
    Backward: the output gradient passes to every rank (all-gathered along dim 0 under sequence
    parallelism); the input gradient is all-gathered along the last dim when the input was split.

    ``forward(input_)`` returns ``(output, output_bias)``: ``output_bias`` is the bias when
    ``skip_bias_add``, else None. Under sequence parallelism the bias has the attribute
    ``sequence_parallel=True``: its gradient is partial per rank and must be all-reduced over the
    TP group by the training loop, as in Megatron-core.
    """

    # Megatron-core's linears save an empty ``_extra_state`` object; sharded_state_dict adds it too.
    saves_megatron_extra_state = True

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: InitMethod | None,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.register_load_state_dict_pre_hook(drop_extra_state)
        name = "RowParallelLinear"
        settings = _check_config(config, name)
        _check_init_method(init_method, settings, name)
        self.config = config
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.stride = stride
        self.is_expert = is_expert
        self.tp_group, world_size, rank, self.expert_parallel, self.explicit_expert_comm = (
            _expert_group_size_rank(tp_group, is_expert, config)
        )
        # Under expert parallelism an expert's parameters are reduced over expert-dp, not dp.
        allreduce = not (is_expert and self.expert_parallel)
        self.tensor_model_parallel_size = world_size
        self.input_size_per_partition = _split_size(input_size, world_size, "input_size", name)
        if self.input_size_per_partition % stride != 0:
            raise ValueError(
                f"{name}: the per-rank input size {self.input_size_per_partition} (input_size={input_size} "
                f"/ tp={world_size}) is not divisible by stride={stride}"
            )
        self.sequence_parallel = _sequence_parallel(settings, world_size)
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(f"{name}: sequence parallelism needs input_is_parallel=True")
        self.gradient_accumulation_fusion = settings.gradient_accumulation_fusion

        device = param_device(settings.use_cpu_initialization)
        self.weight = Parameter(
            torch.empty(
                output_size, self.input_size_per_partition, dtype=settings.params_dtype, device=device
            )
        )
        if settings.perform_initialization:
            if settings.use_cpu_initialization:
                self.master_weight = _initialize_affine_weight_cpu(
                    self.weight, output_size, input_size, self.input_size_per_partition, 1, init_method,
                    stride=stride, return_master_weight=keep_master_weight_for_test,
                    params_dtype=settings.params_dtype, rank=rank, world_size=world_size,
                )
            else:
                _initialize_affine_weight_gpu(
                    self.weight, init_method, partition_dim=1, stride=stride, is_expert=is_expert
                )
        else:
            set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=1, stride=stride)
        self.weight.allreduce = allreduce

        if bias:
            self.bias = Parameter(torch.zeros(output_size, dtype=settings.params_dtype, device=device))
            setattr(self.bias, "sequence_parallel", self.sequence_parallel)
            self.bias.allreduce = allreduce
        else:
            self.register_parameter("bias", None)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Megatron's checkpointing API: each tensor as a ShardedTensor (the weight split along the
        input, dim 1; the bias replicated), and Megatron-core's empty ``_extra_state`` object."""
        return renamed_sharded_state_dict(self, prefix, sharded_offsets, {}, metadata)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.input_is_parallel or self.tensor_model_parallel_size == 1:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        output_parallel = linear_with_grad_accumulation_and_async_allreduce(
            input_parallel,
            self.weight,
            None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=self.tp_group,
        )
        if self.explicit_expert_comm:  # the token dispatcher sums the partial products
            if not self.skip_bias_add:
                raise ValueError(
                    "RowParallelLinear: an expert layer under expert or expert-tensor parallelism needs "
                    "skip_bias_add=True (its bias is added after the dispatcher's reduction)"
                )
            output_ = output_parallel
        elif self.sequence_parallel:
            output_ = reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        if self.skip_bias_add:
            return output_, self.bias
        output = output_ + self.bias if self.bias is not None else output_
        return output, None
