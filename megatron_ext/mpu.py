"""The older ``mpu`` names (Megatron-LM before megatron.core, apex.transformer, fairscale) over
megatron_ext's parallel_state and tensor_parallel.

"Model parallel" here means tensor parallel, as it did in those libraries:
``get_model_parallel_rank()`` is the tensor-model-parallel rank, ``copy_to_model_parallel_region``
the tensor-parallel copy region, and so on.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_ext import parallel_state
from megatron_ext.parallel_state import (
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_src_rank,
    get_data_parallel_world_size,
    get_pipeline_model_parallel_group,
    get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    model_parallel_is_initialized,
)
from megatron_ext.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ext.tensor_parallel.data import broadcast_data
from megatron_ext.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron_ext.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_ext.tensor_parallel.random import (
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron_ext.tensor_parallel.utils import divide, ensure_divisibility, split_tensor_along_last_dim


def initialize_model_parallel(
    tensor_model_parallel_size_: int = 1,
    pipeline_model_parallel_size_: int = 1,
    virtual_pipeline_model_parallel_size_: int | None = None,
    pipeline_model_parallel_split_rank_: int | None = None,
    *,
    model_parallel_size_: int | None = None,
    default_backend: str | None = None,
    p2p_backend: str | None = None,
    **kwargs,
) -> None:
    """``parallel_state.initialize_model_parallel`` under the old trailing-underscore keywords.

    ``model_parallel_size_`` (fairscale, Megatron-LM v1) is the tensor-parallel size. apex's
    ``default_backend`` / ``p2p_backend`` are accepted and ignored: the groups use the backend of
    the default process group.
    """
    if model_parallel_size_ is not None:
        if tensor_model_parallel_size_ not in (1, model_parallel_size_):
            raise ValueError(
                f"model_parallel_size_={model_parallel_size_} and tensor_model_parallel_size_="
                f"{tensor_model_parallel_size_} disagree; they name the same size"
            )
        tensor_model_parallel_size_ = model_parallel_size_
    if pipeline_model_parallel_split_rank_ is not None:
        raise ValueError(
            f"pipeline_model_parallel_split_rank_={pipeline_model_parallel_split_rank_} (encoder-decoder "
            "pipelines) is not supported; Megatron-core 0.16 dropped it too"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size_,
        pipeline_model_parallel_size=pipeline_model_parallel_size_,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size_,
        **kwargs,
    )


def get_model_parallel_group() -> dist.ProcessGroup:
    """The tensor-model-parallel group."""
    return get_tensor_model_parallel_group()


def get_model_parallel_rank() -> int:
    """This process's rank in the tensor-model-parallel group."""
    return get_tensor_model_parallel_rank()


def get_model_parallel_world_size() -> int:
    """The tensor-model-parallel size."""
    return get_tensor_model_parallel_world_size()


def get_model_parallel_src_rank() -> int:
    """The global rank of tensor-model-parallel rank 0 of this process's group."""
    return get_tensor_model_parallel_src_rank()


def copy_to_model_parallel_region(input_):
    """Forward: identity. Backward: all-reduce over the tensor-parallel group."""
    return copy_to_tensor_model_parallel_region(input_)


def reduce_from_model_parallel_region(input_):
    """Forward: all-reduce over the tensor-parallel group. Backward: identity."""
    return reduce_from_tensor_model_parallel_region(input_)


def scatter_to_model_parallel_region(input_):
    """Forward: this rank's chunk of the last dim. Backward: all-gather along the last dim."""
    return scatter_to_tensor_model_parallel_region(input_)


def gather_from_model_parallel_region(input_):
    """Forward: all-gather along the last dim. Backward: this rank's chunk of the last dim."""
    return gather_from_tensor_model_parallel_region(input_)


__all__ = [
    "vocab_parallel_cross_entropy",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "broadcast_data",
    "checkpoint",
    "copy_to_model_parallel_region",
    "destroy_model_parallel",
    "divide",
    "ensure_divisibility",
    "gather_from_model_parallel_region",
    "get_cuda_rng_tracker",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_src_rank",
    "get_model_parallel_world_size",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "initialize_model_parallel",
    "model_parallel_cuda_manual_seed",
    "model_parallel_is_initialized",
    "reduce_from_model_parallel_region",
    "scatter_to_model_parallel_region",
    "split_tensor_along_last_dim",
]
