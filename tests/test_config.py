"""ModelParallelConfig and TransformerConfig against Megatron-core 0.16.1's fields: every name, in
its positional order, with its default (written out from Megatron-core's source); unimplemented
features refused only when set; the fields other parts of megatron_ext implement accepted."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_ext import ModelParallelConfig
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.transformer_config import AttnBackend

# (name, declared default) in Megatron-core's declaration order. What its __post_init__ fills in
# (autocast_dtype, expert_tensor_parallel_size, ...) is checked separately below.
MODEL_PARALLEL_CONFIG_FIELDS = [
    ("tensor_model_parallel_size", 1),
    ("pipeline_model_parallel_comm_backend", None),
    ("pipeline_model_parallel_size", 1),
    ("virtual_pipeline_model_parallel_size", None),
    ("sequence_parallel", False),
    ("context_parallel_size", 1),
    ("hierarchical_context_parallel_sizes", None),
    ("max_seqlen_per_dp_cp_rank", None),
    ("hybrid_context_parallel", False),
    ("expert_model_parallel_size", 1),
    ("expert_tensor_parallel_size", None),
    ("moe_extended_tp", False),
    ("perform_initialization", True),
    ("use_cpu_initialization", False),
    ("fp16", False),
    ("bf16", False),
    ("params_dtype", torch.float32),
    ("timers", None),
    ("finalize_model_grads_func", None),
    ("grad_scale_func", None),
    ("no_sync_func", None),
    ("grad_sync_func", None),
    ("param_sync_func", None),
    ("deterministic_mode", False),
    ("enable_autocast", False),
    ("autocast_dtype", None),
    ("num_microbatches_with_partial_activation_checkpoints", None),
    ("gradient_accumulation_fusion", False),
    ("async_tensor_model_parallel_allreduce", True),
    ("use_te_rng_tracker", False),
    ("tp_comm_overlap", False),
    ("tp_comm_bulk_wgrad", True),
    ("tp_comm_bulk_dgrad", True),
    ("tp_comm_overlap_ag", True),
    ("tp_comm_overlap_rs", True),
    ("tp_comm_overlap_rs_dgrad", False),
    ("tp_comm_split_ag", True),
    ("tp_comm_atomic_ag", False),
    ("tp_comm_split_rs", True),
    ("tp_comm_atomic_rs", False),
    ("cross_entropy_loss_fusion", False),
    ("cross_entropy_fusion_impl", "native"),
    ("tp_comm_overlap_disable_qkv", False),
    ("tp_comm_overlap_disable_fc1", False),
    ("tp_comm_bootstrap_backend", "nccl"),
    ("overlap_moe_expert_parallel_comm", False),
    ("delay_wgrad_compute", False),
    ("ep_overlap_early_attn_memory_release", False),
    ("pipeline_dtype", None),
    ("variable_seq_lengths", False),
    ("overlap_p2p_comm", False),
    ("batch_p2p_comm", True),
    ("batch_p2p_sync", True),
    ("use_ring_exchange_p2p", False),
    ("deallocate_pipeline_outputs", False),
    ("defer_embedding_wgrad_compute", False),
    ("wgrad_deferral_limit", 0),
    ("overlap_p2p_comm_warmup_flush", False),
    ("microbatch_group_size_per_vp_stage", None),
    ("mtp_standalone", False),
    ("cpu_offloading", False),
    ("cpu_offloading_num_layers", 0),
    ("_cpu_offloading_context", None),
    ("cpu_offloading_activations", True),
    ("cpu_offloading_weights", False),
    ("cpu_offloading_double_buffering", False),
    ("barrier_with_L1_time", True),
]
TRANSFORMER_CONFIG_FIELDS = [
    ("num_layers", 0),
    ("mtp_num_layers", None),
    ("mtp_loss_scaling_factor", 0.1),
    ("num_layers_in_first_pipeline_stage", None),
    ("num_layers_in_last_pipeline_stage", None),
    ("pipeline_model_parallel_layout", None),
    ("account_for_embedding_in_pipeline_split", False),
    ("account_for_loss_in_pipeline_split", False),
    ("hidden_size", 0),
    ("num_attention_heads", 0),
    ("attention_backend", AttnBackend.auto),
    ("softmax_scale", None),
    ("softmax_type", "vanilla"),
    ("num_query_groups", None),
    ("ffn_hidden_size", None),
    ("kv_channels", None),
    ("hidden_dropout", 0.1),
    ("attention_dropout", 0.1),
    ("fp32_residual_connection", False),
    ("apply_residual_connection_post_layernorm", False),
    ("layernorm_epsilon", 1e-05),
    ("layernorm_zero_centered_gamma", False),
    ("add_bias_linear", True),
    ("add_qkv_bias", False),
    ("gated_linear_unit", False),
    ("activation_func", F.gelu),
    ("activation_func_fp8_input_store", False),
    ("glu_linear_offset", 0.0),
    ("activation_func_clamp_value", None),
    ("num_moe_experts", None),
    ("rotary_interleaved", False),
    ("window_size", None),
    ("window_attn_skip_freq", None),
    ("normalization", "LayerNorm"),
    ("qk_layernorm", False),
    ("qk_l2_norm", False),
    ("qk_clip", False),
    ("qk_clip_alpha", 0.5),
    ("qk_clip_threshold", 100),
    ("log_max_attention_logit", False),
    ("attention_output_gate", False),
    ("test_mode", False),
    ("calculate_per_token_loss", False),
    ("multi_latent_attention", False),
    ("no_rope_freq", None),
    ("experimental_attention_variant", None),
    ("dsa_indexer_n_heads", None),
    ("dsa_indexer_head_dim", None),
    ("dsa_indexer_topk", None),
    ("dsa_indexer_loss_coeff", None),
    ("dsa_indexer_use_sparse_loss", False),
    ("linear_attention_freq", None),
    ("linear_conv_kernel_dim", 4),
    ("linear_key_head_dim", 128),
    ("linear_value_head_dim", 128),
    ("linear_num_key_heads", 16),
    ("linear_num_value_heads", 32),
    ("init_method", None),
    ("output_layer_init_method", None),
    ("init_method_std", 0.02),
    ("embedding_init_method", None),
    ("embedding_init_method_std", None),
    ("init_model_with_meta_device", False),
    ("apply_query_key_layer_scaling", False),
    ("attention_softmax_in_fp32", True),
    ("disable_bf16_reduced_precision_matmul", False),
    ("bias_activation_fusion", False),
    ("masked_softmax_fusion", False),
    ("persist_layer_norm", False),
    ("memory_efficient_layer_norm", False),
    ("bias_dropout_fusion", False),
    ("apply_rope_fusion", False),
    ("use_fused_weighted_squared_relu", False),
    ("fused_single_qkv_rope", False),
    ("recompute_granularity", None),
    ("recompute_method", None),
    ("recompute_num_layers", None),
    ("distribute_saved_activations", False),
    ("recompute_modules", None),
    ("fp8", None),
    ("fp8_recipe", "delayed"),
    ("fp8_param", False),
    ("fp8_quantizer_factory", None),
    ("fp8_margin", 0),
    ("fp8_interval", 1),
    ("fp8_amax_history_len", 1),
    ("fp8_amax_compute_algo", "most_recent"),
    ("fp8_wgrad", True),
    ("fp8_dot_product_attention", False),
    ("fp8_multi_head_attention", False),
    ("tp_only_amax_red", False),
    ("first_last_layers_bf16", False),
    ("num_layers_at_start_in_bf16", 1),
    ("num_layers_at_end_in_bf16", 1),
    ("use_kitchen", False),
    ("use_kitchen_attention", False),
    ("kitchen_attention_backend", "sdpa"),
    ("fp4", None),
    ("fp4_recipe", "nvfp4"),
    ("fp4_param", False),
    ("fp4_quantizer_factory", None),
    ("moe_shared_expert_intermediate_size", None),
    ("moe_shared_expert_gate", False),
    ("moe_shared_expert_overlap", False),
    ("moe_layer_freq", 1),
    ("moe_ffn_hidden_size", None),
    ("moe_router_load_balancing_type", "aux_loss"),
    ("moe_router_topk", 2),
    ("moe_enable_routing_replay", False),
    ("moe_router_topk_limited_devices", None),
    ("moe_router_padding_for_quantization", False),
    ("moe_router_padding_for_fp8", False),
    ("moe_router_num_groups", None),
    ("moe_router_group_topk", None),
    ("moe_router_pre_softmax", False),
    ("moe_router_topk_scaling_factor", None),
    ("moe_router_score_function", "softmax"),
    ("moe_router_dtype", None),
    ("moe_router_enable_expert_bias", False),
    ("moe_router_bias_update_rate", 0.001),
    ("moe_router_force_load_balancing", False),
    ("moe_grouped_gemm", False),
    ("moe_use_legacy_grouped_gemm", False),
    ("moe_aux_loss_coeff", 0.0),
    ("moe_z_loss_coeff", None),
    ("moe_input_jitter_eps", None),
    ("moe_token_dropping", False),
    ("moe_token_dispatcher_type", "allgather"),
    ("moe_enable_deepep", False),
    ("moe_flex_dispatcher_backend", "deepep"),
    ("moe_per_layer_logging", False),
    ("moe_expert_capacity_factor", None),
    ("moe_pad_expert_input_to_capacity", False),
    ("moe_token_drop_policy", "probs"),
    ("moe_layer_recompute", False),
    ("moe_permute_fusion", False),
    ("moe_router_fusion", False),
    ("moe_apply_probs_on_input", False),
    ("moe_latent_size", None),
    ("moe_deepep_num_sms", 20),
    ("moe_hybridep_num_sms", 16),
    ("cp_comm_type", None),
    ("enable_cuda_graph", False),
    ("cuda_graph_use_single_mempool", False),
    ("cuda_graph_retain_backward_graph", False),
    ("cuda_graph_warmup_steps", 3),
    ("external_cuda_graph", False),
    ("cuda_graph_impl", "none"),
    ("cuda_graph_scope", "full"),
    ("clone_scatter_output_in_embedding", True),
    ("disable_parameter_transpose_cache", False),
    ("config_logger_dir", ""),
    ("flash_decode", False),
    ("batch_invariant_mode", False),
    ("use_te_activation_func", False),
    ("use_te_rng_tracker", False),
    ("inference_rng_tracker", False),
    ("inference_sampling_seed", 42),
    ("symmetric_ar_type", None),
    ("use_inference_optimized_layers", False),
    ("inference_fuse_tp_communication", False),
    ("mrope_section", None),
    ("is_hybrid_model", False),
    ("mamba_state_dim", 128),
    ("mamba_head_dim", 64),
    ("mamba_num_groups", 8),
    ("mamba_num_heads", None),
    ("use_mamba_mem_eff_path", True),
    ("mlp_chunks_for_prefill", 1),
    ("heterogeneous_block_specs", False),
    ("hetereogenous_dist_checkpoint", False),
    ("quant_recipe", None),
    ("transformer_impl", "transformer_engine"),
    ("fine_grained_activation_offloading", False),
    ("offload_modules", []),
    ("min_offloaded_tensor_size", 1024 * 1024),
]


def _small(**kw):
    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, **kw)


def test_field_names_order_and_defaults():
    mpc = [f.name for f in dataclasses.fields(ModelParallelConfig)]
    assert mpc[: len(MODEL_PARALLEL_CONFIG_FIELDS)] == [n for n, _ in MODEL_PARALLEL_CONFIG_FIELDS]
    assert mpc[len(MODEL_PARALLEL_CONFIG_FIELDS) :] == ["hidden_size"]  # megatron_ext's one extra
    tc = [f.name for f in dataclasses.fields(TransformerConfig)]
    assert tc[: len(mpc)] == mpc
    # A field declared again (hidden_size, use_te_rng_tracker) keeps its first place, as in Megatron-core.
    assert tc[len(mpc) :] == [n for n, _ in TRANSFORMER_CONFIG_FIELDS if n not in mpc] + [
        "fused_output_cross_entropy"  # megatron_ext's own, last
    ]
    declared = {}
    for f in dataclasses.fields(TransformerConfig):
        declared[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    for name, default in MODEL_PARALLEL_CONFIG_FIELDS + TRANSFORMER_CONFIG_FIELDS:
        if name != "hidden_size":  # megatron_ext's ModelParallelConfig declares it (None) first
            assert declared[name] == default, name
    mp, config = ModelParallelConfig(), _small()
    # What Megatron-core's __post_init__ fills in.
    assert mp.autocast_dtype == torch.float32 and mp.expert_tensor_parallel_size == 1
    assert (
        ModelParallelConfig(
            pipeline_model_parallel_size=4, pipeline_dtype=torch.float32
        ).microbatch_group_size_per_vp_stage
        == 4
    )
    assert ModelParallelConfig(tensor_model_parallel_size=2).expert_tensor_parallel_size == 2
    assert config.ffn_hidden_size == 64 and config.kv_channels == 4 and config.num_query_groups == 4
    assert config.embedding_init_method is config.init_method and config.embedding_init_method_std == 0.02
    w = torch.empty(2000, dtype=torch.float64)
    torch.manual_seed(0)
    config.output_layer_init_method(w)
    assert abs(w.std().item() - 0.02 / 2) < 0.02 / 2 * 0.05  # sigma / sqrt(2 * num_layers)
    # Every field is a keyword (and a positional parameter in that order).
    params = list(__import__("inspect").signature(TransformerConfig).parameters)
    assert params == tc


def test_replace_round_trip():
    config = _small(sequence_parallel=True, tensor_model_parallel_size=2)
    again = dataclasses.replace(config)
    assert again == config


@pytest.mark.parametrize(
    "field, value",
    [
        ("fp8", "e4m3"),
        ("qk_clip", True),
        ("no_rope_freq", 4),
        ("enable_cuda_graph", True),
        ("tp_comm_overlap", True),
        ("cpu_offloading", True),
        ("enable_autocast", True),
        ("transformer_impl", "inference_optimized"),
        ("embedding_init_method_std", 0.5),
    ],
)
def test_unimplemented_refused_when_set(field, value):
    with pytest.raises(NotImplementedError, match=field):
        _small(**{field: value})


def test_implemented_and_inert_fields_accepted():
    def noop(*args, **kwargs):
        return None

    config = _small(
        # Fields other parts of megatron_ext implement.
        sequence_parallel=True,
        tensor_model_parallel_size=2,
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        gradient_accumulation_fusion=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        virtual_pipeline_model_parallel_size=2,
        microbatch_group_size_per_vp_stage=3,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.bfloat16,
        variable_seq_lengths=True,
        deallocate_pipeline_outputs=True,
        no_sync_func=noop,
        grad_sync_func=noop,
        param_sync_func=noop,
        finalize_model_grads_func=noop,
        grad_scale_func=noop,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
        num_layers_in_first_pipeline_stage=1,
        num_layers_in_last_pipeline_stage=1,
        calculate_per_token_loss=True,
        # The Llama family.
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        num_query_groups=2,
        qk_layernorm=True,
        rotary_interleaved=True,
        # Options of features that are off: they change nothing.
        moe_router_topk=4,
        fp8_margin=1,
        mamba_state_dim=16,
        tp_comm_bulk_wgrad=False,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        transformer_impl="local",
        attention_backend=AttnBackend.local,
        use_te_rng_tracker=True,
    )
    # Every Megatron-core attention backend: flash, fused and auto run torch's SDPA.
    for backend in AttnBackend:
        assert _small(attention_backend=backend).attention_backend is backend
    with pytest.raises(ValueError, match="attention_backend='sdpa' is not one of"):
        _small(attention_backend="sdpa")
    assert config.microbatch_group_size_per_vp_stage == 3 and config.bias_activation_fusion
    with pytest.raises(TypeError):
        _small(no_such_field=1)
    with pytest.raises(ValueError, match="pipeline_dtype is required"):
        ModelParallelConfig(pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="Cannot defer embedding wgrad compute"):
        ModelParallelConfig(defer_embedding_wgrad_compute=True)


def test_hidden_size_zero_describes_no_model():
    # Megatron-core's default: a config for DDP or the optimizer alone, with no model size.
    config = TransformerConfig(num_layers=1, num_attention_heads=1)
    assert (config.hidden_size, config.ffn_hidden_size, config.kv_channels) == (0, 0, 0)
    from megatron_ext.transformer.transformer_layer import ParallelTransformerLayer

    with pytest.raises(ValueError, match="a transformer layer needs config.hidden_size >= 1, got 0"):
        ParallelTransformerLayer(config)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"hidden_size must be a non-negative integer, got {bad!r}"):
            TransformerConfig(num_layers=1, num_attention_heads=1, hidden_size=bad)
    for name in ("num_layers", "num_attention_heads"):
        with pytest.raises(ValueError, match=f"TransformerConfig.{name} must be a positive integer, got 0"):
            TransformerConfig(**{"num_layers": 1, "num_attention_heads": 1, "hidden_size": 4, name: 0})
