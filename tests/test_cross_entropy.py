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
from tests.conftest import (
    TIGHT,
    Comparisons,
    assert_comparisons,
    assert_opchecks_passed,
    float64,
    has_kernel,
    opcheck_report,
)
from tests.distributed import run_distributed

VOCAB = 48  # divisible by every TP size tested
KERNEL_OPS = ["vocab_parallel_cross_entropy_row_stats", "vocab_parallel_cross_entropy_backward"]


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
    assert_close(x.detach(), before, rtol=0, atol=0, equal_nan=True, msg="the logits were modified")
    return loss.detach(), x.grad


def _check_float64(compared: Comparisons):
    cases = [(0.0, None), (0.1, None), (0.0, 7), (0.1, 7), (0.3, -100)]
    for seed, (smoothing, ignore) in enumerate(cases):
        full, target, grad = _inputs(seed, ignore_index=ignore)
        loss, dx = _ours(_local(full), target, grad, label_smoothing=smoothing, ignore_index=ignore)
        ref_loss, ref_dx = _reference(full, target, grad, smoothing, ignore)
        assert loss.dtype == torch.float64 and dx.dtype == torch.float64
        compared.close(loss, ref_loss, **TIGHT)
        compared.close(dx, _local(ref_dx), **TIGHT)
        if ignore is not None and ignore >= 0:
            ignored = target == ignore
            assert ignored.any()
            assert torch.all(loss[ignored] == 0)
            assert torch.all(dx[ignored] == 0)
            assert torch.all(loss[~ignored] > 0)


def _check_large_logits(compared: Comparisons):
    for dtype, tol in ((torch.float64, TIGHT), (torch.float32, dict(rtol=1e-5, atol=1e-3))):
        full, target, grad = _inputs(10, scale=1e4)
        full = full.to(dtype)
        for smoothing in (0.0, 0.2):
            loss, dx = _ours(_local(full), target, grad, label_smoothing=smoothing)
            ref_loss, ref_dx = _reference(full, target, grad, smoothing, None)
            assert torch.isfinite(loss).all() and torch.isfinite(dx).all()
            compared.close(loss.double(), ref_loss, **tol)
            compared.close(dx.double(), _local(ref_dx), **tol)


def _check_low_precision(compared: Comparisons):
    full, target, grad = _inputs(20, shape=(6, 2))
    ref_loss, ref_dx = _reference(full, target, grad, 0.1, None)
    loss, dx = _ours(_local(full.float()), target, grad, label_smoothing=0.1)
    assert loss.dtype == torch.float32 and dx.dtype == torch.float32
    compared.close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    compared.close(dx.double(), _local(ref_dx), rtol=1e-5, atol=1e-6)
    for dtype in (torch.bfloat16, torch.float16):
        rounded = full.to(dtype)
        # fp32 accumulation makes the loss as exact as the rounded logits allow.
        ref_loss, ref_dx = _reference(rounded, target, grad, 0.1, None)
        loss, dx = _ours(_local(rounded), target, grad, label_smoothing=0.1)
        assert loss.dtype == torch.float32 and dx.dtype == dtype
        compared.close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
        compared.close(dx, _local(ref_dx).to(dtype))
    # ignore_index with 32- and 16-bit logits: those tokens get exactly zero loss and gradient.
    full, target, grad = _inputs(21, shape=(6, 2), ignore_index=5)
    ignored = target == 5
    for dtype in (torch.float32, torch.bfloat16):
        rounded = full.to(dtype)
        ref_loss, ref_dx = _reference(rounded, target, grad, 0.1, 5)
        loss, dx = _ours(_local(rounded), target, grad, label_smoothing=0.1, ignore_index=5)
        assert bool(ignored.any()) and torch.all(loss[ignored] == 0) and torch.all(dx[ignored] == 0)
        compared.close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
        compared.close(dx, _local(ref_dx).to(dtype))


def _check_api_variants(compared: Comparisons):
    full, target, grad = _inputs(30)
    ref_loss, _ = _reference(full, target, grad, 0.0, None)
    local = _local(full)
    group = ps.get_tensor_model_parallel_group()
    compared.close(tp_.vocab_parallel_cross_entropy(local, target, tp_group=group), ref_loss, **TIGHT)
    compared.close(tp_.vocab_parallel_cross_entropy(local, target.int()), ref_loss, **TIGHT)
    with torch.inference_mode():  # runs the op without its autograd node
        compared.close(tp_.vocab_parallel_cross_entropy(local, target), ref_loss, **TIGHT)
    # A non-contiguous [b, s, v] view of [s, b, v] logits.
    transposed = tp_.vocab_parallel_cross_entropy(local.transpose(0, 1), target.t())
    compared.close(transposed, ref_loss.t(), **TIGHT)
    empty = tp_.vocab_parallel_cross_entropy(local[:0], target[:0])
    assert empty.shape == (0, 3)

    x = local.clone().requires_grad_(True)
    loss = tp_.vocab_parallel_cross_entropy(x, target)
    assert not isinstance(loss.grad_fn, torch.autograd.function.BackwardCFunction)
    assert "VocabParallelCrossEntropyFunction" in loss.grad_fn.name(), loss.grad_fn.name()
    loss.sum().backward()  # an expanded upstream gradient
    _, ref_dx = _reference(full, target, torch.ones_like(grad), 0.0, None)
    compared.close(x.grad, _local(ref_dx), **TIGHT)


def _check_errors(compared: Comparisons):
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
    compared.close(tp_.vocab_parallel_cross_entropy(local, target), ref_loss, **TIGHT)


def _check_unequal_slices(compared: Comparisons):
    """Slices of different sizes are found inside the MAX all-reduce: every rank raises the same
    error, and a valid call afterwards proves no rank was left waiting."""
    n, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if n == 1:
        return
    full, target, _ = _inputs(45)
    for widths in ([VOCAB // n + (1 if i == 0 else 0) for i in range(n)], [0] + [VOCAB // n] * (n - 1)):
        local = full[..., : widths[r]].contiguous()
        with pytest.raises(ValueError, match=rf"vocabulary slices of different sizes \(from {min(widths)} to "
                           rf"{max(widths)}\); each of the {n} ranks must hold vocab_size / {n} logits"):
            tp_.vocab_parallel_cross_entropy(local, target)
    ref_loss, _ = _reference(full, target, torch.ones(5, 3), 0.0, None)
    compared.close(tp_.vocab_parallel_cross_entropy(_local(full), target), ref_loss, **TIGHT)


def _check_non_finite(compared: Comparisons):
    """±inf, NaN and huge logits give what torch.nn.functional.cross_entropy gives."""
    n = ps.get_tensor_model_parallel_world_size()
    slice_ = VOCAB // n
    for dtype in (torch.float64, torch.float32):
        full, target, grad = _inputs(60, shape=(8,))
        full = full.to(dtype)
        last = VOCAB - 1
        # The last rank's whole slice (a quarter of the row at TP 1) is -inf and holds the target.
        full[0, -(slice_ if n > 1 else VOCAB // 4):] = -torch.inf
        target[0] = last
        full[1, 0] = -torch.inf  # a -inf first logit (label smoothing makes the loss +inf)
        full[2, 5] = torch.nan
        full[3, 7] = torch.inf
        full[4, :] = -torch.inf  # a row with no finite logit
        full[5, 3] = torch.finfo(dtype).max / 1000  # huge logits, with the target far below
        full[5, 9] = -torch.finfo(dtype).max / 1000
        target[5] = 9
        full[6, 11] = -torch.inf  # a -inf logit that is not the target
        target[6] = 12
        full[7, 1:3] = torch.inf
        for smoothing in (0.0, 0.1):
            loss, dx = _ours(_local(full), target, grad, label_smoothing=smoothing)
            ref_loss, ref_dx = _reference(full, target, grad, smoothing, None)
            tol = TIGHT if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
            compared.close(loss.double(), ref_loss, equal_nan=True, **tol)
            compared.close(dx.double(), _local(ref_dx), equal_nan=True, **tol)
            assert loss[0] == torch.inf and torch.isfinite(dx[0]).all()


def _check_double_backward(compared: Comparisons):
    full, target, grad = _inputs(70)
    x = _local(full).requires_grad_(True)
    loss = tp_.vocab_parallel_cross_entropy(x, target, label_smoothing=0.1)
    (dx,) = torch.autograd.grad(loss, x, grad, create_graph=True)
    _, ref_dx = _reference(full, target, grad, 0.1, None)
    compared.close(dx, _local(ref_dx), **TIGHT)
    assert dx.requires_grad
    with pytest.raises(RuntimeError, match="vocab_parallel_cross_entropy is not twice differentiable"):
        dx.sum().backward()


def _check_overwrite_logits(compared: Comparisons):
    """overwrite_logits: the same loss and gradient, the gradient written over the logits."""
    for dtype in (torch.float64, torch.bfloat16):
        full, target, grad = _inputs(80, ignore_index=7)
        local = _local(full).to(dtype)
        ref_loss, ref_dx = _ours(local, target, grad, label_smoothing=0.1, ignore_index=7)
        x = local.clone().requires_grad_(True)
        logits = x * 1  # an intermediate, as a GPT's logits are
        loss = tp_.vocab_parallel_cross_entropy(logits, target, 0.1, None, 7, overwrite_logits=True)
        assert torch.equal(logits.detach(), local), "the forward modified the logits"
        grads = []
        logits.register_hook(lambda g: grads.append(g))
        loss.backward(grad.to(loss.dtype))
        compared.close(loss, ref_loss, rtol=0, atol=0)
        compared.close(x.grad, ref_dx, rtol=0, atol=0)
        assert grads[0].data_ptr() == logits.data_ptr(), "the gradient did not reuse the logits buffer"
    # A node that saved the logits sees autograd's version error, not a wrong gradient.
    x = _local(full).requires_grad_(True)
    logits = x.exp()
    loss = tp_.vocab_parallel_cross_entropy(logits, target, overwrite_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()


def _check_ignored_tokens(compared: Comparisons):
    """Ignored tokens get loss 0 and gradient 0 whatever ``ignore_index`` is (an id of the last or
    the first rank's slice, one past the vocabulary, or a value the local target uses as a code:
    -1, -2) and whatever their logits and loss gradients hold (NaN, inf); every other token gets
    torch's loss and gradient. Unfused (default and overwrite_logits) and fused alike."""
    n = ps.get_tensor_model_parallel_world_size()
    h = torch.randn(5, 3, 6, generator=torch.Generator().manual_seed(61), dtype=torch.float64)
    w = torch.randn(VOCAB, 6, generator=torch.Generator().manual_seed(62), dtype=torch.float64)
    for ignore in (VOCAB - 1, 0, VOCAB, -1, -2):
        full, target, grad = _inputs(60, ignore_index=ignore)  # every fourth token ignored
        ignored = target == ignore
        ref_loss, ref_dx = _reference(full, target, grad.masked_fill(ignored, 0.0), 0.1, ignore)
        full.view(-1, VOCAB)[0, 5], full.view(-1, VOCAB)[4, 9] = float("nan"), float("inf")  # ignored rows
        grad.view(-1)[0] = float("nan")
        for overwrite in (False, True):
            x = _local(full).requires_grad_(True)
            logits = x * 1
            loss = tp_.vocab_parallel_cross_entropy(logits, target, 0.1, None, ignore,
                                                    overwrite_logits=overwrite)
            loss.backward(grad)
            assert torch.all(loss[ignored] == 0) and torch.all(x.grad[ignored] == 0), (ignore, overwrite)
            compared.close(loss[~ignored], ref_loss[~ignored], **TIGHT)
            compared.close(x.grad[~ignored], _local(ref_dx)[~ignored], **TIGHT)
        hidden = h.clone().requires_grad_(True)
        weight = w.chunk(n)[ps.get_tensor_model_parallel_rank()].clone().requires_grad_(True)
        loss = tp_.vocab_parallel_linear_cross_entropy(hidden, weight, target, 0.1, ignore, chunk_size=4)
        loss.backward(grad)
        logits = (h @ w.T).requires_grad_(True)
        ref = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none",
                              ignore_index=ignore, label_smoothing=0.1 * VOCAB / (VOCAB - 1))
        ref = ref.reshape(target.shape)
        ref.backward(grad.masked_fill(ignored, 0.0))
        compared.close(loss, ref.detach(), **TIGHT)
        compared.close(hidden.grad, (logits.grad @ w), **TIGHT)
        compared.close(weight.grad, _local(logits.grad).reshape(-1, VOCAB // n).T @ h.reshape(-1, 6), **TIGHT)


def _check_fakes():
    """The fake kernels give the real ops' shapes, strides, devices and errors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    full, target, _ = _inputs(90)
    local = _local(full)
    n = ps.get_tensor_model_parallel_world_size()
    for logits, tgt in ((local, target.to("meta")), (local.to("meta"), target)):
        with pytest.raises(
            ValueError, match=r"target is on (meta|cpu) but vocab_parallel_logits are on (cpu|meta)"
        ):
            tp_.vocab_parallel_cross_entropy(logits, tgt)
    mode = FakeTensorMode()
    fx = mode.from_tensor(local.transpose(0, 1))
    ft = mode.from_tensor(target.t())
    with mode:
        loss = tp_.vocab_parallel_cross_entropy(fx, ft)
        assert loss.shape == (3, 5) and loss.stride() == (5, 1) and loss.dtype == torch.float64
        with pytest.raises(ValueError, match="label_smoothing must be in"):
            tp_.vocab_parallel_cross_entropy(fx, ft, label_smoothing=-0.5)
        with pytest.raises(ValueError, match="target must hold integer token ids"):
            tp_.vocab_parallel_cross_entropy(fx, ft.float())
        # The fused op: its fake gives the loss's shape and dtype, the op its own errors.
        hidden, weight = mode.from_tensor(torch.ones(3, 5, 4)), mode.from_tensor(torch.ones(VOCAB // n, 4))
        loss = tp_.vocab_parallel_linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), ft)
        assert loss.shape == (3, 5) and loss.dtype == torch.float32
        with pytest.raises(ValueError, match="must equal the hidden size of the weight"):
            tp_.vocab_parallel_linear_cross_entropy(hidden, weight[:, :3], ft)
    real = tp_.vocab_parallel_cross_entropy(local.transpose(0, 1), target.t())
    assert real.stride() == (5, 1)


def _cross_entropy_worker(tp_sizes: list[int]) -> list[tuple]:
    """The vocab-parallel cross-entropy against torch's serial one at each TP size (recorded
    comparisons, made in the test)."""
    compared = Comparisons()
    for tp in tp_sizes:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        _check_float64(compared)
        _check_large_logits(compared)
        _check_low_precision(compared)
        _check_api_variants(compared)
        _check_errors(compared)
        _check_unequal_slices(compared)
        _check_non_finite(compared)
        _check_double_backward(compared)
        _check_overwrite_logits(compared)
        _check_ignored_tokens(compared)
        _check_fakes()
        ps.destroy_model_parallel()
    return compared.made


@pytest.mark.slow
def test_parallel_equals_serial_world4():
    results = run_distributed(4, _cross_entropy_worker, [1, 2, 4])
    for made in results:
        assert_comparisons(made)
    assert len({len(made) for made in results}) == 1


def _opcheck_worker(tp: int) -> dict:
    """opcheck's reports, the local targets and row statistics of the ops (compared in the test)."""
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    group = ps.get_tensor_model_parallel_group()
    group_name, n = group.group_name, tp
    full, target, grad = _inputs(50)
    local = _local(full)
    ops = torch.ops.megatron_ext
    x = local.clone().requires_grad_(True)
    reports = [
        ("vocab_parallel_cross_entropy",
         opcheck_report(ops.vocab_parallel_cross_entropy.default, (x, target, 0.1, 7, group_name, n))),
        ("forward", opcheck_report(
            ops.vocab_parallel_cross_entropy_forward.default, (local, target, 0.0, None, group_name, n)
        )),
        ("row_stats",
         opcheck_report(ops.vocab_parallel_cross_entropy_row_stats.default, (local, target, 0, None))),
    ]
    _, row_max, lse, local_target = ops.vocab_parallel_cross_entropy_forward(
        local, target, 0.0, None, group_name, n
    )
    args = (grad, local, local_target, row_max, lse, 0.0, VOCAB)
    reports.append(("backward", opcheck_report(ops.vocab_parallel_cross_entropy_backward.default, args)))
    reports.append(("backward_", opcheck_report(
        ops.vocab_parallel_cross_entropy_backward_.default, (grad, local.clone(), *args[2:])
    )))
    for bad in (
        local.size(-1),
        -3,
    ):  # a column past the slice, or no meaning at all: refused, nothing written
        wrong = local_target.clone()
        wrong[1] = bad
        with pytest.raises(
            ValueError, match=rf"local_target must hold columns in \[0, {local.size(-1)}\).*{bad}"
        ):
            ops.vocab_parallel_cross_entropy_backward(grad, local, wrong, row_max, lse, 0.0, VOCAB)
    with pytest.raises(ValueError, match=rf"group_size {n + 1} does not match the size {n} of process group"):
        ops.vocab_parallel_cross_entropy(local, target, 0.0, None, group_name, n + 1)

    # local_target with ignore_index 20.
    local_target = ops.vocab_parallel_cross_entropy_forward(local, target, 0.0, 20, group_name, n)[3]
    # Row statistics of one rank holding ids [16, 32) of a 48-id vocabulary.
    stats = ops.vocab_parallel_cross_entropy_row_stats(full[..., 16:32].contiguous(), target, 16, 20)
    return {
        "opcheck": reports,
        "codes": (megatron_ext._C.CROSS_ENTROPY_TARGET_ELSEWHERE,
                  megatron_ext._C.CROSS_ENTROPY_IGNORED_TOKEN),
        "rank": ps.get_tensor_model_parallel_rank(),
        "local_target": local_target.tolist(),
        "row_stats": stats.tolist(),
    }


def _check_opcheck_and_row_stats(results: list[dict], n: int) -> None:
    full, target, _ = _inputs(50)
    for got in results:
        assert len(got["opcheck"]) == 5
        assert_opchecks_passed(got["opcheck"])
        # local_target: the target's column in this rank's slice, else the codes of
        # kernels/cross_entropy.h.
        elsewhere, ignored = got["codes"]
        assert (elsewhere, ignored) == (-1, -2)
        start, width = got["rank"] * (VOCAB // n), VOCAB // n
        expected = torch.where((target >= start) & (target < start + width), target - start, elsewhere)
        assert torch.equal(torch.tensor(got["local_target"]), torch.where(target == 20, ignored, expected))

        stats = float64(got["row_stats"])
        local = full[..., 16:32]
        m = local.amax(-1)
        assert_close(stats[..., 0], m, **TIGHT)
        assert_close(stats[..., 1], (local - m.unsqueeze(-1)).exp().sum(-1), **TIGHT)
        assert_close(stats[..., 2], (local - m.unsqueeze(-1)).sum(-1), **TIGHT)
        holds = (target >= 16) & (target < 32) & (target != 20)
        picked = local.gather(-1, (target - 16).clamp(0, 15).unsqueeze(-1)).squeeze(-1) - m
        assert_close(stats[..., 4], holds.double(), rtol=0, atol=0)
        assert_close(stats[..., 3], torch.where(holds, picked, 0.0), **TIGHT)


def test_opcheck_and_row_stats_world1():
    _check_opcheck_and_row_stats(run_distributed(1, _opcheck_worker, 1), 1)


def test_opcheck_world2():
    _check_opcheck_and_row_stats(run_distributed(2, _opcheck_worker, 2), 2)


def _compiled_matches_eager(tag: str, compile_here: bool) -> int:
    """Compiles (or runs eagerly) fwd+bwd of the loss; returns this rank's AOT-cache hits."""
    from torch._dynamo.utils import counters

    n, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    width = 16  # the same local shape at every TP size, as a cache would see it
    g = torch.Generator().manual_seed(100)
    full = torch.randn(6, width * n, generator=g, dtype=torch.float64)
    target = torch.randint(0, width * n, (6,), generator=g)

    def step(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.clone().requires_grad_(True)
        loss = fn(x, target, 0.1)
        loss.sum().backward()
        return loss.detach(), x.grad

    local = full[:, r * width : (r + 1) * width]
    fn = tp_.vocab_parallel_cross_entropy
    eager = step(local)
    if compile_here:
        torch._dynamo.reset()
        fn = torch.compile(tp_.vocab_parallel_cross_entropy, backend="inductor", fullgraph=True)
    before = counters["aot_autograd"]["autograd_cache_hit"]
    got = step(local)
    assert_close(got[0], eager[0], **TIGHT, msg=f"{tag}: compiled loss differs from eager")
    assert_close(got[1], eager[1], **TIGHT, msg=f"{tag}: compiled gradient differs from eager")
    return counters["aot_autograd"]["autograd_cache_hit"] - before


def _compile_cache_worker(cache_dir: str) -> list[int]:
    import torch._functorch.config
    import torch._inductor.config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch._functorch.config.enable_autograd_cache = True
    torch._inductor.config.fx_graph_cache = True
    r = dist.get_rank()
    hits = []
    # TP 1 on each rank, then TP 2 with rank 0 compiling first and rank 1 reusing its artifacts
    # (the other rank joins the collectives eagerly meanwhile).
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    hits.append(_compiled_matches_eager("tp1", True))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    for turn in (0, 1):
        dist.barrier()
        hits.append(_compiled_matches_eager(f"tp2 rank {r} turn {turn}", r == turn))
    ps.destroy_model_parallel()
    return hits


@pytest.mark.slow  # compiles with inductor
def test_compile_shared_cache_tp1_tp2(tmp_path):
    hits = run_distributed(2, _compile_cache_worker, str(tmp_path / "inductor"), timeout=600)
    # Rank 1 compiled the TP-2 graph after rank 0 had stored it: the shared cache was used, and
    # its gradient (rank-dependent) still equals eager.
    assert hits[1][2] > 0, hits


def test_kernels_registered():
    cuda = megatron_ext.build_info()["cuda_compiled"]
    if os.environ.get("FORCE_CUDA") == "1":
        assert cuda, "FORCE_CUDA=1 but the extension was built without its CUDA kernels"
    for op in KERNEL_OPS:
        assert has_kernel(op, "CPU")
        assert has_kernel(op, "CUDA") == cuda
        assert has_kernel(op, "Meta")
    assert has_kernel("vocab_parallel_cross_entropy", "Autograd")
    assert has_kernel("vocab_parallel_cross_entropy", "CompositeExplicitAutograd")
    assert has_kernel("vocab_parallel_cross_entropy_forward", "CompositeExplicitAutograd")
    assert has_kernel("vocab_parallel_cross_entropy_backward_", "CPU")


CAPABILITY_DTYPES = {"float64": TIGHT, "float32": dict(rtol=2e-6, atol=2e-6),
                     "bfloat16": dict(rtol=1e-5, atol=1e-5)}


def _capability_inputs():
    g = torch.Generator().manual_seed(5)
    rows, width = 7, 2048 + 64 + 5  # two blocks, a vector body and a scalar tail
    full = torch.randn(rows, width, generator=g, dtype=torch.float64) * 4
    full[0, 3] = -torch.inf
    target = torch.randint(0, width, (rows,), generator=g)
    target[1] = -100
    grad = torch.rand(rows, generator=g, dtype=torch.float64)
    return full, target, grad


def test_cpu_capability_variants_agree():
    """Every instruction-set variant the CPU supports gives the torch reference's numbers."""
    (got,) = run_distributed(1, _cpu_capability_worker)
    supported = got["supported"]
    # The best the CPU supports, unless MEGATRON_EXT_CPU_CAPABILITY asks for another.
    chosen = os.environ.get("MEGATRON_EXT_CPU_CAPABILITY", supported[-1])
    assert got["capability"] == got["chosen"] == chosen
    assert set(supported) <= set(got["capabilities"]) and "default" in supported
    assert "unknown CPU capability 'sse9'" in got["refused"]
    assert got["set_to"] == supported and got["restored"] == got["chosen"]
    full, target, grad = _capability_inputs()
    width = full.size(-1)
    assert sorted(got["results"]) == sorted((c, d) for c in supported for d in CAPABILITY_DTYPES)
    for (capability, dtype_name), (loss, x_grad) in got["results"].items():
        dtype, tol = getattr(torch, dtype_name), CAPABILITY_DTYPES[dtype_name]
        ref = full.to(dtype).double().detach().clone().requires_grad_(True)
        ref_loss = F.cross_entropy(ref, target, reduction="none", ignore_index=-100,
                                   label_smoothing=0.1 * width / (width - 1))
        ref_loss.backward(grad)
        # The worker's values are exactly its dtype's (converted to Python floats).
        assert_close(float64(loss), ref_loss.detach(), **tol, msg=f"{capability} {dtype}")
        assert_close(float64(x_grad), ref.grad.to(dtype).double(), **tol, msg=f"{capability} {dtype}")


def _cpu_capability_worker() -> dict:
    from megatron_ext import _C

    ps.initialize_model_parallel()

    info = megatron_ext.build_info()
    supported = _C.supported_cpu_capabilities()
    got = {
        "capability": info["cpu_capability"], "capabilities": info["cpu_capabilities"],
        "chosen": _C.cpu_capability(), "supported": supported, "set_to": [], "results": {},
    }
    with pytest.raises(ValueError) as refused:
        _C._set_cpu_capability("sse9")
    got["refused"] = str(refused.value)
    full, target, grad = _capability_inputs()
    try:
        for capability in supported:
            _C._set_cpu_capability(capability)
            got["set_to"].append(_C.cpu_capability())
            for dtype_name in CAPABILITY_DTYPES:
                x = full.to(getattr(torch, dtype_name)).detach().clone().requires_grad_(True)
                loss = tp_.vocab_parallel_cross_entropy(x, target, 0.1, None, -100)
                loss.backward(grad.to(loss.dtype))
                got["results"][(capability, dtype_name)] = (loss.double().tolist(), x.grad.double().tolist())
    finally:
        _C._set_cpu_capability(got["chosen"])
    got["restored"] = _C.cpu_capability()
    return got
