"""Activation recomputation with Megatron-core's settings: full recomputation ("uniform" chunks of
``recompute_num_layers`` layers, or the first ``recompute_num_layers`` layers as a "block") and
selective recomputation of ``recompute_modules`` ("core_attn", "mlp", "layernorm"; in MoE layers
"moe", "moe_act", "shared_experts"). Every mode gives the losses and gradients of the run without
recomputation in float64, with dropout on (the recomputation replays the forward's random states),
at tensor-parallel size 2 with sequence parallelism, for a GPT, a Llama-style and an MoE model (ep
2); and every mode keeps fewer activation bytes for the backward. Bad settings raise ValueError
naming the value."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.transformer import TransformerConfig
from tests.conftest import EXACT, Comparisons, assert_comparisons
from tests.distributed import run_distributed

VOCAB, SEQ, BATCH, SEED = 64, 8, 2, 5
MODES = {
    "full uniform 1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full uniform 2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full block 2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective core_attn": dict(recompute_granularity="selective"),  # the default module
    "selective mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "selective layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "selective all": dict(recompute_granularity="selective",
                          recompute_modules=["core_attn", "mlp", "layernorm"]),
}


# Mixture-of-experts layers in every layer of the Llama-style model: 4 experts over ep 2 (beside
# tp 2), grouped GEMMs, shared experts, load-balancing and z-losses.
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_grouped_gemm=True,
           moe_shared_expert_intermediate_size=16, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
           moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2,
           expert_tensor_parallel_size=1)
MOE_MODES = {
    "selective moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    "selective moe_act": dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
    "selective shared_experts": dict(recompute_granularity="selective", recompute_modules=["shared_experts"]),
    "selective mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),  # dense only
    "selective all": dict(recompute_granularity="selective",
                          recompute_modules=["core_attn", "layernorm", "moe", "moe_act", "shared_experts"]),
    "moe_layer_recompute": dict(moe_layer_recompute=True),  # Megatron-core's older switch
    "full uniform 1": MODES["full uniform 1"],
}


def _config(arch: str, **recompute) -> TransformerConfig:
    fields = dict(
        tensor_model_parallel_size=2, sequence_parallel=True, num_layers=3, hidden_size=16,
        num_attention_heads=4, hidden_dropout=0.1, attention_dropout=0.1, params_dtype=torch.float64,
        pipeline_dtype=torch.float64, use_cpu_initialization=True, bias_dropout_fusion=True,
        bias_activation_fusion=True,
    )
    if arch in ("llama", "moe"):
        fields.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                      add_bias_linear=False, num_query_groups=2, ffn_hidden_size=32)
    if arch == "moe":
        fields.update(MOE)
    return TransformerConfig(**fields, **recompute)


def _run(arch: str, recompute: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, gradients and the bytes of activations kept for the backward (distinct storages
    still allocated when the forward returns)."""
    from megatron_ext.models import GPTModel

    config = _config(arch, **recompute)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, init_seed=SEED,
                     position_embedding_type="rope" if arch == "llama" else "learned_absolute")
    model.train()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    torch.manual_seed(11)  # the default generator (fused dropout) starts alike in every run
    saved: list[torch.Tensor] = []
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, positions, labels=labels).sum()
    storages = {}
    for t in saved:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes() > 0:
            storages[storage.data_ptr()] = storage.nbytes()
    saved.clear()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(storages.values())


def _worker() -> tuple[list, dict]:
    ps.initialize_model_parallel(2)
    compared = Comparisons()
    kept = {}
    for arch in ("gpt", "llama"):
        ref_loss, ref_grads, kept[(arch, "none")] = _run(arch, {})
        for mode, recompute in MODES.items():
            loss, grads, kept[(arch, mode)] = _run(arch, recompute)
            compared.close(loss, ref_loss, label=f"{arch} {mode} loss", **EXACT)
            for name, grad in grads.items():
                compared.close(grad, ref_grads[name], label=f"{arch} {mode} {name}", **EXACT)
    ps.destroy_model_parallel()
    return compared.made, kept


def _moe_worker() -> tuple[list, dict]:
    ps.initialize_model_parallel(2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    compared = Comparisons()
    ref_loss, ref_grads, kept = _run("moe", {})
    kept = {"none": kept}
    for mode, recompute in MOE_MODES.items():
        loss, grads, kept[mode] = _run("moe", recompute)
        compared.close(loss, ref_loss, label=f"moe {mode} loss", **EXACT)
        for name, grad in grads.items():
            compared.close(grad, ref_grads[name], label=f"moe {mode} {name}", **EXACT)
    ps.destroy_model_parallel()
    return compared.made, kept


@pytest.mark.slow  # two spawned ranks
def test_moe_recompute_modules_equal_no_recompute():
    """Recomputing the whole MoE layer from its input ("moe"), the experts' activation, freed
    once the second grouped GEMM has it ("moe_act"), or the shared experts gives the losses and
    gradients (the router's through its load-balancing and z-losses too) of the run without
    recomputation, and keeps fewer activations; "mlp" leaves MoE layers alone."""
    for made, kept in run_distributed(2, _moe_worker):
        assert_comparisons(made)
        none = kept["none"]
        assert kept["selective mlp"] == none
        for mode in ("selective moe", "selective moe_act", "selective shared_experts", "moe_layer_recompute"):
            assert kept[mode] < none, (mode, kept[mode], none)
        assert kept["moe_layer_recompute"] < kept["selective moe"]  # it also keeps the default core_attn
        assert kept["selective all"] < min(kept[m] for m in ("selective moe", "moe_layer_recompute"))


@pytest.mark.slow  # two spawned ranks, many training steps
def test_every_recompute_mode_equals_no_recompute():
    for made, kept in run_distributed(2, _worker):
        assert_comparisons(made)
        for arch in ("gpt", "llama"):
            none = kept[(arch, "none")]
            for mode in MODES:
                assert kept[(arch, mode)] < none, (arch, mode, kept[(arch, mode)], none)
            # One chunk of two layers keeps fewer inputs than two chunks of one; "block 2" keeps
            # the third layer's activations.
            full = [kept[(arch, f"full {m}")] for m in ("uniform 2", "uniform 1", "block 2")]
            assert full == sorted(set(full)), full
            assert kept[(arch, "selective all")] < min(
                kept[(arch, f"selective {m}")] for m in ("core_attn", "mlp", "layernorm")
            )


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (dict(recompute_granularity="partial"), ValueError, "recompute_granularity='partial' must be"),
        (dict(recompute_granularity="full", recompute_method="zigzag", recompute_num_layers=1), ValueError,
         "recompute_method='zigzag' must be"),
        (dict(recompute_granularity="full"), ValueError, "needs recompute_method 'uniform' or 'block'"),
        (dict(recompute_granularity="full", recompute_method="uniform"), ValueError,
         "needs recompute_num_layers >= 1.*got None"),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=0), ValueError,
         "needs recompute_num_layers >= 1.*got 0"),
        (dict(recompute_granularity="selective", recompute_num_layers=2), ValueError,
         "'selective' needs recompute_num_layers=None, got 2"),
        (dict(recompute_granularity="selective", recompute_modules=["core_attn", "attention"]), ValueError,
         r"invalid choices \['attention'\]"),
        (dict(recompute_granularity="selective", recompute_modules="mlp"), ValueError,
         "must be a list of module names, got 'mlp'"),
        (dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]), ValueError,
         r"'mla_up_proj' is only supported with multi_latent_attention"),
        (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), ValueError,
         "'moe_act' needs moe_grouped_gemm=True"),
        (dict(recompute_granularity="selective", recompute_modules=["shared_experts"], moe_grouped_gemm=True,
              num_moe_experts=2, moe_shared_expert_intermediate_size=8, moe_shared_expert_overlap=True),
         ValueError, "'shared_experts' cannot be recomputed with moe_shared_expert_overlap=True"),
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
              moe_layer_recompute=True), ValueError, "moe_layer_recompute=True cannot be combined"),
    ],
)
def test_bad_recompute_settings_are_refused(fields, error, match):
    with pytest.raises(error, match=match):
        TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, **fields)


def _settings(granularity=None, method=None, num_layers=None, modules=None) -> dict:
    return dict(recompute_granularity=granularity, recompute_method=method, recompute_num_layers=num_layers,
                recompute_modules=modules)


def test_defaults_and_example_flags():
    default = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4)
    assert default.recompute_modules == ["core_attn"]
    from megatron_ext.training.arguments import parse_args
    from megatron_ext.training.model import recompute_settings

    base = ["--layers", "2", "--hidden", "16", "--heads", "4"]
    settings = {
        (): _settings(),
        ("--recompute",): _settings("full", "uniform", 1),
        ("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"):
            _settings("full", "block", 2),
        ("--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm"):
            _settings("selective", modules=["mlp", "layernorm"]),
    }
    for flags, expected in settings.items():
        assert recompute_settings(parse_args(base + list(flags))) == expected, flags
    args = parse_args(base + ["--recompute", "--recompute-granularity", "selective"])
    with pytest.raises(ValueError, match="--recompute is full recomputation.*selective"):
        recompute_settings(args)
