"""The conjugate communication regions of tensor and sequence parallelism.

Each function calls a C++ op whose autograd node does the conjugate collective in backward.
``group=None`` means the tensor-model-parallel group. A group of one rank passes tensors through.

=================================================  ========================  ==========================
region                                             forward                   backward
=================================================  ========================  ==========================
copy_to_tensor_model_parallel_region               identity                  all-reduce
reduce_from_tensor_model_parallel_region           all-reduce                identity
scatter_to_tensor_model_parallel_region            split last dim            all-gather last dim
gather_from_tensor_model_parallel_region           all-gather last dim       split last dim
scatter_to_sequence_parallel_region                split first dim           all-gather first dim
gather_from_sequence_parallel_region               all-gather first dim      reduce-scatter first dim
                                                                             (split when
                                                                             ``tensor_parallel_output_grad``
                                                                             is False)
reduce_scatter_to_sequence_parallel_region         reduce-scatter first dim  all-gather first dim
all_gather_last_dim_from_tensor_parallel_region    all-gather last dim       reduce-scatter last dim
reduce_scatter_last_dim_to_tensor_parallel_region  reduce-scatter last dim   all-gather last dim
=================================================  ========================  ==========================
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.tensor_parallel.utils import resolve_tp_group

_ops = torch.ops.megatron_ext


def resolve_group_name(group: dist.ProcessGroup | None) -> str:
    """The c10d registry name of ``group``; ``None`` means the tensor-model-parallel group."""
    return resolve_tp_group(group).group_name


def _check_tensor(input_: object, region: str) -> torch.Tensor:
    if not isinstance(input_, torch.Tensor):
        raise TypeError(f"{region}: expected a torch.Tensor, got {type(input_).__name__}")
    return input_


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce of the gradient."""
    _check_tensor(input_, "copy_to_tensor_model_parallel_region")
    return _ops.copy_to_tensor_model_parallel_region(input_, resolve_group_name(group))


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: all-reduce (the input is not modified). Backward: identity."""
    _check_tensor(input_, "reduce_from_tensor_model_parallel_region")
    return _ops.reduce_from_tensor_model_parallel_region(input_, resolve_group_name(group))


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: this rank's chunk of the last dim. Backward: all-gather along the last dim."""
    _check_tensor(input_, "scatter_to_tensor_model_parallel_region")
    return _ops.scatter_to_tensor_model_parallel_region(input_, resolve_group_name(group))


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: all-gather along the last dim. Backward: this rank's chunk of the last dim."""
    _check_tensor(input_, "gather_from_tensor_model_parallel_region")
    return _ops.gather_from_tensor_model_parallel_region(input_, resolve_group_name(group))


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: this rank's chunk of the first dim. Backward: all-gather along the first dim."""
    _check_tensor(input_, "scatter_to_sequence_parallel_region")
    return _ops.scatter_to_sequence_parallel_region(input_, resolve_group_name(group))


def gather_from_sequence_parallel_region(
    input_: torch.Tensor, tensor_parallel_output_grad: bool = True, group=None
) -> torch.Tensor:
    """Forward: all-gather along the first dim.

    Backward: reduce-scatter along the first dim when the consumer of the output is
    tensor-parallel (each rank holds a partial gradient), else this rank's chunk of it.
    """
    _check_tensor(input_, "gather_from_sequence_parallel_region")
    return _ops.gather_from_sequence_parallel_region(
        input_, bool(tensor_parallel_output_grad), resolve_group_name(group)
    )


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: reduce-scatter along the first dim. Backward: all-gather along the first dim."""
    _check_tensor(input_, "reduce_scatter_to_sequence_parallel_region")
    return _ops.reduce_scatter_to_sequence_parallel_region(input_, resolve_group_name(group))


def all_gather_last_dim_from_tensor_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: all-gather along the last dim. Backward: reduce-scatter along the last dim."""
    _check_tensor(input_, "all_gather_last_dim_from_tensor_parallel_region")
    return _ops.all_gather_last_dim_from_tensor_parallel_region(input_, resolve_group_name(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Forward: reduce-scatter along the last dim. Backward: all-gather along the last dim."""
    _check_tensor(input_, "reduce_scatter_last_dim_to_tensor_parallel_region")
    return _ops.reduce_scatter_last_dim_to_tensor_parallel_region(input_, resolve_group_name(group))
