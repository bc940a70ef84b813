"""The gated delta rule op of Gated DeltaNet layers (``torch.ops.megatron_ext.chunk_gated_delta_rule``)
against a float64 reference written from the recurrence itself, one token at a time, no chunking; against
transformers' Qwen3-Next torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule; packed rows,
states, chunk sizes, 16-bit inputs and the refusals. Forward and the gradients of q, k, v, g, beta and the
initial state, the final state's gradient included.

Tolerances come from float32's (or bfloat16's) unit roundoff u: each value of a chunk is a sum of at most
K + V + 2 C products (its rows of the chunk's products, the state's read, the substitution) of terms no
larger than the result's largest magnitude; with L2-normalised keys and beta <= 1 the state's transition
e^g (I - beta k k^T) does not expand, so the errors of earlier chunks are not amplified.
"""

from __future__ import annotations

import pytest
import torch

import megatron_ext
from megatron_ext import _C
from megatron_ext.fusions import chunk_gated_delta_rule
from tests.conftest import has_kernel

ops = torch.ops.megatron_ext
HAS_GPU = torch.cuda.is_available()


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _make(batch, length, heads, dk, dv, *, seed, states=None, init=True, dtype=torch.float64):
    """q, k, v, g (log decay in [-1, 0)), beta in (0, 1), and the initial states (or None)."""
    q, k = _randn(batch, length, heads, dk, seed=seed), _randn(batch, length, heads, dk, seed=seed + 1)
    v = _randn(batch, length, heads, dv, seed=seed + 2)
    g = -_randn(batch, length, heads, seed=seed + 3).abs().clamp(max=3.0) / 3.0
    beta = torch.sigmoid(_randn(batch, length, heads, seed=seed + 4))
    s = _randn(states or batch, heads, dk, dv, seed=seed + 5) if init else None
    return [None if t is None else t.to(dtype) for t in (q, k, v, g, beta, s)]


def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def reference(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, l2norm=False):
    """The recurrence in the inputs' dtype, a token at a time: S = e^g S; u = beta (v - S^T k);
    S += k u^T; o = S^T (scale q). Returns (o, final states)."""
    batch, length, heads, dk = q.shape
    scale = dk**-0.5 if scale is None else scale
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    bounds = [0, length] if cu_seqlens is None else cu_seqlens.tolist()
    outs, finals = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        rows = batch if cu_seqlens is None else 1
        if initial_state is None:
            state = q.new_zeros(rows, heads, dk, v.shape[-1])
        else:
            state = initial_state if cu_seqlens is None else initial_state[i : i + 1]
        for t in range(start, end):
            state = state * g[:, t].exp()[..., None, None]
            delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state))
            state = state + k[:, t, :, :, None] * delta[:, :, None, :]
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
        finals.append(state)
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return o, torch.cat(finals, 0)


def _leaves(tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def _run(fn, tensors, grad_o, grad_final, **kwargs):
    """fn's output, final state and the gradients of (q, k, v, g, beta, initial state) for the loss
    <o, grad_o> + <final, grad_final>."""
    inputs = _leaves(tensors)
    o, final = fn(*inputs[:5], initial_state=inputs[5], **kwargs)
    wanted = [t for t in inputs if t is not None]
    loss = (o.double() * grad_o).sum() + (final.double() * grad_final).sum()
    got = iter(torch.autograd.grad(loss, wanted))
    return [o.detach(), final.detach()] + [None if t is None else next(got) for t in inputs]


def _op(q, k, v, g, beta, initial_state=None, scale=None, cu_seqlens=None, l2norm=False, chunk_size=64):
    return ops.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, True, cu_seqlens, l2norm,
                                      chunk_size)


def _ref(q, k, v, g, beta, initial_state=None, scale=None, cu_seqlens=None, l2norm=False, chunk_size=None):
    return reference(q, k, v, g, beta, scale, initial_state, cu_seqlens, l2norm)


def _assert_all_close(got, want, *, rtol, atol_of):
    for i, (a, e) in enumerate(zip(got, want)):
        if e is None:
            assert a is None, i
            continue
        torch.testing.assert_close(a.double(), e.double(), rtol=rtol, atol=atol_of(e), msg=f"output {i}")


@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_float64_equals_recurrence(chunk_size, init, l2norm):
    # T = 37: a last chunk shorter than the others for every chunk size but 1.
    tensors = _make(2, 37, 3, 5, 4, seed=1, init=init)
    grads = _randn(2, 37, 3, 4, seed=11), _randn(2, 3, 5, 4, seed=12)
    got = _run(_op, tensors, *grads, l2norm=l2norm, chunk_size=chunk_size, scale=0.7)
    want = _run(_ref, tensors, *grads, l2norm=l2norm, scale=0.7)
    _assert_all_close(got, want, rtol=1e-10, atol_of=lambda e: 1e-11 * max(1.0, e.abs().max().item()))


def test_gradcheck():
    tensors = _make(1, 5, 2, 3, 2, seed=3)
    inputs = _leaves(tensors)

    def fn(q, k, v, g, beta, s):
        return _op(q, k, v, g, beta, s, l2norm=True, chunk_size=2)

    assert torch.autograd.gradcheck(fn, inputs)
    cu = torch.tensor([0, 2, 2, 5])
    packed = _leaves(_make(1, 5, 2, 3, 2, seed=4, states=3))
    assert torch.autograd.gradcheck(lambda *t: _op(*t[:5], t[5], cu_seqlens=cu, chunk_size=2), packed)


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_packed_rows_equal_each_sequence_alone(offsets_dtype):
    # An empty sequence (equal offsets) passes its initial state through to its final state.
    bounds = [0, 9, 9, 10, 30]
    cu = torch.tensor(bounds, dtype=offsets_dtype)
    tensors = _make(1, 30, 2, 4, 3, seed=5, states=4)
    grads = _randn(1, 30, 2, 3, seed=13), _randn(4, 2, 4, 3, seed=14)
    got = _run(_op, tensors, *grads, cu_seqlens=cu, chunk_size=4, l2norm=True)
    pieces = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = [t[:, start:end] for t in tensors[:5]] + [tensors[5][i : i + 1]]
        pieces.append(_run(_op, part, grads[0][:, start:end], grads[1][i : i + 1], chunk_size=4, l2norm=True))
    tol = dict(rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got[0], torch.cat([p[0] for p in pieces], 1), **tol)
    torch.testing.assert_close(got[1], torch.cat([p[1] for p in pieces], 0), **tol)
    for j in range(2, 7):  # q, k, v, g, beta along time; the initial states along the sequences
        torch.testing.assert_close(got[j], torch.cat([p[j] for p in pieces], 1), **tol)
    torch.testing.assert_close(got[7], torch.cat([p[7] for p in pieces], 0), **tol)
    assert torch.equal(got[1][1], tensors[5][1])
    torch.testing.assert_close(got[7][1], grads[1][1], rtol=0, atol=0)
    # And the reference on the packed row.
    want = _run(_ref, tensors, *grads, cu_seqlens=cu, l2norm=True)
    _assert_all_close(got, want, rtol=1e-10, atol_of=lambda e: 1e-11 * max(1.0, e.abs().max().item()))


def test_final_state_alone_and_strided_inputs():
    # The loss reads the final state only (the output's gradient is undefined in the backward); q and
    # k arrive as strided views, as a split of a fused projection gives them.
    q, k, v, g, beta, s = _make(1, 23, 2, 4, 3, seed=12)
    qk = torch.cat([q, k], -1).requires_grad_()
    leaves = _leaves([v, g, beta, s])
    final = _op(qk[..., :4], qk[..., 4:], *leaves[:3], leaves[3], l2norm=True, chunk_size=8)[1]
    got = torch.autograd.grad(final.sum(), [qk, *leaves])
    qk_ref = torch.cat([q, k], -1).requires_grad_()
    ref_leaves = _leaves([v, g, beta, s])
    want_final = reference(qk_ref[..., :4], qk_ref[..., 4:], *ref_leaves[:3], initial_state=ref_leaves[3],
                           l2norm=True)[1]
    want = torch.autograd.grad(want_final.sum(), [qk_ref, *ref_leaves])
    torch.testing.assert_close(final, want_final, rtol=1e-12, atol=1e-13)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-11)


def test_chunk_sizes_agree():
    tensors = _make(1, 70, 2, 8, 8, seed=6)
    grads = _randn(1, 70, 2, 8, seed=15), _randn(1, 2, 8, 8, seed=16)
    first = _run(_op, tensors, *grads, chunk_size=64, l2norm=True)
    for chunk_size in (1, 7, 32, 70, 256):
        got = _run(_op, tensors, *grads, chunk_size=chunk_size, l2norm=True)
        _assert_all_close(got, first, rtol=1e-11, atol_of=lambda e: 1e-12 * max(1.0, e.abs().max().item()))


def _float_tol(dk, dv, chunk_size, dtype):
    """The float32 accumulation's bound (module docstring) and, for 16-bit results, their rounding."""
    n = dk + dv + 2 * chunk_size
    u32 = torch.finfo(torch.float32).eps / 2
    rtol = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    return rtol, lambda e: n * u32 * max(1.0, e.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_16_and_32_bit_within_their_rounding(dtype):
    # Inputs rounded to the dtype first: the reference runs on the values the op sees.
    tensors = [t.to(dtype) for t in _make(2, 150, 2, 16, 16, seed=7)]
    tensors[5] = tensors[5].float()
    grads = _randn(2, 150, 2, 16, seed=17).to(dtype).double(), _randn(2, 2, 16, 16, seed=18)
    got = _run(_op, tensors, *grads, l2norm=True)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert [t.dtype for t in got[2:]] == [t.dtype for t in tensors]
    want = _run(_ref, [t.double() for t in tensors], *grads, l2norm=True)
    rtol, atol_of = _float_tol(16, 16, 64, dtype)
    _assert_all_close(got, want, rtol=rtol, atol_of=atol_of)


def test_every_cpu_instruction_set():
    tensors = _make(1, 40, 2, 6, 5, seed=8)
    grads = _randn(1, 40, 2, 5, seed=19), _randn(1, 2, 6, 5, seed=20)
    chosen = _C.cpu_capability()
    results = {}
    try:
        for capability in _C.supported_cpu_capabilities():
            _C._set_cpu_capability(capability)
            results[capability] = _run(_op, tensors, *grads, chunk_size=16, l2norm=True)
    finally:
        _C._set_cpu_capability(chosen)
    for values in results.values():
        _assert_all_close(values, results[chosen], rtol=1e-12, atol_of=lambda e: 1e-13)


def _transformers():
    module = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    return module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule


@pytest.mark.parametrize("grouped", [False, True])
def test_equals_transformers_qwen3_next(grouped):
    # transformers computes in float32 with q and k L2-normalised, K^-1/2 scaling; its q, k heads each
    # serve HV / H consecutive value heads (repeat_interleave), as the wrapper's do.
    chunk_fn, recurrent_fn = _transformers()
    heads, value_heads, dk, dv, length = 2, 4 if grouped else 2, 16, 8, 100
    q, k = _randn(2, length, heads, dk, seed=31).float(), _randn(2, length, heads, dk, seed=32).float()
    v = _randn(2, length, value_heads, dv, seed=33).float()
    g = (-_randn(2, length, value_heads, seed=34).abs() / 3).float()
    beta = torch.sigmoid(_randn(2, length, value_heads, seed=35)).float()
    s = _randn(2, value_heads, dk, dv, seed=36).float()
    tensors = [q, k, v, g, beta, s]
    grads = _randn(2, length, value_heads, dv, seed=37), _randn(2, value_heads, dk, dv, seed=38)

    def ours(q, k, v, g, beta, initial_state):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)

    got = _run(ours, tensors, *grads)
    rtol, atol_of = _float_tol(dk, dv, 64, torch.float32)
    for fn in (chunk_fn, recurrent_fn):
        want = _run(lambda *t, initial_state: fn(*t, initial_state=initial_state, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True), tensors, *grads)
        # Both are float32 computations of the same values: twice the bound apart at most.
        _assert_all_close(got, want, rtol=rtol, atol_of=lambda e: 2 * atol_of(e))


def test_megatron_core_call():
    # GatedDeltaNet's call: keywords, no initial state, no final state (None).
    tensors = _make(1, 20, 2, 4, 4, seed=9, init=False)
    o, final = chunk_gated_delta_rule(*tensors[:3], g=tensors[3], beta=tensors[4], initial_state=None,
                                      output_final_state=False, use_qk_l2norm_in_kernel=False)
    assert final is None
    torch.testing.assert_close(o, reference(*tensors[:5])[0], rtol=1e-12, atol=1e-13)


def test_opcheck():
    tensors = _make(1, 9, 2, 3, 2, seed=10, states=2)
    leaves = _leaves(tensors)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    for final in (False, True):
        torch.library.opcheck(ops.chunk_gated_delta_rule.default,
                              (*leaves[:5], None, leaves[5], final, cu, True, 4))
    single = _leaves(tensors[:5])
    torch.library.opcheck(ops.chunk_gated_delta_rule.default, (*single, 0.5, None, True, None, False, 3))
    o, f, states = ops.gated_delta_rule_forward(*tensors[:5], 0.5, tensors[5], cu, True, 4)
    assert states.shape == (1, 2, 3 + 2 - 1, 3, 2)
    torch.library.opcheck(ops.gated_delta_rule_forward.default, (*tensors[:5], 0.5, tensors[5], cu, True, 4))
    torch.library.opcheck(ops.gated_delta_rule_backward.default,
                          (torch.ones_like(o), f, *tensors[:5], 0.5, tensors[5], cu, states, True, 4))


def test_kernels_registered_for_every_backend_built():
    cuda = megatron_ext.build_info()["cuda_compiled"]
    for op in ("gated_delta_rule_forward", "gated_delta_rule_backward"):
        assert has_kernel(op, "CPU") and has_kernel(op, "Meta"), op
        assert has_kernel(op, "CUDA") == cuda, op
    for key in ("Autograd", "CompositeExplicitAutograd", "Meta"):
        assert has_kernel("chunk_gated_delta_rule", key), key


def test_refusals():
    q, k, v, g, beta, s = _make(2, 10, 3, 4, 5, seed=11)
    with pytest.raises(ValueError, match=r"q must be \[batch, length, heads, key dim\].*shape \[10, 3, 4\]"):
        _op(q[0], k, v, g, beta)
    with pytest.raises(ValueError, match=r"k must have q's shape \[2, 10, 3, 4\], got \[2, 10, 3, 3\]"):
        _op(q, k[..., :3], v, g, beta)
    with pytest.raises(ValueError, match="k dtype Float differs from the q dtype Double"):
        _op(q, k.float(), v, g, beta)
    with pytest.raises(ValueError, match=r"v must be \[2, 10, 3, value dim\].*got shape \[2, 10, 6, 5\]"):
        _op(q, k, torch.cat([v, v], 2), g, beta)
    with pytest.raises(ValueError, match=r"g must be \[2, 10, 3\] \(q's batch, length, heads\), got shape"):
        _op(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match="beta must be float64, float32, bfloat16 or float16, got Long"):
        _op(q, k, v, g, beta.long())
    with pytest.raises(ValueError, match="g is on meta but q is on cpu"):
        _op(q, k, v, g.to("meta"), beta)
    with pytest.raises(ValueError, match=r"chunk_size must be in \[1, 256\], got 0"):
        _op(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match=r"chunk_size must be in \[1, 256\], got 257"):
        _op(q, k, v, g, beta, chunk_size=257)
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        _op(q, k, v, g, beta, scale=float("nan"))
    with pytest.raises(ValueError, match=r"initial_state must be \[2, 3, 4, 5\] \(batch, heads, key dim"):
        _op(q, k, v, g, beta, initial_state=s[:1])
    with pytest.raises(ValueError, match=r"\(cu_seqlens\) take q of batch size 1, got shape \[2, 10, 3, 4\]"):
        _op(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10]))
    one = [t[:1] for t in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="cu_seqlens must be nondecreasing, got 6 then 4 at index 2"):
        _op(*one, cu_seqlens=torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match=r"cu_seqlens must end at q's length 10 \(dim 1\), got 9"):
        _op(*one, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, got 1"):
        _op(*one, cu_seqlens=torch.tensor([1, 4, 10]))
    with pytest.raises(ValueError, match="cu_seqlens must be int32 or int64, got Float"):
        _op(*one, cu_seqlens=torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError, match=r"initial_state must be \[2, 3, 4, 5\] \(sequences, heads"):
        _op(*one, cu_seqlens=torch.tensor([0, 4, 10]), initial_state=s[:1])
    o, f, states = ops.gated_delta_rule_forward(q, k, v, g, beta, 0.5, None, None, False, 4)
    with pytest.raises(ValueError, match=r"grad_output has shape \[2, 9, 3, 5\] but v has shape \[2, 10"):
        ops.gated_delta_rule_backward(o[:, :9], None, q, k, v, g, beta, 0.5, None, None, states, False, 4)
    with pytest.raises(ValueError, match=r"chunk_states must be \[2, 3, 5, 4, 5\], got shape \[2, 3, 3,"):
        ops.gated_delta_rule_backward(o, None, q, k, v, g, beta, 0.5, None, None, states, False, 2)
    with pytest.raises(ValueError, match=r"v's heads \(6\) must be a multiple of q's and k's heads \(4\)"):
        chunk_gated_delta_rule(torch.cat([q, q[:, :, :1]], 2), torch.cat([k, k[:, :, :1]], 2),
                               torch.cat([v, v], 2), torch.cat([g, g], 2), torch.cat([beta, beta], 2))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_equals_cpu(dtype, packed):
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int32) if packed else None
    tensors = _make(1 if packed else 2, 300, 3, 32, 16, seed=41, states=3 if packed else None, dtype=dtype)
    tensors[5] = tensors[5].float() if dtype != torch.float64 else tensors[5]
    grads = _randn(*tensors[2].shape[:3], 16, seed=42), _randn(*tensors[5].shape, seed=43)
    cpu = _run(_op, tensors, *grads, cu_seqlens=cu, l2norm=True)
    gpu = _run(_op, [t.cuda() for t in tensors], grads[0].cuda(), grads[1].cuda(),
               cu_seqlens=None if cu is None else cu.cuda(), l2norm=True)
    # The same arithmetic; libm's exp and rsqrt and the order of some sums differ.
    if dtype == torch.float64:
        rtol, atol_of = 1e-10, lambda e: 1e-11 * max(1.0, e.abs().max().item())
    else:
        rtol, atol_of = _float_tol(32, 16, 64, dtype)
        atol_of = (lambda f: lambda e: 2 * f(e))(atol_of)
    _assert_all_close([None if t is None else t.cpu() for t in gpu], cpu, rtol=rtol, atol_of=atol_of)
