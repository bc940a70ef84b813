"""Hugging Face mixture-of-experts weights in and out: small random Mixtral, Qwen2-MoE and
Qwen3-MoE models loaded into megatron_ext at ep 1, ep 2 (SequentialMLP and GroupedMLP) and tp 2 x
ep 2 give transformers' logits in float64; the export gives back the files' tensors under the
files' names, and transformers reads it back. Needs ``transformers`` (installed by CI)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.models import GPTModel
from megatron_ext.models.hf import config_from_hf, export_hf_state_dict, hf_config_dict, load_hf_state_dict
from tests.distributed import run_distributed

transformers = pytest.importorskip("transformers")
from tests.test_hf import BATCH, SEQ, _forward, _rms_norm_in_input_dtype  # noqa: E402

pytestmark = pytest.mark.slow  # end-to-end runs from Hugging Face weights

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, num_experts_per_tok=2,
             rope_parameters={"rope_type": "default", "rope_theta": 500.0})
MODELS = {
    "mixtral": dict(num_local_experts=4),
    # a dense second layer; the top-k weights stay the full softmax's
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                      mlp_only_layers=[1], norm_topk_prob=False),
    # a dense first layer (decoder_sparse_step 2); the top-k weights renormalised
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=24, decoder_sparse_step=2, norm_topk_prob=True),
}
# (tp, ep, etp, moe_grouped_gemm) on two ranks
LAYOUTS = [(1, 1, None, False), (1, 2, None, False), (1, 2, None, True), (2, 2, 1, False)]


def _hf_config(model_type: str, **overrides):
    return transformers.AutoConfig.for_model(model_type, **{**SIZES, **MODELS[model_type], **overrides})


def _hf_model(model_type: str, **overrides):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _hf_config(model_type, **overrides), attn_implementation="sdpa", experts_implementation="eager",
        dtype=torch.float64,
    )
    with torch.no_grad():  # the norms start at ones: make them tell the layers apart
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _router_in_input_dtype(self, hidden_states):
    """transformers' routers take the softmax in float32 whatever the input dtype; this one does not."""
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, indices = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, indices


def _float64_logits(model, tokens):
    norm, router = type(model.model.norm), type(model.model.layers[0].mlp.gate) if hasattr(
        model.model.layers[0].mlp, "gate") else type(model.model.layers[1].mlp.gate)
    saved = norm.forward, router.forward
    norm.forward, router.forward = _rms_norm_in_input_dtype, _router_in_input_dtype
    try:
        with torch.no_grad():
            return model(tokens).logits
    finally:
        norm.forward, router.forward = saved


def _tokens():
    return torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _build(config, tp, ep, etp, grouped, **overrides):
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    mconfig, kwargs = config_from_hf(
        config, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        moe_grouped_gemm=grouped, params_dtype=torch.float64, use_cpu_initialization=True, **overrides,
    )
    return GPTModel(mconfig, parallel_output=False, **kwargs).eval()


def _worker(cases) -> dict:
    """Per model type: each layout's logits difference from transformers' (relative to the largest
    logit), after loading transformers' in-memory (fused) state dict; checks that the export is
    the files' tensors and that loading the files gives the same export; the refusal of a
    checkpoint with more experts than the model."""
    from safetensors.torch import load_file, save_file

    out = {}
    for model_type, path in cases:
        hf_model = _hf_model(model_type)
        tokens = _tokens()
        hf_state, hf_logits = hf_model.state_dict(), _float64_logits(hf_model, tokens)
        files = load_file(f"{path}/model.safetensors")
        diffs, exported = {}, None
        for layout in LAYOUTS:
            model = _build(hf_model.config, *layout)
            load_hf_state_dict(model, hf_state)
            logits = _forward([model], tokens)
            diffs[layout] = ((logits - hf_logits).abs().max() / hf_logits.abs().max()).item()
            exported = export_hf_state_dict(model)
            assert set(exported) == set(files), (layout, set(exported) ^ set(files))
            for name, tensor in files.items():
                assert torch.equal(exported[name], tensor), (layout, name)
            for param in model.parameters():  # then reloaded from the files
                param.data.zero_()
            load_hf_state_dict(model, path)
            again = export_hf_state_dict(model)
            assert list(again) == list(exported)
            assert all(torch.equal(again[k], v) for k, v in exported.items())
            config_json = hf_config_dict(model)
            ps.destroy_model_parallel()
        errors = []
        model = _build(hf_model.config, 1, 2, None, False, num_moe_experts=2)
        for source in (hf_state, path):
            with pytest.raises(ValueError) as info:
                load_hf_state_dict(model, source)
            errors.append(str(info.value))
        ps.destroy_model_parallel()
        if dist.get_rank() == 0:  # the last layout's export, with its config.json, for transformers
            os.makedirs(f"{path}_export")
            save_file({k: v.contiguous() for k, v in exported.items()}, f"{path}_export/model.safetensors",
                      metadata={"format": "pt"})
            with open(f"{path}_export/config.json", "w") as f:
                json.dump(config_json, f)
        out[model_type] = dict(diffs=diffs, logits=hf_logits.tolist(), errors=errors)
    return out


def test_hf_moe_models_give_transformers_logits(tmp_path):
    cases = []
    for model_type in MODELS:
        _hf_model(model_type).save_pretrained(tmp_path / model_type)
        cases.append((model_type, str(tmp_path / model_type)))
    first, second = run_distributed(2, _worker, cases)

    for model_type, result in first.items():
        for layout, err in result["diffs"].items():
            assert err < 1e-9, (model_type, layout, err)
        assert result["errors"] == second[model_type]["errors"]  # the same error on every rank
        for error in result["errors"]:
            layer = 1 if model_type == "qwen3_moe" else 0  # the first MoE layer
            assert error.startswith(
                f"load_hf_state_dict: rank 0: layer {layer} of the Hugging Face checkpoint has a different "
                "number of experts than the model's num_moe_experts=2: "
            ), error
            assert "gives 4" in error and "rank 1:" in error, error
        # transformers reads the export (with hf_config_dict's config.json) as the same model
        out = tmp_path / f"{model_type}_export"
        written, original = transformers.AutoConfig.from_pretrained(str(out)), _hf_config(model_type)
        assert type(written) is type(original)
        for key in ("num_experts", "num_experts_per_tok", "intermediate_size", "moe_intermediate_size",
                    "shared_expert_intermediate_size", "norm_topk_prob", "num_key_value_heads", "qkv_bias"):
            assert getattr(written, key, None) == getattr(original, key, None), (model_type, key)
        reread = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), dtype=torch.float64, experts_implementation="eager"
        ).eval()
        logits = _float64_logits(reread, _tokens())
        expected = torch.tensor(result["logits"], dtype=torch.float64)
        assert ((logits - expected).abs().max() / expected.abs().max()).item() < 1e-12, model_type


# --- examples/train_gpt.py --load-hf / --export-hf --------------------------------------------------

EXAMPLE = ["--tp", "1", "--pp", "1", "--seq-len", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--dtype", "float64", "--no-progress", "--plot", "", "--steps", "1", "--lr", "0"]


def _example_worker(path: str, export_dir: str) -> tuple[list[float], list[float]]:
    """The example's losses, and again with the router's balance and z losses on (they join the
    backward, not the reported language-model loss)."""
    from tests.conftest import load_train_gpt

    train_gpt = load_train_gpt()
    args = EXAMPLE + ["--ep", "2", "--load-hf", path, "--export-hf", export_dir]
    router_losses = EXAMPLE + ["--ep", "2", "--load-hf", path, "--moe-aux-loss-coeff", "0.01",
                               "--moe-z-loss-coeff", "1e-3"]
    return (train_gpt.train(train_gpt.parse_args(args))["losses"],
            train_gpt.train(train_gpt.parse_args(router_losses))["losses"])


def _transformers_loss(path: str) -> float:
    """transformers' mean loss of the model in ``path`` on the example's first global batch."""
    from tests.conftest import example_first_batches

    batches = example_first_batches(EXAMPLE + ["--load-hf", path, "--dp", "1"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    losses = []
    for batch in batches:
        logits = _float64_logits(model, batch["tokens"])
        losses.append(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))
    return torch.stack(losses).mean().item()


def test_example_loads_and_exports_hf_moe(tmp_path):
    """train_gpt.py --load-hf of a Qwen2-MoE model at ep 2 (lr 0) starts from transformers' loss
    and --export-hf writes back the same files."""
    from safetensors.torch import load_file

    path, export_dir = str(tmp_path / "qwen2_moe"), str(tmp_path / "export")
    _hf_model("qwen2_moe", vocab_size=256).save_pretrained(path)  # the example's tokens are bytes
    (first, with_router_losses), second = run_distributed(2, _example_worker, path, export_dir)
    assert (first, with_router_losses) == second
    hf_loss = _transformers_loss(path)
    assert abs(first[0] - hf_loss) < 1e-9 * hf_loss, (first, hf_loss)
    assert abs(with_router_losses[0] - hf_loss) < 1e-9 * hf_loss, (with_router_losses, hf_loss)
    original, exported = load_file(f"{path}/model.safetensors"), load_file(f"{export_dir}/model.safetensors")
    assert set(original) == set(exported)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
