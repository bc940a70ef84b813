"""Hugging Face DeepSeek-V2 and DeepSeek-V3 weights in and out: megatron_ext's multi-latent attention
equals transformers' ``DeepseekV3Attention`` / ``DeepseekV2Attention`` (YaRN, same weights: output and
every gradient in float64); small random ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM``
models (a dense first layer, shared experts, group-limited sigmoid routing with the expert bias /
softmax routing) loaded at tp 1, tp 2 and ep 2 give transformers' logits in float64; the export gives
back the files' tensors, multi-token prediction layers kept when the files hold them (and ignored
by transformers); the refusals of configs megatron_ext cannot map and of configs that disagree
with the weights. Needs ``transformers``."""

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
from megatron_ext.transformer.multi_latent_attention import MLASelfAttention
from tests.distributed import run_distributed

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3  # noqa: E402

from tests.test_hf import _rms_norm_in_input_dtype  # noqa: E402

BATCH, SEQ = 2, 10
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.8}
ATTENTION = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8,
                 qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, max_position_embeddings=32,
                 rms_norm_eps=1e-6, rope_parameters=YARN, intermediate_size=24)
MODELS = {
    # DeepSeek-V3: query compression, a dense first layer, 4 experts in 2 groups (1 chosen), top 2
    # renormalised sigmoid scores plus the expert bias, times 2.5, one shared expert.
    "deepseek_v3": dict(q_lora_rank=12, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4,
                        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                        moe_intermediate_size=12, routed_scaling_factor=2.5, num_nextn_predict_layers=0),
    # DeepSeek-V2-Lite-like: no query compression, the top 2 of a softmax over 4 experts within the
    # 2 groups holding the best experts, times 1.5, two shared experts, the plain rotary embedding.
    "deepseek_v2": dict(q_lora_rank=None, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4,
                        num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=2, topk_group=2,
                        n_shared_experts=2, moe_intermediate_size=12, routed_scaling_factor=1.5,
                        rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
}


def _hf_config(model_type: str, **overrides):
    return transformers.AutoConfig.for_model(model_type, **{**ATTENTION, **MODELS[model_type], **overrides})


def _rotary_in_input_dtype(xq, xk, freqs_cis):
    """transformers' DeepSeek-V2 rotation rounds to float32 whatever the input dtype; this one does not."""
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.unsqueeze(1)
    return torch.view_as_real(xq_ * freqs_cis).flatten(3), torch.view_as_real(xk_ * freqs_cis).flatten(3)


def _v2_rotary_with_cos_sin(self, x, position_ids):
    """transformers' V2 rotary factors taken with torch.cos / torch.sin, as its V3 (and megatron_ext)
    take them: its torch.polar rounds some float32 cosines and sines to the next float32."""
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.complex(freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling)


def _v3_router_in_input_dtype(self, hidden_states):
    """transformers' V3 router in the input's dtype (it rounds to float32), otherwise its arithmetic."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight.to(hidden_states.dtype))
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias
    per_group = self.num_experts // self.num_group
    group_scores = choice.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
    choice = choice.masked_fill(~mask.bool(), float("-inf"))
    indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, indices


def _v2_router_in_input_dtype(self, hidden_states):
    """transformers' V2 router (softmax, group-limited greedy) in the input's dtype."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight.to(hidden_states.dtype))
    scores = logits.softmax(dim=-1)
    if self.topk_method == "group_limited_greedy":
        group_scores = scores.view(-1, self.num_group, self.num_experts // self.num_group).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        mask = mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
        scores = scores.masked_fill(~mask.reshape(-1, self.num_experts).bool(), 0.0)
    weights, indices = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
    return logits, weights * self.routed_scaling_factor, indices


class _Float64:
    """transformers' DeepSeek models computing in float64 where they round to float32."""

    def __enter__(self):
        self.saved = [(v3.DeepseekV3RMSNorm, "forward", _rms_norm_in_input_dtype),
                      (v2.DeepseekV2RMSNorm, "forward", _rms_norm_in_input_dtype),
                      (v3.DeepseekV3TopkRouter, "forward", _v3_router_in_input_dtype),
                      (v2.DeepseekV2TopkRouter, "forward", _v2_router_in_input_dtype),
                      (v2, "apply_rotary_emb", _rotary_in_input_dtype),
                      (v2.DeepseekV2RotaryEmbedding, "forward", _v2_rotary_with_cos_sin)]
        self.saved = [(owner, name, getattr(owner, name), new) for owner, name, new in self.saved]
        for owner, name, _, new in self.saved:
            setattr(owner, name, new)

    def __exit__(self, *exc):
        for owner, name, old, _ in self.saved:
            setattr(owner, name, old)


def _randomise(model: torch.nn.Module) -> None:
    """Norms away from 1 (they start there) and a random expert bias (it starts at 0)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(5)) * 0.1)


# --- one attention layer -----------------------------------------------------------------------------

_ATTENTION_NAMES = {  # transformers' name -> megatron_ext's
    "q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_latent_norm",
    "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
    "kv_a_layernorm": "kv_latent_norm",
    "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj",
}


def _attention_diffs(model_type: str, q_lora_rank) -> dict:
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    hf_config = _hf_config(model_type, q_lora_rank=q_lora_rank, rope_parameters=YARN)
    hf_config._attn_implementation = "sdpa"  # eager attention takes its softmax in float32
    module = v3 if model_type == "deepseek_v3" else v2
    torch.manual_seed(0)
    prefix = type(hf_config).__name__.replace("Config", "")
    hf_attention = getattr(module, f"{prefix}Attention")(hf_config, 0).double()
    rotary = getattr(module, f"{prefix}RotaryEmbedding")(hf_config)
    _randomise(hf_attention)
    config, _ = config_from_hf(hf_config, params_dtype=torch.float64, use_cpu_initialization=True)
    ours = MLASelfAttention(config).train()
    with torch.no_grad():
        for hf_name, param in hf_attention.named_parameters():
            getattr(ours, _ATTENTION_NAMES[hf_name.rsplit(".", 1)[0]]).weight.copy_(param)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, SEQ, hf_config.hidden_size, generator=g, dtype=torch.float64)
    grad = torch.randn(BATCH, SEQ, hf_config.hidden_size, generator=g, dtype=torch.float64)
    hf_x, our_x = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    with _Float64():
        position_embeddings = rotary(hf_x, torch.arange(SEQ)[None])
        hf_out, _ = hf_attention(hf_x, position_embeddings=position_embeddings, attention_mask=None)
    (hf_out * grad).sum().backward()
    out, _ = ours(our_x)
    (out * grad.transpose(0, 1)).sum().backward()
    diffs = {"out": ((out.transpose(0, 1) - hf_out).abs().max() / hf_out.abs().max()).item(),
             "x grad": ((our_x.grad.transpose(0, 1) - hf_x.grad).abs().max() / hf_x.grad.abs().max()).item()}
    for hf_name, param in hf_attention.named_parameters():
        mine = getattr(ours, _ATTENTION_NAMES[hf_name.rsplit(".", 1)[0]]).weight.grad
        diffs[hf_name] = ((mine - param.grad).abs().max() / param.grad.abs().max()).item()
    ps.destroy_model_parallel()
    return diffs


def _attention_worker(cases):
    return [_attention_diffs(*case) for case in cases]


ATTENTION_CASES = [("deepseek_v3", 12), ("deepseek_v3", None), ("deepseek_v2", 12), ("deepseek_v2", None)]


def test_mla_equals_transformers_deepseek_attention():
    (results,) = run_distributed(1, _attention_worker, ATTENTION_CASES)
    for case, diffs in zip(ATTENTION_CASES, results):
        assert len(diffs) >= 7, (case, diffs)
        for what, diff in diffs.items():
            assert diff < 1e-12, (case, what, diff)


# --- whole models ------------------------------------------------------------------------------------

def _hf_model(model_type: str, **overrides):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _hf_config(model_type, **overrides), attn_implementation="sdpa", experts_implementation="eager",
        dtype=torch.float64,
    )
    model = model.double()  # the router's weight is kept in float32 (transformers' rule); not here
    _randomise(model)
    return model.eval()


def _tokens():
    return torch.randint(0, ATTENTION["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _logits(model, tokens):
    with _Float64(), torch.no_grad():
        return model(tokens).logits


LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, ep) on 2 ranks (and serial)


def _build(hf_config, tp: int, ep: int, **overrides) -> GPTModel:
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config, kwargs = config_from_hf(hf_config, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                    params_dtype=torch.float64, use_cpu_initialization=True, **overrides)
    return GPTModel(config, parallel_output=False, **kwargs).eval()


def _model_worker(cases) -> dict:
    from safetensors.torch import load_file

    out = {}
    for model_type, path in cases:
        hf_model = _hf_model(model_type)
        tokens = _tokens()
        hf_state, hf_logits = hf_model.state_dict(), _logits(hf_model, tokens)
        files = load_file(f"{path}/model.safetensors")
        diffs = {}
        for tp, ep in LAYOUTS:
            if tp * ep != dist.get_world_size() and (tp, ep) != (1, 1):
                continue
            model = _build(hf_model.config, tp, ep)
            load_hf_state_dict(model, hf_state)
            with torch.no_grad():
                logits = model(tokens, None)
            diffs[(tp, ep)] = ((logits - hf_logits).abs().max() / hf_logits.abs().max()).item()
            exported = export_hf_state_dict(model)
            assert set(exported) == set(files), (tp, ep, set(exported) ^ set(files))
            for name, tensor in files.items():
                assert torch.equal(exported[name], tensor), (tp, ep, name)
            for param in model.parameters():  # then reloaded from the files
                param.data.zero_()
            load_hf_state_dict(model, path)
            again = export_hf_state_dict(model)
            assert all(torch.equal(again[k], v) for k, v in exported.items())
            written = hf_config_dict(model)
            ps.destroy_model_parallel()
        out[model_type] = dict(diffs=diffs, config=written)
    return out


@pytest.mark.slow  # end-to-end runs from Hugging Face weights on 1 and 2 ranks
def test_hf_deepseek_models_give_transformers_logits(tmp_path):
    cases = []
    for model_type in MODELS:
        _hf_model(model_type).save_pretrained(tmp_path / model_type)
        cases.append((model_type, str(tmp_path / model_type)))
    for world in (1, 2):
        for rank_result in run_distributed(world, _model_worker, cases):
            for model_type, result in rank_result.items():
                assert len(result["diffs"]) == (1 if world == 1 else 3), result
                for layout, err in result["diffs"].items():
                    assert err < 1e-12, (model_type, layout, err)
                # transformers reads hf_config_dict's config as the same model
                written = transformers.AutoConfig.for_model(**result["config"])
                original = _hf_config(model_type)
                for key in (*ATTENTION, *MODELS[model_type]):
                    if key not in ("rope_parameters", "num_nextn_predict_layers"):
                        assert getattr(written, key) == getattr(original, key), (model_type, key)
                assert written.rope_parameters == original.rope_parameters, model_type


# --- multi-token prediction layers: kept from the files, ignored by transformers ---------------------

def _mtp_worker(path: str, plain: str) -> dict:
    """A serial model with one multi-token prediction depth written as DeepSeek-V3's files; loaded
    back (exactly), into a model without the depth, and refused where the files lack it or its
    embedding copy differs."""
    from safetensors.torch import load_file, save_file

    hf_config = _hf_config("deepseek_v3", num_nextn_predict_layers=1)
    model = _build(hf_config, 1, 1, mtp_num_layers=1)
    state = export_hf_state_dict(model)
    os.makedirs(path)
    tensors = {k: v.contiguous() for k, v in state.items()}
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with open(f"{path}/config.json", "w") as f:
        json.dump(hf_config_dict(model), f)
    with torch.no_grad():
        logits = model(_tokens(), None)
    out = {"mtp names": sorted(n for n in state if n.startswith("model.layers.3.")),
           "logits": logits.tolist()}
    ps.destroy_model_parallel()
    fresh = _build(hf_config, 1, 1, mtp_num_layers=1)  # other random weights, then the files'
    load_hf_state_dict(fresh, path)
    again = export_hf_state_dict(fresh)
    out["kept"] = set(again) == set(state) and all(torch.equal(again[k], v) for k, v in state.items())
    ps.destroy_model_parallel()
    without = _build(hf_config, 1, 1)
    load_hf_state_dict(without, path)  # the depth's tensors are not this model's: ignored
    out["without"] = sorted(export_hf_state_dict(without)) == sorted(n for n in state if not n.startswith(
        "model.layers.3."))
    ps.destroy_model_parallel()
    errors = []
    other_copy = {**load_file(f"{path}/model.safetensors"),
                  "model.layers.3.embed_tokens.weight": torch.zeros_like(state["model.embed_tokens.weight"])}
    for source in (plain, other_copy):
        model = _build(hf_config, 1, 1, mtp_num_layers=1)
        with pytest.raises(ValueError) as info:
            load_hf_state_dict(model, source)
        errors.append(str(info.value))
        ps.destroy_model_parallel()
    out["errors"] = errors
    return out


@pytest.mark.slow  # end-to-end runs from Hugging Face weights
def test_mtp_layers_are_kept_and_transformers_ignores_them(tmp_path):
    plain = tmp_path / "plain"
    _hf_model("deepseek_v3").save_pretrained(plain)
    (out,) = run_distributed(1, _mtp_worker, str(tmp_path / "mtp"), str(plain))
    assert out["mtp names"] == sorted(
        f"model.layers.3.{name}" for name in (
            "embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
            "shared_head.norm.weight", "shared_head.head.weight", "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
            "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
            "self_attn.kv_b_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
            "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
            "mlp.shared_experts.down_proj.weight",
            *(f"mlp.experts.{e}.{p}.weight" for e in range(4)
              for p in ("gate_proj", "up_proj", "down_proj")),
        )
    )
    assert out["kept"] and out["without"], out
    assert "has no multi-token prediction layers ('model.layers.3.eh_proj.weight')" in out["errors"][0]
    assert "model.layers.3.embed_tokens.weight differs from model.embed_tokens.weight" in out["errors"][1]
    # transformers reads the files (the depth's tensors left unused) as the same model
    reread = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "mtp"), dtype=torch.float64, experts_implementation="eager").double().eval()
    expected = torch.tensor(out["logits"], dtype=torch.float64)
    got = _logits(reread, _tokens())
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-12


# --- configs that do not map, and that disagree with the weights ------------------------------------

@pytest.mark.parametrize(("model_type", "overrides", "error", "match"), [
    ("deepseek_v3", dict(rope_interleave=False), NotImplementedError, "rope_interleave=False"),
    ("deepseek_v3", dict(norm_topk_prob=False), NotImplementedError, "norm_topk_prob=False"),
    ("deepseek_v3", dict(topk_group=2), NotImplementedError, "by its best 2 expert"),
    ("deepseek_v3", dict(attention_bias=True), NotImplementedError, "attention_bias=True"),
    ("deepseek_v3", dict(rms_norm_eps=1e-5), NotImplementedError, "rms_norm_eps=1e-05"),
    ("deepseek_v3", dict(n_group=3), ValueError, "not divisible by n_group"),
    ("deepseek_v3", dict(rope_parameters={**YARN, "mscale": 0}), NotImplementedError, "mscale_all_dim=0.8"),
    ("deepseek_v3", dict(rope_parameters={**YARN, "truncate": False}), NotImplementedError, "truncate=False"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), NotImplementedError, "topk_method 'noaux_tc'"),
    ("deepseek_v2", dict(topk_group=1), NotImplementedError, "by its best 1 expert"),
])
def test_deepseek_configs_that_do_not_map_raise(model_type, overrides, error, match):
    config = {**_hf_config(model_type).to_dict(), **overrides}
    with pytest.raises(error, match=match):
        config_from_hf(config)


def _disagree_worker(path: str) -> list[str]:
    """Files of one config loaded into models built from configs that differ from them."""
    errors = []
    for overrides in (dict(kv_lora_rank=6), dict(first_k_dense_replace=2), dict(qk_rope_head_dim=2)):
        model = _build(_hf_config("deepseek_v3", **overrides), 1, 2)
        with pytest.raises(ValueError) as info:
            load_hf_state_dict(model, path)
        errors.append(str(info.value))
        ps.destroy_model_parallel()
    return errors


@pytest.mark.slow  # a 2-rank group
def test_configs_that_disagree_with_the_weights_raise_on_every_rank(tmp_path):
    _hf_model("deepseek_v3").save_pretrained(tmp_path)
    first, second = run_distributed(2, _disagree_worker, str(tmp_path))
    assert first == second
    for error in first:
        assert error.startswith("load_hf_state_dict: rank 0: ") and "rank 1: " in error, error
    assert "kv_a_proj_with_mqa" in first[0] and "was not built from this config" in first[0]
    assert "model.layers.1.mlp" in first[1]
    assert "the model was not built from this config" in first[2]


# --- examples/train_gpt.py --load-hf / --export-hf ---------------------------------------------------

EXAMPLE = ["--tp", "1", "--pp", "1", "--seq-len", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--dtype", "float64", "--no-progress", "--plot", "", "--steps", "1", "--lr", "0"]


def _example_worker(path: str, export_dir: str) -> list[float]:
    from tests.conftest import load_train_gpt

    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(EXAMPLE + ["--ep", "2", "--load-hf", path, "--export-hf", export_dir])
    return train_gpt.train(args)["losses"]


def _transformers_loss(path: str) -> float:
    """transformers' mean loss of the model in ``path`` on the example's first global batch."""
    from tests.conftest import example_first_batches

    batches = example_first_batches(EXAMPLE + ["--load-hf", path, "--dp", "1"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager").double().eval()
    losses = [F.cross_entropy(_logits(model, b["tokens"]).flatten(0, 1), b["labels"].flatten())
              for b in batches]
    return torch.stack(losses).mean().item()


@pytest.mark.slow  # a 2-rank training from Hugging Face weights
def test_example_loads_and_exports_hf_deepseek(tmp_path):
    """train_gpt.py --load-hf of a DeepSeek-V3 model at ep 2 (lr 0) starts from transformers' loss
    and --export-hf writes back the same files, but for the expert biases, which the step moves by
    the update rate (1e-3) each (lr 0 stops the weights, not them)."""
    from safetensors.torch import load_file

    path, export_dir = str(tmp_path / "deepseek_v3"), str(tmp_path / "export")
    _hf_model("deepseek_v3", vocab_size=256).save_pretrained(path)  # the example's tokens are bytes
    first, second = run_distributed(2, _example_worker, path, export_dir)
    assert first == second
    hf_loss = _transformers_loss(path)
    assert abs(first[0] - hf_loss) < 1e-9 * hf_loss, (first, hf_loss)
    original, exported = load_file(f"{path}/model.safetensors"), load_file(f"{export_dir}/model.safetensors")
    assert set(original) == set(exported)
    biases = [k for k in original if k.endswith("e_score_correction_bias")]
    assert len(biases) == 2
    assert all(torch.equal(exported[k], v) for k, v in original.items() if k not in biases)
    for k in biases:  # each moved by +-1e-3 (in float32), or not at all where an expert had its share
        moved = (exported[k] - original[k]).abs()
        assert (((moved - 1e-3).abs() < 1e-7) | (moved == 0)).all() and (moved > 0).any(), (k, moved)
