"""Tensor parallelism: communication regions, layers, vocab-parallel cross-entropy, RNG."""

from megatron_ext.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ext.tensor_parallel.data import broadcast_data
from megatron_ext.tensor_parallel.inference_layers import (
    InferenceLayerNormColumnParallelLinear,
    InferenceRowParallelLinear,
)
from megatron_ext.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron_ext.tensor_parallel.linear_cross_entropy import vocab_parallel_linear_cross_entropy
from megatron_ext.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    all_to_all,
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_ext.tensor_parallel.random import (
    CheckpointFunction,
    CheckpointWithoutOutput,
    CudaRNGStatesTracker,
    checkpoint,
    convert_cuda_rng_state,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    is_graph_safe_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron_ext.tensor_parallel.utils import (
    VocabUtility,
    divide,
    ensure_divisibility,
    gather_split_1d_tensor,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
)

__all__ = [
    # data
    "broadcast_data",
    # inference_layers
    "InferenceLayerNormColumnParallelLinear",
    "InferenceRowParallelLinear",
    # layers
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_tensor_model_parallel_attributes",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    # cross_entropy
    "vocab_parallel_cross_entropy",
    # linear_cross_entropy
    "vocab_parallel_linear_cross_entropy",
    # mappings
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_to_all",
    "all_to_all_hp2sp",
    "all_to_all_sp2hp",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    # random
    "CheckpointFunction",
    "CheckpointWithoutOutput",
    "CudaRNGStatesTracker",
    "checkpoint",
    "convert_cuda_rng_state",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "is_graph_safe_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    # utils
    "VocabUtility",
    "divide",
    "ensure_divisibility",
    "gather_split_1d_tensor",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
]
