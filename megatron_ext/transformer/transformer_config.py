"""Configuration of the parallel transformer: every field of Megatron-core 0.16.1's
TransformerConfig, with its name, default and place in the positional order.

The fields megatron_ext's transformer reads take any valid value; a field whose feature it does not
implement (FP8, multi-latent attention, CUDA graphs, ...) is accepted at its
default and raises ``NotImplementedError`` naming it when set to anything else. Options that only
refine an unimplemented feature (the ``moe_*`` settings without ``num_moe_experts``, the ``fp8_*``
settings without ``fp8``, ...) change nothing and are accepted.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from megatron_ext.model_parallel_config import ModelParallelConfig, refuse_unimplemented
from megatron_ext.transformer.context_parallel import check_context_parallel_config
from megatron_ext.transformer.mla_config import check_mla_config, check_mtp_config
from megatron_ext.transformer.utils import check_attention_variants


class AttnBackend(enum.Enum):
    """Megatron-core's attention backends. megatron_ext runs ``auto``, ``flash`` and ``fused`` as
    torch's scaled_dot_product_attention, ``unfused`` and ``local`` as the unfused attention."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Initialises a tensor in place from N(0, sigma^2)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(
    sigma: float, num_layers: int, multiplier: float = 2.0
) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / sqrt(multiplier * num_layers))^2): the output projections of the residual
    branches."""
    return init_method_normal(sigma / math.sqrt(multiplier * num_layers))


# Fields whose feature the transformer does not implement, each with that feature.
_UNIMPLEMENTED = {
    "pipeline_model_parallel_layout": "custom pipeline layouts",
    "softmax_scale": "a custom attention softmax scale",
    "fp32_residual_connection": "fp32 residual connections",
    "layernorm_zero_centered_gamma": "zero-centred LayerNorm gamma",
    "activation_func_fp8_input_store": "FP8 activation storage",
    "qk_l2_norm": "query/key L2 normalisation",
    "qk_clip": "query/key clipping",
    "log_max_attention_logit": "attention-logit logging",
    "no_rope_freq": "rotary embeddings skipped in some layers",
    "apply_query_key_layer_scaling": "query-key layer scaling",
    "disable_bf16_reduced_precision_matmul": "cuBLAS reduced-precision control",
    "masked_softmax_fusion": "the fused masked softmax kernel",
    "use_fused_weighted_squared_relu": "weighted squared ReLU",
    "fused_single_qkv_rope": "rotary embeddings",
    "distribute_saved_activations": "distributing recomputation inputs across tensor-parallel ranks",
    "fp8": "FP8 training",
    "fp8_param": "FP8 training",
    "fp8_dot_product_attention": "FP8 training",
    "fp8_multi_head_attention": "FP8 training",
    "first_last_layers_bf16": "FP8 training",
    "use_kitchen": "NVIDIA Kitchen quantisation",
    "use_kitchen_attention": "NVIDIA Kitchen quantisation",
    "fp4": "FP4 training",
    "fp4_param": "FP4 training",
    "enable_cuda_graph": "CUDA graphs",
    "external_cuda_graph": "CUDA graphs",
    "cuda_graph_impl": "CUDA graphs",
    "flash_decode": "flash decoding",
    "batch_invariant_mode": "batch-invariant kernels",
    "use_te_activation_func": "TransformerEngine activations",
    "symmetric_ar_type": "symmetric-memory all-reduce",
    "use_inference_optimized_layers": "inference-optimised layers",
    "inference_fuse_tp_communication": "inference-optimised layers",
    "mrope_section": "multimodal rotary embeddings",
    "is_hybrid_model": "hybrid (Mamba) models",
    "heterogeneous_block_specs": "heterogeneous layers",
    "quant_recipe": "quantisation recipes",
    "fine_grained_activation_offloading": "activation offloading",
    "moe_latent_size": "MoE latent projections (TransformerEngine's in Megatron-core)",
    "moe_apply_probs_on_input": "router probabilities applied on the experts' input",
    "moe_enable_deepep": "DeepEP's flex token dispatcher",
    "moe_enable_routing_replay": "routing replay",
}


MOE_DISPATCHERS = ("allgather", "alltoall")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_group_limited_routing(num_experts: int, topk: int, num_groups: Any, group_topk: Any) -> None:
    """ValueError unless ``num_groups`` groups of ``num_experts / num_groups`` consecutive experts,
    ``group_topk`` of them chosen per token, can give each token ``topk`` experts and a score to
    every group (the sum of its ``topk // group_topk`` best experts' scores). Megatron-core's
    rules (groups divide the experts, no more chosen groups than groups, group_topk needs
    num_groups), and two of its silent failures refused: a ``topk`` beyond the experts of the
    chosen groups, and one below ``group_topk`` (every group would score 0)."""
    if group_topk is None and num_groups is None:
        return
    if group_topk is None:
        raise ValueError(
            f"moe_router_num_groups ({num_groups!r}) needs moe_router_group_topk (the groups chosen per "
            "token): group-limited routing takes both"
        )
    if num_groups is None:
        raise ValueError(
            f"moe_router_group_topk ({group_topk!r}) needs moe_router_num_groups: group-limited routing "
            "takes both"
        )
    for name, value in (("moe_router_num_groups", num_groups), ("moe_router_group_topk", group_topk)):
        if not _positive_int(value):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if num_experts % num_groups:
        raise ValueError(
            f"num_moe_experts ({num_experts}) must be divisible by moe_router_num_groups ({num_groups})"
        )
    if group_topk > num_groups:
        raise ValueError(
            f"moe_router_group_topk ({group_topk}) must not exceed moe_router_num_groups ({num_groups})"
        )
    per_group = num_experts // num_groups
    if topk > group_topk * per_group:
        raise ValueError(
            f"moe_router_topk ({topk}) is not reachable with moe_router_group_topk ({group_topk}) groups "
            f"of {per_group} experts: at most {group_topk * per_group} experts are in the chosen groups"
        )
    if topk < group_topk:
        raise ValueError(
            f"moe_router_topk ({topk}) must be at least moe_router_group_topk ({group_topk}): a group's "
            "score sums its moe_router_topk // moe_router_group_topk best experts"
        )


def check_moe_config(config: Any, ep: int | None = None) -> None:
    """ValueError naming the offending setting of an MoE configuration."""
    experts, topk = config.num_moe_experts, config.moe_router_topk
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        raise ValueError(f"num_moe_experts must be a positive integer, got {experts!r}")
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= experts:
        raise ValueError(f"moe_router_topk ({topk!r}) must be between 1 and num_moe_experts ({experts})")
    ep = config.expert_model_parallel_size if ep is None else ep
    if experts % ep:
        raise ValueError(
            f"num_moe_experts ({experts}) must be divisible by expert_model_parallel_size ({ep})"
        )
    if config.moe_token_dispatcher_type not in MOE_DISPATCHERS:
        raise ValueError(
            f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r} is not one of "
            f"{list(MOE_DISPATCHERS)}"
        )
    if config.moe_router_score_function not in ("softmax", "sigmoid"):
        raise ValueError(
            f"moe_router_score_function={config.moe_router_score_function!r} is not 'softmax' or 'sigmoid'"
        )
    types = config.moe_router_load_balancing_type
    for kind in types if isinstance(types, list) else [types]:
        if kind not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"):
            raise ValueError(
                f"moe_router_load_balancing_type={kind!r} is not supported; expected 'aux_loss', "
                "'seq_aux_loss', 'global_aux_loss', 'sinkhorn' or 'none'"
            )
    if isinstance(types, list) and (
        not isinstance(config.moe_aux_loss_coeff, list) or len(config.moe_aux_loss_coeff) != len(types)
    ):
        raise ValueError("moe_aux_loss_coeff must be a list as long as moe_router_load_balancing_type")
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        raise ValueError("moe_router_enable_expert_bias needs moe_router_score_function='sigmoid'")
    factor = config.moe_expert_capacity_factor
    if factor is not None and (
        isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0
    ):
        raise ValueError(f"moe_expert_capacity_factor must be a positive number or None, got {factor!r}")
    if config.moe_pad_expert_input_to_capacity and factor is None:
        raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor")
    if config.moe_token_drop_policy not in ("probs", "position"):
        raise ValueError(
            f"moe_token_drop_policy={config.moe_token_drop_policy!r} is not 'probs' or 'position'"
        )
    ffn = config.moe_ffn_hidden_size
    if not isinstance(ffn, int) or ffn < 1:
        raise ValueError(f"moe_ffn_hidden_size must be a positive integer, got {ffn!r}")
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if ffn % etp:
        raise ValueError(
            f"moe_ffn_hidden_size ({ffn}) must be divisible by expert_tensor_parallel_size ({etp})"
        )
    freq = config.moe_layer_freq
    pattern_ok = isinstance(freq, (list, tuple)) and len(freq) == config.num_layers and set(freq) <= {0, 1}
    if not (isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1) and not pattern_ok:
        raise ValueError(
            f"moe_layer_freq must be a positive integer or a list of num_layers ({config.num_layers}) "
            f"0/1 entries, got {freq!r}"
        )
    shared = config.moe_shared_expert_intermediate_size
    if shared is not None and (not isinstance(shared, int) or shared < 1):
        raise ValueError(f"moe_shared_expert_intermediate_size must be a positive integer, got {shared!r}")
    check_group_limited_routing(
        experts, topk, config.moe_router_num_groups, config.moe_router_group_topk
    )


@dataclass
class TransformerConfig(ModelParallelConfig):
    """What the transformer layers read, on top of the model-parallel settings."""

    num_layers: int = 0
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float | None = 0.1
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    pipeline_model_parallel_layout: Any = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    hidden_size: int = 0
    num_attention_heads: int = 0
    attention_backend: Any = AttnBackend.auto
    softmax_scale: float | None = None
    softmax_type: str = "vanilla"
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    fp32_residual_connection: bool = False
    apply_residual_connection_post_layernorm: bool = False
    layernorm_epsilon: float = 1e-05
    layernorm_zero_centered_gamma: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    gated_linear_unit: bool = False
    activation_func: Callable = F.gelu
    activation_func_fp8_input_store: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    num_moe_experts: int | None = None
    rotary_interleaved: bool = False
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: Any = None
    normalization: str = "LayerNorm"
    qk_layernorm: bool = False
    qk_l2_norm: bool = False
    qk_clip: bool = False
    qk_clip_alpha: float = 0.5
    qk_clip_threshold: float = 100
    log_max_attention_logit: bool = False
    attention_output_gate: bool = False
    test_mode: bool = False
    calculate_per_token_loss: bool = False
    multi_latent_attention: bool = False
    no_rope_freq: Any = None
    experimental_attention_variant: str | None = None
    dsa_indexer_n_heads: int | None = None
    dsa_indexer_head_dim: int | None = None
    dsa_indexer_topk: int | None = None
    dsa_indexer_loss_coeff: float | None = None
    dsa_indexer_use_sparse_loss: bool = False
    linear_attention_freq: Any = None
    linear_conv_kernel_dim: int | None = 4
    linear_key_head_dim: int | None = 128
    linear_value_head_dim: int | None = 128
    linear_num_key_heads: int | None = 16
    linear_num_value_heads: int | None = 32
    init_method: Callable | None = None
    output_layer_init_method: Callable | None = None
    init_method_std: float = 0.02
    embedding_init_method: Callable | None = None
    embedding_init_method_std: float | None = None
    init_model_with_meta_device: bool = False
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    disable_bf16_reduced_precision_matmul: bool = False
    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = False
    persist_layer_norm: bool = False
    memory_efficient_layer_norm: bool = False
    bias_dropout_fusion: bool = False
    apply_rope_fusion: bool = False
    use_fused_weighted_squared_relu: bool = False
    fused_single_qkv_rope: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    distribute_saved_activations: bool | None = False
    recompute_modules: list[str] | None = None
    fp8: str | None = None
    fp8_recipe: str | None = "delayed"
    fp8_param: bool = False
    fp8_quantizer_factory: str | None = None
    fp8_margin: int = 0
    fp8_interval: int = 1
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True
    fp8_dot_product_attention: bool = False
    fp8_multi_head_attention: bool = False
    tp_only_amax_red: bool = False
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    use_kitchen: bool = False
    use_kitchen_attention: bool = False
    kitchen_attention_backend: str = "sdpa"
    fp4: str | None = None
    fp4_recipe: str | None = "nvfp4"
    fp4_param: bool = False
    fp4_quantizer_factory: str | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_shared_expert_overlap: bool = False
    moe_layer_freq: Any = 1
    moe_ffn_hidden_size: int | None = None
    moe_router_load_balancing_type: Any = "aux_loss"
    moe_router_topk: int = 2
    moe_enable_routing_replay: bool = False
    moe_router_topk_limited_devices: int | None = None
    moe_router_padding_for_quantization: bool | None = False
    moe_router_padding_for_fp8: bool | None = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_score_function: str = "softmax"
    moe_router_dtype: str | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 0.001
    moe_router_force_load_balancing: bool = False
    moe_grouped_gemm: bool = False
    moe_use_legacy_grouped_gemm: bool = False
    moe_aux_loss_coeff: Any = 0.0
    moe_z_loss_coeff: float | None = None
    moe_input_jitter_eps: float | None = None
    moe_token_dropping: bool = False
    moe_token_dispatcher_type: str = "allgather"
    moe_enable_deepep: bool = False
    moe_flex_dispatcher_backend: str = "deepep"
    moe_per_layer_logging: bool = False
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_layer_recompute: bool = False
    moe_permute_fusion: bool = False
    moe_router_fusion: bool = False
    moe_apply_probs_on_input: bool = False
    moe_latent_size: int | None = None
    moe_deepep_num_sms: int = 20
    moe_hybridep_num_sms: int = 16
    cp_comm_type: Any = None
    enable_cuda_graph: bool = False
    cuda_graph_use_single_mempool: bool = False
    cuda_graph_retain_backward_graph: bool = False
    cuda_graph_warmup_steps: int = 3
    external_cuda_graph: bool = False
    cuda_graph_impl: str = "none"
    cuda_graph_scope: Any = "full"
    clone_scatter_output_in_embedding: bool = True
    disable_parameter_transpose_cache: bool = False
    config_logger_dir: str = ""
    flash_decode: bool = False
    batch_invariant_mode: bool = False
    use_te_activation_func: bool = False
    use_te_rng_tracker: bool = False
    inference_rng_tracker: bool = False
    inference_sampling_seed: int = 42
    symmetric_ar_type: str | None = None
    use_inference_optimized_layers: bool = False
    inference_fuse_tp_communication: bool = False
    mrope_section: list[int] | None = None
    is_hybrid_model: bool = False
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int | None = None
    use_mamba_mem_eff_path: bool = True
    mlp_chunks_for_prefill: int = 1
    heterogeneous_block_specs: bool = False
    hetereogenous_dist_checkpoint: bool = False
    quant_recipe: Any = None
    transformer_impl: str = "transformer_engine"
    fine_grained_activation_offloading: bool = False
    offload_modules: list[str] | None = field(default_factory=list)
    min_offloaded_tensor_size: int = 1024 * 1024
    # Not in Megatron-core: GPTModel computes the loss with the fused output layer +
    # cross-entropy (tensor_parallel.vocab_parallel_linear_cross_entropy), which never holds the
    # [s, b, vocab / tp] logits; same losses and gradients. Only the loss path (labels given).
    fused_output_cross_entropy: bool = False

    # The modules selective recomputation can recompute here.
    SELECTIVE_RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe_act", "moe", "shared_experts",
                                   "mla_up_proj")
    _MEGATRON_CORE_RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                                        "shared_experts")

    def _check_recompute(self) -> None:
        """Megatron-core's rules: ``recompute_granularity`` None, "full" (with ``recompute_method``
        "uniform" or "block" and ``recompute_num_layers`` >= 1) or "selective" (without
        ``recompute_num_layers``; ``recompute_modules`` defaults to ``["core_attn"]``)."""
        granularity, method = self.recompute_granularity, self.recompute_method
        num = self.recompute_num_layers
        if granularity not in (None, "full", "selective"):
            raise ValueError(
                f"TransformerConfig.recompute_granularity={granularity!r} must be None, 'full' or "
                "'selective'"
            )
        if method not in (None, "uniform", "block"):
            raise ValueError(
                f"TransformerConfig.recompute_method={method!r} must be None, 'uniform' or 'block'"
            )
        if granularity == "full":
            if method is None:
                raise ValueError(
                    "TransformerConfig.recompute_granularity='full' needs recompute_method 'uniform' or "
                    "'block'"
                )
            if isinstance(num, bool) or not isinstance(num, int) or num < 1:
                raise ValueError(
                    "TransformerConfig.recompute_granularity='full' needs recompute_num_layers >= 1 "
                    "(layers per recomputed chunk with 'uniform', recomputed layers per pipeline stage "
                    f"with 'block'), got {num!r}"
                )
        if granularity == "selective" and num is not None:
            raise ValueError(
                "TransformerConfig.recompute_granularity='selective' needs recompute_num_layers=None, "
                f"got {num!r}"
            )
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        if not isinstance(self.recompute_modules, (list, tuple)) or not all(
            isinstance(m, str) for m in self.recompute_modules
        ):
            raise ValueError(
                "TransformerConfig.recompute_modules must be a list of module names, got "
                f"{self.recompute_modules!r}"
            )
        if granularity == "selective":
            invalid = [m for m in self.recompute_modules if m not in self._MEGATRON_CORE_RECOMPUTE_MODULES]
            if invalid:
                raise ValueError(
                    f"TransformerConfig.recompute_modules: invalid choices {invalid}; allowed modules are "
                    f"{list(self._MEGATRON_CORE_RECOMPUTE_MODULES)}"
                )
            missing = [m for m in self.recompute_modules if m not in self.SELECTIVE_RECOMPUTE_MODULES]
            if missing:
                raise NotImplementedError(
                    f"TransformerConfig.recompute_modules {missing} are not supported by megatron_ext "
                    f"(no such modules); it recomputes {list(self.SELECTIVE_RECOMPUTE_MODULES)}"
                )
            if "moe_act" in self.recompute_modules and not self.moe_grouped_gemm:
                raise ValueError(
                    "TransformerConfig.recompute_modules: 'moe_act' needs moe_grouped_gemm=True (the "
                    "experts' activation is recomputed in GroupedMLP)"
                )
            if "mla_up_proj" in self.recompute_modules and not self.multi_latent_attention:
                raise ValueError(
                    "TransformerConfig.recompute_modules: 'mla_up_proj' is only supported with "
                    "multi_latent_attention"
                )
            if ("shared_experts" in self.recompute_modules and self.moe_shared_expert_overlap
                    and self.moe_shared_expert_intermediate_size is not None):
                raise ValueError(
                    "TransformerConfig.recompute_modules: 'shared_experts' cannot be recomputed with "
                    "moe_shared_expert_overlap=True"
                )
        if self.moe_layer_recompute:  # Megatron-core's older switch for recompute_modules "moe"
            if granularity == "full":
                raise ValueError(
                    "TransformerConfig.moe_layer_recompute=True cannot be combined with "
                    "recompute_granularity='full'"
                )
            warnings.warn("TransformerConfig.moe_layer_recompute is deprecated: use "
                          "recompute_granularity='selective' with 'moe' in recompute_modules")
            self.recompute_granularity = "selective"
            if "moe" not in self.recompute_modules:
                self.recompute_modules = [*self.recompute_modules, "moe"]

    def _check_gated_unit(self) -> None:
        """``glu_linear_offset`` (finite) and ``activation_func_clamp_value`` (positive and finite,
        or None) shape the gated linear unit: set without ``gated_linear_unit`` they would do
        nothing (Megatron-core ignores them there), so they raise."""
        offset, clamp = self.glu_linear_offset, self.activation_func_clamp_value
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
            raise ValueError(f"TransformerConfig.glu_linear_offset must be a finite number, got {offset!r}")
        if clamp is not None and (
            isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not 0 < clamp < math.inf
        ):
            raise ValueError(
                "TransformerConfig.activation_func_clamp_value must be a positive finite number or None, "
                f"got {clamp!r}"
            )
        if not self.gated_linear_unit and (offset != 0.0 or clamp is not None):
            raise ValueError(
                f"TransformerConfig.glu_linear_offset ({offset}) and activation_func_clamp_value ({clamp}) "
                "shape the gated linear unit: they need gated_linear_unit=True"
            )

    def _translate_topk_limited_devices(self) -> None:
        """Megatron-core's deprecated ``moe_router_topk_limited_devices`` d: device-limited routing,
        ``moe_router_group_topk`` d of ``expert_model_parallel_size`` groups."""
        devices = self.moe_router_topk_limited_devices
        if not devices:
            return
        if self.moe_router_group_topk:
            raise ValueError(
                "moe_router_topk_limited_devices is deprecated and replaced by moe_router_group_topk "
                "and moe_router_num_groups: set only those"
            )
        warnings.warn("moe_router_topk_limited_devices is deprecated: use moe_router_group_topk and "
                      "moe_router_num_groups")
        self.moe_router_group_topk = devices
        self.moe_router_num_groups = self.expert_model_parallel_size

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_unimplemented(self, _UNIMPLEMENTED)
        for name in ("num_layers", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransformerConfig.{name} must be a positive integer, got {value!r}")
        # 0, the default, as in Megatron-core: a config that describes no model (DDP's or the
        # optimizer's); the layers refuse it.
        if (
            not isinstance(self.hidden_size, int)
            or isinstance(self.hidden_size, bool)
            or self.hidden_size < 0
        ):
            raise ValueError(
                f"TransformerConfig.hidden_size must be a non-negative integer, got {self.hidden_size!r}"
            )
        tp = self.tensor_model_parallel_size
        if self.num_attention_heads % tp != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"tensor_model_parallel_size ({tp})"
            )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.ffn_hidden_size % tp != 0:
            raise ValueError(
                f"ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by "
                f"tensor_model_parallel_size ({tp})"
            )
        if self.kv_channels is None:  # as Megatron-core: rounded down when the heads do not divide
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        groups = self.num_query_groups
        if not isinstance(groups, int) or groups < 1 or self.num_attention_heads % groups != 0:
            raise ValueError(
                f"TransformerConfig.num_query_groups ({groups!r}) must be a positive divisor of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if groups % tp != 0 and tp % groups != 0:
            raise ValueError(
                f"TransformerConfig.num_query_groups ({groups}) must be a multiple or a divisor of "
                f"tensor_model_parallel_size ({tp})"
            )
        if self.init_model_with_meta_device and not self.use_cpu_initialization:
            raise ValueError(
                "TransformerConfig.init_model_with_meta_device=True needs use_cpu_initialization=True: the "
                "weights are drawn again from the CPU generator, unit by unit, when "
                "FullyShardedDataParallel shards the model, which gives the weights a model built directly "
                "has only with CPU initialisation"
            )
        check_context_parallel_config(self)
        check_attention_variants(self)
        check_mla_config(self)
        check_mtp_config(self)
        if self.num_moe_experts is not None:
            self._translate_topk_limited_devices()
            if self.moe_ffn_hidden_size is None:
                self.moe_ffn_hidden_size = self.ffn_hidden_size
            check_moe_config(self)
        elif self.expert_model_parallel_size > 1:
            raise ValueError(
                f"expert_model_parallel_size={self.expert_model_parallel_size} needs num_moe_experts "
                "(a mixture-of-experts model)"
            )
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"TransformerConfig.normalization={self.normalization!r} is not one of 'LayerNorm', 'RMSNorm'"
            )
        if (self.persist_layer_norm or self.memory_efficient_layer_norm) and self.normalization != "RMSNorm":
            raise NotImplementedError(
                "TransformerConfig.persist_layer_norm / memory_efficient_layer_norm select megatron_ext's "
                "fused "
                f"RMSNorm kernel; there is no fused LayerNorm (normalization={self.normalization!r})"
            )
        if not callable(self.activation_func):
            raise ValueError(
                f"TransformerConfig.activation_func must be callable, got {self.activation_func!r}"
            )
        self._check_gated_unit()
        self._check_recompute()
        backend = getattr(self.attention_backend, "name", self.attention_backend)
        if backend not in AttnBackend.__members__:
            raise ValueError(
                f"TransformerConfig.attention_backend={self.attention_backend!r} is not one of "
                f"{list(AttnBackend.__members__)}"
            )
        if self.transformer_impl not in ("transformer_engine", "local"):
            raise NotImplementedError(
                f"TransformerConfig.transformer_impl={self.transformer_impl!r} is not supported: "
                "megatron_ext builds its own layers ('local'; the default 'transformer_engine' means the "
                "same here)"
            )
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)
        # The word embedding is initialised with init_method.
        if self.embedding_init_method_std is None:
            self.embedding_init_method_std = self.init_method_std
        if self.embedding_init_method_std != self.init_method_std or self.embedding_init_method not in (
            None,
            self.init_method,
        ):
            raise NotImplementedError(
                "TransformerConfig.embedding_init_method / embedding_init_method_std different from "
                "init_method / init_method_std are not supported: the embedding is initialised with "
                "init_method"
            )
        self.embedding_init_method = self.init_method


@dataclass
class MLATransformerConfig(TransformerConfig):
    """Megatron-core's configuration of multi-latent attention (DeepSeek-V2/V3): its fields, defaults
    and order on top of ``TransformerConfig``'s (``transformer.multi_latent_attention``).

    ``q_lora_rank`` (None: the query is projected from the hidden state in one step, as in
    DeepSeek-V2-Lite), ``kv_lora_rank``: the ranks of the compressed query and key/value latents;
    ``qk_head_dim`` + ``qk_pos_emb_head_dim``: a query/key head (its rotated part shared by all heads
    of a key), ``v_head_dim``: a value head. ``rope_type`` ``"rope"`` or ``"yarn"`` (YaRN with
    ``rotary_scaling_factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
    ``mscale``, ``mscale_all_dim``; the softmax scale carries ``mscale_all_dim``'s factor squared)."""

    multi_latent_attention: bool = True
    q_lora_rank: int | None = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    normalization: str = "RMSNorm"
    rope_type: str = "yarn"
    rotary_base: float = 10000
    rotary_percent: float = 1.0
    rotary_scaling_factor: float = 40
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    cache_mla_latents: bool = False
