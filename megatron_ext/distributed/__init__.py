"""Data-parallel and embedding gradient reductions."""

from megatron_ext.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_ext.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_ext.distributed.fully_sharded_data_parallel import FullyShardedDataParallel
from megatron_ext.distributed.finalize_model_grads import (
    allreduce_embedding_grads,
    allreduce_gradients,
    allreduce_layernorm_grads,
    finalize_model_grads,
)

__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "FullyShardedDataParallel",
    "allreduce_embedding_grads",
    "allreduce_gradients",
    "allreduce_layernorm_grads",
    "finalize_model_grads",
]
