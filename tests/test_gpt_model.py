"""GPTModel and the gradient finalisation: parallel logits and losses equal the serial model's,
the tied embedding stays tied across pipeline stages, bad token ids are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.distributed import finalize_model_grads
from megatron_ext.models import GPTModel
from megatron_ext.transformer import TransformerConfig
from tests.conftest import TIGHT, Comparisons, assert_comparisons, float64
from tests.distributed import run_distributed

VOCAB, SEQ, BATCH, SEED = 64, 8, 3, 7


def _model(tp: int, pp: int = 1, **kwargs) -> GPTModel:
    config = TransformerConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, num_layers=2, hidden_size=16,
        num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64,
        pipeline_dtype=torch.float64, use_cpu_initialization=True,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, init_seed=SEED, **kwargs)


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ), labels


class _Wrapper(torch.nn.Module):
    """Stands for DistributedDataParallel: it keeps the model as ``.module``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def _tensor_parallel_worker() -> list[tuple]:
    """The GPT at TP 2 against the serial one (recorded comparisons, made in the test)."""
    compared = Comparisons()
    tokens, positions, labels = _batch()
    ps.initialize_model_parallel(1)
    serial = _model(1)
    ref_logits = serial(tokens, positions)
    ref_loss = serial(tokens, positions, labels=labels)
    ref_loss.sum().backward()
    ref_grad = serial.embedding.word_embeddings.weight.grad
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(2)
    r = ps.get_tensor_model_parallel_rank()
    for parallel_output in (True, False):
        model = _model(2, parallel_output=parallel_output)
        logits = model(tokens, positions)
        expected = ref_logits.chunk(2, -1)[r] if parallel_output else ref_logits
        compared.close(logits, expected, **TIGHT, label=f"logits, parallel_output={parallel_output}")
        loss = model(tokens, positions, labels=labels)  # vocab-parallel whatever parallel_output says
        compared.close(loss, ref_loss, **TIGHT, label=f"loss, parallel_output={parallel_output}")
        loss.sum().backward()
        compared.close(model.embedding.word_embeddings.weight.grad, ref_grad.chunk(2, 0)[r], **TIGHT,
                       label=f"embedding gradient, parallel_output={parallel_output}")

    for bad in (VOCAB, -1):
        ids = tokens.clone()
        ids[1, 2] = bad
        with pytest.raises(ValueError, match=rf"token id {bad} is outside \[0, {VOCAB}\)"):
            model(ids, positions)
    ps.destroy_model_parallel()
    return compared.made


def _tied_embedding_worker() -> dict:
    ps.initialize_model_parallel(1, 2)
    first = ps.is_pipeline_first_stage()
    model = _model(1, 2)
    weight = model.shared_embedding_or_output_weight()
    gathered = [torch.empty_like(weight) for _ in range(2)]
    dist.all_gather(gathered, weight.detach())
    # Each stage's own gradient; after finalisation both hold their sum, found through a wrapper.
    weight.grad = torch.full_like(weight, 1.0 if first else 2.0)
    finalize_model_grads([_Wrapper(model)])
    got = {"first_stage": first, "gathered": [g.tolist() for g in gathered], "grad": weight.grad.tolist()}
    ps.destroy_model_parallel()
    return got


@pytest.mark.slow
def test_tensor_parallel_gpt_equals_serial():
    results = run_distributed(2, _tensor_parallel_worker)
    for made in results:
        assert len(made) == 6
        assert_comparisons(made)


def test_tied_embedding_across_stages():
    results = run_distributed(2, _tied_embedding_worker)
    assert [got["first_stage"] for got in results] == [True, False]
    for got in results:
        first, last = got["gathered"]
        assert_close(float64(first), float64(last), rtol=0, atol=0)  # the last stage's copy starts equal
        grad = float64(got["grad"])
        assert_close(grad, torch.full_like(grad, 3.0), rtol=0, atol=0)  # the two stages' sum


def _attention_worker() -> None:
    """SDPA (the default backend) equals the unfused attention in float64, with and without a
    padding mask, forward and backward; with dropout, recomputation replays SDPA's draws."""
    from megatron_ext.transformer.attention import ParallelAttention

    ps.initialize_model_parallel(2)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SEQ, BATCH, 16, dtype=torch.float64, generator=g)
    padding = torch.zeros(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    padding[0, :, :, SEQ - 2:] = True  # the last two keys of the first sequence are padding
    results = {}
    for backend in ("auto", "unfused"):
        config = TransformerConfig(
            tensor_model_parallel_size=2, num_layers=1, hidden_size=16, num_attention_heads=4,
            attention_dropout=0.0, params_dtype=torch.float64, use_cpu_initialization=True,
            attention_backend=backend)
        torch.manual_seed(SEED)
        layer = ParallelAttention(config)
        assert layer.unfused == (backend == "unfused")
        for mask in (None, padding):
            inp = x.clone().requires_grad_()
            out, bias = layer(inp, mask)
            out.backward(torch.cos(out.detach()))
            weight_grad = layer.query_key_value.weight.grad.clone()
            layer.zero_grad()
            results[(backend, mask is None)] = (out.detach(), inp.grad, weight_grad)
    for no_mask in (True, False):
        for fused, unfused in zip(results[("auto", no_mask)], results[("unfused", no_mask)]):
            assert_close(fused, unfused, **TIGHT)
    assert not torch.allclose(results[("auto", True)][0], results[("auto", False)][0])
    # Dropout inside SDPA draws from the tracker's stream: the same stream, the same output.
    config = TransformerConfig(
        tensor_model_parallel_size=2, num_layers=1, hidden_size=16, num_attention_heads=4,
        attention_dropout=0.5, params_dtype=torch.float64, use_cpu_initialization=True)
    layer = ParallelAttention(config)
    outs = []
    for _ in range(2):
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        outs.append(layer(x)[0])
    assert_close(outs[0], outs[1], rtol=0, atol=0)
    layer.eval()
    assert not torch.allclose(layer(x)[0], outs[0])  # the training output was dropped out
    ps.destroy_model_parallel()


def test_sdpa_attention_equals_unfused():
    run_distributed(2, _attention_worker)
