"""The model the flags describe: its TransformerConfig and GPTModel chunks."""

from __future__ import annotations

import argparse

import torch

from megatron_ext import tensor_parallel
from megatron_ext.distributed import (
    finalize_model_grads,
)
from megatron_ext.fusions.fused_bias_geglu import quick_gelu
from megatron_ext.models import GPTModel
from megatron_ext.models.mamba import MambaModel
from megatron_ext.models.hf import (
    config_from_hf,
    load_hf_state_dict,
)
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.transformer_config import MLATransformerConfig
from megatron_ext.training.arguments import BYTE_VOCAB, DTYPES
from megatron_ext.training.arguments_model import layer_pattern


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else DTYPES[args.dtype]


def llama_ffn_hidden(hidden: int) -> int:
    """Llama's MLP width: 8/3 of the hidden size, rounded up to a multiple of 32."""
    return -(-8 * hidden // 3 // 32) * 32


def megatron_swiglu_ffn_hidden(hidden: int) -> int:
    """Megatron-LM's MLP width with --swiglu: 2/3 of 4 x the hidden size, rounded down to a multiple
    of 64."""
    return int(4 * hidden * 2 / 3 / 64) * 64


def architecture(args: argparse.Namespace) -> dict:
    """The model's parts: --arch's (gpt: LayerNorm, GeLU, learned positions, tied output layer,
    biases; llama and deepseek: RMSNorm, SwiGLU, rotary positions, untied, no biases), each replaced
    by its Megatron-LM flag where one is given."""
    llama = args.arch in ("llama", "deepseek")
    swiglu = llama or args.swiglu
    if args.ffn_hidden is not None:
        ffn = args.ffn_hidden
    else:
        ffn = (llama_ffn_hidden(args.hidden) if llama
               else megatron_swiglu_ffn_hidden(args.hidden) if swiglu else None)
    return dict(
        normalization=args.normalization or ("RMSNorm" if llama else "LayerNorm"),
        swiglu=swiglu,
        position_embedding_type=args.position_embedding_type or ("rope" if llama else "learned_absolute"),
        untied=llama or args.untie_embeddings_and_output_weights,
        add_bias_linear=(not llama or args.add_bias_linear) and not args.disable_bias_linear,
        # DeepSeek's value, the one its Hugging Face models normalise the latents with
        norm_epsilon=(args.norm_epsilon if args.norm_epsilon is not None
                      else 1e-6 if args.arch == "deepseek" else 1e-5),
        ffn_hidden=ffn,
    )


def recompute_settings(args: argparse.Namespace) -> dict:
    """The TransformerConfig recomputation fields of the flags; ``--recompute`` is full
    recomputation of each layer on its own."""
    if args.recompute_activations:  # Megatron-LM's shorthand
        if args.recompute or args.recompute_granularity not in (None, "selective"):
            raise ValueError("--recompute-activations is selective recomputation; it cannot be combined with "
                             "--recompute or --recompute-granularity full")
        return dict(recompute_granularity="selective", recompute_method=args.recompute_method,
                    recompute_num_layers=args.recompute_num_layers, recompute_modules=args.recompute_modules)
    if args.recompute:
        if args.recompute_granularity not in (None, "full"):
            raise ValueError(f"--recompute is full recomputation; it cannot be combined with "
                             f"--recompute-granularity {args.recompute_granularity}")
        return dict(recompute_granularity="full", recompute_method=args.recompute_method or "uniform",
                    recompute_num_layers=args.recompute_num_layers or 1,
                    recompute_modules=args.recompute_modules)
    return dict(recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers, recompute_modules=args.recompute_modules)


def hybrid(args: argparse.Namespace) -> bool:
    """Whether the flags describe a Mamba-2 hybrid (MambaModel)."""
    return args.is_hybrid_model or args.hybrid_override_pattern is not None


def linear_attention_settings(args: argparse.Namespace) -> dict:
    """The TransformerConfig fields of the Gated DeltaNet flags (none without the variant)."""
    if args.experimental_attention_variant is None:
        return {}
    return dict(
        experimental_attention_variant=args.experimental_attention_variant,
        linear_attention_freq=layer_pattern(args.linear_attention_freq, "--linear-attention-freq"),
        linear_conv_kernel_dim=args.linear_conv_kernel_dim, linear_key_head_dim=args.linear_key_head_dim,
        linear_value_head_dim=args.linear_value_head_dim, linear_num_key_heads=args.linear_num_key_heads,
        linear_num_value_heads=args.linear_num_value_heads,
    )


def moe_settings(args: argparse.Namespace) -> dict:
    """The TransformerConfig fields of the mixture-of-experts flags (none without --num-experts)."""
    if args.num_experts is None:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        # The settings that a --load-hf model may have its own of (its dense layers, its shared
        # expert, its router's): only when given.
        **{field: value for field, value in (
            ("moe_layer_freq", None if args.moe_layer_freq == 1 else args.moe_layer_freq),
            ("moe_shared_expert_intermediate_size", args.moe_shared_expert_intermediate_size),
            ("moe_router_load_balancing_type", args.moe_router_load_balancing_type),
            ("moe_router_score_function", args.moe_router_score_function),
            ("moe_router_enable_expert_bias", args.moe_router_enable_expert_bias or None),
            ("moe_router_bias_update_rate", args.moe_router_bias_update_rate),
            ("moe_router_num_groups", args.moe_router_num_groups),
            ("moe_router_group_topk", args.moe_router_group_topk),
            ("moe_router_topk_scaling_factor", args.moe_router_topk_scaling_factor),
        ) if value is not None},
    )


def yarn_flags(args: argparse.Namespace) -> tuple:
    """The YaRN flags of multi-latent attention: (flag, value, default)."""
    return (("--rotary-scaling-factor", args.rotary_scaling_factor, 1.0), ("--mscale", args.mscale, 1.0),
            ("--mscale-all-dim", args.mscale_all_dim, 0.0))


def mla_rope_type(args: argparse.Namespace) -> str:
    """--rope-type, or its default: Megatron-LM's YaRN, built as the plain rotation (the same one)
    when every YaRN flag keeps its default (a factor of 1 stretches nothing)."""
    if args.rope_type is not None:
        return args.rope_type
    return "yarn" if any(value != default for _, value, default in yarn_flags(args)) else "rope"


def mla_settings(args: argparse.Namespace) -> dict:
    """The MLATransformerConfig fields of the multi-latent attention flags (none without them)."""
    if not args.multi_latent_attention or args.hf_config is not None:
        return {}
    return dict(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim, qk_layernorm=True,
                rope_type=mla_rope_type(args), rotary_scaling_factor=args.rotary_scaling_factor,
                mscale=args.mscale, mscale_all_dim=args.mscale_all_dim)


def core_transformer_config_from_args(args: argparse.Namespace) -> tuple[TransformerConfig, dict]:
    """The TransformerConfig the flags describe (Megatron-LM's function of this name), a --load-hf
    model's with its config.json, and the GPTModel arguments beside it (vocabulary, positions, tied
    output layer, rotary embedding)."""
    dtype = params_dtype(args)
    training = dict(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp,
        cp_comm_type=args.cp_comm_type,
        hidden_dropout=args.dropout if args.hidden_dropout is None else args.hidden_dropout,
        attention_dropout=args.dropout if args.attention_dropout is None else args.attention_dropout,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        use_cpu_initialization=True,
        init_model_with_meta_device=args.init_model_with_meta_device,
        **recompute_settings(args),
        bias_activation_fusion=not args.no_bias_gelu_fusion,
        bias_dropout_fusion=not args.no_bias_dropout_fusion,
        sequence_parallel=args.sequence_parallel,
        finalize_model_grads_func=finalize_model_grads,
        # packed rows: the loss per token of the global batch
        calculate_per_token_loss=args.sft is not None or args.calculate_per_token_loss,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline,
        **moe_settings(args),
        **linear_attention_settings(args),
        **({} if not hybrid(args) else dict(
            mamba_state_dim=args.mamba_state_dim, mamba_head_dim=args.mamba_head_dim,
            mamba_num_groups=args.mamba_num_groups, mamba_num_heads=args.mamba_num_heads)),
    )
    if args.hf_config is None:  # a --load-hf model's attention is its own
        training.update(
            window_size=None if args.window_size is None else (args.window_size - 1, 0),
            window_attn_skip_freq=args.window_attn_skip_freq,
            softmax_type=args.softmax_type,
        )
    if args.mtp_num_layers is not None:
        training.update(mtp_num_layers=args.mtp_num_layers,
                        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)
    if args.hf_config is not None:
        config, model_kwargs = config_from_hf(args.hf_config, **training)
    else:
        parts = architecture(args)
        activation = torch.nn.functional.silu if parts["swiglu"] else torch.nn.functional.gelu
        rotary = dict(rotary_base=args.rotary_base, rotary_percent=args.rotary_percent)
        attention = {"qk_layernorm": True} if args.qk_layernorm else {}
        if args.attention_output_gate:
            attention["attention_output_gate"] = True
        if args.multi_latent_attention:  # its rotary embedding is the config's
            attention.update(mla_settings(args), **rotary)
        config = (MLATransformerConfig if args.multi_latent_attention else TransformerConfig)(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            num_query_groups=args.num_query_groups,
            kv_channels=args.kv_channels,
            ffn_hidden_size=parts["ffn_hidden"],
            normalization=parts["normalization"],
            layernorm_epsilon=parts["norm_epsilon"],
            gated_linear_unit=parts["swiglu"] or args.quick_geglu,
            activation_func=quick_gelu if args.quick_geglu else activation,
            glu_linear_offset=args.glu_linear_offset,
            activation_func_clamp_value=args.activation_func_clamp_value,
            add_bias_linear=parts["add_bias_linear"],
            init_method_std=args.init_method_std,
            **attention,
            **training,
        )
        # --vocab-size left unset and check_args not run (a script building the model alone): bytes
        vocab_size = BYTE_VOCAB if args.vocab_size is None else args.vocab_size
        model_kwargs = dict(vocab_size=vocab_size,
                            max_sequence_length=args.max_position_embeddings or args.seq_len,
                            share_embeddings_and_output_weights=not parts["untied"],
                            position_embedding_type=parts["position_embedding_type"],
                            **({} if args.multi_latent_attention else rotary))
    return config, model_kwargs


def build_model(args: argparse.Namespace, device: torch.device | str = "cpu") -> list[GPTModel]:
    """This rank's model chunks: one GPTModel, or one per virtual pipeline stage."""
    config, model_kwargs = core_transformer_config_from_args(args)
    torch.manual_seed(args.seed)  # the CPU generator: dropout outside tensor-parallel regions on CPU
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    stages = [None] if args.virtual_pipeline is None else range(args.virtual_pipeline)
    if hybrid(args):
        models = [MambaModel(config, None, hybrid_attention_ratio=args.hybrid_attention_ratio,
                             hybrid_mlp_ratio=args.hybrid_mlp_ratio,
                             hybrid_override_pattern=args.hybrid_override_pattern, init_seed=args.seed,
                             vp_stage=vp_stage, **model_kwargs) for vp_stage in stages]
    else:
        models = [GPTModel(config, init_seed=args.seed, vp_stage=vp_stage, **model_kwargs)
                  for vp_stage in stages]
    if args.load_hf is not None:
        load_hf_state_dict(models, args.load_hf)
    if args.init_model_with_meta_device:  # FullyShardedDataParallel draws it on the device
        return models
    return [model.to(device) for model in models]
