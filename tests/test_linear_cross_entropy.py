"""vocab_parallel_linear_cross_entropy (output layer + loss over chunks of tokens) against the
unfused path copy_to -> linear -> vocab_parallel_cross_entropy at tensor-parallel sizes 1, 2 and
4: loss, hidden-state and weight gradients in float64 (1e-10) for several chunk sizes, loss
gradients (uniform, loss-masked, arbitrary), label smoothing, ignore_index, frozen inputs and a
retained graph; float32 and bfloat16 looser; bad input; opcheck; kernel registration."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel as tp_
from tests.conftest import (
    TIGHT,
    Comparisons,
    assert_comparisons,
    assert_opchecks_passed,
    has_kernel,
    opcheck_report,
)
from tests.distributed import run_distributed

VOCAB = 48  # divisible by every TP size tested
HIDDEN = 8
SHAPE = (5, 3)  # 15 tokens: chunk sizes 4 and 7 do not divide it
OPS = ("vocab_parallel_linear_cross_entropy", "vocab_parallel_linear_cross_entropy_forward",
       "vocab_parallel_linear_cross_entropy_backward")


def _inputs(seed: int, dtype=torch.float64, ignore_index: int | None = None):
    """Hidden states, the full weight, targets and loss gradients, identical on every process."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*SHAPE, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.7
    target = torch.randint(0, VOCAB, SHAPE, generator=g)
    if ignore_index is not None:
        target.view(-1)[1::4] = ignore_index
    grads = {
        "uniform": torch.full(SHAPE, 1.0 / target.numel(), dtype=torch.float64),
        "masked": (torch.rand(SHAPE, generator=g) > 0.3).double() / 7,
        "arbitrary": torch.rand(SHAPE, generator=g, dtype=torch.float64) + 0.5,
    }
    return hidden.to(dtype), weight.to(dtype), target, {k: v.to(dtype) for k, v in grads.items()}


def _local_rows(full: torch.Tensor) -> torch.Tensor:
    n, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return full.chunk(n, 0)[r].contiguous()


def _run(fused: bool, hidden, weight, target, grad, *, hidden_grad=True, weight_grad=True, **kwargs):
    """Loss and gradients of this rank's weight slice, fused or through the unfused layers."""
    h = hidden.detach().clone().requires_grad_(hidden_grad)
    w = _local_rows(weight).requires_grad_(weight_grad)
    if fused:
        loss = tp_.vocab_parallel_linear_cross_entropy(h, w, target, **kwargs)
    else:
        kwargs.pop("chunk_size", None)
        logits = F.linear(tp_.copy_to_tensor_model_parallel_region(h), w)
        loss = tp_.vocab_parallel_cross_entropy(logits, target, **kwargs)
    loss.backward(grad.to(loss.dtype))
    return loss.detach(), h.grad, w.grad


def _check_equal_to_unfused(tp: int, compared: Comparisons) -> None:
    hidden, weight, target, grads = _inputs(seed=10 + tp)
    for chunk_size in (1, 4, 7, 15, 100, None):
        for name, grad in grads.items():
            ref = _run(False, hidden, weight, target, grad)
            got = _run(True, hidden, weight, target, grad, chunk_size=chunk_size)
            for a, b in zip(got, ref):
                compared.close(a, b, **TIGHT, label=f"tp={tp} chunk={chunk_size} grad={name}")

    # The unfused path itself against serial torch on the full logits.
    ref_loss = F.cross_entropy((hidden @ weight.T).reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    compared.close(_run(True, hidden, weight, target, grads["arbitrary"], chunk_size=4)[0],
                   ref_loss.reshape(SHAPE), **TIGHT)

    # Label smoothing and ignore_index, together and apart, with every kind of loss gradient.
    hidden, weight, target, grads = _inputs(seed=20 + tp, ignore_index=7)
    for kwargs in (
        dict(label_smoothing=0.1),
        dict(ignore_index=7),
        dict(label_smoothing=0.2, ignore_index=7),
    ):
        for name, grad in grads.items():
            grad = grad.clone()
            grad.view(-1)[1] = float("nan")  # an ignored token's gradient must not leak
            if "ignore_index" not in kwargs:
                grad.view(-1)[1] = 0.25
            ref = _run(False, hidden, weight, target, grad, **kwargs)
            got = _run(True, hidden, weight, target, grad, chunk_size=4, **kwargs)
            for a, b in zip(got, ref):
                compared.close(a, b, **TIGHT, label=f"tp={tp} {kwargs} grad={name}")

    # Every token ignored: zero loss and zero gradients.
    all_ignored = torch.full_like(target, 7)
    got = _run(True, hidden, weight, all_ignored, grads["arbitrary"], ignore_index=7, chunk_size=4)
    for t in got:
        compared.close(t, torch.zeros_like(t), rtol=0, atol=0)

    # Only one of the inputs requires a gradient.
    grad = grads["masked"]
    ref = _run(False, hidden, weight, target, grad)
    got = _run(True, hidden, weight, target, grad, weight_grad=False, chunk_size=4)
    assert got[2] is None
    compared.close(got[1], ref[1], **TIGHT)
    got = _run(True, hidden, weight, target, grad, hidden_grad=False, chunk_size=4)
    assert got[1] is None
    compared.close(got[2], ref[2], **TIGHT)

    # A retained graph: the second backward recomputes every chunk and adds the same gradients.
    h = hidden.clone().requires_grad_(True)
    w = _local_rows(weight).requires_grad_(True)
    loss = tp_.vocab_parallel_linear_cross_entropy(h, w, target, chunk_size=4)
    loss.backward(grads["uniform"], retain_graph=True)
    loss.backward(grads["arbitrary"])
    ref_u = _run(False, hidden, weight, target, grads["uniform"])
    ref_a = _run(False, hidden, weight, target, grads["arbitrary"])
    compared.close(h.grad, ref_u[1] + ref_a[1], **TIGHT)
    compared.close(w.grad, ref_u[2] + ref_a[2], **TIGHT)

    # No autograd: the loss alone.
    with torch.no_grad():
        loss = tp_.vocab_parallel_linear_cross_entropy(hidden, _local_rows(weight), target, chunk_size=4)
    compared.close(loss, ref_u[0], **TIGHT)


def _check_low_precision(tp: int, compared: Comparisons) -> None:
    for dtype, tol in (
        (torch.float32, dict(rtol=1e-5, atol=1e-6)),
        (torch.bfloat16, dict(rtol=3e-2, atol=1e-2)),
    ):
        hidden, weight, target, grads = _inputs(seed=30 + tp, dtype=dtype)
        for name, grad in grads.items():
            ref = _run(False, hidden, weight, target, grad, label_smoothing=0.1)
            got = _run(True, hidden, weight, target, grad, label_smoothing=0.1, chunk_size=4)
            assert got[0].dtype == torch.float32 and got[1].dtype == dtype and got[2].dtype == dtype
            for a, b in zip(got, ref):
                compared.close(a.float(), b.float(), **tol, label=f"tp={tp} {dtype} grad={name}")


def _check_errors(tp: int) -> None:
    hidden, weight, target, _ = _inputs(seed=1)
    w = _local_rows(weight)
    fn = tp_.vocab_parallel_linear_cross_entropy
    with pytest.raises(ValueError, match=r"target id 48 is outside the vocabulary \[0, 48\)"):
        fn(hidden, w, torch.where(target == target.view(-1)[3], VOCAB, target), chunk_size=4)
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        fn(hidden, w, target, chunk_size=0)
    with pytest.raises(ValueError, match="last dim of hidden"):
        fn(hidden[..., :-1], w, target)
    with pytest.raises(ValueError, match="target shape"):
        fn(hidden, w, target[:, :2])
    with pytest.raises(ValueError, match="weight has dtype Float but hidden has dtype Double"):
        fn(hidden, w.float(), target)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        fn(hidden, w, target, label_smoothing=1.5)
    name = ps.get_tensor_model_parallel_group().group_name
    with pytest.raises(ValueError, match="do not match process group"):
        torch.ops.megatron_ext.vocab_parallel_linear_cross_entropy(
            hidden, w, target, 0.0, None, 4, name, tp + 1, 0
        )


def _check_opcheck() -> list[tuple[str, dict[str, str]]]:
    hidden, weight, target, grads = _inputs(seed=3, ignore_index=5)
    name, size, rank = tp_.utils.group_args()
    ops = torch.ops.megatron_ext
    w = _local_rows(weight)
    h = hidden.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    reports = [
        ("fused", opcheck_report(ops.vocab_parallel_linear_cross_entropy.default,
                                 (h, wg, target, 0.1, 5, 4, name, size, rank))),
        ("forward", opcheck_report(ops.vocab_parallel_linear_cross_entropy_forward.default,
                                   (hidden, w, target, 0.1, 5, 4, True, True, name, size, rank))),
    ]
    _, row_max, lse, gh, gw = ops.vocab_parallel_linear_cross_entropy_forward(
        hidden, w, target, 0.1, 5, 4, True, True, name, size, rank)
    local = w.size(0)
    reports.append(("backward", opcheck_report(
        ops.vocab_parallel_linear_cross_entropy_backward.default,
        (grads["masked"], hidden, w, target, row_max, lse, gh, gw, 0.1, 5, 4, True,
         rank * local, size * local, name, size),
    )))
    return reports


def _worker() -> dict:
    """Fused against unfused losses and gradients at TP 1, 2 and 4 (recorded comparisons, made in
    the test) and opcheck's reports."""
    compared, reports = Comparisons(), []
    for tp in (1, 2, 4):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        _check_equal_to_unfused(tp, compared)
        _check_errors(tp)
        if tp in (1, 2):
            reports += _check_opcheck()
        if tp == 2:
            _check_low_precision(tp, compared)
        ps.destroy_model_parallel()
    return {"compared": compared.made, "opcheck": reports}


@pytest.mark.slow  # three TP sizes over 4 ranks; test_cross_entropy covers the unfused loss in the fast set
def test_equal_to_unfused_tp_1_2_4():
    results = run_distributed(4, _worker)
    for got in results:
        assert_comparisons(got["compared"])
        assert len(got["opcheck"]) == 6
        assert_opchecks_passed(got["opcheck"])
    assert len({len(got["compared"]) for got in results}) == 1


def test_kernels_registered():
    for op in OPS:
        assert has_kernel(op, "CompositeExplicitAutograd")
    assert has_kernel(OPS[0], "Autograd")


def _cuda_worker() -> list[tuple]:
    torch.cuda.set_device(0)
    compared = Comparisons()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    for dtype, tol in ((torch.float64, TIGHT), (torch.bfloat16, dict(rtol=3e-2, atol=1e-2))):
        hidden, weight, target, grads = _inputs(seed=5, dtype=dtype, ignore_index=3)
        args = [t.cuda() for t in (hidden, weight, target)]
        for grad in grads.values():
            ref = _run(False, *args, grad.cuda(), label_smoothing=0.1, ignore_index=3)
            got = _run(True, *args, grad.cuda(), label_smoothing=0.1, ignore_index=3, chunk_size=4)
            for a, b in zip(got, ref):
                compared.close(a.float(), b.float(), **tol)
    return compared.made


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_one_rank():
    """On a GPU, a group of one rank: fused against unfused in float64 and bfloat16."""
    (made,) = run_distributed(1, _cuda_worker)
    assert_comparisons(made)
