"""The fused RMSNorm, rotary embedding and SwiGLU ops on CPU (the twins of the CUDA kernels) against
the torch-op chains they replace, forward and backward:

* float64 and float32: rotary embedding and SwiGLU equal the chains bit for bit (the CPU kernels
  round every product the chains round; SwiGLU's exp is torch's own vectorised one and its rows
  split into vector lanes and a scalar tail as torch's loops split them, so that equality holds
  where our kernels run the instruction set torch runs); RMSNorm sums a row in another order than
  torch's reduction, so it equals F.rms_norm to a few units in the last place;
* bfloat16: the fused kernels compute in float32 and round once, so they are compared with the
  chains evaluated in float32 from the same bfloat16 inputs, to half a bfloat16 unit (plus the
  float32 rounding of sums).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import megatron_ext
from megatron_ext import _C
from megatron_ext.fusions import (
    bias_swiglu,
    bias_swiglu_impl,
    fused_apply_rotary_pos_emb,
    fused_rms_norm,
    swiglu,
)
from tests.conftest import grads_of, has_kernel

ops = torch.ops.megatron_ext
DTYPES = [torch.float64, torch.float32, torch.bfloat16]
# Half a bfloat16 unit in the last place, relative (8 significant bits).
BF16_HALF_ULP = dict(rtol=2.0**-8, atol=1e-6)
# The fused SwiGLU and rotary kernels equal torch's ops bit for bit when they run torch's instruction set.
SAME_ISA = _C.cpu_capability() == torch.backends.cpu.get_cpu_capability().lower()


def _randn(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0,
           scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _leaf(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype).requires_grad_()


def _assert_equal(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, msg
    diff = (got.double() - want.double()).abs().max().item()
    assert torch.equal(got, want), f"{msg}: max |diff| {diff:.3e}"


# --- RMSNorm ---------------------------------------------------------------------------------

RMS_SHAPES = [(5, 3, 24), (7, 37), (2, 3, 1000 + 3), (1, 1)]  # vector body and tail, one lane


@pytest.mark.parametrize("shape", RMS_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_torch(dtype, shape):
    eps = 1e-5
    h = shape[-1]
    x = _leaf(_randn(*shape, dtype=dtype, seed=1, scale=3.0))
    w = _leaf(_randn(h, dtype=dtype, seed=2) + 1)
    grad = _randn(*shape, dtype=dtype, seed=3)
    out = fused_rms_norm(x, w, eps)
    assert out.dtype == dtype and out.shape == x.shape
    grads = grads_of(out, grad, x, w)
    # The reference in the accumulation dtype from the same (rounded) inputs.
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    x_ref, w_ref = _leaf(x, acc), _leaf(w, acc)
    ref = F.rms_norm(x_ref, (h,), w_ref, eps)
    ref_grads = grads_of(ref, grad.to(acc), x_ref, w_ref)
    if dtype == torch.float64:
        # Only the row sums' order differs from torch's: the output within 4 ulp, the gradients
        # (whose terms partly cancel) within 1e-14 of their scale.
        assert_close(out, ref, rtol=1e-15, atol=0)
        for got, want in zip(grads, ref_grads):
            assert_close(got, want, rtol=1e-14, atol=1e-14 * want.abs().max().item())
    elif dtype == torch.float32:
        assert_close(out, ref, rtol=4e-7, atol=1e-7)
        for got, want in zip(grads, ref_grads):
            assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:
        assert_close(out.float(), ref, **BF16_HALF_ULP)
        for got, want in zip(grads, ref_grads):
            assert got.dtype == dtype
            assert_close(got.float(), want, rtol=2.0**-8, atol=1e-5 * want.abs().max().item())


def test_rms_norm_statistics_and_weight_gradient_are_float32_for_bf16():
    """rstd is float32 for 16-bit inputs, and the weight gradient is summed in float32 before its one
    rounding: over 4096 rows a bfloat16 running sum would be far off."""
    rows, h = 4096, 8
    x = _randn(rows, h, dtype=torch.bfloat16, seed=4)
    w = _randn(h, dtype=torch.bfloat16, seed=5)
    out, rstd = ops.rms_norm_forward(x, w, 1e-6)
    assert rstd.dtype == torch.float32 and rstd.shape == (rows,)
    assert_close(rstd, x.float().pow(2).mean(-1).add(1e-6).rsqrt(), rtol=1e-6, atol=0)
    grad = _randn(rows, h, dtype=torch.bfloat16, seed=6)
    _, grad_w = ops.rms_norm_backward(grad, x, w, rstd)
    want = (grad.float() * x.float() * rstd[:, None]).sum(0)
    assert grad_w.dtype == torch.bfloat16
    assert_close(grad_w.float(), want, rtol=2.0**-8, atol=1e-3)


def test_rms_norm_weight_gradient_does_not_depend_on_threads():
    x = _randn(300, 40, seed=7)
    w = _randn(40, seed=8)
    grad = _randn(300, 40, seed=9)
    _, rstd = ops.rms_norm_forward(x, w, 1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.rms_norm_backward(grad, x, w, rstd)
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(ops.rms_norm_backward(grad, x, w, rstd), one):
        _assert_equal(got, want)


def test_rms_norm_non_contiguous_input():
    base = _randn(6, 4, 2 * 33, seed=10)
    x = _leaf(base)[..., ::2]  # strided last dim
    w = _leaf(_randn(33, seed=11))
    grad = _randn(6, 4, 33, seed=12)
    out = fused_rms_norm(x, w, 1e-6)
    assert out.is_contiguous()
    x_ref, w_ref = _leaf(x.detach().contiguous()), _leaf(w)
    ref = F.rms_norm(x_ref, (33,), w_ref, 1e-6)
    assert_close(out, ref, rtol=1e-15, atol=0)
    gx, gw = grads_of(out, grad, x, w)
    rx, rw = grads_of(ref, grad, x_ref, w_ref)
    assert_close(gx, rx, rtol=1e-14, atol=1e-14)
    assert_close(gw, rw, rtol=1e-14, atol=1e-14)


# --- rotary embedding ------------------------------------------------------------------------


def _freqs(s: int, rot_dim: int, interleaved: bool, base: float = 10000.0) -> torch.Tensor:
    """Megatron-core's rotary angles [s, 1, 1, rot_dim] (RotaryEmbedding.get_emb) in float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    emb = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return emb[:, None, None, :]


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """t * cos + rotate_half(t) * sin, rotate_half as Megatron-core's ``_rotate_half``."""
    if interleaved:
        rotated = torch.stack((-t[..., 1::2], t[..., 0::2]), dim=-1).flatten(-2)
    else:
        first, second = torch.chunk(t, 2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
    return t * cos + rotated * sin


def _rope_chain(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The torch ops of Megatron-core's unfused rotary embedding (``_apply_rotary_pos_emb_bshd``)."""
    rot_dim = freqs.shape[-1]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    return torch.cat((_rotate(t[..., :rot_dim], cos, sin, interleaved), t[..., rot_dim:]), dim=-1)


ROPE_CASES = [((7, 3, 4, 40), 40), ((5, 2, 3, 64), 32), ((3, 1, 2, 6), 2), ((4, 2, 2, 80), 80)]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape,rot_dim", ROPE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_equals_megatron_chain(dtype, shape, rot_dim, interleaved):
    t = _leaf(_randn(*shape, dtype=dtype, seed=20, scale=2.0))
    freqs = _freqs(shape[0], rot_dim, interleaved)
    grad = _randn(*shape, dtype=dtype, seed=21)
    out = fused_apply_rotary_pos_emb(t, freqs, rotary_interleaved=interleaved)
    assert out.dtype == dtype and out.shape == t.shape and out.is_contiguous()
    (got_grad,) = grads_of(out, grad, t)
    if dtype in (torch.float64, torch.float32):
        t_ref = _leaf(t)
        ref = _rope_chain(t_ref, freqs, interleaved)
        _assert_equal(out, ref, "forward")
        _assert_equal(got_grad, grads_of(ref, grad, t_ref)[0], "backward")
    else:
        t32 = _leaf(t, torch.float32)
        cos = torch.cos(freqs).to(dtype).float()
        sin = torch.sin(freqs).to(dtype).float()
        ref = torch.cat((_rotate(t32[..., :rot_dim], cos, sin, interleaved), t32[..., rot_dim:]), dim=-1)
        assert_close(out.float(), ref, **BF16_HALF_ULP)
        (want,) = grads_of(ref, grad.float(), t32)
        assert_close(got_grad.float(), want, **BF16_HALF_ULP)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_reads_strided_heads(interleaved):
    """q of a fused QKV output is a view: read in place when its lanes are contiguous, else copied."""
    s, b, n, d = 6, 2, 3, 16
    freqs = _freqs(s, d, interleaved)
    grad = _randn(s, b, n, d, seed=22)
    mixed = _leaf(_randn(s, b, n, 3 * d, seed=23))
    transposed = _leaf(_randn(s, b, d, n, seed=24))
    for t in (mixed[..., d : 2 * d], transposed.transpose(2, 3)):
        assert not t.is_contiguous()
        out = fused_apply_rotary_pos_emb(t, freqs, interleaved)
        ref = _rope_chain(t, freqs, interleaved)
        _assert_equal(out, ref, "forward")
        leaf = mixed if t.stride(3) == 1 else transposed
        _assert_equal(grads_of(out, grad, leaf)[0], grads_of(ref, grad, leaf)[0], "backward")


def test_rotary_megatron_keyword_and_float64_angles():
    t = _randn(4, 2, 2, 8, seed=25)
    freqs = _freqs(4, 8, True)
    _assert_equal(fused_apply_rotary_pos_emb(t, freqs, interleaved=True), _rope_chain(t, freqs, True))
    with pytest.raises(ValueError, match="contradicts"):
        fused_apply_rotary_pos_emb(t, freqs, True, interleaved=False)
    # cos and sin are computed in freqs' dtype, then cast: float64 angles for a float32 t.
    t32, f64 = t.float(), freqs.double()
    _assert_equal(fused_apply_rotary_pos_emb(t32, f64), _rope_chain(t32, f64, False))


# --- SwiGLU ----------------------------------------------------------------------------------


def _swiglu_chain(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Megatron-core's unfused SwiGLU: chunk(y + bias) and F.silu(gate) * up."""
    gate, up = torch.chunk(y + bias if bias is not None else y, 2, -1)
    return F.silu(gate) * up


SWIGLU_SHAPES = [(5, 3, 2 * 37), (4, 2 * 40), (3, 2, 2 * 100), (2, 2 * 1061), (2, 2)]  # 1061: two blocks


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", SWIGLU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_equals_megatron_chain(dtype, shape, with_bias):
    y = _leaf(_randn(*shape, dtype=dtype, seed=30, scale=3.0))
    b = _leaf(_randn(shape[-1], dtype=dtype, seed=31)) if with_bias else None
    grad = _randn(*shape[:-1], shape[-1] // 2, dtype=dtype, seed=32)
    inputs = (y, b) if with_bias else (y,)
    out = bias_swiglu(y, b)
    assert out.dtype == dtype and out.shape == grad.shape
    got = grads_of(out, grad, *inputs)
    if dtype in (torch.float64, torch.float32):
        refs = [_leaf(t) for t in inputs]
        ref = _swiglu_chain(refs[0], refs[1] if with_bias else None)
        want = grads_of(ref, grad, *refs)
        if SAME_ISA:
            _assert_equal(out, ref, "forward")
            for name, g, w in zip(("y", "bias"), got, want):
                _assert_equal(g, w, f"grad {name}")
        else:  # another instruction set's exp: a unit in its last place, carried through the
            # sigmoid's division and the product with up (each rounding once more): 4 units
            tol = dict(rtol=4 * torch.finfo(dtype).eps, atol=0)
            assert_close(out, ref, **tol)
            for g, w in zip(got, want):
                assert_close(g, w, rtol=tol["rtol"] * 8, atol=tol["rtol"] * 8 * w.abs().max().item())
    else:
        refs = [_leaf(t, torch.float32) for t in inputs]
        ref = _swiglu_chain(refs[0], refs[1] if with_bias else None)
        want = grads_of(ref, grad.float(), *refs)
        assert_close(out.float(), ref, **BF16_HALF_ULP)
        assert_close(got[0].float(), want[0], **BF16_HALF_ULP)
        if with_bias:  # a sum over rows of gradients each rounded to bfloat16 (the bias's gradient is y's)
            terms = want[0].abs().reshape(-1, shape[-1]).sum(0)
            assert ((got[1].float() - want[1]).abs() <= 2.0**-8 * (terms + want[1].abs())).all()


def test_swiglu_names_and_non_contiguous_input():
    y = _randn(6, 4, 2 * 24, seed=33)
    assert torch.equal(swiglu(y), bias_swiglu(y))
    b = _randn(48, seed=34)
    assert torch.equal(bias_swiglu_impl(y, b), bias_swiglu(y, b))
    assert torch.equal(bias_swiglu_impl(y, None), swiglu(y))
    with pytest.raises(NotImplementedError, match="fp8_input_store"):
        bias_swiglu_impl(y, b, fp8_input_store=True)
    strided = _leaf(_randn(4, 6, 48, seed=35)).transpose(0, 1)
    assert not strided.is_contiguous()
    ref_leaf = _leaf(strided.detach().contiguous())
    out, ref = swiglu(strided), _swiglu_chain(ref_leaf, None)
    grad = _randn(6, 4, 24, seed=36)
    tol = dict(rtol=0, atol=0) if SAME_ISA else dict(rtol=4e-15, atol=4e-15)
    assert_close(out, ref, **tol)
    assert_close(grads_of(out, grad, strided)[0], grads_of(ref, grad, ref_leaf)[0], **tol)


# --- every op: opcheck, torch.compile, instruction sets, refusals ----------------------------


def test_opcheck_every_op():
    x = _randn(3, 5, 12, seed=40).requires_grad_()
    w = _randn(12, seed=41).requires_grad_()
    out, rstd = ops.rms_norm_forward(x.detach(), w.detach(), 1e-5)
    torch.library.opcheck(ops.rms_norm.default, (x, w, 1e-5))
    torch.library.opcheck(ops.rms_norm_forward.default, (x.detach(), w.detach(), 1e-5))
    torch.library.opcheck(ops.rms_norm_backward.default,
                          (torch.randn_like(out), x.detach(), w.detach(), rstd))

    t = _randn(4, 2, 3, 8, seed=42).requires_grad_()
    freqs = _freqs(4, 6, False)
    cos, sin = torch.cos(freqs[:, 0, 0]).double(), torch.sin(freqs[:, 0, 0]).double()
    for interleaved in (False, True):
        torch.library.opcheck(ops.rotary_pos_emb.default, (t, freqs, interleaved))
        torch.library.opcheck(ops.rotary_pos_emb_forward.default, (t.detach(), cos, sin, interleaved))
        torch.library.opcheck(ops.rotary_pos_emb_backward.default, (t.detach(), cos, sin, interleaved))

    y = _randn(3, 4, 10, seed=43).requires_grad_()
    b = _randn(10, seed=44).requires_grad_()
    g = _randn(3, 4, 5, seed=45)
    for bias in (None, b):
        torch.library.opcheck(ops.swiglu.default, (y, bias))
        plain = None if bias is None else bias.detach()
        torch.library.opcheck(ops.swiglu_forward.default, (y.detach(), plain))
        torch.library.opcheck(ops.swiglu_backward.default, (g, y.detach(), plain))


def _llama_block(x, w, freqs, y, b):
    h = fused_rms_norm(x, w, 1e-5)
    q = fused_apply_rotary_pos_emb(h.view(*h.shape[:2], 2, -1), freqs, True)
    return q.sum() + bias_swiglu(y, b).square().sum() + swiglu(y).sum()


@pytest.mark.slow  # compiles with inductor
def test_compiles_with_fullgraph():
    torch._dynamo.reset()
    x, w = _randn(4, 2, 16, seed=46), _randn(16, seed=47)
    # Under compile the op's cos(freqs) and sin(freqs) are traced into the graph and evaluated by the
    # compiler's own cos and sin, a unit in the last place from eager torch's: float64 angles keep
    # that below the tolerance.
    freqs = _freqs(4, 8, True).double()
    y, b = _randn(4, 2, 12, seed=48), _randn(12, seed=49)
    leaves = [_leaf(t) for t in (x, w, y, b)]
    eager = _llama_block(leaves[0], leaves[1], freqs, leaves[2], leaves[3])
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled_leaves = [_leaf(t) for t in (x, w, y, b)]
    compiled = torch.compile(_llama_block, fullgraph=True)
    got = compiled(compiled_leaves[0], compiled_leaves[1], freqs, compiled_leaves[2], compiled_leaves[3])
    assert_close(got, eager, rtol=1e-12, atol=1e-12)
    for g, e in zip(torch.autograd.grad(got, compiled_leaves), eager_grads):
        assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_cpu_capability_variants_agree():
    """Every instruction-set variant the CPU supports computes the same values (float64: to an ulp,
    the vectorised exp and the row sums differ between them)."""
    x, w = _randn(5, 3 * 16 + 7, seed=50), _randn(3 * 16 + 7, seed=51)
    t, freqs = _randn(3, 2, 2, 36, seed=52), _freqs(3, 36, True)
    y = _randn(5, 2 * 37, seed=53)
    results = {}
    chosen = _C.cpu_capability()
    try:
        for capability in _C.supported_cpu_capabilities():
            _C._set_cpu_capability(capability)
            results[capability] = [fused_rms_norm(x, w, 1e-5), fused_apply_rotary_pos_emb(t, freqs, True),
                                   fused_apply_rotary_pos_emb(t, freqs, False), swiglu(y)]
    finally:
        _C._set_cpu_capability(chosen)
    first = results[chosen]
    for capability, values in results.items():
        for got, want in zip(values, first):
            assert_close(got, want, rtol=1e-15, atol=1e-15, msg=capability)


def test_inference_mode_equals_grad_mode():
    """Under inference mode the ops run their forward kernels without an autograd node."""
    x, w = _randn(3, 8, seed=54), _randn(8, seed=55)
    t, freqs = _randn(4, 2, 2, 8, seed=56), _freqs(4, 8, False)
    y, b = _randn(3, 10, seed=57), _randn(10, seed=58)
    calls = (lambda: fused_rms_norm(x, w, 1e-5), lambda: fused_apply_rotary_pos_emb(t, freqs),
             lambda: bias_swiglu(y, b))
    for call in calls:
        want = call()
        with torch.inference_mode():
            got = call()
        _assert_equal(got, want)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"rms_norm: weight must have shape \[8\]"):
        fused_rms_norm(x, w[:-1], 1e-5)


def test_bad_input_is_refused():
    x, w = _randn(3, 8), _randn(8)
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        fused_rms_norm(x, w[:-1], 1e-5)
    with pytest.raises(ValueError, match="weight dtype Float differs from the input dtype Double"):
        fused_rms_norm(x, w.float(), 1e-5)
    with pytest.raises(ValueError, match="eps must be >= 0, got -1"):
        fused_rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="input must be float64, float32, bfloat16 or float16, got Long"):
        fused_rms_norm(x.long(), w.long(), 1e-5)
    with pytest.raises(ValueError, match="non-empty last"):
        fused_rms_norm(x[:, :0], w[:0], 1e-5)
    t = _randn(4, 2, 2, 8)
    with pytest.raises(ValueError, match=r"t must be \[s, b, n, d\], got shape \[4, 2, 8\]"):
        fused_apply_rotary_pos_emb(t[:, 0], _freqs(4, 8, False))
    with pytest.raises(ValueError, match=r"freqs must have shape \[4, 1, 1, d_rot\]"):
        fused_apply_rotary_pos_emb(t, _freqs(5, 8, False))
    with pytest.raises(ValueError, match=r"must be even and in \(0, 8\] \(the head dim\), got 10"):
        fused_apply_rotary_pos_emb(t, _freqs(4, 10, False))
    with pytest.raises(ValueError, match="got 3"):
        fused_apply_rotary_pos_emb(t, _freqs(4, 8, False)[..., :3])
    with pytest.raises(ValueError, match="freqs must be a floating tensor"):
        fused_apply_rotary_pos_emb(t, _freqs(4, 8, False).long())
    with pytest.raises(ValueError, match=r"cos must have shape \[4, d_rot\]"):
        ops.rotary_pos_emb_forward(t, t[0, 0], t[0, 0], False)
    y = _randn(3, 7)
    with pytest.raises(ValueError, match="an even size, got shape"):
        swiglu(y)
    with pytest.raises(ValueError, match=r"bias must have shape \[6\]"):
        bias_swiglu(y[:, :6], _randn(7))
    with pytest.raises(ValueError, match="bias dtype Float differs"):
        bias_swiglu(y[:, :6], _randn(6).float())
    with pytest.raises(ValueError, match=r"grad_output must have shape \[3, 3\], got \[3, 6\]"):
        ops.swiglu_backward(y[:, :6], y[:, :6], None)
    with pytest.raises(ValueError, match=r"rstd must have the input's shape without its last dim"):
        ops.rms_norm_backward(x, x, w, torch.ones(4, dtype=torch.float64))


def test_kernels_registered_for_every_backend_built():
    cuda = megatron_ext.build_info()["cuda_compiled"]
    kernels = ("rms_norm_forward", "rms_norm_backward", "rotary_pos_emb_forward", "rotary_pos_emb_backward",
               "swiglu_forward", "swiglu_backward")
    for op in kernels:
        assert has_kernel(op, "CPU") and has_kernel(op, "Meta"), op
        assert has_kernel(op, "CUDA") == cuda, op
    for op in ("rms_norm", "rotary_pos_emb", "swiglu"):
        for key in ("Autograd", "CompositeExplicitAutograd", "Meta"):
            assert has_kernel(op, key), (op, key)
