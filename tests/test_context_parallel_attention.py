"""context_parallel_attention at cp 2 and 4 (every comm type, causal and not, MHA and GQA) against
full-sequence attention computed unfused: outputs and query/key/value gradients in float64; the
op's fake kernels (opcheck) and its errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.context_parallel import (
    CP_COMM_TYPES,
    ContextParallelDotProductAttention,
    context_parallel_attention,
    get_pos_emb_on_this_cp_rank,
)
from tests.conftest import TIGHT, Comparisons, assert_comparisons, assert_opchecks_passed, opcheck_report
from tests.distributed import run_distributed

CHUNK = 3  # tokens per chunk; the sequence is 2 * cp chunks
HEAD_DIM = 8
# (query heads, key/value groups): MHA and GQA, both divisible by cp = 4 for a2a; and GQA with fewer
# groups than ranks, for the comm types that do not split heads.
HEADS = [(4, 4), (8, 4), (4, 2)]


def _reference(q, k, v, causal: bool, grad):
    """Unfused attention over the whole sequence and its gradients; keys/values in groups."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    repeats = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1)
    scores = q @ kx.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ vx
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _local(t: torch.Tensor, cp: int, rank: int, dim: int = 2) -> torch.Tensor:
    chunks = t.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def _check_group(cmp: Comparisons, group: dist.ProcessGroup, seed: int) -> None:
    cp, rank = group.size(), group.rank()
    g = torch.Generator().manual_seed(seed)
    for heads, groups in HEADS:
        q, grad = (
            torch.randn(2, heads, 2 * cp * CHUNK, HEAD_DIM, generator=g, dtype=torch.float64)
            for _ in range(2)
        )
        k, v = (
            torch.randn(2, groups, 2 * cp * CHUNK, HEAD_DIM, generator=g, dtype=torch.float64)
            for _ in range(2)
        )
        for causal in (True, False):
            expected = [_local(t, cp, rank) for t in _reference(q, k, v, causal, grad)]
            for comm in CP_COMM_TYPES:
                if comm == "a2a" and groups % cp:
                    continue
                lq, lk, lv = (_local(t, cp, rank).requires_grad_(True) for t in (q, k, v))
                out = context_parallel_attention(lq, lk, lv, group, causal, comm)
                out.backward(_local(grad, cp, rank))
                label = f"cp{cp} rank{rank} {comm} causal={causal} heads={heads} groups={groups}"
                for name, actual, ref in zip(
                    "out dq dk dv".split(), (out, lq.grad, lk.grad, lv.grad), expected
                ):
                    cmp.close(actual, ref, f"{label} {name}", **TIGHT)


def _errors(group: dist.ProcessGroup) -> list[str]:
    cp, rank = group.size(), group.rank()
    x = torch.randn(1, 4, 2 * cp * CHUNK, HEAD_DIM, dtype=torch.float64)
    cases = [
        (x[:, :, :5], x[:, :, :5], x[:, :, :5], True, "p2p"),  # odd local length under the mask
        (x, x[:, :1], x[:, :1], False, "a2a"),  # groups not divisible by cp
        (x, x, x, True, "ring"),  # unknown comm type
    ]
    messages = []
    for q, k, v, causal, comm in cases:
        try:
            context_parallel_attention(q, k, v, group, causal, comm)
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append(f"no error on rank {rank}")
    return messages


def _check_dot_product_attention(cmp: Comparisons) -> None:
    """Megatron-core's DotProductAttention interface: [s, b, n, d] in, [s, b, n * d] out, the layer's
    comm type from a per-layer list, at cp 2 (world 4 as tp 2 x cp 2)."""
    ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=8,
        num_query_groups=4,
        context_parallel_size=2,
        tensor_model_parallel_size=2,
        cp_comm_type=["all_gather", "a2a"],
        attention_dropout=0.0,
    )
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 2 * cp * CHUNK, 4, generator=g, dtype=torch.float64)  # this tp rank's heads
    k, v = (torch.randn(2, 2, 2 * cp * CHUNK, 4, generator=g, dtype=torch.float64) for _ in range(2))
    expected = _reference(q, k, v, True, torch.zeros_like(q))[0]
    for layer in (1, 2):
        attention = ContextParallelDotProductAttention(config, layer, "causal", "self")
        assert attention.cp_comm_type == ["all_gather", "a2a"][layer - 1]
        sbhd = [_local(t, cp, rank).permute(2, 0, 1, 3) for t in (q, k, v)]
        out = attention(*sbhd, attention_mask=None)
        ref = _local(expected, cp, rank).permute(2, 0, 1, 3).reshape(out.shape)
        cmp.close(out, ref, f"DotProductAttention layer {layer}", **TIGHT)
    ps.destroy_model_parallel()


def _worker() -> tuple[list, list, list]:
    rank = dist.get_rank()
    cmp = Comparisons()
    _check_group(cmp, dist.group.WORLD, seed=1)  # cp 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    _check_group(cmp, pair, seed=2)  # cp 2
    # The rotary angles of this rank's chunks.
    angles = torch.arange(2 * 4 * CHUNK, dtype=torch.float64)[:, None, None, None]
    cmp.close(
        get_pos_emb_on_this_cp_rank(angles, 0, dist.group.WORLD),
        _local(angles, 4, rank, 0),
        "pos emb",
        **TIGHT,
    )
    q = torch.randn(1, 4, 2 * CHUNK, HEAD_DIM, dtype=torch.float64)
    reports = [
        (
            f"{comm} rank {rank}",
            opcheck_report(
                torch.ops.megatron_ext.context_parallel_attention_forward.default,
                (q, q, q, pair.group_name, 2, pair.rank(), True, comm, None),
            ),
        )
        for comm in ("p2p", "a2a")  # a2a's log-sum-exp has its own shape
    ]
    _check_dot_product_attention(cmp)
    return cmp.made, _errors(pair), reports


@pytest.mark.slow  # 4 ranks, 34 attention calls per rank and the opchecks' compiled graphs
def test_context_parallel_attention_equals_full_attention():
    results = run_distributed(4, _worker)
    for made, errors, reports in results:
        assert_comparisons(made)
        assert_opchecks_passed(reports)
        assert "divisible by 2*cp = 4" in errors[0], errors[0]
        assert "'a2a' splits the heads" in errors[1] and "1 key/value heads" in errors[1], errors[1]
        assert "cp_comm_type must be 'p2p', 'all_gather' or 'a2a', got 'ring'" in errors[2], errors[2]
    # Per rank: 4 tensors x 2 masks x comm types (cp 4: 3 + 3 + 2 without a2a over 2 groups; cp 2: 3 x 3),
    # the rotary angles and the two DotProductAttention layers.
    assert len(results[0][0]) == 4 * 2 * (8 + 9) + 3


@pytest.mark.slow  # opcheck compiles graphs
@pytest.mark.parametrize("comm", CP_COMM_TYPES)
def test_opcheck_single_rank(comm):
    """At cp 1 (no communication) the op is one attention block: opcheck and equality with SDPA."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(2, 2, 6, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)
    )
    args = (q, k, v, "", 1, 0, True, comm, None)
    assert_opchecks_passed(
        [(comm, opcheck_report(torch.ops.megatron_ext.context_parallel_attention.default, args))]
    )
    out = torch.ops.megatron_ext.context_parallel_attention(*args)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, **TIGHT)


def test_single_rank_equals_sdpa():
    """At cp 1 every comm type is one attention block, causal or not, GQA keys and values."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 6, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(2, 2, 6, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)
    )
    grad = torch.randn(2, 4, 6, HEAD_DIM, generator=g, dtype=torch.float64)
    for comm in CP_COMM_TYPES:
        for causal in (True, False):
            out = torch.ops.megatron_ext.context_parallel_attention(q, k, v, "", 1, 0, causal, comm, 0.3)
            expected = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=True, scale=0.3
            )
            torch.testing.assert_close(out, expected, **TIGHT)
            for got, want in zip(
                torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)
            ):
                torch.testing.assert_close(got, want, **TIGHT)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_single_rank_on_cuda(dtype):
    """cp 1 on a GPU: the op's CUDA block (the block's scores in float64, SDPA's memory-efficient
    kernel for float32, its flash kernel for bfloat16, each with the log-sum-exp) and its backward,
    against unfused float64 attention; MHA and GQA, causal and not. The error bound is relative to
    the largest value of each reference tensor: the kernels' roundings (TF32, bfloat16)."""
    bound = {torch.float64: 1e-12, torch.float32: 2e-3, torch.bfloat16: 2e-2}[dtype]
    g = torch.Generator().manual_seed(9)
    for heads, groups in HEADS:
        q, grad = (torch.randn(2, heads, 128, 64, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(2, groups, 128, 64, generator=g, dtype=torch.float64) for _ in range(2))
        for causal in (True, False):
            expected = _reference(q, k, v, causal, grad)
            lq, lk, lv = (t.to("cuda", dtype).requires_grad_(True) for t in (q, k, v))
            out = torch.ops.megatron_ext.context_parallel_attention(lq, lk, lv, "", 1, 0, causal, "p2p", None)
            out.backward(grad.to("cuda", dtype))
            for name, got, want in zip("out dq dk dv".split(), (out, lq.grad, lk.grad, lv.grad), expected):
                error = (got.double().cpu() - want).abs().max().item()
                assert error <= bound * want.abs().max().item(), (dtype, heads, groups, causal, name, error)
