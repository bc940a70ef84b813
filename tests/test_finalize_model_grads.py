"""finalize_model_grads' reductions besides the data-parallel one, with Megatron-core's helper
signatures: q/k LayerNorm sums and average_gradients_across_tp_domain averages over the
tensor-parallel group, conditional embedders summed over the pipeline (and over a rank's chunks),
a frozen tied embedding left alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.distributed import finalize_model_grads
from megatron_ext.distributed.finalize_model_grads import (
    _allreduce_conditional_embedding_grads,
    _allreduce_layernorm_grads,
    _allreduce_non_tensor_model_parallel_grads,
    _allreduce_word_embedding_grads,
)
from tests.distributed import run_distributed


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_layernorm = torch.nn.LayerNorm(2, dtype=torch.float64)
        self.k_layernorm = torch.nn.LayerNorm(2, dtype=torch.float64)
        self.proj = torch.nn.Linear(2, 2, dtype=torch.float64)
        self.router = torch.nn.Linear(2, 2, bias=False, dtype=torch.float64)
        self.router.weight.average_gradients_across_tp_domain = True


def _set_grads(module: torch.nn.Module, value: float, main_grad: bool = False) -> None:
    for p in module.parameters():
        g = torch.full_like(p, value)
        if main_grad:
            p.main_grad = g
        else:
            p.grad = g


def _worker() -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    out = {}

    # Tensor-parallel group: q/k LayerNorms summed under qk_layernorm, the marked router averaged.
    block = Block()
    _set_grads(block, 1.0 + tp_rank)  # 1 and 2 on the two tensor-parallel ranks
    _allreduce_non_tensor_model_parallel_grads([block], SimpleNamespace(qk_layernorm=True), None)
    out["qk"] = {n: p.grad.flatten()[0].item() for n, p in block.named_parameters()}
    assert _allreduce_layernorm_grads is _allreduce_non_tensor_model_parallel_grads
    # Without qk_layernorm only the marked router is reduced.
    _set_grads(block, 1.0 + tp_rank)
    block.config = SimpleNamespace(qk_layernorm=False, sequence_parallel=False)
    finalize_model_grads([block])  # (the data-parallel group has one rank)
    out["plain"] = {n: p.grad.flatten()[0].item() for n, p in block.named_parameters()}

    # Conditional embedders: parameters marked pipeline_parallel summed over the pipeline and
    # over this rank's two chunks, the others left alone.
    chunks = [torch.nn.Linear(2, 2, dtype=torch.float64) for _ in range(2)]
    for i, chunk in enumerate(chunks):
        chunk.weight.pipeline_parallel = True
        _set_grads(chunk, 10.0 * pp_rank + i, main_grad=True)
    _allreduce_conditional_embedding_grads(chunks, SimpleNamespace(has_cond_embedder=True))
    out["cond"] = [(c.weight.main_grad[0, 0].item(), c.bias.main_grad[0].item()) for c in chunks]
    _allreduce_conditional_embedding_grads(chunks, SimpleNamespace(has_cond_embedder=False))  # nothing
    assert [(c.weight.main_grad[0, 0].item(), c.bias.main_grad[0].item()) for c in chunks] == out["cond"]

    # A frozen tied embedding has no gradient: nothing to reduce (Megatron-core's signature).
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(4, 2)
            self.embedding.weight.shared_embedding = True
            self.embedding.weight.requires_grad_(False)

        def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
            return self.embedding.weight

    tied = Tied()
    _allreduce_word_embedding_grads(
        [tied], None, ps.get_embedding_group(), ps.get_pipeline_model_parallel_group()
    )
    out["frozen"] = tied.embedding.weight.grad is None
    out["rank"] = (tp_rank, pp_rank, dist.get_rank())
    return out


@pytest.mark.slow
def test_tensor_parallel_pipeline_and_frozen_reductions():
    for out in run_distributed(4, _worker):
        tp_rank, pp_rank, _ = out["rank"]
        own = 1.0 + tp_rank
        assert out["qk"] == {
            "q_layernorm.weight": 3.0,
            "q_layernorm.bias": 3.0,
            "k_layernorm.weight": 3.0,
            "k_layernorm.bias": 3.0,
            "proj.weight": own,
            "proj.bias": own,
            "router.weight": 1.5,
        }
        assert out["plain"] == {
            "q_layernorm.weight": own,
            "q_layernorm.bias": own,
            "k_layernorm.weight": own,
            "k_layernorm.bias": own,
            "proj.weight": own,
            "proj.bias": own,
            "router.weight": 1.5,
        }
        # (0 + 1) on stage 0 plus (10 + 11) on stage 1, on every chunk; biases keep their own.
        assert out["cond"] == [(22.0, 10.0 * pp_rank), (22.0, 10.0 * pp_rank + 1)]
        assert out["frozen"]
