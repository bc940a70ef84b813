"""Megatron-core 0.16.1's signatures (written out from its source) of the DistributedDataParallel,
gradient-buffer, finalize_model_grads, optimizer and process-group entry points: megatron_ext's take
the same parameters in the same order (extra parameters only after them). No megatron-core install
is needed."""

import importlib
import inspect

import pytest

from megatron_ext.distributed import DistributedDataParallel, finalize_model_grads
from megatron_ext.distributed import param_and_grad_buffer as buffers
from megatron_ext.optimizer import ChainedOptimizer, _get_param_groups, get_megatron_optimizer
from megatron_ext.process_groups_config import ProcessGroupCollection

# The module (megatron_ext.distributed re-exports its function under the same name).
finalize_module = importlib.import_module("megatron_ext.distributed.finalize_model_grads")

SIGNATURES = {
    "DistributedDataParallel": (
        DistributedDataParallel.__init__,
        ["self", "config", "ddp_config", "module", "disable_bucketing", "pg_collection"],
    ),
    "DistributedDataParallel.finish_grad_sync": (
        DistributedDataParallel.finish_grad_sync,
        ["self", "force_all_reduce"],
    ),
    "DistributedDataParallel.start_param_sync": (
        DistributedDataParallel.start_param_sync,
        ["self", "unused", "force_sync", "force_dispatch"],
    ),
    "DistributedDataParallel.scale_gradients": (
        DistributedDataParallel.scale_gradients,
        ["self", "scaling_factor"],
    ),
    "finalize_model_grads": (
        finalize_model_grads,
        ["model", "num_tokens", "pg_collection", "force_all_reduce"],
    ),
    "_allreduce_word_embedding_grads": (
        finalize_module._allreduce_word_embedding_grads,
        ["model", "config", "embd_group", "pp_group"],
    ),
    "_allreduce_non_tensor_model_parallel_grads": (
        finalize_module._allreduce_non_tensor_model_parallel_grads,
        ["model", "config", "tp_group"],
    ),
    "_allreduce_conditional_embedding_grads": (
        finalize_module._allreduce_conditional_embedding_grads,
        ["model", "config", "pp_group"],
    ),
    "_ParamAndGradBuffer": (
        buffers._ParamAndGradBuffer.__init__,
        [
            "self",
            "ddp_config",
            "param_dtype",
            "grad_dtype",
            "params",
            "data_parallel_group",
            "bucket_size",
            "param_to_name",
            "gradient_scaling_factor",
            "param_indices",
            "nccl_ub",
            "pg_collection",
        ],
    ),
    "_ParamAndGradBucket": (
        buffers._ParamAndGradBucket.__init__,
        [
            "self",
            "params",
            "param_data",
            "grad_data",
            "offset",
            "numel_unpadded",
            "gradient_scaling_factor",
            "bucket_id",
        ],
    ),
    "_ParamAndGradBucketGroup": (
        buffers._ParamAndGradBucketGroup.__init__,
        ["self", "buckets", "ddp_config", "collective_group", "collective_group_size"],
    ),
    "_ParamAndGradBucketGroup.register_grad_ready": (
        buffers._ParamAndGradBucketGroup.register_grad_ready,
        ["self", "param", "force_all_reduce"],
    ),
    "_ParamAndGradBucketGroup.start_grad_sync": (
        buffers._ParamAndGradBucketGroup.start_grad_sync,
        ["self", "force_all_reduce"],
    ),
    "_ParamAndGradBucketGroup.finish_grad_sync": (
        buffers._ParamAndGradBucketGroup.finish_grad_sync,
        ["self", "force_all_reduce"],
    ),
    "partition_buckets": (buffers.partition_buckets, ["buffers", "force_single_bucket_group"]),
    "shard_buffer": (buffers.shard_buffer, ["buffer", "data_parallel_world_size"]),
    "reduce_scatter_with_fp32_accumulation": (
        buffers.reduce_scatter_with_fp32_accumulation,
        ["output_tensor", "input_tensor", "op", "group", "async_op"],
    ),
    "get_megatron_optimizer": (
        get_megatron_optimizer,
        [
            "config",
            "model_chunks",
            "config_overrides",
            "use_gloo_process_groups",
            "pg_collection",
            "dump_param_to_param_group_map",
        ],
    ),
    "_get_param_groups": (_get_param_groups, ["model_chunks", "config", "config_overrides"]),
    "ChainedOptimizer": (ChainedOptimizer.__init__, ["self", "chained_optimizers"]),
    "ProcessGroupCollection.setup_process_groups_for_ddp": (
        ProcessGroupCollection.setup_process_groups_for_ddp,
        ["pg_collection", "config", "ddp_config"],
    ),
    "ProcessGroupCollection.setup_process_groups_for_optimizer": (
        ProcessGroupCollection.setup_process_groups_for_optimizer,
        ["pg_collection", "model_chunks", "use_gloo_process_groups"],
    ),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_megatron_signature(name):
    fn, expected = SIGNATURES[name]
    names = list(inspect.signature(fn).parameters)
    assert names[: len(expected)] == expected, (name, names)
