"""Forward and backward of every communication region against values computed without
communication, in float64, at tensor-parallel sizes 1, 2 and 4."""

import re

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel as tp_
from megatron_ext.tensor_parallel.utils import group_args
from tests.conftest import (
    EXACT,
    Comparisons,
    assert_comparisons,
    assert_opchecks_passed,
    opcheck_report,
    per_rank,
)
from tests.distributed import run_distributed


def _run(region, x: torch.Tensor, grad: torch.Tensor, **kwargs):
    x = x.clone().requires_grad_(True)
    x_before = x.detach().clone()
    out = region(x, **kwargs)
    out.backward(grad)
    assert_close(x.detach(), x_before, rtol=0, atol=0)  # the input is never modified
    return out.detach(), x.grad


def _check_regions(compared: Comparisons, group=None):
    tp_group = group if group is not None else ps.get_tensor_model_parallel_group()
    n, r = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    kw = {} if group is None else {"group": group}
    s, b, h = 4 * n, 3, 8 * n
    xs = per_rank(n, (s, b, h), seed=1)  # each rank's own input
    gs = per_rank(n, (s, b, h), seed=2)  # each rank's upstream gradient
    total_x, total_g = sum(xs), sum(gs)

    def chunk(t, dim):
        return t.chunk(n, dim)[r]

    out, grad = _run(tp_.copy_to_tensor_model_parallel_region, xs[r], gs[r], **kw)
    compared.close(out, xs[r], **EXACT)
    compared.close(grad, total_g, **EXACT)

    out, grad = _run(tp_.reduce_from_tensor_model_parallel_region, xs[r], gs[r], **kw)
    compared.close(out, total_x, **EXACT)
    compared.close(grad, gs[r], **EXACT)

    full = xs[0]
    out, grad = _run(tp_.scatter_to_tensor_model_parallel_region, full, chunk(gs[r], -1), **kw)
    compared.close(out, chunk(full, -1), **EXACT)
    compared.close(grad, torch.cat([g.chunk(n, -1)[i] for i, g in enumerate(gs)], -1), **EXACT)

    local = [x.chunk(n, -1)[i] for i, x in enumerate(xs)]
    out, grad = _run(tp_.gather_from_tensor_model_parallel_region, local[r], gs[r], **kw)
    compared.close(out, torch.cat(local, -1), **EXACT)
    compared.close(grad, chunk(gs[r], -1), **EXACT)

    out, grad = _run(tp_.scatter_to_sequence_parallel_region, full, chunk(gs[r], 0), **kw)
    compared.close(out, chunk(full, 0), **EXACT)
    compared.close(grad, torch.cat([g.chunk(n, 0)[i] for i, g in enumerate(gs)], 0), **EXACT)

    local = [x.chunk(n, 0)[i] for i, x in enumerate(xs)]
    out, grad = _run(tp_.gather_from_sequence_parallel_region, local[r], gs[r], **kw)
    compared.close(out, torch.cat(local, 0), **EXACT)
    compared.close(grad, chunk(total_g, 0), **EXACT)
    out, grad = _run(tp_.gather_from_sequence_parallel_region, local[r], gs[r],
                     tensor_parallel_output_grad=False, **kw)
    compared.close(out, torch.cat(local, 0), **EXACT)
    compared.close(grad, chunk(gs[r], 0), **EXACT)

    out, grad = _run(tp_.reduce_scatter_to_sequence_parallel_region, xs[r], chunk(gs[r], 0), **kw)
    compared.close(out, chunk(total_x, 0), **EXACT)
    compared.close(grad, torch.cat([g.chunk(n, 0)[i] for i, g in enumerate(gs)], 0), **EXACT)

    local = [x.chunk(n, -1)[i] for i, x in enumerate(xs)]
    out, grad = _run(tp_.all_gather_last_dim_from_tensor_parallel_region, local[r], gs[r], **kw)
    compared.close(out, torch.cat(local, -1), **EXACT)
    compared.close(grad, chunk(total_g, -1), **EXACT)

    out, grad = _run(tp_.reduce_scatter_last_dim_to_tensor_parallel_region, xs[r], chunk(gs[r], -1), **kw)
    compared.close(out, chunk(total_x, -1), **EXACT)
    compared.close(grad, torch.cat([g.chunk(n, -1)[i] for i, g in enumerate(gs)], -1), **EXACT)


def _check_autograd_nodes_are_cpp():
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    for region in (tp_.copy_to_tensor_model_parallel_region, tp_.reduce_from_tensor_model_parallel_region,
                   tp_.gather_from_sequence_parallel_region):
        out = region(x)
        assert out.grad_fn is not None
        assert not isinstance(out.grad_fn, torch.autograd.function.BackwardCFunction)
        assert "RegionFunction" in out.grad_fn.name(), out.grad_fn.name()


def _check_errors(n: int):
    with pytest.raises(TypeError, match="expected a torch.Tensor, got list"):
        tp_.copy_to_tensor_model_parallel_region([1.0, 2.0])
    if n == 1:
        return
    odd = torch.randn(2 * n + 1, 3 * n + 1)
    with pytest.raises(ValueError, match=rf"dimension 1 of the input has size {3 * n + 1}, which is not "
                       rf"divisible by the group size {n}"):
        tp_.scatter_to_tensor_model_parallel_region(odd)
    with pytest.raises(ValueError, match=rf"dimension 0 of the input has size {2 * n + 1}.*group size {n}"):
        tp_.reduce_scatter_to_sequence_parallel_region(odd)
    with pytest.raises(ValueError, match=rf"dimension 1 of the input has size {3 * n + 1}"):
        tp_.reduce_scatter_last_dim_to_tensor_parallel_region(odd)
    with pytest.raises(ValueError, match="at least one dimension"):
        tp_.scatter_to_sequence_parallel_region(torch.tensor(1.0))


def _check_dtypes(n: int, compared: Comparisons):
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = torch.arange(2 * n * 4, dtype=dtype).reshape(2 * n, 4)
        compared.close(tp_.reduce_from_tensor_model_parallel_region(x), x * n)
        gathered = tp_.gather_from_sequence_parallel_region(x)
        assert gathered.dtype == dtype and gathered.shape == (2 * n * n, 4)
        compared.close(
            tp_.reduce_scatter_to_sequence_parallel_region(x),
            x.chunk(n, 0)[ps.get_tensor_model_parallel_rank()] * n,
        )


def _check_unsupported_dtype(n: int):
    # gloo cannot move uint16: the error names the operation, the dtype, the group with its ranks
    # and backend, and this rank, on every rank (megatron_ext.comm_errors).
    ranks = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    group = (rf"of a uint16 tensor of shape \[2, 2\] over the tensor-model-parallel group \(global ranks "
             rf"{re.escape(str(ranks))}, gloo\) failed on global rank {dist.get_rank()}")
    with pytest.raises(
        dist.DistBackendError,
        match=rf"^all-gather in the forward of gather_from_tensor_model_parallel_region {group}",
    ):
        tp_.gather_from_tensor_model_parallel_region(torch.zeros(2, 2, dtype=torch.uint16))
    with pytest.raises(
        dist.DistBackendError,
        match=rf"^all-reduce in the forward of reduce_from_tensor_model_parallel_region {group}",
    ):
        tp_.reduce_from_tensor_model_parallel_region(torch.zeros(2, 2, dtype=torch.uint16))


def _check_fake_shapes(n: int):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4 * n, 2, 8 * n)
        assert tp_.gather_from_tensor_model_parallel_region(x).shape == (4 * n, 2, 8 * n * n)
        assert tp_.scatter_to_tensor_model_parallel_region(x).shape == (4 * n, 2, 8)
        assert tp_.gather_from_sequence_parallel_region(x).shape == (4 * n * n, 2, 8 * n)
        assert tp_.reduce_scatter_to_sequence_parallel_region(x).shape == (4, 2, 8 * n)
        assert tp_.reduce_from_tensor_model_parallel_region(x).shape == x.shape


def _check_fakes_match_real(n: int):
    """The fakes, reached below autograd, give the real kernels' shapes and strides from the
    schema's arguments alone; on fake tensors the argument errors are the op's own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.megatron_ext
    args = group_args()
    x = torch.randn(4 * n, 6 * n, dtype=torch.float64)
    below_autograd = torch._C._AutoDispatchBelowAutograd
    for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
                 "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
                 "scatter_to_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
                 "all_gather_last_dim_from_tensor_parallel_region",
                 "reduce_scatter_last_dim_to_tensor_parallel_region"):
        op = getattr(ops, name)
        for inp in (x, x.t()):
            with below_autograd():
                real = op(inp, *args)
            with FakeTensorMode() as mode, below_autograd():
                fake = op(mode.from_tensor(inp), *args)
            assert fake.shape == real.shape, (name, fake.shape, real.shape)
            assert fake.stride() == real.stride(), (name, fake.stride(), real.stride())
    if n > 1:
        # The argument errors are the op's own, on fake tensors too (its autograd kernel checks);
        # below autograd the fake only refuses a shape it cannot compute.
        bad = torch.ones(2, 2 * n + 1)
        with FakeTensorMode() as mode:
            with pytest.raises(ValueError, match="not divisible by the group size"):
                ops.scatter_to_tensor_model_parallel_region(mode.from_tensor(bad), *args)
            with pytest.raises(ValueError, match="0 <= rank < group_size"):
                ops.scatter_to_tensor_model_parallel_region(mode.from_tensor(x), args[0], n, n)
            with below_autograd(), pytest.raises(RuntimeError, match=f"dim 1 divisible by {n}"):
                ops.scatter_to_tensor_model_parallel_region(mode.from_tensor(bad), *args)
        with FakeTensorMode() as mode, below_autograd():  # a scalar's all-reduce is a scalar
            scalar = mode.from_tensor(torch.ones(()))
            assert ops.reduce_from_tensor_model_parallel_region(scalar, *args).shape == ()


def _check_schema_mismatch(n: int):
    # group_size and rank travel in the schema; a call that disagrees with the group is refused.
    name, size, rank = group_args()
    with pytest.raises(ValueError, match=f"has size {n} .* passed group_size {n + 1}"):
        torch.ops.megatron_ext.reduce_from_tensor_model_parallel_region(torch.ones(2), name, n + 1, 0)


def _check_double_backward(n: int, compared: Comparisons):
    """Twice differentiable: gradients of gradients equal the serial ones.

    Serial model: z = x * (w_0 + ... + w_{n-1}); y = sum(z^2 * c); G = dy/dx; s = <v, G>.
    Parallel: rank r holds w_r; z = reduce_from(copy_to(x) * w_r).
    """
    r = dist.get_rank(ps.get_tensor_model_parallel_group())
    gen = torch.Generator().manual_seed(4)
    x0 = torch.randn(3, 4 * n, dtype=torch.float64, generator=gen)
    ws = [torch.randn(3, 4 * n, dtype=torch.float64, generator=gen) for _ in range(n)]
    c = torch.randn(3, 4 * n, dtype=torch.float64, generator=gen)
    v = torch.randn(3, 4 * n, dtype=torch.float64, generator=gen)

    def second(parallel: bool):
        x = x0.clone().requires_grad_(True)
        w = [t.clone().requires_grad_(True) for t in ws]
        if parallel:
            z = tp_.copy_to_tensor_model_parallel_region(x) * w[r]
            z = tp_.reduce_from_tensor_model_parallel_region(z)
            # gather/scatter pair along the last dim as well
            z = tp_.gather_from_tensor_model_parallel_region(tp_.scatter_to_tensor_model_parallel_region(z))
        else:
            z = x * sum(w)
        y = (z * z * c).sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        assert gx.requires_grad
        s = (gx * v).sum()
        return gx.detach(), torch.autograd.grad(s, [x, *w], allow_unused=True)

    gx_par, second_par = second(True)
    gx_ser, second_ser = second(False)
    compared.close(gx_par, gx_ser, **EXACT)
    compared.close(second_par[0], second_ser[0], **EXACT)
    compared.close(second_par[1 + r], second_ser[1 + r], **EXACT)


def _check_opcheck(n: int) -> list[tuple[str, dict[str, str]]]:
    """Schema, fake kernel, autograd registration and AOT tracing of every region op."""
    args = group_args()
    ops = torch.ops.megatron_ext
    x = torch.randn(2 * n, 3 * n, dtype=torch.float64, requires_grad=True)
    cases = [
        (getattr(ops, op).default, (x, *args))
        for op in (
            "copy_to_tensor_model_parallel_region",
            "reduce_from_tensor_model_parallel_region",
            "scatter_to_tensor_model_parallel_region",
            "gather_from_tensor_model_parallel_region",
            "scatter_to_sequence_parallel_region",
            "reduce_scatter_to_sequence_parallel_region",
            "all_gather_last_dim_from_tensor_parallel_region",
            "reduce_scatter_last_dim_to_tensor_parallel_region",
        )
    ]
    cases += [(ops.gather_from_sequence_parallel_region.default, (x, flag, *args)) for flag in (True, False)]
    return [(str(op), opcheck_report(op, op_args)) for op, op_args in cases]


def _regions_worker(tp_sizes) -> dict:
    """The regions against serial results at each TP size (recorded comparisons, made in the test)
    and opcheck's reports."""
    compared, reports = Comparisons(), []
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        tp_.copy_to_tensor_model_parallel_region(torch.ones(2))
    for tp in tp_sizes:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        _check_regions(compared)
        _check_regions(compared, group=ps.get_data_parallel_group())  # an explicit group
        _check_errors(tp)
        _check_fakes_match_real(tp)
        _check_schema_mismatch(tp)
        _check_double_backward(tp, compared)
        if tp > 1:
            _check_autograd_nodes_are_cpp()
            _check_dtypes(tp, compared)
            _check_fake_shapes(tp)
            _check_unsupported_dtype(tp)
            if not reports:  # the registration is the same at every size (shapes: _check_fake_shapes)
                reports += _check_opcheck(tp)
            _check_copies(tp, compared)
        ps.destroy_model_parallel()
    return {"compared": compared.made, "opcheck": reports}


def _assert_regions(results: list[dict], tp_sizes: list[int]) -> None:
    for got in results:
        assert_comparisons(got["compared"])
        assert len(got["opcheck"]) == 10 * any(tp > 1 for tp in tp_sizes)
        assert_opchecks_passed(got["opcheck"])
    assert len({len(got["compared"]) for got in results}) == 1


def _copies(fn, also=()) -> int:
    """How many tensor copies (and ``also`` ops) ``fn`` runs, as the profiler sees every op the
    dispatcher runs, the regions' C++ kernels included."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::copy_", *also))


def _check_copies(tp, compared: Comparisons):
    # copy_to -> reduce_from, forward and backward, as a tensor-parallel MLP uses them. Megatron-core
    # all-reduces the caller's tensors in place; here the caller's input and gradient are never
    # written. A sum of at least 1 MiB over two ranks is an exchange and copies nothing; otherwise
    # reduce_from's forward copies its input once and copy_to's backward copies a gradient the
    # caller still holds once. A gradient autograd owns is reduced in place: no new buffer at all.
    for rows in (6, 256):  # 384 B and 2 MiB of float64
        g = torch.Generator().manual_seed(11 + dist.get_rank())
        x = torch.randn(rows, 1024 if rows > 6 else 8, dtype=torch.float64, generator=g).requires_grad_(True)
        held = torch.randn(x.shape, dtype=torch.float64, generator=g)
        x0, held0 = x.detach().clone(), held.clone()
        out = []
        copies = [_copies(lambda: out.append(tp_.reduce_from_tensor_model_parallel_region(x))),
                  _copies(lambda: tp_.copy_to_tensor_model_parallel_region(x).backward(held))]
        grad_held, x.grad = x.grad, None
        z = tp_.copy_to_tensor_model_parallel_region(x) * 3.0
        copies.append(_copies(lambda: z.backward(held), also=("aten::empty", "aten::empty_like")))
        grad_owned, x.grad = x.grad, None
        # Every collective has run on every rank before anything is asserted.
        sums = [torch.empty_like(out[0]) for _ in range(tp)]
        dist.all_gather(sums, out[0].detach(), group=ps.get_tensor_model_parallel_group())
        reduced = _all_reduced(held)

        assert copies == ([0, 0, 0] if tp == 2 and rows > 6 else [1, 1, 0]), (rows, copies)
        assert torch.equal(x.detach(), x0) and torch.equal(held, held0)
        assert all(torch.equal(s, sums[0]) for s in sums)  # every rank holds the same sum, bit for bit
        compared.close(grad_held, reduced, **EXACT)
        compared.close(grad_owned, reduced * 3.0, **EXACT)


def _all_reduced(t):
    t = t.clone()
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    return t


def test_regions_world1():
    _assert_regions(run_distributed(1, _regions_worker, [1]), [1])


@pytest.mark.slow  # TP 2 and 4 over 4 ranks; test_regions_world1 stays in the fast set
def test_regions_world4():
    _assert_regions(run_distributed(4, _regions_worker, [1, 2, 4]), [1, 2, 4])


def test_group_of_one_returns_a_view():
    # The schemas declare that outputs may alias the input (Tensor(a)): at group size 1 a region
    # returns a view of its input, never the input object itself, and copies nothing.
    (got,) = run_distributed(1, _pass_through_worker)
    assert len(got["regions"]) == 5
    for name, (is_input, same_storage, shape, grad) in got["regions"].items():
        assert not is_input and same_storage and shape == [3, 5], name
        assert grad == [[1.0] * 5] * 3, name
    assert got["schema_aliases"] == (True, True)


def _pass_through_worker() -> dict:
    ps.initialize_model_parallel()
    x = torch.randn(3, 5, requires_grad=True)
    regions = {}
    for region in (tp_.copy_to_tensor_model_parallel_region, tp_.reduce_from_tensor_model_parallel_region,
                   tp_.scatter_to_tensor_model_parallel_region, tp_.gather_from_sequence_parallel_region,
                   tp_.reduce_scatter_last_dim_to_tensor_parallel_region):
        out = region(x)
        out.backward(torch.ones_like(out))
        same_storage = out.data_ptr() == x.data_ptr()
        regions[region.__name__] = (out is x, same_storage, list(out.shape), x.grad.tolist())
        x.grad = None
    schema = torch.ops.megatron_ext.reduce_from_tensor_model_parallel_region.default._schema
    aliases = (schema.arguments[0].alias_info is not None, schema.returns[0].alias_info is not None)
    return {"regions": regions, "schema_aliases": aliases}
