"""Llama-family layers: RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, no biases and
an untied output layer. Every tensor-parallel split (key/value groups split or, with tp > groups,
replicated) gives the serial model's logits, losses and gradients in float64, and the example
trains ``--arch llama`` to the serial losses in every layout, resharding its checkpoints."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.distributed import finalize_model_grads
from megatron_ext.models import GPTModel
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.rotary import RotaryEmbedding, apply_rotary_pos_emb
from tests.conftest import assert_losses_match, checkpoint_run, train_layouts
from tests.distributed import run_distributed

VOCAB, SEQ, BATCH = 64, 12, 2
LLAMA = ["--arch", "llama", "--num-query-groups", "2"]


def _llama(tp: int, groups: int = 2, **overrides) -> GPTModel:
    kwargs = dict(
        tensor_model_parallel_size=tp,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=groups,
        ffn_hidden_size=48,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
    )
    model_kwargs = {k: overrides.pop(k) for k in ("rotary_percent", "rotary_base") if k in overrides}
    kwargs.update(overrides)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    return GPTModel(TransformerConfig(**kwargs), vocab_size=VOCAB, max_sequence_length=SEQ, init_seed=5,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope", **model_kwargs)


# The fused kernels: RMSNorm, rotary embedding, SwiGLU.
FUSED = {"persist_layer_norm": True, "apply_rope_fusion": True, "bias_activation_fusion": True}


def _shard(full: torch.Tensor, param: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of a serial tensor, as the parameter's partition attributes deal it."""
    if full.shape == param.shape:
        return full
    dim, stride = param.partition_dim % full.dim(), param.partition_stride
    return torch.cat(full.chunk(tp * stride, dim)[rank::tp], dim)


def _split_worker(cases) -> list[float]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tp = torch.distributed.get_world_size()
    losses = []
    for groups, overrides in cases:
        serial_overrides = {k: v for k, v in overrides.items() if k != "sequence_parallel"}
        ps.initialize_model_parallel(1)
        serial = _llama(1, groups, **serial_overrides)
        ref_logits = serial(tokens, None)
        ref_loss = serial(tokens, None, labels=labels)
        ref_loss.sum().backward()
        ref_grads = {n: p.grad for n, p in serial.named_parameters()}
        ps.destroy_model_parallel()

        ps.initialize_model_parallel(tp)
        rank = ps.get_tensor_model_parallel_rank()
        model = _llama(tp, groups, **overrides)
        assert_close(model(tokens, None), ref_logits.chunk(tp, -1)[rank], rtol=1e-10, atol=1e-12)
        loss = model(tokens, None, labels=labels)
        assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        loss.sum().backward()
        finalize_model_grads([model])
        assert set(ref_grads) == {n for n, _ in model.named_parameters()}
        for name, param in model.named_parameters():
            expected = _shard(ref_grads[name], param, rank, tp)
            assert_close(
                param.grad, expected, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{groups} {n}: {m}"
            )
        losses.append(loss.sum().item())
        ps.destroy_model_parallel()
    return losses


@pytest.mark.parametrize(
    "world,cases",
    [
        # groups == tp, groups > tp, and query/key normalisation, interleaved partial rotary, QKV bias
        (2, [(2, {}), (4, {"qk_layernorm": True}), (2, FUSED),
             (2, {"rotary_interleaved": True, "rotary_percent": 0.5, "add_qkv_bias": True})]),
        # tp > groups: each group's key and value serve two or four ranks; sequence parallelism
        (4, [(2, {}), (1, {"sequence_parallel": True, "qk_layernorm": True})]),
    ],
)
@pytest.mark.slow
def test_tensor_parallel_llama_equals_serial(world, cases):
    results = run_distributed(world, _split_worker, cases)
    assert all(r == results[0] for r in results)  # every rank computed the same global loss


def _fused_worker() -> list[float]:
    """The largest relative differences between the fused and the unfused model: logits, loss and
    each gradient, in float64."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ps.initialize_model_parallel(1)
    out = []
    for overrides in ({}, FUSED, {**FUSED, "rotary_interleaved": True, "rotary_percent": 0.5}):
        model = _llama(1, 2, **overrides)
        logits = model(tokens, None)
        model(tokens, None, labels=labels).sum().backward()
        out.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    ps.destroy_model_parallel()
    (ref_logits, ref_grads), (logits, grads), _ = out

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    errors = [rel(logits, ref_logits)] + [rel(grads[n], ref_grads[n]) for n in ref_grads]
    assert out[2][0].shape == ref_logits.shape
    return errors


def test_fused_kernels_equal_the_unfused_layers():
    # persist_layer_norm (RMSNorm), apply_rope_fusion and bias_activation_fusion (SwiGLU) pick the
    # fused kernels: the same model to float64 rounding.
    (errors,) = run_distributed(1, _fused_worker)
    assert max(errors) < 1e-13, errors


def test_rotary_embedding_is_a_rotation_of_channel_pairs():
    # Position p rotates channel pair i by p * base^(-2i / dim): (x + i y) e^{i theta} written out,
    # for the half-split pairing (j, j + dim / 2) and the interleaved one (2i, 2i + 1), with the
    # channels past dim passing through (angles in float64 here, float32 in the module).
    s, b, n, d, dim, base = 7, 2, 3, 8, 6, 500
    t = torch.randn(s, b, n, d, dtype=torch.float64)
    for interleaved in (False, True):
        rope = RotaryEmbedding(d, dim / d, rotary_interleaved=interleaved, rotary_base=base)
        freqs = rope(s)
        assert freqs.shape == (s, 1, 1, dim) and freqs.dtype == torch.float32
        config = TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=1, rotary_interleaved=interleaved
        )
        got = apply_rotary_pos_emb(t, freqs, config)
        expected = t.clone()
        for i in range(dim // 2):
            theta = torch.tensor([p * base ** (-2 * i / dim) for p in range(s)], dtype=torch.float64)
            cos, sin = theta.cos()[:, None, None], theta.sin()[:, None, None]
            a, c = (2 * i, 2 * i + 1) if interleaved else (i, i + dim // 2)
            expected[..., a] = t[..., a] * cos - t[..., c] * sin
            expected[..., c] = t[..., c] * cos + t[..., a] * sin
        assert_close(got, expected, rtol=0, atol=1e-6)  # the angles are float32
    with pytest.raises(ValueError, match="rotary_percent must be in"):
        RotaryEmbedding(8, 1.5)
    with pytest.raises(ValueError, match="3 rotated channels"):
        RotaryEmbedding(6, 0.5)


@pytest.mark.parametrize(
    "overrides,error,message",
    [
        (dict(num_query_groups=3), ValueError, r"num_query_groups \(3\) must be a positive divisor"),
        (
            dict(num_query_groups=2, tensor_model_parallel_size=3, num_attention_heads=6),
            ValueError,
            r"num_query_groups \(2\) must be a multiple or a divisor of tensor_model_parallel_size \(3\)",
        ),
        (dict(normalization="LayerNorm2"), ValueError, r"normalization='LayerNorm2' is not one of"),
        (dict(activation_func="silu"), ValueError, "activation_func must be callable"),
        (dict(glu_linear_offset=1.0), ValueError,
         r"glu_linear_offset \(1.0\) and activation_func_clamp_value \(None\) shape the gated linear unit"),
        (dict(gated_linear_unit=True, activation_func_clamp_value=0.0), ValueError,
         r"activation_func_clamp_value must be a positive finite number or None, got 0.0"),
        (dict(gated_linear_unit=True, activation_func_clamp_value=float("inf")), ValueError,
         r"activation_func_clamp_value must be a positive finite number or None, got inf"),
        (dict(gated_linear_unit=True, glu_linear_offset=float("nan")), ValueError,
         r"glu_linear_offset must be a finite number, got nan"),
        (dict(persist_layer_norm=True), NotImplementedError, "there is no fused LayerNorm"),
    ],
)
def test_bad_llama_configs_are_refused(overrides, error, message):
    kwargs = dict(num_layers=1, hidden_size=12, num_attention_heads=4)
    kwargs.update(overrides)
    with pytest.raises(error, match=message):
        TransformerConfig(**kwargs)


def _position_embedding_worker() -> dict:
    ps.initialize_model_parallel(1)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    with pytest.raises(ValueError, match="position_embedding_type='alibi' is not one of"):
        GPTModel(config, vocab_size=16, max_sequence_length=4, position_embedding_type="alibi")
    none = GPTModel(config, vocab_size=16, max_sequence_length=4, position_embedding_type="none")
    tokens = torch.randint(0, 16, (2, 4))
    got = {
        "none_has_position_embeddings": none.embedding.position_embeddings is not None,
        "none_has_rotary": hasattr(none, "rotary_pos_emb"),
        "none_logits_shape": tuple(none(tokens, None).shape),
    }
    learned = GPTModel(config, vocab_size=16, max_sequence_length=4)
    with pytest.raises(ValueError, match="position_ids are needed"):
        learned(tokens, None)
    ps.destroy_model_parallel()
    return got


def test_gpt_model_position_embedding_choices():
    (got,) = run_distributed(1, _position_embedding_worker)
    assert got == {"none_has_position_embeddings": False, "none_has_rotary": False,
                   "none_logits_shape": (2, 4, 16)}


# --- training with examples/train_gpt.py --arch llama -----------------------------------------------


@pytest.fixture(scope="module")
def serial_llama_losses():
    (ref,) = run_distributed(1, train_layouts, [(1, 1, 1)], ["float64"], ["1f1b"], LLAMA)
    losses = ref[(1, 1, 1, "float64", "1f1b")]
    assert len(losses) == 5 and losses[-1] < losses[0] and math.isfinite(losses[-1])  # it trains
    return ref


@pytest.mark.parametrize(
    "layouts,schedules,extra",
    [
        ([(2, 2, 1), (2, 1, 2), (4, 1, 1)], ["1f1b"], []),
        ([(2, 2, 1)], ["1f1b", "gpipe", "zb-h1", "zb-v"],
         ["--sequence-parallel", "--use-distributed-optimizer", "--recompute"]),
        ([(1, 2, 2)], ["1f1b"], ["--virtual-pipeline", "2"]),
    ],
)
@pytest.mark.slow  # trains the example Llama
def test_llama_layouts_match_serial(serial_llama_losses, layouts, schedules, extra):
    results = run_distributed(4, train_layouts, layouts, ["float64"], schedules, LLAMA + extra)
    assert all(r == results[0] for r in results)
    assert_losses_match(serial_llama_losses, results[0])


def _resume_worker(save_dir: str):
    full = checkpoint_run((2, 2, 1), *LLAMA, "--save", save_dir, "--save-interval", "2")
    ckpt = os.path.join(save_dir, "iter_0000002")
    layouts = [(1, 4, 1), (4, 1, 1), (1, 2, 2)]
    resumed = {layout: checkpoint_run(layout, *LLAMA, "--load", ckpt) for layout in layouts}
    return full["losses"], {k: (v["start_step"], v["losses"]) for k, v in resumed.items()}


@pytest.mark.slow  # trains the example Llama
def test_llama_checkpoint_resumes_at_other_layouts(tmp_path):
    results = run_distributed(4, _resume_worker, str(tmp_path / "run"))
    full, resumed = results[0]
    for start, losses in resumed.values():
        assert start == 2
        assert_close(torch.tensor(losses), torch.tensor(full[2:]), rtol=1e-9, atol=0)
