"""Megatron-core 0.16.1's public names of ``parallel_state`` and ``tensor_parallel`` (written out
from its source), and the parameter order of the functions megatron_ext mirrors: a name missing
or a parameter out of Megatron's order fails here. No megatron-core install is needed."""

import inspect

import pytest

from megatron_ext import parallel_state, tensor_parallel
from megatron_ext.tensor_parallel import cross_entropy, layers, mappings, random

# Every public function and class of megatron/core/parallel_state.py with its parameters in order
# (for a class, its __init__'s).
PARALLEL_STATE = {
    "get_nccl_options": ("pg_name", "nccl_comm_cfgs"),
    "update_pg_timeout": ("timeout", "pg"),
    "create_group": ("ranks", "timeout", "backend", "pg_options", "use_local_synchronization", "group_desc"),
    "generate_masked_orthogonal_rank_groups": ("world_size", "parallel_size", "mask"),
    "create_hierarchical_groups": (
        "rank",
        "ranks",
        "hierarchical_group_sizes",
        "create_gloo_process_groups",
        "pg_options",
        "timeout",
        "group_desc",
    ),
    "create_hybrid_dp_cp_groups": ("rank", "ranks", "pg_options"),
    "RankGenerator": ("tp", "ep", "dp", "pp", "cp", "order", "rank_offset"),
    "default_embedding_ranks": ("pp_ranks",),
    "default_position_embedding_ranks": ("pp_ranks",),
    "overwrite_nccl_comm_cfgs": ("nccl_comm_cfgs", "pg_name", "key_value_pair"),
    "initialize_model_parallel": (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "pipeline_model_parallel_comm_backend",
        "use_sharp",
        "context_parallel_size",
        "hierarchical_context_parallel_sizes",
        "hybrid_context_parallel",
        "expert_model_parallel_size",
        "num_distributed_optimizer_instances",
        "expert_tensor_parallel_size",
        "nccl_communicator_config_path",
        "distributed_timeout_minutes",
        "order",
        "get_embedding_ranks",
        "get_position_embedding_ranks",
        "create_gloo_process_groups",
        "high_priority_stream_groups",
        "sharp_enabled_group",
        "create_all_gather_group",
    ),
    "is_initialized": (),
    "is_unitialized": (),
    "model_parallel_is_initialized": (),
    "get_model_parallel_group": ("check_initialized",),
    "get_tensor_model_parallel_group": ("check_initialized",),
    "get_pipeline_model_parallel_group": ("check_initialized",),
    "get_data_parallel_group": ("with_context_parallel", "partial_data_parallel", "independent_all_gather"),
    "has_separate_all_gather_group": (),
    "get_data_parallel_group_gloo": ("with_context_parallel", "partial_data_parallel"),
    "get_context_parallel_group": ("check_initialized",),
    "get_context_parallel_global_ranks": ("check_initialized",),
    "get_hierarchical_context_parallel_groups": ("check_initialized",),
    "get_hybrid_data_context_parallel_groups": ("check_initialized", "group_size"),
    "get_embedding_group": ("check_initialized",),
    "get_position_embedding_group": ("check_initialized",),
    "get_amax_reduction_group": ("with_context_parallel", "tp_only_amax_red"),
    "get_tensor_and_data_parallel_group": ("check_initialized", "with_context_parallel"),
    "get_tensor_and_context_parallel_group": ("check_initialized",),
    "set_tensor_model_parallel_world_size": ("world_size",),
    "set_pipeline_model_parallel_world_size": ("world_size",),
    "set_virtual_pipeline_model_parallel_world_size": ("world_size",),
    "get_tensor_model_parallel_world_size": (),
    "get_pipeline_model_parallel_world_size": (),
    "set_tensor_model_parallel_rank": ("rank",),
    "set_pipeline_model_parallel_rank": ("rank",),
    "get_tensor_model_parallel_rank": (),
    "get_pipeline_model_parallel_rank": (),
    "is_pipeline_first_stage": ("ignore_virtual", "vp_stage"),
    "is_pipeline_last_stage": ("ignore_virtual", "vp_stage"),
    "is_rank_in_embedding_group": ("ignore_virtual", "vp_stage"),
    "is_rank_in_position_embedding_group": (),
    "get_virtual_pipeline_model_parallel_rank": (),
    "set_virtual_pipeline_model_parallel_rank": ("rank",),
    "get_virtual_pipeline_model_parallel_world_size": (),
    "get_tensor_model_parallel_src_rank": (),
    "get_model_parallel_src_rank": (),
    "get_data_parallel_src_rank": ("with_context_parallel",),
    "get_pipeline_model_parallel_first_rank": (),
    "get_pipeline_model_parallel_last_rank": (),
    "get_pipeline_model_parallel_next_rank": (),
    "get_pipeline_model_parallel_prev_rank": (),
    "get_data_parallel_world_size": ("with_context_parallel", "partial_data_parallel"),
    "set_data_parallel_rank": ("rank",),
    "get_data_parallel_rank": ("with_context_parallel", "partial_data_parallel"),
    "get_context_parallel_world_size": (),
    "get_context_parallel_rank": (),
    "get_tensor_and_context_parallel_world_size": (),
    "get_tensor_and_context_parallel_rank": (),
    "get_expert_model_parallel_group": ("check_initialized",),
    "get_expert_model_parallel_src_rank": (),
    "get_expert_model_parallel_world_size": (),
    "set_expert_model_parallel_world_size": ("world_size",),
    "get_expert_model_parallel_rank": (),
    "set_expert_model_parallel_rank": ("rank",),
    "get_expert_tensor_parallel_group": ("check_initialized",),
    "get_expert_tensor_parallel_world_size": (),
    "set_expert_tensor_parallel_world_size": ("world_size",),
    "get_expert_tensor_parallel_rank": (),
    "set_expert_tensor_parallel_rank": ("rank",),
    "get_expert_tensor_and_model_parallel_group": ("check_initialized",),
    "get_expert_tensor_and_model_parallel_world_size": (),
    "get_expert_tensor_and_model_parallel_rank": (),
    "get_expert_tensor_model_pipeline_parallel_group": ("check_initialized",),
    "get_expert_data_parallel_group": ("check_initialized", "partial_expert_data_parallel"),
    "get_data_modulo_expert_parallel_group": ("partial_expert_data_parallel",),
    "get_expert_data_parallel_group_gloo": ("partial_expert_data_parallel",),
    "get_expert_data_parallel_rank": ("partial_expert_data_parallel",),
    "get_expert_data_parallel_world_size": ("partial_expert_data_parallel",),
    "get_intra_distributed_optimizer_instance_group": ("check_initialized",),
    "get_inter_distributed_optimizer_instance_group": ("check_initialized",),
    "get_global_memory_buffer": (),
    "get_global_symmetric_memory_buffer": (),
    "destroy_global_memory_buffer": (),
    "destroy_global_symmetric_memory_buffer": (),
    "get_all_ranks": (),
    "destroy_model_parallel": (),
}

# megatron/core/tensor_parallel/__init__.py: its imports and __all__.
TENSOR_PARALLEL = [
    "CheckpointWithoutOutput",
    "ColumnParallelLinear",
    "InferenceLayerNormColumnParallelLinear",
    "InferenceRowParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_to_all",
    "all_to_all_hp2sp",
    "all_to_all_sp2hp",
    "broadcast_data",
    "checkpoint",
    "convert_cuda_rng_state",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_split_1d_tensor",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "is_graph_safe_cuda_rng_tracker",
    "linear_with_grad_accumulation_and_async_allreduce",
    "model_parallel_cuda_manual_seed",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
    "vocab_parallel_cross_entropy",
]

# Names user code reaches in the submodules: the region classes of mappings.py, the tracker
# machinery of random.py, the linears' functions and classes of layers.py, the cross-entropy's
# classes (Megatron-core's fused cross-entropy imports VocabParallelCrossEntropy).
SUBMODULES = {
    mappings: [
        "_CopyToModelParallelRegion",
        "_ReduceFromModelParallelRegion",
        "_ScatterToModelParallelRegion",
        "_GatherFromModelParallelRegion",
        "_ScatterToSequenceParallelRegion",
        "_GatherFromSequenceParallelRegion",
        "_ReduceScatterToSequenceParallelRegion",
        "_AllGatherFromTensorParallelRegion",
        "_ReduceScatterToTensorParallelRegion",
        "_AllToAll",
        "all_to_all",
        "all_to_all_sp2hp",
        "all_to_all_hp2sp",
    ],
    random: [
        "CudaRNGStatesTracker",
        "initialize_rng_tracker",
        "get_cuda_rng_tracker",
        "get_all_rng_states",
        "model_parallel_cuda_manual_seed",
        "is_graph_safe_cuda_rng_tracker",
        "is_checkpointing",
        "convert_cuda_rng_state",
        "CheckpointFunction",
        "checkpoint",
        "CheckpointWithoutOutput",
        "get_data_parallel_rng_tracker_name",
        "get_expert_parallel_rng_tracker_name",
    ],
    layers: [
        "linear_with_frozen_weight",
        "LinearWithFrozenWeight",
        "LinearWithGradAccumulationAndAsyncCommunication",
    ],
    cross_entropy: [
        "VocabParallelCrossEntropy",
        "_VocabParallelCrossEntropy",
        "vocab_parallel_cross_entropy",
    ],
}

# Parameters, in order, of the tensor_parallel functions this project mirrors from Megatron-core.
TENSOR_PARALLEL_SIGNATURES = {
    "param_is_not_tensor_parallel_duplicate": ("param", "tp_group"),
    "gather_from_sequence_parallel_region": (
        "input_",
        "tensor_parallel_output_grad",
        "group",
        "output_split_sizes",
        "use_global_buffer",
    ),
    "reduce_scatter_to_sequence_parallel_region": (
        "input_",
        "group",
        "input_split_sizes",
        "use_global_buffer",
    ),
    "all_to_all": ("group", "input_", "output_split_sizes_", "input_split_sizes"),
    "all_to_all_sp2hp": ("input_", "group"),
    "all_to_all_hp2sp": ("input_", "group"),
    "convert_cuda_rng_state": ("state", "to_graphable"),
    "get_expert_parallel_rng_tracker_name": (),
    "get_data_parallel_rng_tracker_name": (),
    "CudaRNGStatesTracker": ("use_cudagraphable_rng", "is_inference_rng_tracker"),
    "initialize_rng_tracker": (
        "use_te_rng_tracker",
        "inference_rng_tracker",
        "use_cudagraphable_rng",
        "force_reset",
    ),
    "get_cuda_rng_tracker": ("use_te_rng_tracker", "inference_rng_tracker", "use_cudagraphable_rng"),
    "get_all_rng_states": (),
    "model_parallel_cuda_manual_seed": (
        "seed",
        "te_rng_tracker",
        "inference_rng_tracker",
        "use_cudagraphable_rng",
        "tp_rank",
        "ep_rank",
        "etp_rank",
        "force_reset_rng",
    ),
    "is_graph_safe_cuda_rng_tracker": ("cuda_rng_tracker",),
    "is_checkpointing": (),
    "checkpoint": ("function", "distribute_saved_activations"),
    "CheckpointWithoutOutput": ("fp8",),
    "linear_with_frozen_weight": (
        "input",
        "weight",
        "bias",
        "gradient_accumulation_fusion",
        "allreduce_dgrad",
        "sequence_parallel",
        "tp_group",
        "grad_output_buffer",
        "wgrad_deferral_limit",
        "async_grad_allreduce",
    ),
}

# (class, apply's parameters) of Megatron-core's region classes.
REGION_APPLY = {
    "_CopyToModelParallelRegion": ("input_", "group"),
    "_ReduceFromModelParallelRegion": ("input_", "group"),
    "_ScatterToModelParallelRegion": ("input_", "group"),
    "_GatherFromModelParallelRegion": ("input_", "group"),
    "_ScatterToSequenceParallelRegion": ("input_", "group"),
    "_GatherFromSequenceParallelRegion": (
        "input_",
        "group",
        "tensor_parallel_output_grad",
        "output_split_sizes",
        "use_global_buffer",
    ),
    "_ReduceScatterToSequenceParallelRegion": ("input_", "group", "input_split_sizes", "use_global_buffer"),
    "_AllGatherFromTensorParallelRegion": ("input_", "group"),
    "_ReduceScatterToTensorParallelRegion": ("input_", "group"),
    "_AllToAll": ("group", "input", "output_split_sizes", "input_split_sizes"),
}


def _params(obj) -> tuple:
    target = obj.__init__ if inspect.isclass(obj) else obj
    names = [
        p.name
        for p in inspect.signature(target).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return tuple(names[1:] if inspect.isclass(obj) else names)


def test_parallel_state_names():
    assert len(PARALLEL_STATE) == 87
    missing = [n for n in PARALLEL_STATE if not hasattr(parallel_state, n)]
    assert not missing, f"parallel_state lacks {missing}"


@pytest.mark.parametrize("name", sorted(PARALLEL_STATE))
def test_parallel_state_signature(name):
    assert _params(getattr(parallel_state, name)) == PARALLEL_STATE[name]


def test_tensor_parallel_names():
    missing = [n for n in TENSOR_PARALLEL if not hasattr(tensor_parallel, n)]
    assert not missing, f"tensor_parallel lacks {missing}"
    for module, names in SUBMODULES.items():
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, f"{module.__name__} lacks {missing}"


@pytest.mark.parametrize("name", sorted(TENSOR_PARALLEL_SIGNATURES))
def test_tensor_parallel_signature(name):
    obj = next(getattr(m, name) for m in (mappings, random, layers) if hasattr(m, name))
    assert _params(obj) == TENSOR_PARALLEL_SIGNATURES[name]


@pytest.mark.parametrize("name", sorted(REGION_APPLY))
def test_region_class_apply_signature(name):
    assert _params(getattr(mappings, name).apply) == REGION_APPLY[name]


# (class, static method, its parameters) of Megatron-core's other tensor_parallel classes.
CLASS_METHODS = [
    (layers.LinearWithFrozenWeight, "apply", ("input", "weight", "bias", "allreduce_dgrad", "tp_group")),
    (
        layers.LinearWithGradAccumulationAndAsyncCommunication,
        "apply",
        (
            "input",
            "weight",
            "bias",
            "gradient_accumulation_fusion",
            "allreduce_dgrad",
            "sequence_parallel",
            "grad_output_buffer",
            "wgrad_deferral_limit",
            "tp_group",
        ),
    ),
    (
        cross_entropy._VocabParallelCrossEntropy,
        "apply",
        ("vocab_parallel_logits", "target", "label_smoothing"),
    ),
    (cross_entropy.VocabParallelCrossEntropy, "calculate_logits_max", ("vocab_parallel_logits",)),
    (
        cross_entropy.VocabParallelCrossEntropy,
        "calculate_predicted_logits",
        ("vocab_parallel_logits", "target", "logits_max", "vocab_start_index", "vocab_end_index"),
    ),
    (
        cross_entropy.VocabParallelCrossEntropy,
        "calculate_cross_entropy_loss",
        ("exp_logits", "predicted_logits", "sum_exp_logits"),
    ),
    (
        cross_entropy.VocabParallelCrossEntropy,
        "prepare_gradient_calculation_operands",
        ("softmax", "target_mask"),
    ),
    (
        cross_entropy.VocabParallelCrossEntropy,
        "calculate_gradients",
        ("grad_2d", "arange_1d", "masked_target_1d", "softmax_update", "grad_input", "grad_output"),
    ),
] + [(getattr(mappings, name), "backward", ("ctx", "grad_output")) for name in REGION_APPLY]


@pytest.mark.parametrize("cls,method,params", CLASS_METHODS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_class_method_signature(cls, method, params):
    assert _params(getattr(cls, method)) == params
