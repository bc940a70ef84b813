"""``attention_output_gate`` (Megatron-core's gated attention, Qwen3-Next's full-attention layers): each
query group's block of the fused projection is ``[q, gate, k, v]`` and every head's output is scaled by
``sigmoid(gate)`` before the output projection. The layer equals a float64 reference written here from
that definition at tp 1 and tp 2, with more query groups than ranks and fewer (the groups replicated);
without the flag the projection has no gate rows."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.attention import ParallelAttention
from tests.distributed import run_distributed

HIDDEN, HEADS, D, SEQ, BATCH = 16, 4, 4, 6, 2


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reference(x: torch.Tensor, qkv_w: torch.Tensor, dense_w: torch.Tensor, groups: int) -> torch.Tensor:
    per = HEADS // groups
    blocks = torch.split(x @ qkv_w.T, (2 * per + 2) * D, dim=-1)  # one per group
    outs = []
    for block in blocks:
        q, gate, k, v = torch.split(block, [per * D, per * D, D, D], dim=-1)
        for h in range(per):
            qh, gh = q[..., h * D : (h + 1) * D], gate[..., h * D : (h + 1) * D]  # [s, b, D]
            scores = torch.einsum("sbd,tbd->bst", qh, k) / D**0.5
            causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
            probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
            outs.append(torch.einsum("bst,tbd->sbd", probs, v) * torch.sigmoid(gh))
    return torch.cat(outs, dim=-1) @ dense_w.T


def _worker(tp: int, groups: int, gated: bool) -> tuple:
    ps.initialize_model_parallel(tp)
    torch.manual_seed(2)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        kv_channels=D,
        num_query_groups=groups,
        tensor_model_parallel_size=tp,
        attention_output_gate=gated,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
        attention_dropout=0.0,
    )
    layer = ParallelAttention(config)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out, bias = layer(x)
    if bias is not None:
        out = out + bias
    qkv_w = _gather(layer.query_key_value.weight.detach(), 0)
    dense_w = _gather(layer.dense.weight.detach(), 1)
    ps.destroy_model_parallel()
    return out.tolist(), qkv_w.tolist(), dense_w.tolist()


def test_gated_attention_equals_the_reference():
    for tp, groups in ((1, 2), (2, 2), (2, 1)):
        for out, qkv_w, dense_w in run_distributed(tp, _worker, tp, groups, True):
            qkv_w, dense_w = (torch.tensor(w, dtype=torch.float64) for w in (qkv_w, dense_w))
            assert qkv_w.shape == ((2 * HEADS + 2 * groups) * D, HIDDEN), (tp, groups, qkv_w.shape)
            x = torch.randn(
                SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4), dtype=torch.float64
            )
            torch.testing.assert_close(
                torch.tensor(out, dtype=torch.float64),
                reference(x, qkv_w, dense_w, groups),
                rtol=1e-10,
                atol=1e-12,
                msg=lambda m: f"tp {tp}, groups {groups}: {m}",
            )
    ((_, plain, _),) = run_distributed(1, _worker, 1, 2, False)
    assert torch.tensor(plain).shape == ((HEADS + 2 * 2) * D, HIDDEN)
