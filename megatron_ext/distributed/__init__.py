"""Data-parallel and embedding gradient reductions."""

from megatron_ext.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_ext.distributed.finalize_model_grads import (
    allreduce_embedding_grads,
    allreduce_gradients,
    finalize_model_grads,
)

__all__ = [
    "DistributedDataParallel",
    "allreduce_embedding_grads",
    "allreduce_gradients",
    "finalize_model_grads",
]
