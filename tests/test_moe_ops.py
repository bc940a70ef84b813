"""The experts' C++ ops: token permutation / unpermutation, the grouped GEMM and the uneven
all-to-all, against the plain torch formulas (Megatron-core 0.16.1's semantics) in float64,
forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext import tensor_parallel
from megatron_ext.transformer.moe import moe_utils
from megatron_ext.transformer.moe.grouped_gemm_util import grouped_gemm_is_available, ops
from tests.conftest import (
    EXACT,
    Comparisons,
    assert_comparisons,
    assert_opchecks_passed,
    has_kernel,
    opcheck_report,
)
from tests.distributed import run_distributed

_ops = torch.ops.megatron_ext
F64 = torch.float64


# --- the reference: Megatron-core's unfused formulas, written out -----------------------------


def ref_permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False):
    num_tokens, num_experts = routing_map.shape
    if drop_and_pad and num_out_tokens is not None:
        capacity = num_out_tokens // num_experts
        by_expert = routing_map.to(torch.int8).T.contiguous()
        idx = by_expert.argsort(dim=-1, descending=True, stable=True)[:, :capacity].reshape(-1)
        experts = torch.arange(num_experts).repeat_interleave(min(capacity, num_tokens))
    else:
        mask = routing_map.bool().T.contiguous()
        idx = torch.arange(num_tokens).unsqueeze(0).expand(num_experts, -1).masked_select(mask)
        experts = torch.arange(num_experts).unsqueeze(1).expand(-1, num_tokens).masked_select(mask)
    permuted_probs = probs.T.contiguous()[experts, idx] if probs is not None else None
    return tokens.index_select(0, idx), permuted_probs, idx


def ref_unpermute(rows, idx, restore_shape, probs=None, routing_map=None, drop_and_pad=False):
    if probs is not None:
        num_experts = routing_map.shape[1]
        if drop_and_pad:
            experts = torch.arange(num_experts).repeat_interleave(idx.numel() // num_experts)
        else:
            mask = routing_map.bool().T.contiguous()
            every = torch.arange(num_experts).unsqueeze(1).expand(-1, routing_map.shape[0])
            experts = every.masked_select(mask)
        rows = rows * probs[idx, experts].unsqueeze(-1)
    out = torch.zeros(restore_shape, dtype=rows.dtype)
    return out.scatter_add(0, idx.unsqueeze(1).expand(-1, restore_shape[1]), rows)


def _routing(num_tokens: int, num_experts: int, topk: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(num_tokens, num_experts, dtype=F64, generator=g)
    top = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, top, True)
    probs = torch.softmax(scores, -1) * routing_map
    return routing_map, probs


# (num_out_tokens, drop_and_pad): dropless (num_out_tokens ignored there, as in Megatron-core), a
# capacity that drops tokens, one that pads, one above the token count.
CASES = [(None, False), (14, False), (8, True), (20, True), (40, True)]


@pytest.mark.parametrize("num_out_tokens,drop_and_pad", CASES)
@pytest.mark.parametrize("with_probs", [False, True])
def test_permute_unpermute_equal_formula(num_out_tokens, drop_and_pad, with_probs):
    num_tokens, hidden, num_experts = 7, 5, 4
    routing_map, probs = _routing(num_tokens, num_experts, 2, seed=1)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randn(num_tokens, hidden, dtype=F64, generator=g)
    if not with_probs:
        probs = None
    leaves = [tokens.clone().requires_grad_(True) for _ in range(2)]
    prob_leaves = [probs.clone().requires_grad_(True) if with_probs else None for _ in range(2)]
    got = moe_utils.permute(
        leaves[0], routing_map, prob_leaves[0], num_out_tokens, drop_and_pad=drop_and_pad
    )
    want = ref_permute(leaves[1], routing_map, prob_leaves[1], num_out_tokens, drop_and_pad)
    assert torch.equal(got[2], want[2])
    assert torch.equal(got[0], want[0])
    if with_probs:
        assert torch.equal(got[1], want[1])
    else:
        assert got[1] is None
    # Unpermute the permuted rows (times a per-row factor, as the experts' output) and differentiate
    # everything: tokens, probs (through permute and unpermute), the expert output.
    factor = torch.randn(got[0].shape[0], 1, dtype=F64, generator=g)
    out_got = moe_utils.unpermute(got[0] * factor, got[2], tokens.shape, prob_leaves[0], routing_map,
                                  drop_and_pad=drop_and_pad)
    out_want = ref_unpermute(
        want[0] * factor, want[2], tokens.shape, prob_leaves[1], routing_map, drop_and_pad
    )
    torch.testing.assert_close(out_got, out_want, **EXACT)
    up = torch.randn(num_tokens, hidden, dtype=F64, generator=g)
    loss_got = (out_got * up).sum() + (got[1].square().sum() if with_probs else 0)
    loss_want = (out_want * up).sum() + (want[1].square().sum() if with_probs else 0)
    loss_got.backward()
    loss_want.backward()
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad, **EXACT)
    if with_probs:
        torch.testing.assert_close(prob_leaves[0].grad, prob_leaves[1].grad, **EXACT)


def test_permute_counts_and_capacity():
    routing_map = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    tokens = torch.arange(8, dtype=F64).view(4, 2)
    _, _, idx = moe_utils.permute(tokens, routing_map)
    assert idx.tolist() == [0, 1, 3, 1, 2, 0, 2]  # expert-major, tokens in order
    # capacity 2: expert 0 keeps tokens 0, 1 (drops 3); expert 1 keeps 1, 2; expert 2 keeps 0, 2.
    _, _, idx = moe_utils.permute(tokens, routing_map, num_out_tokens=6, drop_and_pad=True)
    assert idx.tolist() == [0, 1, 1, 2, 0, 2]
    # capacity 3: expert 1 and 2 are padded with the first token they were not sent.
    _, _, idx = moe_utils.permute(tokens, routing_map, num_out_tokens=9, drop_and_pad=True)
    assert idx.tolist() == [0, 1, 3, 1, 2, 0, 0, 2, 1]
    # Unpermute without probs sums the k copies.
    rows = torch.ones(7, 2, dtype=F64)
    _, _, idx = moe_utils.permute(tokens, routing_map)
    out = moe_utils.unpermute(rows, idx, tokens.shape)
    assert out[:, 0].tolist() == [2.0, 2.0, 2.0, 1.0]


def test_unpermute_promotes_to_the_probs_dtype():
    """bfloat16 rows with float32 probs: weighted and summed in float32, returned in bfloat16,
    as Megatron-core's formula does."""
    routing_map, probs = _routing(6, 3, 2, seed=3)
    tokens = torch.randn(6, 4, generator=torch.Generator().manual_seed(4)).bfloat16()
    rows, _, idx = moe_utils.permute(tokens, routing_map)
    got = moe_utils.unpermute(rows, idx, tokens.shape, probs.float(), routing_map)
    want = ref_unpermute(rows.float(), idx, tokens.shape, probs.float(), routing_map).bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_permute_double_backward():
    """A backward that is differentiated again (create_graph=True) gives autograd's numbers."""
    routing_map, probs = _routing(5, 3, 2, seed=5)
    tokens = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(6))
    x, p = tokens.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    rows, _, idx = moe_utils.permute(x, routing_map)
    y = moe_utils.unpermute(rows * 1.5, idx, x.shape, p, routing_map)
    torch.autograd.gradcheck(
        lambda a, b: moe_utils.unpermute(moe_utils.permute(a, routing_map)[0], idx, a.shape, b, routing_map),
        (x, p),
    )
    torch.autograd.gradgradcheck(
        lambda a, b: moe_utils.unpermute(moe_utils.permute(a, routing_map)[0], idx, a.shape, b, routing_map),
        (x, p),
    )
    assert y.shape == x.shape


def test_permute_bad_input():
    routing_map, probs = _routing(4, 3, 1, seed=7)
    tokens = torch.randn(4, 2, dtype=F64)
    with pytest.raises(ValueError, match=r"routing_map must be \[num_tokens=4, num_experts\], got shape"):
        moe_utils.permute(tokens, torch.ones(5, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"probs must be \[4, 3\] like routing_map, got shape \(4, 2\)"):
        moe_utils.permute(tokens, routing_map, probs[:, :2])
    with pytest.raises(ValueError, match="num_out_tokens must be >= 0, got -3"):
        moe_utils.permute(tokens, routing_map, num_out_tokens=-3, drop_and_pad=True)
    with pytest.raises(ValueError, match="probs need the routing_map"):
        moe_utils.unpermute(tokens, torch.arange(4), tokens.shape, probs)
    with pytest.raises(ValueError, match=r"permuted_tokens must be \[rows, hidden=3\]"):
        moe_utils.unpermute(tokens, torch.arange(4), (4, 3))
    with pytest.raises(IndexError, match=r"index 9 at position 1 is outside \[0, 4\)"):
        _ops.moe_permute(tokens, torch.tensor([0, 9]), None)
    with pytest.raises(IndexError, match=r"index -1 at position 0 is outside \[0, 3\)"):
        _ops.moe_unpermute(tokens, torch.tensor([-1, 0, 1, 2]), None, 3)
    with pytest.raises(ValueError, match="the probabilities are Float, the tokens Double"):
        _ops.moe_permute(tokens, torch.tensor([0, 1]), torch.ones(2))
    with pytest.raises(ValueError, match="expected 2 probabilities .* got shape \\[3\\]"):
        _ops.moe_permute(tokens, torch.tensor([0, 1]), torch.ones(3, dtype=F64))
    with pytest.raises(ValueError, match="the indices must be a 1-D int64 tensor, got a Int"):
        _ops.moe_permute(tokens, torch.tensor([0, 1], dtype=torch.int32), None)
    with pytest.raises(ValueError, match="expected a capacity >= 0, got -1"):
        _ops.moe_sort_by_expert(routing_map, -1)


# --- the grouped GEMM -------------------------------------------------------------------------


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("sizes", [[2, 0, 3, 1], [0, 0, 6, 0], [0, 0, 0, 0]])
def test_gmm_equal_formula(trans_b, sizes):
    k, n = 3, 5
    g = torch.Generator().manual_seed(8)
    a = torch.randn(sum(sizes), k, dtype=F64, generator=g, requires_grad=True)
    shape = (len(sizes), n, k) if trans_b else (len(sizes), k, n)
    b = torch.randn(*shape, dtype=F64, generator=g, requires_grad=True)
    batch_sizes = torch.tensor(sizes)
    out = ops.gmm(a, b, batch_sizes, trans_b=trans_b)
    chunks = torch.split(a, sizes)
    want = torch.cat([c @ (b[e].T if trans_b else b[e]) for e, c in enumerate(chunks)])
    torch.testing.assert_close(out, want, **EXACT)
    up = torch.randn(out.shape, dtype=F64, generator=g)
    got_grads = torch.autograd.grad(out, (a, b), up)
    want_grads = torch.autograd.grad(want, (a, b), up)
    for got, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(got, ref, **EXACT)
    assert grouped_gemm_is_available()


def test_gmm_bad_input():
    a = torch.randn(5, 3, dtype=F64)
    b = torch.randn(2, 3, 4, dtype=F64)
    with pytest.raises(ValueError, match=r"batch_sizes \[2, 2\] sum to 4, but a has 5 rows"):
        ops.gmm(a, b, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"batch_sizes\[1\] is -1"):
        ops.gmm(a, b, torch.tensor([6, -1]))
    with pytest.raises(ValueError, match="batch_sizes has 3 entries, but b has 2 experts"):
        ops.gmm(a, b, torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match=r"a has 3 columns, but b \(trans_b\) has an inner size of 4"):
        ops.gmm(a, b, torch.tensor([2, 3]), trans_b=True)
    with pytest.raises(ValueError, match="must share dtype"):
        ops.gmm(a.float(), b, torch.tensor([2, 3]))


# --- registrations and opcheck -------------------------------------------------------------------


MOE_KERNELS = ["moe_gather_rows", "moe_scatter_add_rows", "moe_gathered_row_dot"]
MOE_AUTOGRAD_OPS = ["moe_permute", "moe_unpermute", "grouped_gemm", "all_to_all"]


def test_moe_ops_registered():
    for op in MOE_KERNELS:
        assert has_kernel(op, "CPU") and has_kernel(op, "Meta"), op
    for op in MOE_AUTOGRAD_OPS:
        assert has_kernel(op, "Autograd") and has_kernel(op, "CompositeExplicitAutograd"), op
        assert has_kernel(op, "Meta"), op
    for op in ["moe_sort_by_expert", "grouped_gemm_backward"]:
        assert has_kernel(op, "CompositeExplicitAutograd") and has_kernel(op, "Meta"), op


def test_moe_ops_opcheck():
    routing_map, probs = _routing(6, 3, 2, seed=9)
    g = torch.Generator().manual_seed(10)
    tokens = torch.randn(6, 4, dtype=F64, generator=g, requires_grad=True)
    idx, _ = _ops.moe_sort_by_expert(routing_map, None)
    scale = torch.rand(idx.numel(), dtype=F64, generator=g, requires_grad=True)
    rows = torch.randn(idx.numel(), 4, dtype=F64, generator=g, requires_grad=True)
    grad = torch.randn(6, 4, dtype=F64, generator=g)
    checks = [
        (_ops.moe_permute.default, (tokens, idx, None)),
        (_ops.moe_permute.default, (tokens, idx, scale)),
        (_ops.moe_unpermute.default, (rows, idx, None, 6)),
        (_ops.moe_unpermute.default, (rows, idx, scale, 6)),
        (_ops.moe_gather_rows.default, (tokens.detach().t().contiguous().t(), idx, scale.detach())),
        (_ops.moe_scatter_add_rows.default, (rows.detach(), idx, None, 6)),
        (_ops.moe_gathered_row_dot.default, (grad, idx, rows.detach())),
        (_ops.moe_sort_by_expert.default, (routing_map, 3)),
    ]
    a = torch.randn(6, 3, dtype=F64, generator=g, requires_grad=True)
    b = torch.randn(3, 3, 5, dtype=F64, generator=g, requires_grad=True)
    sizes = torch.tensor([2, 0, 4])
    checks += [
        (_ops.grouped_gemm.default, (a, b, sizes, False)),
        (_ops.grouped_gemm.default, (a, b.transpose(1, 2).contiguous(), sizes, True)),
        (_ops.grouped_gemm_backward.default,
         (torch.randn(6, 5, dtype=F64), a.detach(), b.detach(), sizes, False)),
    ]
    for op, args in checks:
        torch.library.opcheck(op, args)


# --- the uneven all-to-all ------------------------------------------------------------------------


def _all_to_all_worker(world: int) -> list:
    rank = dist.get_rank()
    group = dist.group.WORLD
    compared = Comparisons()
    # send[i][j]: rows rank i sends rank j (some zero, rank 1 sends nothing to anyone at world 4).
    send = [[0 if world == 4 and i == 1 else (2 * i + 3 * j) % 4 for j in range(world)] for i in range(world)]
    hidden = 3
    data = [
        torch.randn(sum(send[i]), hidden, dtype=F64, generator=torch.Generator().manual_seed(100 + i))
        for i in range(world)
    ]
    ups = [
        torch.randn(sum(send[i][j] for i in range(world)), hidden, dtype=F64,
                    generator=torch.Generator().manual_seed(200 + j))
        for j in range(world)
    ]
    recv = [send[i][rank] for i in range(world)]
    x = data[rank].clone().requires_grad_(True)
    out = tensor_parallel.all_to_all(group, x, recv, send[rank])
    expected = torch.cat([torch.split(data[i], send[i])[rank] for i in range(world)])
    compared.close(out, expected, "uneven forward", **EXACT)
    out.backward(ups[rank])
    back = torch.cat([torch.split(ups[j], [send[i][j] for i in range(world)])[rank] for j in range(world)])
    compared.close(x.grad, back, "uneven backward", **EXACT)
    # Splits as numpy arrays (what Megatron-core's alltoall dispatcher passes).
    out_np = tensor_parallel.mappings.all_to_all(group, data[rank], torch.tensor(recv).numpy(),
                                                 torch.tensor(send[rank]).numpy())
    compared.close(out_np, expected, "numpy splits", **EXACT)
    # Equal splits.
    even = torch.arange(world * 2 * hidden, dtype=F64).view(world * 2, hidden) + 100 * rank
    out = tensor_parallel.all_to_all(group, even)
    base = torch.arange(world * 2 * hidden, dtype=F64).view(world * 2, hidden)
    want = torch.cat([(base + 100 * i)[2 * rank : 2 * rank + 2] for i in range(world)])
    compared.close(out, want, "equal forward", **EXACT)
    # Differentiated twice: the backward's reverse all-to-all keeps its graph, whose own backward
    # is the forward exchange again.
    x = data[rank].clone().requires_grad_(True)
    v = ups[rank].clone().requires_grad_(True)
    out = tensor_parallel.all_to_all(group, x, recv, send[rank])
    (g,) = torch.autograd.grad(out, x, v, create_graph=True)
    compared.close(g, back, "backward with create_graph", **EXACT)
    w = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(300 + rank))
    (gv,) = torch.autograd.grad((g * w).sum(), v)
    compared.close(gv, tensor_parallel.all_to_all(group, w, recv, send[rank]), "double backward", **EXACT)
    # Bad input raises on every rank, before communicating.
    errors = []
    for args, pattern in [
        ((data[rank], recv, [s + 1 for s in send[rank]]), "input_split_sizes .* sum to"),
        ((data[rank], recv[:-1], send[rank]), f"output_split_sizes must list {world} non-negative sizes"),
        ((data[rank], [-1] + recv[1:], send[rank]), "non-negative sizes .* got \\[-1"),
        ((torch.zeros(world + 1, 2, dtype=F64),), f"first dim \\({world + 1}\\) is not divisible"),
    ]:
        with pytest.raises(ValueError, match=pattern) as info:
            tensor_parallel.all_to_all(group, *args)
        errors.append(str(info.value).splitlines()[0])
    with pytest.raises(AssertionError, match="group should not be None"):
        tensor_parallel.all_to_all(None, data[rank])
    # A dtype gloo cannot move: the backend's refusal, reported like the other collectives'.
    refused = "all-to-all in the forward of all_to_all of a complex128 tensor"
    with pytest.raises(dist.DistBackendError, match=refused):
        tensor_parallel.all_to_all(group, torch.zeros(world, 2, dtype=torch.complex128))
    # The group still works after the refusals.
    out = tensor_parallel.all_to_all(group, data[rank], recv, send[rank])
    compared.close(out, expected, "after errors", **EXACT)
    x = data[rank].clone().requires_grad_(True)
    reports = [("all_to_all", opcheck_report(_ops.all_to_all.default,
                                             (x, recv, send[rank], group.group_name, world, rank)))]
    return [compared.made, errors, reports]


def _check_all_to_all(world: int) -> None:
    results = run_distributed(world, _all_to_all_worker, world)
    for made, errors, reports in results:
        assert_comparisons(made)
        assert len(errors) == 4
        assert_opchecks_passed(reports)


def test_all_to_all_uneven_2_ranks():
    _check_all_to_all(2)


@pytest.mark.slow
def test_all_to_all_uneven_4_ranks():
    _check_all_to_all(4)


def test_aux_loss_scaler_op():
    from megatron_ext.transformer.moe.router_utils import MoEAuxLossAutoScaler

    assert has_kernel("moe_aux_loss_scaler", "Autograd")
    assert has_kernel("moe_aux_loss_scaler", "CompositeExplicitAutograd")
    g = torch.Generator().manual_seed(11)
    out = torch.randn(3, 4, dtype=F64, generator=g, requires_grad=True)
    aux = torch.rand((), dtype=torch.float32, generator=g, requires_grad=True)
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        y = MoEAuxLossAutoScaler.apply(out, aux)
        assert torch.equal(y, out) and y.grad_fn is not None
        # The scale set after the forward is the one the backward applies.
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.125, dtype=torch.float64))
        w = torch.randn(3, 4, dtype=F64, generator=g)
        out_grad, aux_grad = torch.autograd.grad((y * w).sum(), (out, aux))
        torch.testing.assert_close(out_grad, w, rtol=0, atol=0)
        assert aux_grad.dtype == torch.float32 and aux_grad.item() == 0.125
        # Unset, the scale is 1.
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        (aux_grad,) = torch.autograd.grad(MoEAuxLossAutoScaler.apply(out, aux).sum(), (aux,))
        assert aux_grad.item() == 1.0
        with pytest.raises(ValueError, match="one number"):
            _ops.moe_aux_loss_scaler(out, aux, torch.ones(2))
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved
