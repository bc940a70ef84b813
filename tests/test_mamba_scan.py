"""The Mamba-2 SSD scan (``torch.ops.megatron_ext.mamba_chunk_scan`` and mamba-ssm's
``mamba_chunk_scan_combined`` over it) against a float64 reference written from the recurrence itself,
one token at a time and no chunks:

    dt'_t = clamp(softplus(dt_t + dt_bias) or dt_t + dt_bias, dt_min, dt_max)
    S_t   = exp(dt'_t A) S_{t-1} + dt'_t x_t B_t^T,   y_t = (S_t C_t + D x_t) * silu(z_t)

packed rows running a sequence at a time; forward, final states and the gradients of every input.

Tolerances come from the dtype's unit roundoff u: a float32 output is a sum of about chunk + N rounded
products of decays (<= 1), scores and inputs, within (chunk + N + c) u of the sum of the terms'
magnitudes, which the reference computes from absolute values; a 16-bit output adds half a unit of its
own last place.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megatron_ext
from megatron_ext import _C
from megatron_ext.fusions import mamba_chunk_scan_combined, rms_norm_gated
from tests.conftest import has_kernel

ops = torch.ops.megatron_ext
HAS_GPU = torch.cuda.is_available()


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _steps(dt, dt_bias, softplus, lo, hi):
    v = dt if dt_bias is None else dt + dt_bias
    return (F.softplus(v) if softplus else v).clamp(lo, hi)


def _recurrence(x, dt, A, B, C, D=None, z=None, dt_bias=None, init=None, softplus=False, lo=0.0,
                hi=float("inf")):
    """One row set [b, L, ...]: the state carried token by token."""
    batch, length, heads, headdim = x.shape
    rep = heads // B.shape[2]
    d = _steps(dt, dt_bias, softplus, lo, hi)
    state = x.new_zeros(batch, heads, headdim, B.shape[3]) if init is None else init
    ys = []
    for t in range(length):
        Bt, Ct = B[:, t].repeat_interleave(rep, 1), C[:, t].repeat_interleave(rep, 1)
        decay = torch.exp(d[:, t] * A)[..., None, None]
        state = decay * state + d[:, t][..., None, None] * x[:, t][..., None] * Bt[:, :, None, :]
        y = (state * Ct[:, :, None, :]).sum(-1)
        if D is not None:
            y = y + (D if D.dim() == 2 else D[:, None]) * x[:, t]
        ys.append(y if z is None else y * F.silu(z[:, t]))
    y = torch.stack(ys, 1) if ys else x.new_zeros(x.shape)
    return y, state


def reference(x, dt, A, B, C, D=None, z=None, dt_bias=None, init=None, cu_seqlens=None, softplus=False,
              lo=0.0, hi=float("inf")):
    """(y, final states): each packed sequence on its own."""
    if cu_seqlens is None:
        return _recurrence(x, dt, A, B, C, D, z, dt_bias, init, softplus, lo, hi)
    bounds = cu_seqlens.tolist()
    ys, finals = [], []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        zs = None if z is None else z[:, s:e]
        first = None if init is None else init[i : i + 1]
        y, f = _recurrence(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], D, zs, dt_bias, first, softplus,
                           lo, hi)
        ys.append(y)
        finals.append(f)
    return torch.cat(ys, 1), torch.cat(finals, 0)


def _make(batch, length, heads, headdim, groups, dstate, *, D="head", z=True, bias=True, init=True,
          states=None, dtype=torch.float64, seed=0):
    x = _randn(batch, length, heads, headdim, seed=seed, dtype=dtype)
    dt = (_randn(batch, length, heads, seed=seed + 1) - 1).to(dtype)
    A = -torch.exp(_randn(heads, seed=seed + 2) * 0.5).to(dtype)
    B = _randn(batch, length, groups, dstate, seed=seed + 3, dtype=dtype)
    C = _randn(batch, length, groups, dstate, seed=seed + 4, dtype=dtype)
    Dt = {"head": _randn(heads, seed=seed + 5), "channel": _randn(heads, headdim, seed=seed + 5),
          None: None}[D]
    Dt = None if Dt is None else Dt.to(dtype)
    zt = _randn(batch, length, heads, headdim, seed=seed + 6, dtype=dtype) if z else None
    bt = (_randn(heads, seed=seed + 7) * 0.5).to(dtype) if bias else None
    it = _randn(states or batch, heads, headdim, dstate, seed=seed + 8, dtype=dtype) if init else None
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=Dt, z=zt, dt_bias=bt, init=it)


_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "init")


def _op(t, chunk, cu_seqlens=None, softplus=True, lo=0.0, hi=None):
    return ops.mamba_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, t["D"], t["z"], t["dt_bias"],
                                t["init"], cu_seqlens, softplus, lo, hi)


def _ref(t, cu_seqlens=None, softplus=True, lo=0.0, hi=None):
    return reference(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"], t["init"],
                     cu_seqlens, softplus, lo, float("inf") if hi is None else hi)


def _run(fn, t, seed, **kwargs):
    """The outputs and the gradients of every given input, from random output and final-state grads."""
    leaves = {k: (v.detach().clone().requires_grad_() if v is not None else None) for k, v in t.items()}
    y, final = fn(leaves, **kwargs)
    gy = _randn(*y.shape, seed=seed, dtype=y.dtype)
    gf = _randn(*final.shape, seed=seed + 1, dtype=final.dtype)
    inputs = [leaves[k] for k in _NAMES if leaves[k] is not None]
    grads = torch.autograd.grad((y * gy).sum() + (final * gf).sum(), inputs)
    return [y.detach(), final.detach(), *grads]


def _assert_equal_reference(t, chunk, rtol=1e-11, **kwargs):
    got = _run(lambda v, **k: _op(v, chunk, **k), t, seed=99, **kwargs)
    want = _run(_ref, t, seed=99, **kwargs)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * e.abs().max().item())


@pytest.mark.parametrize("groups,D,z,bias,init", [
    (1, "head", True, True, True), (2, "channel", False, True, False), (4, None, True, False, True),
    (2, "head", False, False, False)])
@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
def test_float64_equals_recurrence(groups, D, z, bias, init, chunk):
    # L = 11: a multiple of chunk 1 and 11, a partial last chunk for 4, one short chunk for 64.
    t = _make(2, 11, 4, 3, groups, 5, D=D, z=z, bias=bias, init=init, seed=chunk)
    _assert_equal_reference(t, chunk)


def test_dt_limits_and_no_softplus():
    t = _make(1, 13, 2, 3, 1, 4, seed=5)
    _assert_equal_reference(t, 4, lo=0.2, hi=0.9)  # both limits clamp some steps (and their gradients)
    t["dt"] = t["dt"].abs() * 0.3
    _assert_equal_reference(t, 5, softplus=False)
    _assert_equal_reference(t, 5, softplus=False, lo=0.1, hi=0.5)


def test_gradcheck():
    t = _make(1, 6, 2, 2, 1, 3, D="channel", seed=7)
    names = [k for k in _NAMES if t[k] is not None]

    def fn(*tensors):
        v = dict(zip(names, tensors))
        return _op({k: v.get(k) for k in _NAMES}, 4, lo=0.05, hi=5.0)

    leaves = [t[k].clone().requires_grad_() for k in names]
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_packed_rows_equal_each_sequence_alone(offsets_dtype):
    # Sequences of lengths 5, 0 (empty), 9 and 6, chunk 4: chunks restart at each sequence's start.
    cu = torch.tensor([0, 5, 5, 14, 20], dtype=offsets_dtype)
    t = _make(1, 20, 4, 3, 2, 5, states=4, seed=11)
    _assert_equal_reference(t, 4, cu_seqlens=cu)
    t["init"] = None
    _assert_equal_reference(t, 3, cu_seqlens=cu)
    # The empty sequence's final state is its initial state, and so is its gradient.
    t = _make(1, 20, 4, 3, 2, 5, states=4, seed=12)
    final = _op(t, 4, cu_seqlens=cu)[1]
    torch.testing.assert_close(final[1], t["init"][1], rtol=0, atol=0)


def test_final_state_gradient_alone():
    # Only the final states feed the loss: the output's gradient is absent, the state's honoured.
    t = _make(2, 9, 2, 3, 1, 4, seed=13)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    got = torch.autograd.grad(_op(leaves, 4)[1].sum(), leaves["x"])[0]
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    want = torch.autograd.grad(_ref(leaves)[1].sum(), leaves["x"])[0]
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)


def test_threads_do_not_change_the_result():
    t = _make(2, 40, 4, 8, 2, 8, seed=17)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = _run(lambda v: _op(v, 16), t, seed=3)
        torch.set_num_threads(max(2, threads))
        parallel = _run(lambda v: _op(v, 16), t, seed=3)
    finally:
        torch.set_num_threads(threads)
    for a, e in zip(parallel, serial):
        assert torch.equal(a, e)


def _magnitudes(t, **kwargs):
    """The reference over absolute values: a bound on the magnitude of the terms of each output."""
    a = {k: (None if v is None else v.abs()) for k, v in t.items()}
    a["A"], a["dt"], a["dt_bias"] = t["A"], t["dt"], t["dt_bias"]
    a["z"] = None
    y, final = _ref(a, **kwargs)
    if t["z"] is not None:
        y = y * F.silu(t["z"]).abs()
    return y, final


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_16_and_32_bit_within_their_rounding(dtype):
    chunk, N = 8, 6
    t = _make(2, 19, 4, 3, 2, N, D="channel", dtype=dtype, seed=21)
    t64 = {k: None if v is None else v.double() for k, v in t.items()}
    y, final = _op(t, chunk)
    assert y.dtype == dtype and final.dtype == torch.float32
    want_y, want_final = _ref(t64)
    mag_y, mag_final = _magnitudes(t64)
    u = torch.finfo(torch.float32).eps / 2
    bound_y = (2 * chunk + N + 16) * u * mag_y
    if dtype != torch.float32:
        bound_y = bound_y + want_y.abs() * torch.finfo(dtype).eps / 2 * (1 + 1e-3)
    assert ((y.double() - want_y).abs() <= bound_y + 1e-30).all()
    assert ((final.double() - want_final).abs() <= (2 * chunk + N + 16) * u * mag_final + 1e-30).all()


def test_strong_decays_within_float32_rounding():
    # Steps of about 3 and A = -5: a chunk's exponents reach -120, so the decays below e^-64 are dropped
    # as zero; the results stay within float32 rounding of the float64 recurrence.
    chunk, N = 8, 4
    t = _make(1, 30, 2, 3, 1, N, dtype=torch.float32, seed=81)
    t["dt"] = t["dt"] + 4
    t["A"] = torch.full((2,), -5.0)
    t64 = {k: None if v is None else v.double() for k, v in t.items()}
    y, final = _op(t, chunk)
    want_y, want_final = _ref(t64)
    mag_y, mag_final = _magnitudes(t64)
    u = torch.finfo(torch.float32).eps / 2
    assert ((y.double() - want_y).abs() <= (2 * chunk + N + 16) * u * mag_y + 1e-30).all()
    assert ((final.double() - want_final).abs() <= (2 * chunk + N + 16) * u * mag_final + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_every_cpu_instruction_set(dtype):
    # Each compiled variant of the loops within the float64 reference's bounds (the vector exp differs).
    t = _make(1, 21, 4, 5, 2, 6, D="channel", dtype=dtype, seed=91)
    chosen = _C.cpu_capability()
    results = {}
    try:
        for capability in _C.supported_cpu_capabilities():
            _C._set_cpu_capability(capability)
            results[capability] = _run(lambda v: _op(v, 8), t, seed=92)
    finally:
        _C._set_cpu_capability(chosen)
    rtol = 1e-11 if dtype == torch.float64 else 2 ** -7
    for capability, values in results.items():
        for got, want in zip(values, results[chosen]):
            torch.testing.assert_close(got.double(), want.double(), rtol=rtol,
                                       atol=rtol * want.double().abs().max().item()), capability


def test_opcheck():
    t = _make(2, 9, 2, 3, 1, 4, D="channel", seed=95)
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"], 4, t["D"], t["z"], t["dt_bias"], t["init"], None, True,
            0.0, None)
    leaves = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(ops.mamba_chunk_scan.default, leaves)
    torch.library.opcheck(ops.mamba_chunk_scan_forward.default, args)
    _, _, chunk_states = ops.mamba_chunk_scan_forward(*args)
    grads = (_randn(2, 9, 2, 3, seed=96), _randn(2, 2, 3, 4, seed=97))
    torch.library.opcheck(ops.mamba_chunk_scan_backward.default, (*grads, *args, chunk_states))
    # Packed rows: the number of chunks depends on the offsets' values.
    t = _make(1, 9, 2, 3, 1, 4, D="channel", states=2, seed=98)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"], 4, t["D"], t["z"], t["dt_bias"], t["init"], cu, True,
            0.0, None)
    torch.library.opcheck(ops.mamba_chunk_scan_forward.default, args)
    leaves = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                   for a in args)
    torch.library.opcheck(ops.mamba_chunk_scan.default, leaves)


def test_transformers_torch_path():
    # transformers' Mamba2Mixer without mamba-ssm runs mamba2_chunk_scan: its steps, limits, D [H] and
    # initial states as the op takes them (z it ignores), float32, chunks of 16 over 40 tokens.
    pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    chunk, N = 16, 8
    t = _make(2, 40, 4, 6, 2, N, z=False, dtype=torch.float32, seed=31)
    t["init"] = t["init"] * 0.5
    kw = dict(lo=0.01, hi=4.0)

    def theirs(v, lo, hi):
        return mamba2_chunk_scan(v["x"], v["dt"], v["A"], v["B"], v["C"], chunk, D=v["D"],
                                 dt_bias=v["dt_bias"],
                                 initial_states=v["init"], dt_softplus=True, dt_limit=(lo, hi),
                                 return_final_states=True)

    got = _run(lambda v, **k: _op(v, chunk, **k), t, seed=5, **kw)
    want = _run(theirs, t, seed=5, **kw)
    t64 = {k: None if v is None else v.double() for k, v in t.items()}
    exact = _run(_ref, t64, seed=5, **kw)
    u = torch.finfo(torch.float32).eps / 2
    # Both are float32 sums of chunk + N (forward) or a few times that (backward) rounded terms; each is
    # within that many roundings of the float64 values, scaled by the largest of them.
    for name, a, b, e in zip(("y", "final", *_NAMES), got, want, exact):
        bound = 4 * (chunk + N + 40) * u * e.abs().max().item()
        assert (a.double() - e).abs().max().item() <= bound, name
        assert (b.double() - e).abs().max().item() <= bound, name
        assert (a - b).abs().max().item() <= 2 * bound, name


def test_mamba_chunk_scan_combined_as_megatron_core_calls_it():
    # MambaMixer._ssm_prefill: D [H, P] (D_has_hdim), z, dt_bias in float32, softplus, final states.
    t = _make(1, 14, 4, 3, 2, 5, D="channel", init=False, seed=41)
    y, final = mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 4, D=t["D"], z=t["z"],
                                         dt_bias=t["dt_bias"], dt_softplus=True, return_final_states=True)
    want_y, want_final = _ref(t)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=1e-12, atol=1e-12)
    plain = mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 4, D=t["D"], z=t["z"],
                                      dt_bias=t["dt_bias"], dt_softplus=True)
    assert torch.equal(plain, y)
    # Dynamic batching: seq_idx and cu_seqlens of the same sequences, the varlen states.
    cu = torch.tensor([0, 6, 14], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(2), torch.tensor([6, 8])).to(torch.int32)[None]
    y, final, varlen = mamba_chunk_scan_combined(
        t["x"], t["dt"], t["A"], t["B"], t["C"], 4, D=t["D"], z=t["z"], dt_bias=t["dt_bias"], seq_idx=seq_idx,
        cu_seqlens=cu, dt_softplus=True, return_final_states=True, return_varlen_states=True)
    want_y, want_states = _ref(t, cu_seqlens=cu)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(varlen, want_states, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, want_states[-1:], rtol=1e-12, atol=1e-12)
    # seq_idx alone marks the same sequences; mamba-ssm's [1, H, P, N] initial state is the first's.
    init = _randn(1, 4, 3, 5, seed=42)
    alone = mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 4, D=t["D"], z=t["z"],
                                      dt_bias=t["dt_bias"], initial_states=init, seq_idx=seq_idx,
                                      dt_softplus=True)
    t["init"] = torch.cat([init, torch.zeros_like(init)])
    torch.testing.assert_close(alone, _ref(t, cu_seqlens=cu)[0], rtol=1e-12, atol=1e-12)


def test_kernels_registered_for_every_backend_built():
    cuda = megatron_ext.build_info()["cuda_compiled"]
    for op in ("mamba_chunk_scan_forward", "mamba_chunk_scan_backward"):
        assert has_kernel(op, "CPU") and has_kernel(op, "Meta"), op
        assert has_kernel(op, "CUDA") == cuda, op
    for key in ("Autograd", "CompositeExplicitAutograd", "Meta"):
        assert has_kernel("mamba_chunk_scan", key), key


def test_refusals():
    t = _make(2, 10, 4, 3, 2, 5, seed=51)

    def run(chunk=4, cu=None, **changes):
        v = {**t, **changes}
        return _op(v, chunk, cu_seqlens=cu)

    with pytest.raises(ValueError, match=r"x must be \[batch, length, heads, headdim\], got shape \[10, 4"):
        run(x=t["x"][0])
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        run(chunk=0)
    with pytest.raises(ValueError, match=r"dt must be \[2, 10, 4\] \(x's batch, length, heads\), got shape"):
        run(dt=t["dt"][..., :3])
    with pytest.raises(ValueError, match=r"A must be \[4\] \(x's heads\), got shape \[3\]"):
        run(A=t["A"][:3])
    with pytest.raises(ValueError, match=r"the heads \(4\) must be a multiple of the groups of B \(3\)"):
        run(B=_randn(2, 10, 3, 5, seed=1), C=_randn(2, 10, 3, 5, seed=2))
    with pytest.raises(ValueError, match=r"C must have B's shape \[2, 10, 2, 5\], got \[2, 10, 2, 4\]"):
        run(C=t["C"][..., :4])
    with pytest.raises(ValueError, match="B dtype Float differs from the x dtype Double"):
        run(B=t["B"].float())
    with pytest.raises(ValueError, match=r"D must be \[4\] or \[4, 3\] \(x's heads, headdim\), got shape"):
        run(D=_randn(4, 2, seed=1))
    with pytest.raises(ValueError, match=r"z must have x's shape \[2, 10, 4, 3\], got \[2, 10, 4, 2\]"):
        run(z=t["z"][..., :2])
    with pytest.raises(ValueError, match=r"dt_bias must be \[4\] \(x's heads\), got shape \[2\]"):
        run(dt_bias=t["dt_bias"][:2])
    with pytest.raises(ValueError, match=r"initial_states must be \[2, 4, 3, 5\] \(batch, heads, headdim"):
        run(init=t["init"][:1])
    with pytest.raises(ValueError, match="dt must be float64, float32, bfloat16 or float16, got Long"):
        run(dt=t["dt"].long())
    with pytest.raises(ValueError, match=r"\(cu_seqlens\) take x of batch size 1, got shape \[2, 10, 4, 3\]"):
        run(cu=torch.tensor([0, 10]))
    one = {k: v[:1] for k, v in t.items() if k in ("x", "dt", "B", "C", "z")}
    with pytest.raises(ValueError, match="cu_seqlens must be nondecreasing, got 6 then 4 at index 2"):
        run(cu=torch.tensor([0, 6, 4, 10]), init=None, **one)
    with pytest.raises(ValueError, match="cu_seqlens must end at x's length 10, got 9"):
        run(cu=torch.tensor([0, 4, 9]), init=None, **one)
    with pytest.raises(ValueError, match="cu_seqlens must be int32 or int64, got Float"):
        run(cu=torch.tensor([0.0, 10.0]), init=None, **one)
    with pytest.raises(ValueError, match=r"initial_states must be \[2, 4, 3, 5\] \(sequences, heads"):
        run(cu=torch.tensor([0, 4, 10]), init=t["init"][:1], **one)
    with pytest.raises(ValueError, match=r"dt_min \(1\) must be <= dt_max \(0.5\)"):
        ops.mamba_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], 4, dt_min=1.0, dt_max=0.5)
    with pytest.raises(ValueError, match="return_varlen_states needs cu_seqlens"):
        mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 4, return_varlen_states=True)
    x1 = one["x"]
    with pytest.raises(ValueError, match=r"does not mark the sequences of seq_idx"):
        mamba_chunk_scan_combined(x1, one["dt"], t["A"], one["B"], one["C"], 4,
                                  cu_seqlens=torch.tensor([0, 5, 10]),
                                  seq_idx=torch.zeros(1, 10, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_idx must be \[1, 10\]"):
        mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 4,
                                  seq_idx=torch.zeros(2, 10, dtype=torch.int32))


def _gated_norm_reference(x, weight, z, eps, group_size, norm_before_gate):
    """Each group of group_size channels on its own, one group at a time, in float64."""
    gate = F.silu(z)
    v = x if norm_before_gate else x * gate
    out = []
    for g in range(x.shape[-1] // group_size):
        part = v[..., g * group_size : (g + 1) * group_size]
        out.append(part / torch.sqrt((part * part).sum(-1, keepdim=True) / group_size + eps))
    out = torch.cat(out, -1) * weight
    return out * gate if norm_before_gate else out


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_rms_norm_over_groups(norm_before_gate):
    # Megatron-core's MambaMixer norm: d_inner 12 in 3 groups of 4, eps 1e-5, gate before the norm.
    x, z = _randn(5, 2, 12, seed=71), _randn(5, 2, 12, seed=72)
    weight = 1 + 0.1 * _randn(12, seed=73)
    leaves = [t.clone().requires_grad_() for t in (x, weight, z)]
    got = rms_norm_gated(leaves[0], leaves[1], z=leaves[2], eps=1e-5, group_size=4,
                         norm_before_gate=norm_before_gate)
    ref_leaves = [t.clone().requires_grad_() for t in (x, weight, z)]
    want = _gated_norm_reference(*ref_leaves[:2], ref_leaves[2], 1e-5, 4, norm_before_gate)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)
    g = _randn(5, 2, 12, seed=74)
    for a, e in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, ref_leaves, g)):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-13)
    # bf16 in, bf16 out, computed in float32.
    out = rms_norm_gated(x.bfloat16(), weight.float(), z=z.bfloat16(), eps=1e-5, group_size=4,
                         norm_before_gate=norm_before_gate)
    assert out.dtype == torch.bfloat16
    exact = _gated_norm_reference(x.bfloat16().double(), weight.double(), z.bfloat16().double(), 1e-5, 4,
                                  norm_before_gate)
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-6)
    with pytest.raises(ValueError, match="group_size 5 must divide the last dimension 12"):
        rms_norm_gated(x, weight, z=z, group_size=5)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_equals_cpu(dtype, packed):
    cu = torch.tensor([0, 37, 38, 100], dtype=torch.int32) if packed else None
    t = _make(1 if packed else 2, 100, 4, 8, 2, 16, D="channel", states=3 if packed else None, dtype=dtype,
              seed=61)
    cpu = _run(lambda v, **k: _op(v, 32, **k), t, seed=62, cu_seqlens=cu)
    dev = {k: None if v is None else v.cuda() for k, v in t.items()}
    gpu = _run(lambda v, **k: _op(v, 32, **k), dev, seed=62, cu_seqlens=None if cu is None else cu.cuda())
    # The same arithmetic in another summation order (and libm's exp).
    rtol = 1e-11 if dtype == torch.float64 else 1e-4
    for a, e in zip(gpu, cpu):
        torch.testing.assert_close(a.cpu(), e, rtol=rtol, atol=rtol * e.abs().max().item())
