"""Megatron-core's remaining tensor_parallel classes over megatron_ext's ops: the region classes'
``backward`` and ``symbolic``, ``VocabParallelCrossEntropy``'s pieces composed as Megatron-core's
fused cross-entropy composes them, ``_VocabParallelCrossEntropy``,
``LinearWithGradAccumulationAndAsyncCommunication`` and ``LinearWithFrozenWeight``, against the
functional path and serial float64 references (tensor-parallel size 3)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel as tp_
from megatron_ext.tensor_parallel import cross_entropy, layers, mappings
from tests.conftest import EXACT, Comparisons, assert_comparisons
from tests.distributed import run_distributed

VCE = cross_entropy.VocabParallelCrossEntropy


def _randn(*shape, seed):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_classes_are_plain_classes():
    # The autograd nodes are the C++ ops': none of these is a Python autograd.Function.
    for cls in (
        VCE,
        cross_entropy._VocabParallelCrossEntropy,
        layers.LinearWithGradAccumulationAndAsyncCommunication,
        layers.LinearWithFrozenWeight,
    ):
        assert not issubclass(cls, torch.autograd.Function), cls


def test_cross_entropy_pieces_work_in_place_on_their_buffer():
    logits = _randn(4, 2, 5, seed=1).to(torch.float32)
    kept = logits.clone()
    target = torch.tensor([[5, 6], [9, 0], [7, 7], [3, 8]])
    copy, logits_max = VCE.calculate_logits_max(logits)
    assert copy.dtype == torch.float32 and copy.data_ptr() != logits.data_ptr()
    assert torch.equal(logits_max, kept.amax(-1))
    pieces = VCE.calculate_predicted_logits(copy, target, logits_max, 5, 10)
    mask, masked_1d, predicted, sum_exp, exp_logits = pieces
    assert exp_logits.data_ptr() == copy.data_ptr()  # the shifted exponentials overwrite the copy
    assert torch.equal(logits, kept)  # never the caller's logits
    assert torch.equal(mask, torch.tensor([[False, False], [False, True], [False, False], [True, False]]))
    assert torch.equal(masked_1d, torch.tensor([0, 1, 4, 0, 2, 2, 0, 3]))
    shifted = kept - kept.amax(-1, keepdim=True)
    rows = torch.arange(8)
    expected = shifted.view(8, 5)[rows, masked_1d].view(4, 2).masked_fill(mask, 0.0)
    assert torch.equal(predicted, expected)
    assert_close(sum_exp, shifted.exp().sum(-1))
    softmax, loss = VCE.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
    assert softmax.data_ptr() == copy.data_ptr()
    assert_close(softmax, shifted.softmax(-1))
    assert_close(loss, sum_exp.log() - predicted)
    grad_2d, arange_1d, update, grad_input = VCE.prepare_gradient_calculation_operands(softmax, mask)
    assert grad_input is softmax and grad_2d.data_ptr() == softmax.data_ptr() and grad_2d.shape == (8, 5)
    assert torch.equal(arange_1d, rows) and torch.equal(update, 1.0 - mask.reshape(-1).float())
    grad_output = torch.rand(4, 2)
    one_hot = torch.zeros(8, 5)
    one_hot[rows, masked_1d] = update
    expected = (shifted.softmax(-1) - one_hot.view(4, 2, 5)) * grad_output.unsqueeze(-1)
    grad = VCE.calculate_gradients(grad_2d, arange_1d, masked_1d, update, grad_input, grad_output)
    assert grad is grad_input
    assert_close(grad_input, expected)
    # bf16 logits are computed on in float32, float64 ones in float64.
    assert VCE.calculate_logits_max(kept.bfloat16())[0].dtype == torch.float32
    assert VCE.calculate_logits_max(kept.double())[0].dtype == torch.float64


def test_cross_entropy_pieces_reject_bad_input():
    logits, logits_max = VCE.calculate_logits_max(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"target shape \[4\] must equal the logits shape \[3, 4\]"):
        VCE.calculate_predicted_logits(logits, torch.zeros(4, dtype=torch.long), logits_max, 0, 4)
    with pytest.raises(ValueError, match=r"range \[0, 8\) must hold as many ids as the logits' last dim"):
        VCE.calculate_predicted_logits(logits, torch.zeros(3, dtype=torch.long), logits_max, 0, 8)
    with pytest.raises(ValueError, match="token ids must be an integer tensor, got Float"):
        VCE.calculate_predicted_logits(logits, torch.zeros(3), logits_max, 0, 4)
    with pytest.raises(ValueError, match="vocab_parallel_logits must be a floating tensor, got torch.int64"):
        VCE.calculate_logits_max(torch.zeros(3, 4, dtype=torch.long))


# --- multi-rank checks, one spawn ------------------------------------------------------------------


class _Ctx:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def _check_region_backward_and_symbolic(group, n, r, compared: Comparisons):
    """Megatron-core's ``backward(ctx, grad_output)`` of each region is its conjugate region;
    ``symbolic(graph, ...)`` is the forward."""
    g = [_randn(6, 2, 9, seed=10 + i) for i in range(n)]
    mine = g[r]

    def chunk(t, dim):
        return t.chunk(n, dim)[r]

    def gathered(dim):  # every rank's chunk of its own tensor, concatenated
        return torch.cat([t.chunk(n, dim)[i] for i, t in enumerate(g)], dim)

    ctx = _Ctx(group=group)
    cases = [
        (mappings._CopyToModelParallelRegion, mine, sum(g)),
        (mappings._ReduceFromModelParallelRegion, mine, mine),
        (mappings._ScatterToModelParallelRegion, chunk(mine, -1), gathered(-1)),
        (mappings._GatherFromModelParallelRegion, mine, chunk(mine, -1)),
        (mappings._ScatterToSequenceParallelRegion, chunk(mine, 0), gathered(0)),
        (mappings._AllGatherFromTensorParallelRegion, mine, chunk(sum(g), -1)),
        (mappings._ReduceScatterToTensorParallelRegion, chunk(mine, -1), gathered(-1)),
    ]
    for cls, grad_output, expected in cases:
        grad, none = cls.backward(ctx, grad_output)
        assert none is None
        compared.close(grad, expected, **EXACT, label=cls.__name__)

    seq = _Ctx(group=group, tensor_parallel_output_grad=True, output_split_sizes=None)
    seq.use_global_buffer = False
    out = mappings._GatherFromSequenceParallelRegion.backward(seq, mine)
    assert len(out) == 5 and out[1:] == (None,) * 4
    compared.close(out[0], chunk(sum(g), 0), **EXACT)
    seq.tensor_parallel_output_grad = False
    compared.close(mappings._GatherFromSequenceParallelRegion.backward(seq, mine)[0], chunk(mine, 0), **EXACT)
    seq.output_split_sizes = [1, 2, 3]
    with pytest.raises(AssertionError, match="output_split_sizes needs tensor_parallel_output_grad=True"):
        mappings._GatherFromSequenceParallelRegion.backward(seq, mine)
    # Uneven splits: rank i holds sizes[i] rows.
    sizes = [1, 2, 3]
    offsets = [0, 1, 3, 6]
    seq.tensor_parallel_output_grad = True
    out = mappings._GatherFromSequenceParallelRegion.backward(seq, mine)
    compared.close(out[0], sum(g)[offsets[r] : offsets[r + 1]], **EXACT)
    rows = [t[: sizes[i]] for i, t in enumerate(g)]
    out = mappings._ReduceScatterToSequenceParallelRegion.backward(
        _Ctx(group=group, input_split_sizes=sizes, use_global_buffer=False), rows[r]
    )
    assert len(out) == 4 and out[1:] == (None,) * 3
    compared.close(out[0], torch.cat(rows), **EXACT)
    out = mappings._ReduceScatterToSequenceParallelRegion.backward(
        _Ctx(group=group, input_split_sizes=None, use_global_buffer=False), chunk(mine, 0)
    )
    compared.close(out[0], gathered(0), **EXACT)
    # All-to-all: the reverse exchange. Rank i sent send[i][j] rows to rank j.
    send = [[1, 2, 0], [3, 0, 1], [2, 2, 2]]
    recv = [send[i][r] for i in range(n)]
    ups = [_randn(sum(send[i][j] for i in range(n)), 4, seed=30 + j) for j in range(n)]
    ctx = _Ctx(group=group, output_split_sizes=recv, input_split_sizes=send[r])
    out = mappings._AllToAll.backward(ctx, ups[r])
    assert out[0] is None and out[2:] == (None, None)
    back = [torch.split(ups[j], [send[i][j] for i in range(n)])[r] for j in range(n)]
    compared.close(out[1], torch.cat(back), **EXACT)

    # symbolic(graph, *args) is the forward.
    xs = [_randn(6, 2, 9, seed=40 + i) for i in range(n)]
    compared.close(mappings._ReduceFromModelParallelRegion.symbolic(None, xs[r], group), sum(xs), **EXACT)
    gathered_xs = torch.cat([t.chunk(n, 0)[i] for i, t in enumerate(xs)])
    out = mappings._GatherFromSequenceParallelRegion.symbolic(None, chunk(xs[r], 0), group, True, None, False)
    compared.close(out, gathered_xs, **EXACT)
    out = mappings._ScatterToModelParallelRegion.symbolic(None, xs[0], group)
    compared.close(out, chunk(xs[0], -1), **EXACT)


def _serial_cross_entropy(full, target, grad_output, label_smoothing=0.0):
    full = full.clone().requires_grad_(True)
    vocab = full.shape[-1]
    loss = F.cross_entropy(
        full.reshape(-1, vocab), target.reshape(-1), reduction="none",
        label_smoothing=label_smoothing * vocab / (vocab - 1),
    ).view(target.shape)
    loss.backward(grad_output)
    return loss.detach(), full.grad


def _fused_megatron_composition(logits, target, group):
    """Megatron-core's fused cross-entropy (megatron/core/fusions/fused_cross_entropy.py) written
    out: its forward and backward as it composes the pieces, its all-reduces over ``group``."""
    logits, logits_max = VCE.calculate_logits_max(logits)
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    start, end = tp_.VocabUtility.vocab_range_from_per_partition_vocab_size(
        logits.shape[-1], group.rank(), group.size()
    )
    mask, masked_1d, predicted, sum_exp, exp_logits = VCE.calculate_predicted_logits(
        logits, target, logits_max, start, end
    )
    both = torch.cat((predicted, sum_exp))
    dist.all_reduce(both, group=group)
    predicted, sum_exp = torch.split(both, both.shape[0] // 2)
    softmax, loss = VCE.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)

    def backward(grad_output):
        grad_2d, arange_1d, update, grad_input = VCE.prepare_gradient_calculation_operands(softmax, mask)
        return VCE.calculate_gradients(grad_2d, arange_1d, masked_1d, update, grad_input, grad_output)

    return loss, backward


def _check_cross_entropy(group, n, r, compared: Comparisons):
    vocab = 4 * n
    full = _randn(5, 3, vocab, seed=50) * 3
    target = torch.randint(0, vocab, (5, 3), generator=torch.Generator().manual_seed(51))
    target[0, 0], target[1, 2] = 0, vocab - 1  # the first and the last rank's edge ids
    grad_output = _randn(5, 3, seed=52)
    local = full.chunk(n, -1)[r].contiguous()
    for smoothing in (0.0, 0.1):
        ref_loss, ref_grad = _serial_cross_entropy(full, target, grad_output, smoothing)
        x = local.clone().requires_grad_(True)
        loss = cross_entropy._VocabParallelCrossEntropy.apply(x, target, smoothing)
        loss.backward(grad_output)
        y = local.clone().requires_grad_(True)
        functional = tp_.vocab_parallel_cross_entropy(y, target, smoothing)
        functional.backward(grad_output)
        assert torch.equal(loss, functional) and torch.equal(x.grad, y.grad)
        compared.close(loss, ref_loss, **EXACT)
        compared.close(x.grad, ref_grad.chunk(n, -1)[r], **EXACT)
        assert torch.equal(x.detach(), local)
    # Megatron-core's own default argument: no smoothing.
    no_smoothing = cross_entropy._VocabParallelCrossEntropy.apply(local, target)
    assert torch.equal(no_smoothing, tp_.vocab_parallel_cross_entropy(local, target))

    # The pieces composed as Megatron-core's fused cross-entropy composes them.
    ref_loss, ref_grad = _serial_cross_entropy(full, target, grad_output)
    logits = local.clone()
    loss, backward = _fused_megatron_composition(logits, target, group)
    assert torch.equal(logits, local)
    compared.close(loss, ref_loss, **EXACT)
    compared.close(backward(grad_output), ref_grad.chunk(n, -1)[r], **EXACT)
    # float32 logits: float32 arithmetic, to float32 accuracy.
    loss32, backward32 = _fused_megatron_composition(local.float(), target, group)
    assert loss32.dtype == torch.float32
    compared.close(loss32.double(), ref_loss, rtol=1e-5, atol=1e-5)
    compared.close(backward32(grad_output.float()).double(), ref_grad.chunk(n, -1)[r], rtol=1e-5, atol=1e-5)

    # A bad argument raises on every rank alike.
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\), got 1.5"):
        cross_entropy._VocabParallelCrossEntropy.apply(local, target, 1.5)
    with pytest.raises(ValueError, match=f"target id {vocab} is outside the vocabulary"):
        cross_entropy._VocabParallelCrossEntropy.apply(local, torch.full_like(target, vocab))


def _check_linears(group, n, r, compared: Comparisons):
    w_full, b_full = _randn(6, 5, seed=60), _randn(6, seed=61)
    x, up = _randn(6, 2, 5, seed=62), _randn(6, 2, 6, seed=63)
    w_shard, b_shard, up_local = w_full.chunk(n, 0)[r], b_full.chunk(n, 0)[r], up.chunk(n, -1)[r]
    serial = (x @ w_full.T + b_full).chunk(n, -1)[r]
    grad_x = up @ w_full  # the column shards' input gradients summed over the group

    def run(cls_or_fn, x_in, *args):
        xx = x_in.clone().requires_grad_(True)
        w = w_shard.clone().requires_grad_(True)
        b = b_shard.clone().requires_grad_(True) if args[0] else None
        out = cls_or_fn(xx, w, b, *args[1:])
        out.backward(up_local)
        return out.detach(), xx.grad, w.grad, None if b is None else b.grad

    cls = layers.LinearWithGradAccumulationAndAsyncCommunication
    # Column-parallel use: the input replicated, its gradient all-reduced inside the linear.
    got = run(cls.apply, x, True, False, True, False, None, 0, group)
    functional = tp_.linear_with_grad_accumulation_and_async_allreduce
    want = run(functional, x, True, False, True, False, None, 0, None, group)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    compared.close(got[0], serial, **EXACT)
    compared.close(got[1], grad_x, **EXACT)
    compared.close(got[2], up_local.reshape(-1, 2).T @ x.reshape(-1, 5), **EXACT)
    compared.close(got[3], up_local.sum((0, 1)), **EXACT)
    # Sequence parallel: the input's rows split, gathered forward, its gradient reduce-scattered.
    out, gx, gw, _ = run(cls.apply, x.chunk(n, 0)[r], False, False, False, True, None, 0, group)
    compared.close(out, (x @ w_full.T).chunk(n, -1)[r], **EXACT)
    compared.close(gx, grad_x.chunk(n, 0)[r], **EXACT)
    compared.close(gw, up_local.reshape(-1, 2).T @ x.reshape(-1, 5), **EXACT)
    # Gradient accumulation fusion: the weight gradient is added into main_grad.
    w = w_shard.clone().requires_grad_(True)
    w.main_grad = torch.ones_like(w)
    cls.apply(x, w, None, True, True, False, None, 0, group).backward(up_local)
    assert w.grad is None
    compared.close(w.main_grad, 1.0 + up_local.reshape(-1, 2).T @ x.reshape(-1, 5), **EXACT)
    with pytest.raises(NotImplementedError, match="grad_output_buffer"):
        cls.apply(x, w_shard, None, False, True, False, [], 0, group)

    # The frozen weight: no weight gradient, the input gradient all-reduced when asked.
    frozen = layers.LinearWithFrozenWeight
    out, gx, gw, gb = run(frozen.apply, x, True, True, group)
    want = run(tp_.linear_with_frozen_weight, x, True, False, True, False, group)
    assert torch.equal(out, want[0]) and torch.equal(gx, want[1]) and torch.equal(gb, want[3])
    compared.close(out, serial, **EXACT)
    compared.close(gx, grad_x, **EXACT)
    assert gw is None
    compared.close(gb, up_local.sum((0, 1)), **EXACT)
    out, gx, gw, _ = run(frozen.apply, x, False, False, None)  # no all-reduce: this shard's part only
    compared.close(gx, up_local @ w_shard, **EXACT)
    assert gw is None


def _worker() -> list[tuple]:
    """The classes' results against serial ones at TP 3 (recorded comparisons, made in the test)."""
    ps.initialize_model_parallel(tensor_model_parallel_size=3)
    group = ps.get_tensor_model_parallel_group()
    n, r = group.size(), group.rank()
    compared = Comparisons()
    _check_region_backward_and_symbolic(group, n, r, compared)
    _check_cross_entropy(group, n, r, compared)
    _check_linears(group, n, r, compared)
    return compared.made


@pytest.mark.slow
def test_classes_at_tensor_parallel_size_3():
    results = run_distributed(3, _worker)
    for made in results:
        assert_comparisons(made)
    assert len({len(made) for made in results}) == 1
