"""Every field of Megatron-core 0.16.1's ``TransformerConfig`` and ``MLATransformerConfig``, set to a
value other than its default in megatron_ext's config of a small GPT (dense, MoE, multi-token
prediction or multi-latent attention, whichever the field belongs to): the model's per-token losses
or gradients change, or the config refuses it (ValueError / NotImplementedError naming the field),
or the field is in ``INERT`` below with why a forward and backward on one CPU rank cannot show it.
Nothing is accepted and ignored. Skipped when megatron-core is not installed (its classes give the
field names)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util

import pytest
import torch
import torch.nn.functional as F

# Not imported here: a worker that aliases megatron.core's packages must import it itself.
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.conftest import assert_comparisons  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

VOCAB, SEQ, BATCH = 32, 8, 2


def _noop(*args, **kwargs) -> None:
    return None


def _other_init(tensor: torch.Tensor) -> torch.Tensor:
    return torch.nn.init.normal_(tensor, std=0.05)


# Values for the fields whose default gives no other value to derive (None, strings, callables,
# dtypes, lists); the rest: a bool flipped, an int + 1, a float doubled (0: 0.1).
VALUES = {
    "pipeline_model_parallel_comm_backend": "ucc",
    "virtual_pipeline_model_parallel_size": 2,
    "hierarchical_context_parallel_sizes": [1, 1],
    "max_seqlen_per_dp_cp_rank": SEQ,
    "expert_tensor_parallel_size": 2,
    "params_dtype": torch.float32,
    "pipeline_dtype": torch.float32,
    "autocast_dtype": torch.bfloat16,
    "timers": _noop,
    "finalize_model_grads_func": _noop,
    "grad_scale_func": _noop,
    "no_sync_func": contextlib.nullcontext,
    "grad_sync_func": _noop,
    "param_sync_func": _noop,
    "num_microbatches_with_partial_activation_checkpoints": 1,
    "cross_entropy_fusion_impl": "te",
    "tp_comm_bootstrap_backend": "gloo",
    "microbatch_group_size_per_vp_stage": 2,
    "_cpu_offloading_context": contextlib.nullcontext(),
    "mtp_num_layers": 1,
    "num_layers_in_first_pipeline_stage": 1,
    "num_layers_in_last_pipeline_stage": 1,
    "pipeline_model_parallel_layout": "Et|tL",
    "attention_backend": "unfused",  # the enum's member, looked up in the worker
    "softmax_scale": 0.3,
    "softmax_type": "off-by-one",
    "num_query_groups": 2,
    "kv_channels": 8,
    "activation_func": F.silu,
    "activation_func_clamp_value": 1.0,
    "num_moe_experts": 4,
    "num_attention_heads": 2,
    "window_size": (2, 0),
    "window_attn_skip_freq": 2,
    "normalization": "RMSNorm",
    "no_rope_freq": 2,
    "experimental_attention_variant": "gated_delta_net",
    "dsa_indexer_n_heads": 2,
    "dsa_indexer_head_dim": 4,
    "dsa_indexer_topk": 2,
    "dsa_indexer_loss_coeff": 0.1,
    "linear_attention_freq": 2,
    "init_method": _other_init,
    "output_layer_init_method": _other_init,
    "embedding_init_method": _other_init,
    "embedding_init_method_std": 0.05,
    "recompute_granularity": "selective",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
    "distribute_saved_activations": True,
    "recompute_modules": ["core_attn", "mlp"],
    "fp8": "e4m3",
    "fp8_recipe": "tensorwise",
    "fp8_quantizer_factory": "factory",
    "fp8_amax_compute_algo": "max",
    "kitchen_attention_backend": "fa",
    "fp4": "e2m1",
    "fp4_recipe": "custom",
    "fp4_quantizer_factory": "factory",
    "moe_shared_expert_intermediate_size": 8,
    "moe_ffn_hidden_size": 8,
    "moe_router_load_balancing_type": "seq_aux_loss",
    "moe_router_topk_limited_devices": 1,
    "moe_router_padding_for_quantization": True,
    "moe_router_padding_for_fp8": True,
    "moe_router_num_groups": 2,
    "moe_router_group_topk": 1,
    "moe_router_topk_scaling_factor": 2.0,
    "moe_router_score_function": "sigmoid",
    "moe_router_dtype": "fp32",
    "moe_z_loss_coeff": 0.01,
    "moe_input_jitter_eps": 0.01,
    "moe_token_dispatcher_type": "alltoall",
    "moe_flex_dispatcher_backend": "hybridep",
    "moe_expert_capacity_factor": 1.0,
    "moe_token_drop_policy": "position",
    "moe_latent_size": 8,
    "cp_comm_type": "a2a",
    "cuda_graph_impl": "local",
    "cuda_graph_scope": "attn",
    "config_logger_dir": "config_logs",
    "symmetric_ar_type": "two_shot",
    "mrope_section": [1, 1],
    "mamba_num_heads": 2,
    "quant_recipe": "recipe",
    "transformer_impl": "local",
    "offload_modules": ["core_attn"],
    "q_lora_rank": None,  # the MLA base has a query latent
    "rope_type": "rope",
    # YaRN's ramp between integer channel bounds: values that move them (4096, 32, 1 give 1 and 3)
    "original_max_position_embeddings": 64,
    "beta_fast": 4.0,
    "beta_slow": 8.0,
}

# Fields a forward and backward of one model on one CPU rank cannot show, each with why.
INERT = {
    # the parallel layout: the layers take the group sizes from parallel_state; parallel equals
    # serial is tested per layout (tests/test_layers.py, test_pipeline*.py, test_moe.py, ...)
    "tensor_model_parallel_size": "layout: the layers read parallel_state's groups",
    "context_parallel_size": "layout: the layers read parallel_state's groups",
    "expert_tensor_parallel_size": "layout: the layers read parallel_state's groups",
    "sequence_parallel": "layout: the identity at tensor-parallel size 1 (documented)",
    "pipeline_model_parallel_comm_backend": "the p2p backend: c10d's, gloo here",
    "cp_comm_type": "context parallelism's exchange, same numbers (tests/test_context_parallel_*.py)",
    # read by the schedules, DDP and the optimizer, not by the model's forward
    "timers": "read by the schedules",
    "finalize_model_grads_func": "read by the schedules",
    "grad_scale_func": "read by the schedules",
    "no_sync_func": "read by the schedules",
    "grad_sync_func": "read by the schedules",
    "param_sync_func": "read by the schedules",
    "pipeline_dtype": "read by the schedules (the p2p tensors' dtype)",
    "variable_seq_lengths": "read by the schedules",
    "batch_p2p_comm": "read by the schedules",
    "batch_p2p_sync": "read by the schedules",
    "deallocate_pipeline_outputs": "read by the schedules",
    "microbatch_group_size_per_vp_stage": "read by the interleaved schedule",
    "num_microbatches_with_partial_activation_checkpoints": "read by the schedules",
    "barrier_with_L1_time": "timers' barrier",
    "num_layers_in_first_pipeline_stage": "the pipeline split, one stage here",
    "num_layers_in_last_pipeline_stage": "the pipeline split, one stage here",
    "account_for_embedding_in_pipeline_split": "the pipeline split, one stage here",
    "account_for_loss_in_pipeline_split": "the pipeline split, one stage here",
    "fp16": "mixed precision: the optimizer's loss scaling (params_dtype sets the weights)",
    "bf16": "mixed precision: the optimizer's (params_dtype sets the weights)",
    "calculate_per_token_loss": "the schedules' loss normalisation",
    "async_tensor_model_parallel_allreduce": "overlap of a collective: same numbers",
    "deterministic_mode": "kernel choice on GPUs",
    "cross_entropy_loss_fusion": "the fused cross-entropy: same losses",
    "test_mode": "Megatron-core's own test hook",
    "clone_scatter_output_in_embedding": "a copy of the embedding's output: same values",
    "disable_parameter_transpose_cache": "TransformerEngine's weight cache",
    "config_logger_dir": "logging",
    "moe_per_layer_logging": "logging",
    "inference_rng_tracker": "inference random state; dropout is off in the test",
    "inference_sampling_seed": "inference sampling",
    "mlp_chunks_for_prefill": "inference prefill",
    "use_te_rng_tracker": "the CUDA random-state tracker's kind",
    "hetereogenous_dist_checkpoint": "checkpoint layout",
    "attention_softmax_in_fp32": "the softmax's dtype: float64 here",
    "attention_backend": "a kernel choice: the same attention",
    "bias_activation_fusion": "fused kernel: same numbers (documented)",
    "bias_dropout_fusion": "fused kernel; dropout is off in the base",
    "apply_rope_fusion": "fused kernel: same numbers",
    "moe_permute_fusion": "fused kernel: same numbers",
    "moe_router_fusion": "fused kernel: same numbers",
    "moe_use_legacy_grouped_gemm": "refines moe_grouped_gemm (off in the base)",
    "moe_token_dispatcher_type": "a dispatcher: same routing, same numbers (tests/test_moe.py)",
    "moe_shared_expert_overlap": "overlap of the shared expert: same numbers",
    "moe_router_bias_update_rate": "the expert bias's update after the step, with the bias off",
    "recompute_granularity": "recomputation: same numbers (tests/test_recompute.py)",
    "recompute_method": "recomputation, with granularity off",
    "recompute_num_layers": "recomputation, with granularity off",
    "recompute_modules": "recomputation: same numbers",
    "moe_layer_recompute": "recomputation: same numbers",
    # options of a feature that is refused (or absent) at its own switch
    **{name: "refines fp8, refused" for name in (
        "fp8_recipe", "fp8_quantizer_factory", "fp8_margin", "fp8_interval", "fp8_amax_history_len",
        "fp8_amax_compute_algo", "fp8_wgrad", "tp_only_amax_red", "num_layers_at_start_in_bf16",
        "num_layers_at_end_in_bf16", "moe_router_padding_for_fp8", "moe_router_padding_for_quantization")},
    **{name: "refines fp4, refused" for name in ("fp4_recipe", "fp4_quantizer_factory")},
    "kitchen_attention_backend": "refines use_kitchen_attention, refused",
    **{name: "refines tp_comm_overlap, refused" for name in (
        "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
        "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs",
        "tp_comm_atomic_rs", "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1",
        "tp_comm_bootstrap_backend")},
    **{name: "refines cpu_offloading, refused" for name in ("cpu_offloading_activations",)},
    **{name: "refines fine_grained_activation_offloading, refused" for name in (
        "offload_modules", "min_offloaded_tensor_size")},
    **{name: "refines qk_clip, refused" for name in ("qk_clip_alpha", "qk_clip_threshold")},
    **{name: "refines experimental_attention_variant, refused" for name in (
        "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
        "dsa_indexer_use_sparse_loss")},
    **{name: "refines linear_attention_freq, refused" for name in (
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads")},
    **{name: "refines is_hybrid_model (Mamba), refused" for name in (
        "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
        "use_mamba_mem_eff_path")},
    **{name: "refines enable_cuda_graph / cuda_graph_impl, refused" for name in (
        "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph", "cuda_graph_warmup_steps",
        "cuda_graph_scope")},
    "moe_deepep_num_sms": "refines moe_enable_deepep, refused",
    "moe_hybridep_num_sms": "refines moe_flex_dispatcher_backend, refused",
    "moe_flex_dispatcher_backend": "refines the flex dispatcher, refused",
    "moe_pad_expert_input_to_capacity": "pads each expert's tokens to its capacity with zeros: same numbers",
    "moe_router_topk_limited_devices": "one device group at expert-parallel size 1",
    "autocast_dtype": "refines enable_autocast, refused",
    "overlap_p2p_comm": "read by the pipeline schedules, which refuse it",
    "transformer_impl": "megatron_ext's own layers for 'local' and 'transformer_engine' (documented)",
    "moe_token_dropping": "Megatron-core reads it nowhere (its docstring: unsupported, leave False)",
}


# The base a field is set on when it refines another (dense otherwise; moe_* on the MoE base).
FIELD_BASE = {"mtp_loss_scaling_factor": "mtp", "window_attn_skip_freq": "window",
              "moe_shared_expert_gate": "shared", "moe_shared_expert_overlap": "shared",
              "moe_token_drop_policy": "capacity", "moe_pad_expert_input_to_capacity": "capacity"}
MLA_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
            "rotary_base", "rotary_percent", "rotary_scaling_factor", "original_max_position_embeddings",
            "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "cache_mla_latents")


def _alternative(name: str, value):
    if name in VALUES:
        return VALUES[name]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 if value else 0.1
    raise KeyError(f"no other value of {name} (default {value!r}): add it to VALUES")


def _walk_worker(names: list[str]) -> dict:
    from megatron_ext import parallel_state as ps
    from megatron_ext import tensor_parallel
    from megatron_ext.models import GPTModel
    from megatron_ext.transformer.transformer_config import (
        AttnBackend, MLATransformerConfig, TransformerConfig,
    )

    ps.initialize_model_parallel()
    dense = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, hidden_dropout=0.0,
                 attention_dropout=0.0, params_dtype=torch.float64, use_cpu_initialization=True,
                 add_bias_linear=False)
    moe = {**dense, "num_moe_experts": 4, "moe_aux_loss_coeff": 0.01}
    bases = {
        "dense": (TransformerConfig, dense),
        "moe": (TransformerConfig, moe),
        "shared": (TransformerConfig, {**moe, "moe_shared_expert_intermediate_size": 8}),
        "capacity": (TransformerConfig, {**moe, "moe_expert_capacity_factor": 1.0}),
        "window": (TransformerConfig, {**dense, "window_size": (2, 0)}),
        "mtp": (TransformerConfig, {**dense, "mtp_num_layers": 1}),
        # rotated head part of 8 channels: 4 frequencies, so that the base and YaRN's numbers matter
        "mla": (MLATransformerConfig, {**dense, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_head_dim": 4,
                                       "qk_pos_emb_head_dim": 8, "v_head_dim": 4,
                                       "rotary_scaling_factor": 4.0, "mscale_all_dim": 1.0}),
    }
    defaults = {cls: {f.name: f for f in dataclasses.fields(cls)}
                for cls in (TransformerConfig, MLATransformerConfig)}
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    weights = torch.rand(BATCH, SEQ, generator=g, dtype=torch.float64)

    def run(cls, fields):
        torch.manual_seed(1)
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        config = cls(**fields)
        vp_stage = 0 if config.virtual_pipeline_model_parallel_size else None
        model = GPTModel(config, VOCAB, SEQ, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False, vp_stage=vp_stage)
        loss = model(tokens, None, labels=labels)
        (loss.double() * weights).sum().backward()
        return loss.detach().double(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    def same(a, b) -> bool:
        (loss_a, grads_a), (loss_b, grads_b) = a, b
        if grads_a.keys() != grads_b.keys() or loss_a.shape != loss_b.shape:
            return False
        pairs = [(loss_a, loss_b)] + [(grads_a[n], grads_b[n]) for n in grads_a]
        return all(x.shape == y.shape and torch.allclose(x.double(), y.double(), rtol=1e-9, atol=1e-12)
                   for x, y in pairs)

    references = {base: run(*bases[base]) for base in bases}
    out = {}
    for name in names:
        base = FIELD_BASE.get(name, "moe" if name.startswith("moe_") else "dense")
        base = "mla" if name in MLA_ONLY else base
        cls, fields = bases[base]
        f = defaults[cls][name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        value = _alternative(name, fields.get(name, default))
        if name == "attention_backend":
            value = AttnBackend[value]
        try:
            result = run(cls, {**fields, name: value})
        except (ValueError, NotImplementedError, TypeError) as e:
            named = name in str(e) or name.replace("_", " ") in str(e).lower()
            out[name] = ("refused", str(e)) if named else ("error", f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - reported per field
            out[name] = ("error", f"{type(e).__name__}: {e}")
        else:
            out[name] = ("same", base) if same(result, references[base]) else ("changes", base)
    ps.destroy_model_parallel()
    return out


@pytest.mark.slow  # some 260 small models built and run: 9 to 12 s on 2 shared cores
def test_every_megatron_core_field_changes_the_model_or_is_refused():
    from megatron.core.transformer import transformer_config as mc

    names = list(dict.fromkeys(f.name for cls in (mc.TransformerConfig, mc.MLATransformerConfig)
                               for f in dataclasses.fields(cls)))
    (out,) = run_distributed(1, _walk_worker, names)
    assert not (INERT.keys() - out.keys())
    problems = []
    for name, (outcome, detail) in out.items():
        if name in INERT:
            if outcome != "same":
                problems.append(f"{name} is listed as inert but {outcome} ({detail})")
        elif outcome == "same":
            problems.append(f"{name}: accepted and ignored (the {detail} model is unchanged)")
        elif outcome == "error":
            problems.append(f"{name}: {detail}")
    assert not problems, "\n".join(problems)


def _megatron_core_worker() -> list:
    from benchmarks.megatron_core_gpt import (
        Run, build_model, copy_weights, cpu_patches, megatron_ext_name, transformer_config, use_megatron_ext,
    )

    use_megatron_ext()
    cpu_patches(full=False)
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper as CoreHelper

    from megatron_ext import parallel_state as ps
    from megatron_ext import tensor_parallel
    from megatron_ext.transformer.multi_token_prediction import MTPLossLoggingHelper
    from tests.conftest import TIGHT, Comparisons

    cmp = Comparisons()
    torch.set_default_dtype(torch.float64)  # Megatron-core's norms are torch's, made in the default dtype
    ps.initialize_model_parallel()
    # 8 heads over a hidden size of 12: both take kv_channels = 12 // 8 = 1 (8 channels of attention)
    run = Run(arch="gpt", layers=2, hidden=12, heads=8, seq=SEQ, vocab=VOCAB)
    core_config, config = transformer_config(run), transformer_config(run, "megatron_ext")
    for name in ("kv_channels", "ffn_hidden_size", "num_query_groups"):
        cmp.close(getattr(config, name), getattr(core_config, name), f"config.{name}")
    tensor_parallel.model_parallel_cuda_manual_seed(run.seed)
    torch.manual_seed(run.seed)
    core, ours = build_model(run, core_config)[0], build_model(run, config, "megatron_ext")[0]
    copy_weights(core, ours)
    g = torch.Generator().manual_seed(3)
    tokens, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    weights = torch.rand(BATCH, SEQ, generator=g, dtype=torch.float64)
    results = {}
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)
    for name, model, mask in (("megatron-core", core, (causal,)), ("megatron_ext", ours, ())):
        loss = model(tokens, positions, *mask, labels=labels)
        (loss * weights).sum().backward()
        results[name] = (loss.detach(), {megatron_ext_name(n): p.grad for n, p in model.named_parameters()})
    cmp.close(results["megatron_ext"][0], results["megatron-core"][0], "per-token loss", **TIGHT)
    for name, grad in results["megatron-core"][1].items():
        cmp.close(results["megatron_ext"][1][name], grad, f"grad {name}", **TIGHT)
    ps.destroy_model_parallel()
    torch.set_default_dtype(torch.float32)

    # the multi-token prediction losses logged: the same numbers in the same dtype (torch's default)
    totals = {}
    for helper in (CoreHelper, MTPLossLoggingHelper):
        helper.tracker.clear()
        for depth, loss in ((0, torch.tensor(2.3)), (1, torch.tensor(1 / 3, dtype=torch.float64)),
                            (1, torch.tensor(2 / 7, dtype=torch.float64))):
            helper.save_loss_to_tracker(loss=loss, layer_number=depth, num_layers=2)
        totals[helper] = {}
        helper.track_mtp_metrics(loss_scale=1.5, iteration=1, writer=None, total_loss_dict=totals[helper])
    ours, theirs = totals[MTPLossLoggingHelper], totals[CoreHelper]
    cmp.close({k: v.item() for k, v in ours.items()}, {k: v.item() for k, v in theirs.items()},
              "track_mtp_metrics", rtol=0, atol=0)
    cmp.close([v.dtype == theirs[k].dtype == torch.float32 for k, v in ours.items()], [True, True],
              "track_mtp_metrics in float32")
    torch.distributed.destroy_process_group()  # megatron.core is loaded: the process serves no other test
    return cmp.made


@pytest.mark.slow  # a process of its own importing megatron-core
def test_heads_not_dividing_the_hidden_size_and_mtp_logging_as_megatron_core():
    (made,) = run_distributed(1, _megatron_core_worker)
    assert_comparisons(made)
    assert len(made) > 20
