"""vocab_parallel_cross_entropy at tensor-parallel sizes 1, 2 and 4 against
torch.nn.functional.cross_entropy on the gathered logits: loss and gradient in float64, float32,
float16 and bfloat16, label smoothing, ignore_index, large logits, bad input, kernel registration."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

import megatron_ext
from megatron_ext import parallel_state as ps
from megatron_ext import tensor_parallel as tp_
from tests.distributed import run_distributed

VOCAB = 48  # divisible by every TP size tested
TIGHT = dict(rtol=1e-10, atol=1e-12)
KERNEL_OPS = ["vocab_parallel_cross_entropy_row_stats", "vocab_parallel_cross_entropy_backward"]


def _has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_ext::{op}", key)


def _inputs(seed: int, shape=(5, 3), scale: float = 3.0, ignore_index: int | None = None):
    """Full logits ``[*shape, VOCAB]`` (float64), targets and an upstream gradient, identical on
    every process. A few targets equal ``ignore_index`` when it is in the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, VOCAB, generator=g, dtype=torch.float64) * scale
    target = torch.randint(0, VOCAB, shape, generator=g)
    if ignore_index is not None:
        target.view(-1)[::4] = ignore_index
    grad = torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5
    return logits, target, grad


def _reference(full: torch.Tensor, target: torch.Tensor, grad: torch.Tensor, smoothing: float,
               ignore_index: int | None):
    """Loss and full gradient of torch's cross-entropy in float64. Megatron-core's smoothing ``a``
    (1 - a on the target, a / (V - 1) elsewhere) is torch's ``a * V / (V - 1)``."""
    x = full.detach().to(torch.float64).requires_grad_(True)
    loss = F.cross_entropy(
        x.reshape(-1, VOCAB), target.reshape(-1), reduction="none",
        label_smoothing=smoothing * VOCAB / (VOCAB - 1),
        ignore_index=-100 if ignore_index is None else ignore_index,
    ).reshape(target.shape)
    loss.backward(grad.to(torch.float64))
    return loss.detach(), x.grad


def _local(full: torch.Tensor) -> torch.Tensor:
    n, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return full.chunk(n, -1)[r].contiguous()


def _ours(local: torch.Tensor, target: torch.Tensor, grad: torch.Tensor, **kwargs):
    x = local.clone().requires_grad_(True)
    before = x.detach().clone()
    loss = tp_.vocab_parallel_cross_entropy(x, target, **kwargs)
    loss.backward(grad.to(loss.dtype))
    assert torch.equal(x.detach(), before), "the logits were modified"
    return loss.detach(), x.grad


def _check_float64():
    cases = [(0.0, None), (0.1, None), (0.0, 7), (0.1, 7), (0.3, -100)]
    for seed, (smoothing, ignore) in enumerate(cases):
        full, target, grad = _inputs(seed, ignore_index=ignore)
        loss, dx = _ours(_local(full), target, grad, label_smoothing=smoothing, ignore_index=ignore)
        ref_loss, ref_dx = _reference(full, target, grad, smoothing, ignore)
        assert loss.dtype == torch.float64 and dx.dtype == torch.float64
        assert_close(loss, ref_loss, **TIGHT)
        assert_close(dx, _local(ref_dx), **TIGHT)
        if ignore is not None and ignore >= 0:
            ignored = target == ignore
            assert ignored.any()
            assert torch.all(loss[ignored] == 0)
            assert torch.all(dx[ignored] == 0)
            assert torch.all(loss[~ignored] > 0)


def _check_large_logits():
    for dtype, tol in ((torch.float64, TIGHT), (torch.float32, dict(rtol=1e-5, atol=1e-3))):
        full, target, grad = _inputs(10, scale=1e4)
        full = full.to(dtype)
        for smoothing in (0.0, 0.2):
            loss, dx = _ours(_local(full), target, grad, label_smoothing=smoothing)
            ref_loss, ref_dx = _reference(full, target, grad, smoothing, None)
            assert torch.isfinite(loss).all() and torch.isfinite(dx).all()
            assert_close(loss.double(), ref_loss, **tol)
            assert_close(dx.double(), _local(ref_dx), **tol)


def _check_low_precision():
    full, target, grad = _inputs(20, shape=(6, 2))
    ref_loss, ref_dx = _reference(full, target, grad, 0.1, None)
    loss, dx = _ours(_local(full.float()), target, grad, label_smoothing=0.1)
    assert loss.dtype == torch.float32 and dx.dtype == torch.float32
    assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    assert_close(dx.double(), _local(ref_dx), rtol=1e-5, atol=1e-6)
    for dtype in (torch.bfloat16, torch.float16):
        rounded = full.to(dtype)
        # fp32 accumulation makes the loss as exact as the rounded logits allow.
        ref_loss, ref_dx = _reference(rounded, target, grad, 0.1, None)
        loss, dx = _ours(_local(rounded), target, grad, label_smoothing=0.1)
        assert loss.dtype == torch.float32 and dx.dtype == dtype
        assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
        assert_close(dx, _local(ref_dx).to(dtype))
    # ignore_index with 32- and 16-bit logits: those tokens get exactly zero loss and gradient.
    full, target, grad = _inputs(21, shape=(6, 2), ignore_index=5)
    ignored = target == 5
    for dtype in (torch.float32, torch.bfloat16):
        rounded = full.to(dtype)
        ref_loss, ref_dx = _reference(rounded, target, grad, 0.1, 5)
        loss, dx = _ours(_local(rounded), target, grad, label_smoothing=0.1, ignore_index=5)
        assert bool(ignored.any()) and torch.all(loss[ignored] == 0) and torch.all(dx[ignored] == 0)
        assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
        assert_close(dx, _local(ref_dx).to(dtype))


def _check_api_variants():
    full, target, grad = _inputs(30)
    ref_loss, _ = _reference(full, target, grad, 0.0, None)
    local = _local(full)
    group = ps.get_tensor_model_parallel_group()
    assert_close(tp_.vocab_parallel_cross_entropy(local, target, tp_group=group), ref_loss, **TIGHT)
    assert_close(tp_.vocab_parallel_cross_entropy(local, target.int()), ref_loss, **TIGHT)
    with torch.inference_mode():  # runs the op without its autograd node
        assert_close(tp_.vocab_parallel_cross_entropy(local, target), ref_loss, **TIGHT)
    # A non-contiguous [b, s, v] view of [s, b, v] logits.
    transposed = tp_.vocab_parallel_cross_entropy(local.transpose(0, 1), target.t())
    assert_close(transposed, ref_loss.t(), **TIGHT)
    empty = tp_.vocab_parallel_cross_entropy(local[:0], target[:0])
    assert empty.shape == (0, 3)

    x = local.clone().requires_grad_(True)
    loss = tp_.vocab_parallel_cross_entropy(x, target)
    assert not isinstance(loss.grad_fn, torch.autograd.function.BackwardCFunction)
    assert "VocabParallelCrossEntropyFunction" in loss.grad_fn.name(), loss.grad_fn.name()
    loss.sum().backward()  # an expanded upstream gradient
    _, ref_dx = _reference(full, target, torch.ones_like(grad), 0.0, None)
    assert_close(x.grad, _local(ref_dx), **TIGHT)


def _check_errors():
    """Every rank raises the same error before any collective; a valid call afterwards proves no
    rank was left waiting in one."""
    n = ps.get_tensor_model_parallel_world_size()
    full, target, _ = _inputs(40)
    local = _local(full)
    bad = target.clone()
    bad[1, 2] = VOCAB
    with pytest.raises(ValueError, match=rf"target id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"):
        tp_.vocab_parallel_cross_entropy(local, bad)
    bad[1, 2] = -3
    with pytest.raises(ValueError, match=rf"target id -3 is outside the vocabulary \[0, {VOCAB}\) and is not "
                       r"ignore_index -100 \(1 such target\)"):
        tp_.vocab_parallel_cross_entropy(local, bad, ignore_index=-100)
    bad[1, 2] = -100  # an ignored id is not range-checked
    assert tp_.vocab_parallel_cross_entropy(local, bad, ignore_index=-100)[1, 2].item() == 0.0
    with pytest.raises(ValueError, match=r"target shape \[5, 2\] must equal the logits shape "
                       rf"\[5, 3, {VOCAB // n}\] without its last"):
        tp_.vocab_parallel_cross_entropy(local, target[:, :2])
    with pytest.raises(ValueError, match="target must hold integer token ids, got dtype Float"):
        tp_.vocab_parallel_cross_entropy(local, target.float())
    with pytest.raises(ValueError, match="vocab_parallel_logits must be floating point, got dtype Long"):
        tp_.vocab_parallel_cross_entropy(target.unsqueeze(-1), target)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\), got 1"):
        tp_.vocab_parallel_cross_entropy(local, target, label_smoothing=1.0)
    with pytest.raises(TypeError, match="target must be a torch.Tensor, got list"):
        tp_.vocab_parallel_cross_entropy(local, [1, 2])
    ref_loss, _ = _reference(full, target, torch.ones(5, 3), 0.0, None)
    assert_close(tp_.vocab_parallel_cross_entropy(local, target), ref_loss, **TIGHT)


def _cross_entropy_worker(tp_sizes: list[int]) -> bool:
    for tp in tp_sizes:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        _check_float64()
        _check_large_logits()
        _check_low_precision()
        _check_api_variants()
        _check_errors()
        ps.destroy_model_parallel()
    return True


def test_parallel_equals_serial_world4():
    assert run_distributed(4, _cross_entropy_worker, [1, 2, 4]) == [True] * 4


def _one_rank_worker() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode

    ps.initialize_model_parallel()
    group_name = ps.get_tensor_model_parallel_group().group_name
    full, target, grad = _inputs(50)
    ops = torch.ops.megatron_ext
    x = full.clone().requires_grad_(True)
    torch.library.opcheck(ops.vocab_parallel_cross_entropy.default, (x, target, 0.1, 7, group_name))
    torch.library.opcheck(ops.vocab_parallel_cross_entropy_forward.default, (full, target, 0.0, None, group_name))
    torch.library.opcheck(ops.vocab_parallel_cross_entropy_row_stats.default, (full, target, 0, None))
    _, row_max, lse = ops.vocab_parallel_cross_entropy_forward(full, target, 0.0, None, group_name)
    torch.library.opcheck(ops.vocab_parallel_cross_entropy_backward.default,
                          (grad, full, target, row_max, lse, 0.0, None, 0, VOCAB))

    # Row statistics of one rank holding ids [16, 32) of a 48-id vocabulary.
    local = full[..., 16:32].contiguous()
    stats = ops.vocab_parallel_cross_entropy_row_stats(local, target, 16, 20)
    m = local.amax(-1)
    assert_close(stats[..., 0], m, **TIGHT)
    assert_close(stats[..., 1], (local - m.unsqueeze(-1)).exp().sum(-1), **TIGHT)
    assert_close(stats[..., 2], (local - m.unsqueeze(-1)).sum(-1), **TIGHT)
    holds = (target >= 16) & (target < 32) & (target != 20)
    picked = local.gather(-1, (target - 16).clamp(0, 15).unsqueeze(-1)).squeeze(-1) - m
    assert_close(stats[..., 4], holds.double(), rtol=0, atol=0)
    assert_close(stats[..., 3], torch.where(holds, picked, 0.0), **TIGHT)

    with FakeTensorMode():
        fx = torch.empty(7, 2, VOCAB, dtype=torch.bfloat16, requires_grad=True)
        ft = torch.empty(7, 2, dtype=torch.long)
        loss = tp_.vocab_parallel_cross_entropy(fx, ft)
        assert loss.shape == (7, 2) and loss.dtype == torch.float32
    return True


def test_opcheck_and_row_stats_world1():
    assert run_distributed(1, _one_rank_worker) == [True]


def test_kernels_registered():
    cuda = megatron_ext.build_info()["cuda_compiled"]
    if os.environ.get("FORCE_CUDA") == "1":
        assert cuda, "FORCE_CUDA=1 but the extension was built without its CUDA kernels"
    for op in KERNEL_OPS:
        assert _has_kernel(op, "CPU")
        assert _has_kernel(op, "CUDA") == cuda
        assert _has_kernel(op, "Meta")
    assert _has_kernel("vocab_parallel_cross_entropy", "Autograd")
    assert _has_kernel("vocab_parallel_cross_entropy", "CompositeExplicitAutograd")
    assert _has_kernel("vocab_parallel_cross_entropy_forward", "CompositeExplicitAutograd")
