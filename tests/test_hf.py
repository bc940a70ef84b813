"""Hugging Face weights in and out: a small randomly initialised ``transformers.LlamaForCausalLM``
loaded into megatron_ext at tp 1, tp 2 and tp 2 x pp 2 gives transformers' logits in float64, and
the export gives back its state dict exactly; so do Qwen2, Qwen3 and Mistral (a sliding window
shorter than the sequence among them, on every layer and on Qwen2's layers from
max_window_layers). Needs ``transformers`` (installed by CI)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.models import GPTModel
from megatron_ext.models.hf import config_from_hf, export_hf_state_dict, hf_config_dict, load_hf_state_dict
from tests.distributed import run_distributed

pytestmark = pytest.mark.slow  # end-to-end runs from Hugging Face weights

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 2, 10


def _hf_config(model_type: str = "llama", **overrides):
    kwargs = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    kwargs.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def _hf_model(config, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float64
    )
    with torch.no_grad():  # the norms start at ones: make them tell the layers apart
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _rms_norm_in_input_dtype(self, hidden_states):
    """transformers' RMSNorm rounds to float32 whatever the input dtype; in float64 this one does not."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _reference(config, tokens, float64_norm: bool):
    model = _hf_model(config)
    norm_class = type(model.model.norm)
    saved = norm_class.forward
    if float64_norm:
        norm_class.forward = _rms_norm_in_input_dtype
    try:
        with torch.no_grad():
            logits = model(tokens).logits
    finally:
        norm_class.forward = saved
    return model.state_dict(), logits


def _load_worker(cases) -> list[dict]:
    return [_load_and_compare(hf_kwargs, layouts, float64_norm) for hf_kwargs, layouts, float64_norm in cases]


def _load_and_compare(hf_kwargs, layouts, float64_norm=True) -> dict:
    """For each (tp, pp, vp) layout that fits this world: loads transformers' weights, checks that
    the export gives them back exactly, and returns the logits' largest difference from
    transformers' relative to their largest magnitude (on the last stage's ranks)."""
    config = _hf_config(**hf_kwargs)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    hf_state, hf_logits = _reference(config, tokens, float64_norm)
    out = {}
    for tp, pp, vp in layouts:
        if tp * pp != dist.get_world_size():
            continue
        ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        mconfig, kwargs = config_from_hf(
            config, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp, params_dtype=torch.float64, use_cpu_initialization=True,
        )
        chunks = [GPTModel(mconfig, parallel_output=False, vp_stage=v, **kwargs).eval()
                  for v in ([None] if vp is None else range(vp))]
        load_hf_state_dict(chunks if vp else chunks[0], hf_state)
        exported = export_hf_state_dict(chunks if vp else chunks[0])
        assert list(exported) == list(hf_state)
        for name, tensor in hf_state.items():
            assert torch.equal(exported[name], tensor), name
        logits = _forward(chunks, tokens)
        if logits is not None:  # the largest difference relative to the largest logit
            out[(tp, pp, vp)] = ((logits - hf_logits).abs().max() / hf_logits.abs().max()).item()
        ps.destroy_model_parallel()
    return out


def _forward(chunks, tokens):
    """The logits of a model split over pipeline stages, passed stage to stage by hand; None on
    ranks that do not hold the last stage."""
    hidden = None
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    with torch.no_grad():
        for stage in range(pp * len(chunks)):
            owner, chunk = stage % pp, stage // pp
            if owner == rank:
                model = chunks[chunk]
                if stage > 0:
                    model.set_input_tensor(hidden)
                hidden = model(tokens if stage == 0 else None, None)
            if stage < pp * len(chunks) - 1:
                if hidden is None or owner != rank:
                    shape = (SEQ, BATCH, chunks[0].config.hidden_size)
                    hidden = torch.empty(shape, dtype=torch.float64)
                dist.broadcast(hidden, src=ranks[owner], group=group)
    return hidden if rank == pp - 1 else None


LAYOUTS = [(1, 1, None), (2, 1, None), (2, 2, None), (1, 2, 2)]
VARIANTS = [
    # tied embeddings (the last stage's copy loads the embedding) with biases on every linear
    dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    dict(model_type="qwen2"),  # biases on the query/key/value projections only
    dict(model_type="qwen3", head_dim=12),  # query/key norms, heads wider than hidden / heads
    dict(model_type="mistral", sliding_window=16),
    # A window shorter than the sequence: transformers' mask (query i sees keys i - 4 < j <= i) as
    # megatron_ext's window_size=(3, 0).
    dict(model_type="mistral", sliding_window=4),
    # Qwen2's window on the layers from max_window_layers on only (window_attn_skip_freq [0, 0, 1, 1])
    dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2),
]


def _compared(results) -> dict:
    """Every rank's differences merged: case index -> layout -> difference."""
    merged: dict = {}
    for rank_result in results:
        for case, out in enumerate(rank_result):
            merged.setdefault(case, {}).update(out)
    return merged


@pytest.mark.parametrize("world", [1, 2, 4])
def test_hf_weights_give_transformers_logits(world):
    fits = [lay for lay in LAYOUTS if lay[0] * lay[1] == world]
    cases = [({}, LAYOUTS, True)] + [(variant, fits[:1], True) for variant in VARIANTS]
    if world == 1:
        # transformers' RMSNorm rounds to float32 whatever the input dtype: with it the logits
        # differ by float32 rounding only, the mapping being right and the precision transformers'.
        cases.append(({}, LAYOUTS, False))
    compared = _compared(run_distributed(world, _load_worker, cases))
    for case, (hf_kwargs, _, float64_norm) in enumerate(cases):
        assert set(compared[case]) == set(fits if case == 0 or not float64_norm else fits[:1]), (
            case,
            compared,
        )
        for layout, err in compared[case].items():
            if float64_norm:
                assert err < 1e-9, (hf_kwargs, layout, err)
            else:
                assert 1e-9 < err < 1e-5, (layout, err)


def _window_export_worker() -> list:
    ps.initialize_model_parallel()
    config, kwargs = config_from_hf(_hf_config("mistral", sliding_window=4), use_cpu_initialization=True)
    exported = hf_config_dict(GPTModel(config, **kwargs))
    refusals = []
    for overrides in (dict(window_attn_skip_freq=2), dict(softmax_type="learnable")):
        other, kwargs = config_from_hf(_hf_config("mistral", sliding_window=4), use_cpu_initialization=True,
                                       **overrides)
        try:
            hf_config_dict(GPTModel(other, **kwargs))
        except ValueError as e:
            refusals.append(str(e))
    ps.destroy_model_parallel()
    return [config.window_size, kwargs["max_sequence_length"], exported, refusals]


def test_mistral_sliding_window_is_the_window_size():
    """transformers' ``sliding_window`` W counts the query itself: Megatron-core's ``(W - 1, 0)``;
    a model with a window on every layer is exported as Mistral with W; windows on some layers and
    sinks have no Hugging Face config here."""
    ((window_size, max_length, exported, refusals),) = run_distributed(1, _window_export_worker)
    assert window_size == (3, 0) and max_length == 32
    assert exported["model_type"] == "mistral" and exported["sliding_window"] == 4
    assert exported["architectures"] == ["MistralForCausalLM"]
    assert "window_attn_skip_freq=2 (expected None)" in refusals[0], refusals
    assert "softmax_type='learnable' (expected 'vanilla')" in refusals[1], refusals


def _directory_worker(path: str) -> list[str]:
    config = _hf_config()
    hf_state = _hf_model(config).state_dict()
    ps.initialize_model_parallel(1, 2)
    mconfig, kwargs = config_from_hf(config, pipeline_model_parallel_size=2, params_dtype=torch.float64,
                                     use_cpu_initialization=True)
    model = GPTModel(mconfig, **kwargs)
    load_hf_state_dict(model, path)  # sharded safetensors with their index, read lazily
    exported = export_hf_state_dict(model)
    assert list(exported) == list(hf_state) and all(torch.equal(exported[k], v) for k, v in hf_state.items())
    errors = []
    missing = {k: v for k, v in hf_state.items() if k != "model.layers.3.mlp.up_proj.weight"}
    extra = dict(hf_state, **{"model.layers.0.self_attn.o_proj.bias": torch.zeros(32, dtype=torch.float64)})
    for bad in (missing, extra, path + "/nothing"):
        with pytest.raises(ValueError) as info:
            load_hf_state_dict(model, bad)
        errors.append(str(info.value))
    ps.destroy_model_parallel()
    return errors


def test_safetensors_directory_and_refusals(tmp_path):
    # Every rank raises the same error, naming the rank that found it and the tensor.
    _hf_model(_hf_config()).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (
        len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    )
    first, second = run_distributed(2, _directory_worker, str(tmp_path))
    assert first == second
    missing, extra, nothing = first
    assert missing == ("load_hf_state_dict: rank 1: the Hugging Face state dict has no "
                       "'model.layers.3.mlp.up_proj.weight' (for decoder.layers.1.mlp.dense_h_to_4h.weight)")
    assert (
        "rank 0: tensors the model has no place for, e.g. ['model.layers.0.self_attn.o_proj.bias']" in extra
    )
    assert "nothing': no such file or directory of safetensors files" in nothing


# --- examples/train_gpt.py --export-hf / --load-hf --------------------------------------------------

TINY = ["--arch", "llama", "--num-query-groups", "2", "--layers", "4", "--hidden", "32", "--heads", "4",
        "--seq-len", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--dtype", "float64",
        "--no-progress", "--plot", ""]


def _example_worker(export_dir: str) -> dict:
    from tests.conftest import load_train_gpt

    train_gpt = load_train_gpt()

    def run(*argv):
        return train_gpt.train(train_gpt.parse_args(TINY + list(argv)))["losses"]

    trained = run("--tp", "2", "--pp", "2", "--steps", "2", "--export-hf", export_dir)
    # The exported weights, trained two steps, evaluated on step 1's batch (lr 0: no update).
    loaded = {
        layout: run(
            "--tp", layout[0], "--pp", layout[1], "--steps", "1", "--lr", "0", "--load-hf", export_dir
        )
        for layout in (("1", "2"), ("4", "1"))
    }
    return {"trained": trained, "loaded": loaded}


def _transformers_loss_worker(export_dir: str) -> float:
    """transformers' mean loss of the exported model on the example's first global batch."""
    from tests.conftest import load_train_gpt

    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(TINY + ["--tp", "1", "--pp", "1", "--dp", "1"])
    ps.initialize_model_parallel(1)
    batches = train_gpt.step_microbatches(train_gpt.load_corpus(None, args.seq_len + 2), 0, args)
    ps.destroy_model_parallel()
    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float64).eval()
    type(model.model.norm).forward = _rms_norm_in_input_dtype
    with torch.no_grad():
        losses = [
            torch.nn.functional.cross_entropy(model(b["tokens"]).logits.flatten(0, 1), b["labels"].flatten())
            for b in batches
        ]
    return torch.stack(losses).mean().item()


def test_example_exports_and_loads_hf_weights(tmp_path):
    export_dir = str(tmp_path / "hf")
    results = run_distributed(4, _example_worker, export_dir)
    assert all(r == results[0] for r in results)
    trained, loaded = results[0]["trained"], results[0]["loaded"]
    with open(os.path.join(export_dir, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] is False and config["intermediate_size"] == 96
    (hf_loss,) = run_distributed(1, _transformers_loss_worker, export_dir)
    for layout, losses in loaded.items():
        assert abs(losses[0] - hf_loss) < 1e-9 * hf_loss, (layout, losses, hf_loss)
    assert abs(trained[0] - hf_loss) > 1e-3  # the exported weights are the trained ones, not the initial ones
