"""The checks of the model flags: experts, multi-latent attention, gated MLPs."""

from __future__ import annotations

import argparse
import math


from megatron_ext.transformer.transformer_config import check_group_limited_routing
from megatron_ext.training.arguments_model import moe_freq_type
from megatron_ext.training.validation_rules import FLOAT32_MAX
from megatron_ext.training.model import architecture, llama_ffn_hidden, yarn_flags



def check_linear_attention_args(args: argparse.Namespace) -> None:
    """The Gated DeltaNet flags: the pattern with the variant only, and what the layers cannot do yet."""
    variant = args.experimental_attention_variant
    if (variant is None) != (args.linear_attention_freq is None):
        raise ValueError("--experimental-attention-variant gated_delta_net and --linear-attention-freq go "
                         "together (the layers and where they are)")
    if variant is None:
        return
    for flag, value in (("--save", args.save), ("--load", args.load), ("--load-hf", args.load_hf),
                        ("--export-hf", args.export_hf)):
        if value is not None:
            raise ValueError(f"{flag} with --experimental-attention-variant {variant}: the Gated DeltaNet "
                             "layers' checkpoints and Hugging Face weights are not supported yet")
    if args.cp > 1:
        raise ValueError(f"--cp {args.cp} with --experimental-attention-variant {variant}: not supported yet")


def check_hybrid_args(args: argparse.Namespace) -> None:
    """The Mamba-2 hybrid flags: what the hybrid stack cannot do yet."""
    if not (args.is_hybrid_model or args.hybrid_override_pattern is not None):
        return
    for flag, value in (("--save", args.save), ("--load", args.load), ("--load-hf", args.load_hf),
                        ("--export-hf", args.export_hf), ("--mtp-num-layers", args.mtp_num_layers)):
        if value is not None:
            raise ValueError(f"{flag} with a Mamba-2 hybrid (--is-hybrid-model / --hybrid-override-pattern): "
                             "not supported yet")
    if args.cp > 1:
        raise ValueError(f"--cp {args.cp} with a Mamba-2 hybrid: not supported yet")


def check_moe_args(args: argparse.Namespace, world_size: int) -> None:
    """The mixture-of-experts flags: experts divisible by --ep, top-k within the experts, the expert
    grid (--etp x --ep x --pp) dividing the world, sequence parallelism with --tp > 1."""
    args.moe_layer_freq = moe_freq_type(args.moe_layer_freq)
    experts = args.num_experts
    if experts is None:
        for flag, value, default in (("--ep", args.ep, 1), ("--etp", args.etp, None),
                                     ("--moe-grouped-gemm", args.moe_grouped_gemm, False),
                                     ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff, 0.0),
                                     ("--moe-z-loss-coeff", args.moe_z_loss_coeff, None),
                                     ("--moe-router-load-balancing-type",
                                      args.moe_router_load_balancing_type, None),
                                     ("--moe-router-score-function", args.moe_router_score_function, None),
                                     ("--moe-router-enable-expert-bias",
                                      args.moe_router_enable_expert_bias, False),
                                     ("--moe-router-bias-update-rate",
                                      args.moe_router_bias_update_rate, None),
                                     ("--moe-expert-capacity-factor", args.moe_expert_capacity_factor, None),
                                     ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size, None),
                                     ("--moe-layer-freq", args.moe_layer_freq, 1),
                                     ("--moe-router-num-groups", args.moe_router_num_groups, None),
                                     ("--moe-router-group-topk", args.moe_router_group_topk, None),
                                     ("--moe-router-topk-scaling-factor",
                                      args.moe_router_topk_scaling_factor, None),
                                     ("--moe-shared-expert-intermediate-size",
                                      args.moe_shared_expert_intermediate_size, None)):
            if value != default:
                raise ValueError(f"{flag} {value} needs --num-experts (a mixture-of-experts model)")
        return
    if experts < 1:
        raise ValueError(f"--num-experts must be >= 1, got {experts}")
    if not 1 <= args.moe_router_topk <= experts:
        raise ValueError(
            f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts {experts}"
        )
    if args.ep < 1 or experts % args.ep != 0:
        raise ValueError(f"--num-experts {experts} is not divisible by --ep {args.ep}")
    etp = args.tp if args.etp is None else args.etp
    if etp < 1:
        raise ValueError(f"--etp must be >= 1, got {etp}")
    grid = etp * args.ep * args.pp
    if world_size % grid != 0:
        raise ValueError(
            f"--etp x --ep x --pp = {etp} x {args.ep} x {args.pp} = {grid} does not divide the world size "
            f"{world_size}: the experts' grid must tile the ranks"
        )
    if args.tp > 1 and not args.sequence_parallel:
        raise ValueError(
            "a mixture-of-experts model with --tp > 1 needs --sequence-parallel (as in Megatron-core)"
        )
    check_moe_layer_args(args)
    if not 0.0 <= args.moe_aux_loss_coeff < FLOAT32_MAX:
        raise ValueError(f"--moe-aux-loss-coeff must be a finite number >= 0, got {args.moe_aux_loss_coeff}")
    z_loss = args.moe_z_loss_coeff
    if z_loss is not None and not 0.0 <= z_loss < FLOAT32_MAX:
        raise ValueError(f"--moe-z-loss-coeff must be a finite number >= 0, got {z_loss}")
    sigmoid = args.moe_router_score_function == "sigmoid"
    if args.moe_router_enable_expert_bias and args.load_hf is None and not sigmoid:
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    rate = args.moe_router_bias_update_rate
    if rate is not None and not 0.0 <= rate < FLOAT32_MAX:
        raise ValueError(f"--moe-router-bias-update-rate must be a finite number >= 0, got {rate}")
    factor = args.moe_expert_capacity_factor
    if factor is not None and not 0.0 < factor < FLOAT32_MAX:
        raise ValueError(f"--moe-expert-capacity-factor must be a finite number > 0, got {factor}")
    ffn = args.moe_ffn_hidden_size
    if ffn is not None and (ffn < 1 or ffn % etp != 0):
        raise ValueError(
            f"--moe-ffn-hidden-size {ffn} must be >= 1 and divisible by the expert-tensor size {etp}"
        )


# The TransformerConfig fields of the group-limited routing flags, as the flags name them.
GROUP_FLAGS = {"moe_router_num_groups": "--moe-router-num-groups",
               "moe_router_group_topk": "--moe-router-group-topk", "moe_router_topk": "--moe-router-topk",
               "num_moe_experts": "--num-experts"}


def check_moe_layer_args(args: argparse.Namespace) -> None:
    """Which layers are MoE layers, group-limited routing, the scaling factor, the shared expert."""
    freq, layers = args.moe_layer_freq, args.layers
    if isinstance(freq, int) and freq < 1:
        raise ValueError(f"--moe-layer-freq must be >= 1 or a list of 0/1, got {freq}")
    if isinstance(freq, list) and (len(freq) != layers or set(freq) - {0, 1} or 1 not in freq):
        raise ValueError(
            f"--moe-layer-freq {freq} must list a 0 (dense) or 1 (MoE) for each of the --layers {layers} "
            "layers, with at least one 1"
        )
    try:
        check_group_limited_routing(args.num_experts, args.moe_router_topk, args.moe_router_num_groups,
                                    args.moe_router_group_topk)
    except ValueError as e:
        message = str(e)
        for field, flag in GROUP_FLAGS.items():
            message = message.replace(field, flag)
        raise ValueError(message) from None
    factor = args.moe_router_topk_scaling_factor
    if factor is not None and not 0.0 < factor < FLOAT32_MAX:
        raise ValueError(f"--moe-router-topk-scaling-factor must be a finite number > 0, got {factor}")
    shared = args.moe_shared_expert_intermediate_size
    if shared is not None and (shared < 1 or shared % args.tp != 0):
        raise ValueError(
            f"--moe-shared-expert-intermediate-size {shared} must be >= 1 and divisible by --tp {args.tp}"
        )


def check_gated_unit_args(args: argparse.Namespace) -> None:
    """gpt-oss's MLP flags: a gated MLP (--arch llama or --quick-geglu), a finite offset, a positive
    finite clamp; not with --load-hf, whose config.json defines the model."""
    flags = [flag for flag, on in (("--quick-geglu", args.quick_geglu),
                                   ("--add-bias-linear", args.add_bias_linear),
                                   ("--glu-linear-offset", args.glu_linear_offset != 0.0),
                                   ("--activation-func-clamp-value",
                                    args.activation_func_clamp_value is not None))
             if on]
    if flags and args.load_hf is not None:
        raise ValueError(
            f"{' '.join(flags)} cannot be combined with --load-hf: its config.json defines the model"
        )
    if not math.isfinite(args.glu_linear_offset):
        raise ValueError(f"--glu-linear-offset must be a finite number, got {args.glu_linear_offset}")
    clamp = args.activation_func_clamp_value
    if clamp is not None and not 0.0 < clamp < FLOAT32_MAX:
        raise ValueError(f"--activation-func-clamp-value must be a finite number > 0, got {clamp}")
    gated = architecture(args)["swiglu"] or args.quick_geglu
    if not gated and (args.glu_linear_offset != 0.0 or clamp is not None):
        raise ValueError("--glu-linear-offset and --activation-func-clamp-value shape a gated MLP: use "
                         "--arch llama or --quick-geglu")


def check_mla_args(args: argparse.Namespace) -> None:
    """Multi-latent attention's ranks and head dims, and what multi-token prediction needs."""
    if args.arch == "deepseek":
        args.multi_latent_attention = True
    head = args.hidden // args.heads
    mla_flags = (("--q-lora-rank", args.q_lora_rank, None), ("--qk-head-dim", args.qk_head_dim, None),
                 ("--qk-pos-emb-head-dim", args.qk_pos_emb_head_dim, None),
                 ("--v-head-dim", args.v_head_dim, None))
    if not args.multi_latent_attention:
        mla_flags += (("--rope-type", args.rope_type, None),
                      *yarn_flags(args))
        for flag, value, default in mla_flags:
            if value != default:
                raise ValueError(f"{flag} {value} needs --multi-latent-attention (or --arch deepseek)")
    elif args.hf_config is None:
        if args.num_query_groups not in (None, args.heads):
            raise ValueError(f"--num-query-groups {args.num_query_groups} with multi-latent attention: every "
                             "query head has its own key and value")
        args.qk_head_dim = args.qk_head_dim or head
        args.v_head_dim = args.v_head_dim or head
        args.qk_pos_emb_head_dim = args.qk_pos_emb_head_dim or max(2, head // 2 // 2 * 2)
        for flag, value in (("--q-lora-rank", args.q_lora_rank), ("--kv-lora-rank", args.kv_lora_rank),
                            ("--qk-head-dim", args.qk_head_dim), ("--v-head-dim", args.v_head_dim),
                            ("--qk-pos-emb-head-dim", args.qk_pos_emb_head_dim)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if args.qk_pos_emb_head_dim % 2:
            raise ValueError(f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim} must be even: the rotary "
                             "embedding turns channel pairs")
        for flag, value in (("--rotary-scaling-factor", args.rotary_scaling_factor),
                            ("--mscale", args.mscale), ("--mscale-all-dim", args.mscale_all_dim)):
            if not 0.0 <= value < FLOAT32_MAX:
                raise ValueError(f"{flag} must be a finite number >= 0, got {value}")
        yarn = [flag for flag, value, default in yarn_flags(args) if value != default]
        if args.rope_type == "rope" and yarn:
            raise ValueError(f"{' '.join(yarn)} shape YaRN: they need --rope-type yarn (multi-latent "
                             "attention's default when they are given)")
        if args.kv_channels not in (None, args.v_head_dim):
            raise ValueError(f"--kv-channels {args.kv_channels} with multi-latent attention: its heads' "
                             f"channels are --qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim "
                             f"({args.v_head_dim}); give none or --v-head-dim's")
    depths = args.mtp_num_layers
    if depths is not None:
        if depths < 1:
            raise ValueError(f"--mtp-num-layers must be >= 1, got {depths}")
        if not 0.0 <= args.mtp_loss_scaling_factor < FLOAT32_MAX:
            raise ValueError(f"--mtp-loss-scaling-factor must be a finite number >= 0, got "
                             f"{args.mtp_loss_scaling_factor}")
        if architecture(args)["position_embedding_type"] == "learned_absolute" and args.pp > 1:
            raise ValueError(f"--mtp-num-layers with learned positions (--arch gpt) and --pp {args.pp}: the "
                             "last stage would need its own copy of the position embedding; use --arch llama "
                             "or deepseek, or --position-embedding-type rope")


def apply_deepseek_defaults(args: argparse.Namespace) -> None:
    """--arch deepseek's experts where the flags keep their defaults (DeepSeek-V3's): sigmoid scores
    with the expert bias, the first layer dense (--moe-layer-freq 1 means this), one shared expert as
    wide as a routed one."""
    if args.arch != "deepseek" or args.num_experts is None:
        return
    if args.moe_router_score_function is None:
        args.moe_router_score_function = "sigmoid"
    if args.moe_router_score_function == "sigmoid":
        args.moe_router_enable_expert_bias = True
    if str(args.moe_layer_freq) == "1" and args.layers > 1:
        args.moe_layer_freq = [0] + [1] * (args.layers - 1)
    if args.moe_shared_expert_intermediate_size is None:
        width = args.moe_ffn_hidden_size or args.ffn_hidden or llama_ffn_hidden(args.hidden)
        args.moe_shared_expert_intermediate_size = width
