"""The attention op's windows, sinks, packed sequences and value heads wider or narrower than the
query/key heads, at cp 1, 2 and 4 with every comm type, against attention written out here in
float64: the [s, s] scores with an explicit mask and an extra softmax column for the sinks (packed
rows: each sequence's attention computed alone). Outputs and the gradients of query, key, value and
sinks; opcheck of the op with the new arguments; the errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext.transformer.context_parallel import CP_COMM_TYPES, context_parallel_attention
from tests.conftest import TIGHT, Comparisons, assert_comparisons, assert_opchecks_passed, opcheck_report
from tests.distributed import run_distributed

CHUNK = 12  # tokens per chunk at cp > 1: the row is 2 * cp chunks


def _reference(q, k, v, grad, causal=True, window=None, sinks=None, bounds=None):
    """Unfused attention over the whole row (``bounds``: a mask between packed sequences) and its
    gradients: out, dq, dk, dv, dsinks (None without sinks)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    q, k, v = leaves
    if sinks is not None:
        sinks = sinks.detach().requires_grad_(True)
    b, heads, s, d = q.shape
    repeats = heads // k.shape[1]
    kx, vx = k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1)
    scores = q @ kx.transpose(-1, -2) / d**0.5
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    visible = torch.ones(s, s, dtype=torch.bool)
    if bounds is not None:
        segment = torch.bucketize(torch.arange(s), torch.tensor(bounds[1:]), right=True)
        visible &= segment[:, None] == segment[None, :]
    if causal:
        visible &= j <= i
    if window is not None:
        visible &= i - j < window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, heads, 1, 1).expand(b, heads, s, 1)], -1)
    probs = scores.softmax(-1)
    out = (probs[..., :s] if sinks is not None else probs) @ vx
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad]


def _per_sequence_reference(q, k, v, grad, bounds, causal=True, window=None, sinks=None):
    """Each packed sequence's attention computed alone, laid back into the row."""
    parts = [
        _reference(*(t[:, :, a:e] for t in (q, k, v, grad)), causal, window, sinks)
        for a, e in zip(bounds, bounds[1:])
    ]
    merged = [torch.cat([p[n] for p in parts], 2) for n in range(4)]
    return merged + [None if sinks is None else sum(p[4] for p in parts)]


def _local(t, cp, rank, bounds=None, dim=2):
    """This rank's rows: chunks ``rank`` and ``2 * cp - 1 - rank`` of every sequence."""
    if cp == 1:
        return t
    bounds = bounds or [0, t.shape[dim]]
    parts = []
    for a, e in zip(bounds, bounds[1:]):
        chunks = t.narrow(dim, a, e - a).chunk(2 * cp, dim)
        parts += [chunks[rank], chunks[2 * cp - 1 - rank]]
    return torch.cat(parts, dim)


def _cases(cp: int, s: int) -> list[dict]:
    """(heads, groups, d, dv), mask, window, sinks and packing: the windows (1, smaller than a chunk,
    spanning chunks, over a tile, the whole row) with sinks, MHA and GQA; sinks alone; value heads
    narrower and wider than the query/key heads; packed rows causal, bidirectional and windowed."""
    unit = 2 * cp
    cases = []
    for window in (1, 7, 30, 50, s):
        for heads, groups in ((4, 4), (8, 4)):
            cases.append(dict(shape=(heads, groups, 8, 8), causal=True, window=window, sinks=True))
    cases += [
        dict(shape=(4, 2, 8, 8), causal=True, window=None, sinks=True),
        dict(shape=(8, 4, 8, 4), causal=True, window=None, sinks=False),
        dict(shape=(4, 4, 4, 12), causal=False, window=None, sinks=False),
        dict(shape=(8, 4, 8, 8), causal=True, window=None, sinks=False, packed=True),
        dict(shape=(4, 4, 8, 4), causal=False, window=None, sinks=False, packed=True),
        dict(shape=(8, 4, 8, 8), causal=True, window=5, sinks=True, packed=True),
    ]
    # Packed sequences of 4, 2, 5 and 1 units of 2 * cp tokens (cp 1: units of 2), the rest in one.
    lengths = [4 * unit, 2 * unit, 5 * unit, unit]
    bounds = [0]
    for n in lengths + [s - sum(lengths)]:
        if n > 0:
            bounds.append(bounds[-1] + n)
    for case in cases:
        case["bounds"] = bounds if case.pop("packed", False) else None
    return cases


def _inputs(case: dict, s: int, g: torch.Generator):
    heads, groups, d, dv = case["shape"]
    q = torch.randn(2, heads, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, groups, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, groups, s, dv, generator=g, dtype=torch.float64)
    grad = torch.randn(2, heads, s, dv, generator=g, dtype=torch.float64)
    sinks = torch.randn(heads, generator=g, dtype=torch.float64) if case["sinks"] else None
    return q, k, v, grad, sinks


def _expected(case, q, k, v, grad, sinks):
    args = dict(causal=case["causal"], window=case["window"], sinks=sinks)
    if case["bounds"] is not None:
        return _per_sequence_reference(q, k, v, grad, case["bounds"], **args)
    return _reference(q, k, v, grad, **args)


def _label(case: dict) -> str:
    packed = "" if case["bounds"] is None else f" packed {case['bounds']}"
    return (f"(heads, groups, d, dv)={case['shape']} causal={case['causal']} window={case['window']} "
            f"sinks={case['sinks']}{packed}")


def _check_group(cmp: Comparisons, group, seed: int) -> None:
    cp, rank = group.size(), group.rank()
    s = 2 * cp * CHUNK
    g = torch.Generator().manual_seed(seed)
    for case in _cases(cp, s):
        q, k, v, grad, sinks = _inputs(case, s, g)
        expected = _expected(case, q, k, v, grad, sinks)
        bounds = case["bounds"]
        cu_seqlens = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
        window_size = None if case["window"] is None else (case["window"] - 1, 0)
        for comm in CP_COMM_TYPES:
            if comm == "a2a" and case["shape"][1] % cp:
                continue
            lq, lk, lv = (_local(t, cp, rank, bounds).requires_grad_(True) for t in (q, k, v))
            ls = None if sinks is None else sinks.clone().requires_grad_(True)
            out = context_parallel_attention(
                lq, lk, lv, group, case["causal"], comm, window_size=window_size, sinks=ls,
                cu_seqlens=cu_seqlens,
            )
            out.backward(_local(grad, cp, rank, bounds))
            label = f"cp{cp} rank{rank} {comm} {_label(case)}"
            got = [out, lq.grad, lk.grad, lv.grad]
            for name, actual, ref in zip("out dq dk dv".split(), got, expected):
                cmp.close(actual, _local(ref, cp, rank, bounds), f"{label} {name}", **TIGHT)
            if sinks is not None:
                # This rank's part of the sinks' gradient; the ranks' parts sum to the whole.
                total = ls.grad.clone()
                dist.all_reduce(total, group=group)
                cmp.close(total, expected[4], f"{label} dsinks", **TIGHT)


def _errors(group) -> list[str]:
    cp = group.size()
    x = torch.randn(1, 4, 2 * cp * CHUNK, 8, dtype=torch.float64)
    s = x.shape[2] * cp
    cases = [
        dict(window_size=(-2, 0)),  # a window of -1 keys
        dict(window_size=(3, 2)),  # keys after the query
        dict(window_size=(3, 0), is_causal=False),  # a window without the causal mask
        dict(cu_seqlens=torch.tensor([0, 8, 4, s])),  # not increasing
        dict(cu_seqlens=torch.tensor([0, 8, s - 8])),  # does not end at the row's length
        dict(cu_seqlens=torch.tensor([0, 2 * cp + 1, s])),  # a sequence not in 2 * cp chunks
        dict(sinks=torch.zeros(3, dtype=torch.float64)),  # not one per head
        dict(value=torch.randn(1, 4, 2 * cp * CHUNK + 2, 8, dtype=torch.float64)),  # rows differ
    ]
    messages = []
    for case in cases:
        args = dict(is_causal=True, cp_comm_type="p2p")
        args.update(case)
        value = args.pop("value", x)
        try:
            context_parallel_attention(x, x, value, group, **args)
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


ERRORS = [
    "window_size=(-2, 0): left must be >= 0, or -1 for no limit",
    "window_size=(3, 2): the right side must be 0",
    "a window of 4 keys needs the causal mask",
    "cu_seqlens must increase strictly from 0 to the packed row's length",
    "cu_seqlens must increase strictly from 0 to the packed row's length",
    "under context parallelism each sequence is cut into 2*cp = 4 chunks",
    "sinks must be one floating logit per query head, [4]",
    "must agree in batch, heads and sequence",
]


def _worker():
    rank = dist.get_rank()
    cmp = Comparisons()
    _check_group(cmp, dist.group.WORLD, seed=1)  # cp 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    _check_group(cmp, pair, seed=2)  # cp 2
    q = torch.randn(1, 4, 2 * 2 * CHUNK, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 2 * 2 * CHUNK, 4, dtype=torch.float64)
    cu = torch.tensor([0, 8, 4 * 2 * CHUNK], dtype=torch.int32)
    reports = [
        (
            f"{comm} rank {rank}",
            opcheck_report(
                torch.ops.megatron_ext.context_parallel_attention_forward.default,
                (q, q[:, :2], v, pair.group_name, 2, pair.rank(), True, comm, None, 5,
                 torch.randn(4, dtype=torch.float64), cu),
            ),
        )
        for comm in ("p2p", "a2a")  # a2a's log-sum-exp has its own shape
    ]
    return cmp.made, _errors(pair), reports


@pytest.mark.slow  # 4 ranks, about 90 attention calls per rank and the opchecks' compiled graphs
def test_variants_at_cp_2_and_4_equal_unfused_attention():
    results = run_distributed(4, _worker)
    for made, errors, reports in results:
        assert_comparisons(made)
        assert_opchecks_passed(reports)
        for message, expected in zip(errors, ERRORS):
            assert expected in message, (expected, message)
    # cp 4: 16 cases x 3 comm types, less a2a with 2 groups (1 case); cp 2: 16 x 3; each 4 tensors
    # and, with sinks (12 cases), the sinks' gradient.
    assert len(results[0][0]) == (16 * 3 - 1) * 4 + (12 * 3 - 1) + 16 * 3 * 4 + 12 * 3


def test_variants_at_cp_1_equal_unfused_attention():
    """cp 1 (no communication) on longer rows, so that windows span several query tiles (the
    unmasked middle between masked edges): every case of the cp > 1 test and windows up to 130."""
    s = 320
    g = torch.Generator().manual_seed(0)
    cases = _cases(1, s) + [
        dict(shape=(4, 2, 8, 8), causal=True, window=w, sinks=True, bounds=None) for w in (64, 130)
    ]
    for case in cases:
        q, k, v, grad, sinks = _inputs(case, s, g)
        expected = _expected(case, q, k, v, grad, sinks)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ls = None if sinks is None else sinks.clone().requires_grad_(True)
        cu = None if case["bounds"] is None else torch.tensor(case["bounds"])
        out = torch.ops.megatron_ext.context_parallel_attention(
            *leaves, "", 1, 0, case["causal"], "p2p", None, case["window"], ls, cu
        )
        out.backward(grad)
        got = [out, *(t.grad for t in leaves), None if ls is None else ls.grad]
        for name, actual, ref in zip("out dq dk dv dsinks".split(), got, expected):
            if ref is not None:
                torch.testing.assert_close(actual, ref, **TIGHT, msg=lambda m: f"{_label(case)} {name}: {m}")


@pytest.mark.slow  # opcheck compiles graphs
def test_opcheck_with_window_sinks_and_packed_rows():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 24, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 24, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 24, 4, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    args = (q, k, v, "", 1, 0, True, "p2p", None, 3, sinks, cu)
    op = torch.ops.megatron_ext.context_parallel_attention.default
    assert_opchecks_passed([("window, sinks, packed", opcheck_report(op, args))])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_variants_on_cuda(dtype):
    """cp 1 on a GPU: the CUDA block kernels (the scores in float64, the memory-efficient kernel with
    a block-sized bias for float32, the flash kernel's window and, for packed rows of batch 1, its
    variable-length calls for bfloat16) and their backward against unfused float64 attention: windows,
    sinks, value heads narrower and wider than the query/key heads (padded for flash), packed rows.
    The error bound is relative to the largest value of each reference tensor (TF32, bfloat16)."""
    bound = {torch.float64: 1e-12, torch.float32: 2e-3, torch.bfloat16: 3e-2}[dtype]
    _check_variants_on("cuda", dtype, bound)


def _check_variants_on(device: str, dtype: torch.dtype, bound: float) -> None:
    s = 256
    g = torch.Generator().manual_seed(4)
    cases = [dict(shape=(8, 2, 64, 64), causal=True, window=w, sinks=True, bounds=None) for w in (1, 17, 100)]
    cases += [
        dict(shape=(8, 2, 64, 64), causal=True, window=s, sinks=True, bounds=None),
        dict(shape=(8, 4, 64, 32), causal=True, window=None, sinks=False, bounds=None),
        dict(shape=(4, 4, 32, 72), causal=False, window=None, sinks=True, bounds=None),
        dict(shape=(8, 2, 64, 64), causal=True, window=None, sinks=False, bounds=[0, 40, 100, s]),
        dict(shape=(8, 2, 64, 48), causal=True, window=30, sinks=True, bounds=[0, 40, 100, s]),
    ]
    for case in cases:
        q, k, v, grad, sinks = _inputs(case, s, g)
        if case["bounds"] is not None:  # a batch of one packed row: flash's variable-length calls
            q, k, v, grad = (t[:1] for t in (q, k, v, grad))
        expected = _expected(case, q, k, v, grad, sinks)
        leaves = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
        sink_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # a float32 parameter
        ls = None if sinks is None else sinks.to(device, sink_dtype).requires_grad_(True)
        cu = None
        if case["bounds"] is not None:
            cu = torch.tensor(case["bounds"], dtype=torch.int32, device=device)
        out = torch.ops.megatron_ext.context_parallel_attention(
            *leaves, "", 1, 0, case["causal"], "p2p", None, case["window"], ls, cu
        )
        out.backward(grad.to(device, dtype))
        got = [out, *(t.grad for t in leaves), None if ls is None else ls.grad]
        for name, actual, want in zip("out dq dk dv dsinks".split(), got, expected):
            if want is not None:
                error = (actual.double().cpu() - want).abs().max().item()
                assert error <= bound * want.abs().max().item(), (dtype, _label(case), name, error)


def test_op_refuses_a_window_of_no_keys():
    x = torch.zeros(1, 2, 8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="window must be a positive integer .the keys a query sees"):
        torch.ops.megatron_ext.context_parallel_attention(x, x, x, "", 1, 0, True, "p2p", None, 0)
