"""Megatron-core's region classes (``mappings._CopyToModelParallelRegion.apply(...)`` and the rest),
uneven first-dim splits and the all-to-all regions, against values computed without communication
(float64, tensor-parallel size 3)."""

import pytest
import torch

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel as tp_
from megatron_ext.tensor_parallel import mappings
from tests.conftest import EXACT, Comparisons, assert_comparisons, per_rank
from tests.distributed import run_distributed

CLASSES = [
    "_CopyToModelParallelRegion",
    "_ReduceFromModelParallelRegion",
    "_ScatterToModelParallelRegion",
    "_GatherFromModelParallelRegion",
    "_ScatterToSequenceParallelRegion",
    "_GatherFromSequenceParallelRegion",
    "_ReduceScatterToSequenceParallelRegion",
    "_AllGatherFromTensorParallelRegion",
    "_ReduceScatterToTensorParallelRegion",
    "_AllToAll",
]


def _run(fn, x, grad, region_op=True):
    x = x.clone().requires_grad_(True)
    out = fn(x)
    if region_op:  # the node is the C++ op's, not a Python autograd.Function's
        assert type(out.grad_fn).__name__ == "CppFunction", type(out.grad_fn)
    out.backward(grad)
    return out.detach(), x.grad


def test_classes_are_plain_classes():
    for name in CLASSES:
        cls = getattr(mappings, name)
        assert not issubclass(cls, torch.autograd.Function), name
        assert callable(cls.apply)


def _worker() -> list[tuple]:
    """The region classes and all-to-all against serial results at TP 3 (recorded comparisons,
    made in the test)."""
    compared = Comparisons()
    ps.initialize_model_parallel(tensor_model_parallel_size=3)
    group = ps.get_tensor_model_parallel_group()
    n, r = 3, ps.get_tensor_model_parallel_rank()
    xs, gs = per_rank(n, (6, 2, 9), 1), per_rank(n, (6, 2, 9), 2)

    def chunk(t, dim):
        return t.chunk(n, dim)[r]

    out, grad = _run(lambda x: mappings._CopyToModelParallelRegion.apply(x, group), xs[r], gs[r])
    compared.close(out, xs[r], **EXACT)
    compared.close(grad, sum(gs), **EXACT)
    out, grad = _run(lambda x: mappings._ReduceFromModelParallelRegion.apply(x, group), xs[r], gs[r])
    compared.close(out, sum(xs), **EXACT)
    compared.close(grad, gs[r], **EXACT)
    out, grad = _run(
        lambda x: mappings._ScatterToModelParallelRegion.apply(x, group), xs[0], chunk(gs[r], -1)
    )
    compared.close(out, chunk(xs[0], -1), **EXACT)
    compared.close(grad, torch.cat([g.chunk(n, -1)[i] for i, g in enumerate(gs)], -1), **EXACT)
    local = [x.chunk(n, -1)[i] for i, x in enumerate(xs)]
    out, grad = _run(lambda x: mappings._GatherFromModelParallelRegion.apply(x, group), local[r], gs[r])
    compared.close(out, torch.cat(local, -1), **EXACT)
    compared.close(grad, chunk(gs[r], -1), **EXACT)
    out, grad = _run(
        lambda x: mappings._ScatterToSequenceParallelRegion.apply(x, group), xs[0], chunk(gs[r], 0)
    )
    compared.close(out, chunk(xs[0], 0), **EXACT)
    compared.close(grad, torch.cat([g.chunk(n, 0)[i] for i, g in enumerate(gs)], 0), **EXACT)
    seq = [x.chunk(n, 0)[i] for i, x in enumerate(xs)]
    out, grad = _run(lambda x: mappings._GatherFromSequenceParallelRegion.apply(x, group), seq[r], gs[r])
    compared.close(out, torch.cat(seq, 0), **EXACT)
    compared.close(grad, chunk(sum(gs), 0), **EXACT)
    out, grad = _run(
        lambda x: mappings._GatherFromSequenceParallelRegion.apply(x, group, False), seq[r], gs[r]
    )
    compared.close(grad, chunk(gs[r], 0), **EXACT)
    out, grad = _run(
        lambda x: mappings._ReduceScatterToSequenceParallelRegion.apply(x, group), xs[r], chunk(gs[r], 0)
    )
    compared.close(out, chunk(sum(xs), 0), **EXACT)
    compared.close(grad, torch.cat([g.chunk(n, 0)[i] for i, g in enumerate(gs)], 0), **EXACT)
    out, grad = _run(lambda x: mappings._AllGatherFromTensorParallelRegion.apply(x, group), local[r], gs[r])
    compared.close(out, torch.cat(local, -1), **EXACT)
    compared.close(grad, chunk(sum(gs), -1), **EXACT)
    out, grad = _run(
        lambda x: mappings._ReduceScatterToTensorParallelRegion.apply(x, group), xs[r], chunk(gs[r], -1)
    )
    compared.close(out, chunk(sum(xs), -1), **EXACT)

    # Uneven first-dim gather: rank i contributes sizes[i] rows.
    sizes = [2, 0, 5]
    rows = [x[: sizes[i]] for i, x in enumerate(xs)]
    total = sum(sizes)
    ups = per_rank(n, (total, 2, 9), 3)
    out, grad = _run(
        lambda x: mappings._GatherFromSequenceParallelRegion.apply(x, group, True, sizes),
        rows[r],
        ups[r],
        False,
    )
    compared.close(out, torch.cat(rows, 0), **EXACT)
    offsets = [0, 2, 2, 7]
    compared.close(grad, sum(ups)[offsets[r] : offsets[r + 1]], **EXACT)
    # The function takes Megatron-core's output_split_sizes too, with the class's result.
    out_f, grad_f = _run(
        lambda x: tp_.gather_from_sequence_parallel_region(x, True, group, sizes), rows[r], ups[r], False
    )
    compared.close(out_f, torch.cat(rows, 0), **EXACT)
    compared.close(grad_f, grad, **EXACT)
    out, grad = _run(lambda x: tp_.gather_from_sequence_parallel_region(x, True, group), seq[r], gs[r])
    compared.close(out, torch.cat(seq, 0), **EXACT)
    with pytest.raises(AssertionError, match="tensor_parallel_output_grad=True"):
        mappings._GatherFromSequenceParallelRegion.apply(rows[r], group, False, sizes)
    # Uneven first-dim reduce-scatter: rank i keeps sizes[i] rows of the sum.
    full = [x[:total] if x.shape[0] >= total else torch.cat([x, x])[:total] for x in xs]
    downs = per_rank(n, (7, 2, 9), 4)
    mine = [d[: sizes[i]] for i, d in enumerate(downs)]
    out, grad = _run(
        lambda x: mappings._ReduceScatterToSequenceParallelRegion.apply(x, group, sizes),
        full[r],
        mine[r],
        False,
    )
    compared.close(out, sum(full)[offsets[r] : offsets[r + 1]], **EXACT)
    compared.close(grad, torch.cat(mine, 0), **EXACT)
    out_f, grad_f = _run(
        lambda x: tp_.reduce_scatter_to_sequence_parallel_region(x, group, sizes), full[r], mine[r], False
    )
    compared.close(out_f, sum(full)[offsets[r] : offsets[r + 1]], **EXACT)
    compared.close(grad_f, torch.cat(mine, 0), **EXACT)
    with pytest.raises(ValueError, match="sum to 7, but the input has 6 rows"):
        mappings._ReduceScatterToSequenceParallelRegion.apply(xs[r], group, sizes)

    # all_to_all with uneven splits: rank i sends send[i][j] rows to rank j.
    send = [[1, 2, 0], [3, 0, 1], [2, 2, 2]]
    data = [
        torch.randn(sum(send[i]), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + i))
        for i in range(n)
    ]
    pieces = [list(torch.split(data[i], send[i])) for i in range(n)]
    recv = [send[i][r] for i in range(n)]
    expected = torch.cat([pieces[i][r] for i in range(n)])
    up = torch.randn(sum(recv), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + r))
    all_up = [
        torch.randn(
            sum(send[i][j] for i in range(n)),
            4,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(20 + j),
        )
        for j in range(n)
    ]
    out, grad = _run(lambda x: tp_.all_to_all(group, x, recv, send[r]), data[r], up, False)
    compared.close(out, expected, **EXACT)
    # Gradient of my row block sent to rank j: rank j's upstream rows that came from me.
    back = [torch.split(all_up[j], [send[i][j] for i in range(n)])[r] for j in range(n)]
    compared.close(grad, torch.cat(back), **EXACT)
    with pytest.raises(AssertionError, match="group should not be None"):
        tp_.all_to_all(None, data[r])

    # sp2hp / hp2sp: [tokens/tp, H] <-> [tokens, H/tp], against the full [tokens, H] matrix.
    tokens, hidden = 6, 9
    full_x = torch.randn(tokens, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(30))
    full_g = torch.randn(tokens, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(31))
    out, grad = _run(lambda x: tp_.all_to_all_sp2hp(x), chunk(full_x, 0), chunk(full_g, 1), False)
    compared.close(out, chunk(full_x, 1), **EXACT)
    compared.close(grad, chunk(full_g, 0), **EXACT)
    out, grad = _run(lambda x: tp_.all_to_all_hp2sp(x, group), chunk(full_x, 1), chunk(full_g, 0), False)
    compared.close(out, chunk(full_x, 0), **EXACT)
    compared.close(grad, chunk(full_g, 1), **EXACT)
    _check_frozen_linear(group, n, r, compared)
    # param_is_not_tensor_parallel_duplicate(param, tp_group): shards always count; a replicated
    # parameter counts on rank 0 of the given group (a group of this rank alone: always).
    shard, replica = torch.zeros(2), torch.zeros(2)
    tp_.set_tensor_model_parallel_attributes(shard, True, 0, 1)
    assert tp_.param_is_not_tensor_parallel_duplicate(shard, group)
    assert tp_.param_is_not_tensor_parallel_duplicate(replica) == (r == 0)
    assert tp_.param_is_not_tensor_parallel_duplicate(replica, group) == (r == 0)
    assert tp_.param_is_not_tensor_parallel_duplicate(replica, ps.get_data_parallel_group())
    return compared.made


def _check_frozen_linear(group, n, r, compared: Comparisons):
    """Column-parallel use (full input, weight rows split) and sequence-parallel use (input split
    along dim 0), against the serial linear."""
    g = torch.Generator().manual_seed(40)
    w_full = torch.randn(6, 5, dtype=torch.float64, generator=g)
    b_full = torch.randn(6, dtype=torch.float64, generator=g)
    x = torch.randn(6, 2, 5, dtype=torch.float64, generator=g)
    up = torch.randn(6, 2, 6, dtype=torch.float64, generator=g)
    w, b = w_full.chunk(n, 0)[r].clone(), b_full.chunk(n, 0)[r].clone().requires_grad_(True)
    up_local = up.chunk(n, -1)[r]
    xx = x.clone().requires_grad_(True)
    out = tp_.linear_with_frozen_weight(xx, w, b, False, True, False, None)
    compared.close(out, (x @ w_full.T + b_full).chunk(n, -1)[r], **EXACT)
    out.backward(up_local)
    compared.close(xx.grad, up @ w_full, **EXACT)  # all-reduced over the column shards
    compared.close(b.grad, up_local.sum((0, 1)), **EXACT)
    assert w.grad is None
    # Sequence parallel: input rows split, gradient reduce-scattered.
    xs = x.chunk(n, 0)[r].clone().requires_grad_(True)
    out = tp_.linear_with_frozen_weight(xs, w, None, False, False, True, group)
    compared.close(out, (x @ w_full.T).chunk(n, -1)[r], **EXACT)
    out.backward(up_local)
    compared.close(xs.grad, (up @ w_full).chunk(n, 0)[r], **EXACT)
    with pytest.raises(AssertionError, match="grad_output_buffer"):
        tp_.linear_with_frozen_weight(xs, w, None, False, False, False, group, [])


@pytest.mark.slow
def test_region_classes_and_all_to_all():
    results = run_distributed(3, _worker)
    for made in results:
        assert_comparisons(made)
    assert len({len(made) for made in results}) == 1
