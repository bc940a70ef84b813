"""Hugging Face gpt-oss weights in and out: small random ``GptOssForCausalLM`` models (sliding
windows on alternating layers shorter than the sequence, learned attention sinks, biases on every
projection, the router's and the experts', a clamp that some values reach, YaRN rotary embeddings)
loaded at tp 1, tp 2 (experts split over etp 2), ep 2 (both expert implementations) and tp 2 x ep 2
give transformers' logits in float64; the export gives back the files' tensors (the experts'
interleaved gate/up columns restored) and transformers reads it, with ``hf_config_dict``'s
config, as the same model; ``examples/train_gpt.py --load-hf`` of one at ep 2 starts from
transformers' loss and ``--export-hf`` writes it back; what megatron_ext cannot express is refused
with one ValueError naming the field (on every rank); Qwen's and the other families'
``layer_types`` rules. Needs ``transformers``."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.fusions import quick_gelu
from megatron_ext.models import GPTModel
from megatron_ext.models.hf import config_from_hf, export_hf_state_dict, hf_config_dict, load_hf_state_dict
from tests.distributed import run_distributed

transformers = pytest.importorskip("transformers")
from transformers.models.gpt_oss import modeling_gpt_oss as oss  # noqa: E402

from tests.test_hf import _forward, _rms_norm_in_input_dtype  # noqa: E402

BATCH, SEQ = 2, 12
# YaRN whose ramp ends fall between channel pairs (1.62 and 4.03 of 8 pairs): truncate matters.
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 4.0, "beta_slow": 1.0, "truncate": False}
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=12, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
             max_position_embeddings=256, sliding_window=4, swiglu_limit=0.6, rms_norm_eps=1e-5,
             rope_parameters=YARN)
MODELS = {
    # transformers' defaults: windows on layers 0 and 2, YaRN without truncation
    "alternating": {},
    # windows on layer 1 only, truncated YaRN with mscale / mscale_all_dim, a tied output layer
    "other": dict(layer_types=["full_attention", "sliding_attention", "full_attention"], sliding_window=5,
                  rope_parameters={**YARN, "truncate": True, "mscale": 1.3, "mscale_all_dim": 0.7},
                  tie_word_embeddings=True),
}
# (tp, ep, etp, moe_grouped_gemm) on two ranks: (1, 1) is two data-parallel replicas.
LAYOUTS = [(1, 1, None, False), (2, 1, None, False), (1, 2, None, False), (1, 2, None, True),
           (2, 2, 1, False)]


def _hf_config(name: str = "alternating", **overrides):
    return transformers.AutoConfig.for_model("gpt_oss", **{**SIZES, **MODELS[name], **overrides})


def _hf_model(name: str = "alternating", **overrides):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _hf_config(name, **overrides), attn_implementation="eager", experts_implementation="eager",
        dtype=torch.float64,
    )
    with torch.no_grad():  # norms away from 1, biases and sinks away from their zeros and 0.02s
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
            elif param_name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5)
    return model.eval()


class _Float64:
    """transformers' gpt-oss computing its norms in float64 (it rounds them to float32), and
    counting the gate and up values its experts clamp."""

    def __enter__(self):
        self.clamped = {"gate": 0, "up": 0, "values": 0}
        apply_gate = self.apply_gate = oss.GptOssExperts._apply_gate
        counts = self.clamped

        def counting(experts, gate_up):
            counts["gate"] += int((gate_up[..., ::2] > experts.limit).sum())
            counts["up"] += int((gate_up[..., 1::2].abs() > experts.limit).sum())
            counts["values"] += gate_up.numel() // 2
            return apply_gate(experts, gate_up)

        self.norm = oss.GptOssRMSNorm.forward
        oss.GptOssRMSNorm.forward, oss.GptOssExperts._apply_gate = _rms_norm_in_input_dtype, counting
        return self

    def __exit__(self, *exc):
        oss.GptOssRMSNorm.forward, oss.GptOssExperts._apply_gate = self.norm, self.apply_gate


def _tokens(vocab: int = SIZES["vocab_size"]):
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _logits(model, tokens) -> tuple[torch.Tensor, dict]:
    with _Float64() as counted, torch.no_grad():
        return model(tokens).logits, counted.clamped


def _build(hf_config, tp: int, ep: int, etp, grouped: bool, **overrides) -> GPTModel:
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config, kwargs = config_from_hf(hf_config, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                    expert_tensor_parallel_size=etp, moe_grouped_gemm=grouped,
                                    params_dtype=torch.float64, use_cpu_initialization=True, **overrides)
    return GPTModel(config, parallel_output=False, **kwargs).eval()


# Models that are not gpt-oss-shaped, and the field hf_config_dict names for each.
NOT_GPT_OSS = [(dict(softmax_type="vanilla"), "softmax_type='vanilla' (expected 'learnable')"),
               (dict(moe_router_pre_softmax=True), "moe_router_pre_softmax=True (expected False)"),
               (dict(add_bias_linear=False, add_qkv_bias=False), "add_bias_linear=False (expected True)"),
               (dict(moe_layer_freq=[1, 0, 1]), "moe_layer_freq (every layer MoE)=[True, False, True]")]


def _worker(cases) -> dict:
    """Per model: each layout's logits difference from transformers' (relative to the largest
    logit) after loading transformers' state dict; checks that the export is the files' tensors in
    transformers' order and that loading the files gives the same export; the last layout's export
    and config for transformers; hf_config_dict's refusals."""
    from safetensors.torch import load_file, save_file

    out = {}
    for name, path in cases:
        hf_model = _hf_model(name)
        hf_state = hf_model.state_dict()
        hf_logits, clamped = _logits(hf_model, _tokens())
        files = load_file(f"{path}/model.safetensors")
        diffs = {}
        for layout in LAYOUTS if name == "alternating" else LAYOUTS[:1]:
            model = _build(hf_model.config, *layout)
            load_hf_state_dict(model, hf_state)
            logits = _forward([model], _tokens())
            diffs[layout] = ((logits - hf_logits).abs().max() / hf_logits.abs().max()).item()
            exported = export_hf_state_dict(model)
            assert list(exported) == list(hf_state), (layout, list(exported))
            for tensor_name, tensor in hf_state.items():
                assert torch.equal(exported[tensor_name], tensor), (layout, tensor_name)
            assert set(files) <= set(exported)  # a tied output layer is the embedding in the files
            for param in model.parameters():  # then reloaded from the files
                param.data.zero_()
            load_hf_state_dict(model, path)
            again = export_hf_state_dict(model)
            assert all(torch.equal(again[k], v) for k, v in exported.items()), layout
            written = hf_config_dict(model)
            ps.destroy_model_parallel()
        if dist.get_rank() == 0:  # the last layout's export, with its config.json, for transformers
            os.makedirs(f"{path}_export")
            tensors = {k: v.contiguous() for k, v in exported.items() if k in files}
            save_file(tensors, f"{path}_export/model.safetensors", metadata={"format": "pt"})
            with open(f"{path}_export/config.json", "w") as f:
                json.dump(written, f)
        out[name] = dict(diffs=diffs, config=written, logits=hf_logits.tolist(), clamped=clamped)
    refusals = []
    for overrides, _ in NOT_GPT_OSS:
        model = _build(_hf_config(), 1, 1, None, False, **overrides)
        with pytest.raises(ValueError) as info:
            hf_config_dict(model)
        refusals.append(str(info.value))
        ps.destroy_model_parallel()
    out["refusals"] = refusals
    return out


@pytest.mark.slow  # end-to-end runs from Hugging Face weights on 2 ranks
def test_gpt_oss_gives_transformers_logits_and_exports_back(tmp_path):
    cases = []
    for name in MODELS:
        _hf_model(name).save_pretrained(tmp_path / name)
        cases.append((name, str(tmp_path / name)))
    first, second = run_distributed(2, _worker, cases)
    assert first["refusals"] == second["refusals"]
    for refusal, (_, expected) in zip(first["refusals"], NOT_GPT_OSS):
        assert refusal.startswith("the model is not gpt-oss-shaped: ") and expected in refusal, refusal
    for name in MODELS:
        result = first[name]
        assert len(result["diffs"]) == (len(LAYOUTS) if name == "alternating" else 1), result["diffs"]
        for layout, err in {**result["diffs"], **second[name]["diffs"]}.items():
            assert err < 1e-12, (name, layout, err)
        clamped = result["clamped"]  # the clamp binds on some values of both halves, not on all
        assert 0 < clamped["gate"] < clamped["values"] and 0 < clamped["up"] < clamped["values"], clamped
        # hf_config_dict's config is the original model's
        written, original = transformers.AutoConfig.for_model(**result["config"]), _hf_config(name)
        for key in (*SIZES, *MODELS[name], "layer_types", "swiglu_alpha", "attention_bias"):
            assert getattr(written, key) == getattr(original, key), (name, key)
        # transformers reads the export as the same model
        reread = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / f"{name}_export"), dtype=torch.float64, experts_implementation="eager",
            attn_implementation="eager").eval()
        logits, _ = _logits(reread, _tokens())
        assert torch.equal(logits, torch.tensor(result["logits"], dtype=torch.float64)), name


# --- the configs: what maps, the family rules, what is refused --------------------------------------

def test_gpt_oss_config_maps_to_megatron_core_fields():
    for source in (_hf_config(), _hf_config().to_dict()):
        config, kwargs = config_from_hf(source)
        assert (config.window_size, config.window_attn_skip_freq) == ((3, 0), [1, 0, 1])
        assert config.softmax_type == "learnable" and config.add_bias_linear and config.add_qkv_bias
        assert config.activation_func is quick_gelu and config.gated_linear_unit
        assert (config.glu_linear_offset, config.activation_func_clamp_value) == (1.0, 0.6)
        assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 12)
        assert config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax
        assert (config.kv_channels, config.num_query_groups) == (16, 2)
        assert kwargs["position_embedding_type"] == "yarn" and kwargs["rotary_base"] == 100.0
        assert (config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings,
                config.yarn_beta_fast, config.yarn_beta_slow, config.yarn_mscale, config.yarn_mscale_all_dim,
                config.yarn_correction_range_round_to_int) == (4.0, 64, 4.0, 1.0, 1.0, 0.0, False)
    # gpt-oss's own config.json: the legacy rope_scaling and rope_theta, no layer_types
    legacy = {k: v for k, v in _hf_config().to_dict().items() if k not in ("layer_types", "rope_parameters")}
    legacy.update(rope_theta=150000.0, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False,
                                                      "original_max_position_embeddings": 4096})
    config, kwargs = config_from_hf(legacy)
    assert config.window_attn_skip_freq == [1, 0, 1] and kwargs["rotary_base"] == 150000.0
    assert (config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings) == (32.0, 4096)
    every_layer, _ = config_from_hf(_hf_config(layer_types=["sliding_attention"] * 3))
    assert (every_layer.window_size, every_layer.window_attn_skip_freq) == ((3, 0), None)
    plain, kwargs = config_from_hf(_hf_config(rope_parameters={"rope_type": "default", "rope_theta": 10.0}))
    assert kwargs["position_embedding_type"] == "rope" and not hasattr(plain, "yarn_rotary_scaling_factor")


LLAMA_SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


@pytest.mark.parametrize(("model_type", "fields", "skip_freq"), [
    # Qwen2 / Qwen3 from layer max_window_layers on, only with use_sliding_window
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2), [0, 0, 1, 1]),
    ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0), None),
    ("qwen2", dict(use_sliding_window=False, sliding_window=4, max_window_layers=2), "no window"),
    # Qwen2-MoE: the even layers below max_window_layers
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=4, max_window_layers=3, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8),
     [1, 0, 1, 0]),
    # Qwen3-MoE: every layer with use_sliding_window
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=8), None),
    # an explicit layer_types wins over the rule
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2,
                   layer_types=["sliding_attention", "full_attention"] * 2), [1, 0, 1, 0]),
])
def test_families_window_the_layers_transformers_windows(model_type, fields, skip_freq):
    """config.json dicts without ``layer_types`` (older files) take the family's rule; the
    transformers config object, which fills the field, maps the same."""
    for source in ({"model_type": model_type, **LLAMA_SIZES, **fields},
                   transformers.AutoConfig.for_model(model_type, **LLAMA_SIZES, **fields)):
        config, kwargs = config_from_hf(source)
        if skip_freq == "no window":
            assert config.window_size is None, source
        else:
            assert (config.window_size, config.window_attn_skip_freq) == ((3, 0), skip_freq), source
        assert kwargs["max_sequence_length"] == 32  # the window no longer caps the sequence


def _gpt_oss_dict(**overrides) -> dict:
    return {**_hf_config().to_dict(), **overrides}


@pytest.mark.parametrize(("overrides", "match"), [
    (dict(swiglu_alpha=1.5), "'swiglu_alpha' must be 1.702"),
    (dict(swiglu_limit=0.0), "'swiglu_limit' must be a positive finite number, got 0.0"),
    (dict(attention_bias=False), "'attention_bias' must be true"),
    (dict(quantization_config={"quant_method": "mxfp4"}), "has a 'quantization_config'"),
    (dict(rope_parameters={**YARN, "rope_type": "linear"}), "rope type 'linear'"),
    (dict(rope_parameters={**YARN, "attention_factor": 1.1}),
     "'attention_factor' \\(YaRN\\) is not expressible"),
    (dict(rope_parameters={**YARN, "partial_rotary_factor": 0.5}), "'partial_rotary_factor' must be 1"),
    (dict(rope_parameters={**YARN, "original_max_position_embeddings": None}),
     "'original_max_position_embeddings' \\(YaRN\\) must be a positive integer"),
    (dict(layer_types=["sliding_attention", "full_attention"]),
     "'layer_types' must list 3 entries \\(num_hidden_layers\\)"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
     "'layer_types' must list"),
    (dict(sliding_window=None),
     "'sliding_window' must be a positive integer for its 'sliding_attention' layers"),
    (dict(num_experts_per_tok=5), "'num_experts_per_tok' \\(5\\) exceeds num_local_experts \\(4\\)"),
])
def test_gpt_oss_configs_megatron_ext_cannot_express_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(_gpt_oss_dict(**overrides))


def test_qwen2_layer_types_of_another_length_raise():
    with pytest.raises(ValueError, match="'layer_types' must list 4 entries"):
        config_from_hf({"model_type": "qwen2", **LLAMA_SIZES, "use_sliding_window": True, "sliding_window": 4,
                        "layer_types": ["full_attention"] * 3})


# --- examples/train_gpt.py --load-hf / --export-hf ---------------------------------------------------

EXAMPLE = ["--tp", "1", "--pp", "1", "--seq-len", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--dtype", "float64", "--no-progress", "--plot", "", "--steps", "1", "--lr", "0"]


def _example_worker(path: str, export_dir: str, bad: str) -> tuple[list[float], str]:
    """The example's losses at ep 2 from the gpt-oss directory, and its refusal of ``bad`` (a
    layer_types of another length) on this rank."""
    from tests.conftest import load_train_gpt

    train_gpt = load_train_gpt()
    try:
        train_gpt.check_args(train_gpt.parse_args(EXAMPLE + ["--load-hf", bad]), dist.get_world_size())
        refusal = "no error"
    except ValueError as e:
        refusal = str(e)
    args = train_gpt.parse_args(EXAMPLE + ["--ep", "2", "--load-hf", path, "--export-hf", export_dir])
    return train_gpt.train(args)["losses"], refusal


def _transformers_loss(path: str) -> float:
    """transformers' mean loss of the model in ``path`` on the example's first global batch."""
    from tests.conftest import example_first_batches

    batches = example_first_batches(EXAMPLE + ["--load-hf", path, "--dp", "1"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager", attn_implementation="eager").eval()
    losses = [F.cross_entropy(_logits(model, b["tokens"])[0].flatten(0, 1), b["labels"].flatten())
              for b in batches]
    return torch.stack(losses).mean().item()


@pytest.mark.slow  # a 2-rank training from Hugging Face weights
def test_example_loads_and_exports_hf_gpt_oss(tmp_path):
    """train_gpt.py --load-hf of a gpt-oss model at ep 2 (lr 0) starts from transformers' loss and
    --export-hf writes back the same files; a config.json whose layer_types does not list every
    layer is refused with the same error on every rank."""
    from safetensors.torch import load_file

    path, export_dir, bad = (str(tmp_path / name) for name in ("gpt_oss", "export", "bad"))
    _hf_model(vocab_size=256).save_pretrained(path)  # the example's tokens are bytes
    _hf_model(vocab_size=256).save_pretrained(bad)
    with open(os.path.join(bad, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump({**config, "layer_types": config["layer_types"][:2]}, f)
    (first, refusal), (second, other_refusal) = run_distributed(2, _example_worker, path, export_dir, bad)
    assert first == second and refusal == other_refusal
    expected = f"--load-hf {bad!r}: the Hugging Face config's 'layer_types' must list 3 entries"
    assert refusal.startswith(expected), refusal
    hf_loss = _transformers_loss(path)
    assert abs(first[0] - hf_loss) < 1e-9 * hf_loss, (first, hf_loss)
    original, exported = load_file(f"{path}/model.safetensors"), load_file(f"{export_dir}/model.safetensors")
    assert set(original) == set(exported)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
