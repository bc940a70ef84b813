"""GPTModel with ``fused_output_cross_entropy`` against the same model without it: losses and
every parameter's gradient equal in float64, at TP 1 and 2, with sequence parallelism, with an
untied output layer, for a mean loss and a loss-masked one."""

from __future__ import annotations

import pytest
import torch

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel
from megatron_ext.models import GPTModel
from megatron_ext.transformer import TransformerConfig
from tests.conftest import TIGHT, Comparisons, assert_comparisons
from tests.distributed import run_distributed

VOCAB, SEQ, BATCH, SEED = 64, 8, 3, 7


def _model(tp: int, fused: bool, sequence_parallel: bool, **kwargs) -> GPTModel:
    config = TransformerConfig(
        tensor_model_parallel_size=tp,
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float64,
        pipeline_dtype=torch.float64,
        use_cpu_initialization=True,
        sequence_parallel=sequence_parallel,
        fused_output_cross_entropy=fused,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, init_seed=SEED, **kwargs)


def _graph_names(t: torch.Tensor) -> set[str]:
    seen, stack = set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None and fn.name() not in seen:
            seen.add(fn.name())
            stack.extend(f for f, _ in fn.next_functions)
    return seen


def _loss_and_grads(model: GPTModel, masked: bool):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.3).double() if masked else torch.ones(BATCH, SEQ).double()
    losses = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), labels=labels)
    fused = any("LinearCrossEntropy" in name for name in _graph_names(losses))
    assert fused == model.config.fused_output_cross_entropy
    ((losses * mask).sum() / mask.sum()).backward()
    return losses.detach(), {name: p.grad for name, p in model.named_parameters()}


def _worker() -> list[tuple]:
    """Fused against unfused output layer + loss (recorded comparisons, made in the test)."""
    compared = Comparisons()
    for tp, sequence_parallel in ((1, False), (2, False), (2, True)):
        ps.initialize_model_parallel(tp)
        for tied in (True, False):
            for masked in (False, True):
                ref_loss, ref_grads = _loss_and_grads(
                    _model(tp, False, sequence_parallel, share_embeddings_and_output_weights=tied), masked)
                fused = _model(tp, True, sequence_parallel, share_embeddings_and_output_weights=tied)
                loss, grads = _loss_and_grads(fused, masked)
                where = f"tp={tp} sp={sequence_parallel} tied={tied} masked={masked}"
                compared.close(loss, ref_loss, **TIGHT, label=where)
                assert grads.keys() == ref_grads.keys()
                for name, grad in grads.items():
                    assert grad is not None, f"{where}: {name} has no gradient"
                    compared.close(grad, ref_grads[name], **TIGHT, label=f"{where} {name}")
        ps.destroy_model_parallel()
    return compared.made


@pytest.mark.slow
def test_fused_output_cross_entropy_equals_unfused():
    results = run_distributed(2, _worker)
    for made in results:
        assert_comparisons(made)
    assert len({len(made) for made in results}) == 1
