"""Tensor parallelism: communication regions, layers, vocab-parallel cross-entropy, RNG."""

from megatron_ext.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ext.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
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
    # cross_entropy
    "vocab_parallel_cross_entropy",
    # mappings
    "all_gather_last_dim_from_tensor_parallel_region",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    # utils
    "VocabUtility",
    "divide",
    "ensure_divisibility",
    "gather_split_1d_tensor",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
]
