"""The causal convolution op of Mamba-2 / Gated DeltaNet layers (``torch.ops.megatron_ext.causal_conv1d``)
against a float64 reference written from its formula: the inputs behind their W - 1 initial states (zeros
without), torch's grouped F.conv1d with no padding, then the activation; packed rows run a sequence at a
time. Forward and the gradients of x, weight, bias and initial states.

Tolerances come from the dtype's unit roundoff u: an n-term sum whose terms carry a few roundings each
is within (n + c) u of the sum of the terms' magnitudes (first order), which the same reference computes
from absolute values; a 16-bit result adds half a unit of its own last place.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megatron_ext
from megatron_ext import _C
from megatron_ext.fusions import causal_conv1d_fn
from tests.conftest import has_kernel

ops = torch.ops.megatron_ext
HAS_GPU = torch.cuda.is_available()


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _reference_rows(x, weight, bias, init, activation):
    """One unpacked batch: y = act(conv1d(cat(init, x), weight[:, None], bias, groups=D))."""
    batch, channels, length = x.shape
    width = weight.shape[1]
    if length == 0:  # conv1d takes no input shorter than its kernel
        return x.new_zeros(batch, channels, 0)
    history = init if init is not None else x.new_zeros(batch, channels, width - 1)
    z = F.conv1d(torch.cat([history, x], dim=-1), weight[:, None, :], bias, groups=channels)
    return F.silu(z) if activation == "silu" else z


def reference(x, weight, bias=None, cu_seqlens=None, init=None, activation="none"):
    """The formula in float64, each packed sequence on its own."""
    if cu_seqlens is None:
        return _reference_rows(x, weight, bias, init, activation)
    bounds = cu_seqlens.tolist()
    pieces = [
        _reference_rows(x[..., s:e], weight, bias, None if init is None else init[i : i + 1], activation)
        for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))
    ]
    return torch.cat(pieces, dim=-1)


def _make(batch, channels, length, width, *, bias, init, states=None, dtype=torch.float64, seed=0):
    x = _randn(batch, channels, length, seed=seed, dtype=dtype)
    w = (_randn(channels, width, seed=seed + 1) * 0.5).to(dtype)
    b = _randn(channels, seed=seed + 2, dtype=dtype) if bias else None
    s = _randn(states or batch, channels, width - 1, seed=seed + 3, dtype=dtype) if init else None
    return x, w, b, s


def _grads(out, grad, inputs):
    wanted = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(out, wanted, grad))
    return [None if t is None else next(got) for t in inputs]


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_()


def _run(fn, x, w, b, s, g, **kwargs):
    inputs = [_leaf(t) for t in (x, w, b, s)]
    out = fn(inputs[0], inputs[1], inputs[2], init=inputs[3], **kwargs)
    return [out.detach(), *_grads(out, g, inputs)]


def _op(x, w, b, init=None, cu_seqlens=None, activation="none"):
    return ops.causal_conv1d(x, w, b, cu_seqlens, init, activation)


def _to64(t):
    return None if t is None else t.double()


def _ref(x, w, b, init=None, cu_seqlens=None, activation="none"):
    return reference(x.double(), w.double(), _to64(b), cu_seqlens, _to64(init), activation)


def _bounds(x, w, b, s, g, cu_seqlens, activation):
    """Per element, the magnitudes the roundings scale with, and each quantity's number of summed terms:
    |y| and |z|'s terms; for the gradients, |g| (|act'| <= 1.1, and act' moves by <= 0.5 per unit of z's
    error) pushed back through |weight| (inputs) or |x| (weight, bias)."""
    a = [None if t is None else t.detach().double().abs() for t in (x, w, b, s)]
    terms = reference(a[0], a[1], a[2], cu_seqlens, a[3], "none")
    reach = g.double().abs() * (1.1 + 0.5 * terms)
    leaves = [_leaf(t) for t in a]
    linear = reference(leaves[0], leaves[1], leaves[2], cu_seqlens, leaves[3], "none")
    mags = _grads(linear, reach, leaves)
    return [1.1 * terms, *mags]


def _assert_within(name, got, want, magnitude, terms, dtype):
    u = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps / 2
    u_out = torch.finfo(dtype).eps / 2
    # float64: the reference rounds too, as much again.
    twice = 2 if dtype == torch.float64 else 1
    bound = twice * ((terms + 10) * u * magnitude + u_out * want.abs()) + torch.finfo(dtype).tiny
    err = (got.double() - want).abs()
    assert got.dtype == dtype, (name, got.dtype)
    worst = (err / bound).argmax()
    message = f"{name}: error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}"
    assert bool((err <= bound).all()), message


def _check_against_reference(x, w, b, s, cu_seqlens, activation, seed):
    dtype = x.dtype
    g = _randn(*x.shape, seed=seed + 7, dtype=dtype)
    got = _run(_op, x, w, b, s, g, cu_seqlens=cu_seqlens, activation=activation)
    want = _run(_ref, *map(_to64, (x, w, b, s, g)), cu_seqlens=cu_seqlens, activation=activation)
    mags = _bounds(x, w, b, s, g, cu_seqlens, activation)
    steps = x.shape[0] * x.shape[2]
    terms = [w.shape[1] + 1, w.shape[1], steps, steps, w.shape[1]]
    for name, got_t, want_t, mag, n in zip(("y", "grad_x", "grad_weight", "grad_bias", "grad_init"), got,
                                           want, mags, terms):
        assert (got_t is None) == (want_t is None), name
        if got_t is not None:
            _assert_within(name, got_t, want_t, mag, n, dtype)


@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_float64_equals_reference(width, bias, init, activation):
    x, w, b, s = _make(2, 5, 17, width, bias=bias, init=init, seed=width)
    _check_against_reference(x, w, b, s, None, activation, seed=10 * width)


def test_width_one_and_short_rows():
    # W = 1 has no history; a row shorter than W - 1 reads only initial states before it.
    for width, length in ((1, 6), (4, 2), (4, 1), (8, 12)):
        x, w, b, s = _make(2, 3, length, width, bias=True, init=width > 1, seed=width + length)
        _check_against_reference(x, w, b, s, None, "silu", seed=length)


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("init", [False, True])
def test_packed_rows_equal_each_sequence_alone(init, offsets_dtype):
    width = 4
    # A sequence shorter than W - 1, an empty one, and longer ones.
    bounds = [0, 7, 9, 9, 20, 33]
    cu = torch.tensor(bounds, dtype=offsets_dtype)
    x, w, b, s = _make(1, 6, 33, width, bias=True, init=init, states=len(bounds) - 1, seed=3)
    g = _randn(*x.shape, seed=11)
    packed = _run(_op, x, w, b, s, g, cu_seqlens=cu, activation="silu")
    alone_x, alone_w, alone_b, alone_s = [], 0, 0, []
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        si = None if s is None else s[i : i + 1]
        y, gx, gw, gb, gs = _run(_op, x[..., lo:hi], w, b, si, g[..., lo:hi], activation="silu")
        torch.testing.assert_close(packed[0][..., lo:hi], y, rtol=0, atol=0)
        alone_x.append(gx)
        alone_w, alone_b = alone_w + gw, alone_b + gb
        alone_s.append(gs)
    torch.testing.assert_close(packed[1], torch.cat(alone_x, -1), rtol=0, atol=0)
    torch.testing.assert_close(packed[2], alone_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(packed[3], alone_b, rtol=1e-12, atol=1e-12)
    if init:
        torch.testing.assert_close(packed[4], torch.cat(alone_s, 0), rtol=0, atol=0)
    # And the formula itself.
    _check_against_reference(x, w, b, s, cu, "silu", seed=5)


def test_channels_last_input():
    # Megatron-core's chunked prefill passes x as a [B, L, D] tensor transposed to [B, D, L].
    x, w, b, s = _make(2, 6, 11, 4, bias=True, init=True, seed=8)
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    _check_against_reference(strided, w, b, s, None, "silu", seed=9)


def test_nothing_leaks_across_packed_sequences():
    cu = torch.tensor([0, 5, 12])
    x, w, b, _ = _make(1, 3, 12, 3, bias=True, init=False, seed=4)
    y = _op(x, w, b, cu_seqlens=cu, activation="silu")
    changed = x.clone()
    changed[..., :5] += 100.0
    y2 = _op(changed, w, b, cu_seqlens=cu, activation="silu")
    assert torch.equal(y[..., 5:], y2[..., 5:])
    assert not torch.equal(y[..., :5], y2[..., :5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
def test_16_and_32_bit_within_their_rounding(dtype, packed):
    cu = torch.tensor([0, 40, 41, 96]) if packed else None
    x, w, b, s = _make(1 if packed else 3, 8, 96, 4, bias=True, init=True, states=3 if packed else None,
                       dtype=dtype, seed=21)
    _check_against_reference(x, w, b, s, cu, "silu", seed=22)
    _check_against_reference(x, w, None, None, cu, "none", seed=23)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_every_cpu_instruction_set(dtype):
    # Each compiled variant within the bounds; without the activation (no exp) all equal bit for bit.
    x, w, b, s = _make(2, 5, 45, 4, bias=True, init=True, dtype=dtype, seed=71)
    g = _randn(*x.shape, seed=72, dtype=dtype)
    chosen = _C.cpu_capability()
    plain = {}
    try:
        for capability in _C.supported_cpu_capabilities():
            _C._set_cpu_capability(capability)
            _check_against_reference(x, w, b, s, None, "silu", seed=73)
            plain[capability] = _run(_op, x, w, b, s, g, activation="none")
    finally:
        _C._set_cpu_capability(chosen)
    for capability, values in plain.items():
        for got, want in zip(values, plain[chosen]):
            assert torch.equal(got, want), capability


def test_megatron_core_unfused_path():
    # MambaMixer / GatedDeltaNet without causal-conv1d: act(nn.Conv1d(padding=W - 1)(x)[..., :L]).
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(6, 6, kernel_size=4, groups=6, padding=3, bias=True, dtype=torch.float64)
    x = _randn(2, 6, 19, seed=31).requires_grad_()
    want = F.silu(conv(x)[..., :19])
    got = causal_conv1d_fn(x, conv.weight.squeeze(1), conv.bias, activation="silu")
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)
    g = _randn(2, 6, 19, seed=32)
    want_grads = torch.autograd.grad(want, (x, conv.weight, conv.bias), g)
    got_grads = torch.autograd.grad(got, (x, conv.weight, conv.bias), g)
    for a, e in zip(got_grads, want_grads):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-13)


def test_opcheck():
    x, w, b, s = _make(2, 3, 9, 4, bias=True, init=True, seed=41)
    g = _randn(2, 3, 9, seed=42)
    leaves = [_leaf(t) for t in (x, w, b, s)]
    for act in ("silu", "none"):
        xl, wl, bl, sl = leaves
        torch.library.opcheck(ops.causal_conv1d.default, (xl, wl, bl, None, sl, act))
        torch.library.opcheck(ops.causal_conv1d.default, (xl, wl, None, None, None, act))
        torch.library.opcheck(ops.causal_conv1d_forward.default, (x, w, b, None, s, act))
        torch.library.opcheck(ops.causal_conv1d_backward.default, (g, x, w, b, None, s, act))
        torch.library.opcheck(ops.causal_conv1d_backward.default, (g, x, w, None, None, None, act))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    xp, sp = _leaf(x[:1]), _leaf(_randn(2, 3, 3, seed=43))
    torch.library.opcheck(ops.causal_conv1d.default, (xp, leaves[1], leaves[2], cu, sp, "silu"))
    torch.library.opcheck(ops.causal_conv1d_backward.default, (g[:1], x[:1], w, b, cu, sp.detach(), "silu"))


def test_kernels_registered_for_every_backend_built():
    cuda = megatron_ext.build_info()["cuda_compiled"]
    for op in ("causal_conv1d_forward", "causal_conv1d_backward"):
        assert has_kernel(op, "CPU") and has_kernel(op, "Meta"), op
        assert has_kernel(op, "CUDA") == cuda, op
    for key in ("Autograd", "CompositeExplicitAutograd", "Meta"):
        assert has_kernel("causal_conv1d", key), key


def test_refusals():
    x, w, b, s = _make(2, 4, 10, 3, bias=True, init=True, seed=51)
    with pytest.raises(ValueError, match=r"x must be \[batch, channels, length\], got shape \[4, 10\]"):
        _op(x[0], w, b)
    with pytest.raises(ValueError, match=r"with channels = 4 \(x's dim 1\), got shape \[5, 3\]"):
        _op(x, _randn(5, 3, seed=1), b)
    with pytest.raises(ValueError, match=r"weight must be \[channels, width\].*got shape \[4, 1, 3\]"):
        _op(x, w[:, None], b)
    with pytest.raises(ValueError, match=r"kernel width \(weight's dim 1\) must be in \[1, 8\], got 9"):
        _op(x, _randn(4, 9, seed=1), b)
    with pytest.raises(ValueError, match=r"bias must be \[4\] \(x's channels\), got shape \[3\]"):
        _op(x, w, b[:3])
    with pytest.raises(ValueError, match="weight dtype Float differs from the x dtype Double"):
        _op(x, w.float(), b)
    with pytest.raises(ValueError, match=r"\[2, 4, 2\] \(batch, channels, width - 1\), got shape \[2, 4, 3"):
        _op(x, w, b, init=_randn(2, 4, 3, seed=1))
    with pytest.raises(ValueError, match="must be 'silu', 'swish', 'none' or 'identity', got 'gelu'"):
        _op(x, w, b, activation="gelu")
    with pytest.raises(ValueError, match=r"\(cu_seqlens\) take x of batch size 1, got shape \[2, 4, 10\]"):
        _op(x, w, b, cu_seqlens=torch.tensor([0, 10]))
    one = x[:1]
    with pytest.raises(ValueError, match="cu_seqlens must be nondecreasing, got 6 then 4 at index 2"):
        _op(one, w, b, cu_seqlens=torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match="cu_seqlens must end at x's length 10, got 9"):
        _op(one, w, b, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, got 1"):
        _op(one, w, b, cu_seqlens=torch.tensor([1, 4, 10]))
    with pytest.raises(ValueError, match="cu_seqlens must be int32 or int64, got Float"):
        _op(one, w, b, cu_seqlens=torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError, match=r"\[2, 4, 2\] \(sequences, channels, width - 1\), got shape \[1"):
        _op(one, w, b, cu_seqlens=torch.tensor([0, 4, 10]), init=s[:1])
    with pytest.raises(ValueError, match=r"grad_output has shape \[2, 4, 9\] but x has shape \[2, 4, 10\]"):
        ops.causal_conv1d_backward(x[..., :9], x, w, b, None, None, "silu")
    with pytest.raises(ValueError, match="seq_idx is not supported"):
        causal_conv1d_fn(x, w, b, seq_idx=torch.zeros(2, 10, dtype=torch.int32))
    with pytest.raises(ValueError, match="return_final_states and final_states_out are not supported"):
        causal_conv1d_fn(x, w, b, return_final_states=True)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_equals_cpu(dtype, packed):
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int32) if packed else None
    x, w, b, s = _make(1 if packed else 2, 16, 300, 4, bias=True, init=True, states=3 if packed else None,
                       dtype=dtype, seed=61)
    g = _randn(*x.shape, seed=62, dtype=dtype)
    cpu = _run(_op, x, w, b, s, g, cu_seqlens=cu, activation="silu")
    dev = [t.cuda() for t in (x, w, b, s, g)]
    gpu = _run(_op, *dev, cu_seqlens=None if cu is None else cu.cuda(), activation="silu")
    # The same arithmetic; libm's exp and the order of the reduced sums (weight, bias) differ.
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(
        rtol=4 * torch.finfo(dtype).eps, atol=1e-4 if dtype == torch.float32 else 2e-2)
    for a, e in zip(gpu, cpu):
        torch.testing.assert_close(a.cpu(), e, **tol)
    # And against the formula.
    _check_against_reference(*dev[:4], None if cu is None else cu.cuda(), "silu", seed=63)
