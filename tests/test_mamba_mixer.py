"""MambaMixer (Megatron-core's Mamba-2 layer) on megatron_ext's ops: at tensor-parallel size 1 and 2
(with and without sequence parallelism) its weights are the serial layer's, and its output and every
gradient equal, in float64, a reference written here from the recurrence one token at a time
(``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``); packed rows equal each
sequence alone; transformers' Mamba2Mixer given the same weights computes the same output; bad
configurations are refused alike on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext import parallel_state as ps
from megatron_ext.packed_seq_params import PackedSeqParams
from megatron_ext.ssm import MambaMixer
from megatron_ext.transformer import TransformerConfig
from tests.distributed import run_distributed
from tests.test_gated_delta_net import _gather

HIDDEN, HEADS, P, GROUPS, N, W = 16, 4, 8, 2, 6, 4
INNER = HEADS * P
SEQ, BATCH = 12, 2


def _config(tp: int = 1, sp: bool = False, dtype=torch.float64, **kw) -> TransformerConfig:
    fields = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        params_dtype=dtype,
        use_cpu_initialization=True,
        mamba_state_dim=N,
        mamba_head_dim=P,
        mamba_num_groups=GROUPS,
        mamba_num_heads=HEADS,
    )
    fields.update(kw)
    return TransformerConfig(**fields)


IN_BLOCKS = [INNER, INNER, GROUPS * N, GROUPS * N, HEADS]
CONV_BLOCKS = [INNER, GROUPS * N, GROUPS * N]


def reference(x: torch.Tensor, w: dict, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """The mixer from its definition, one token at a time: x ``[s, b, h]``; w the full weights."""
    s, b, _ = x.shape
    z, xs, B, C, dt = torch.split(x @ w["in_proj"].T, IN_BLOCKS, dim=-1)
    xbc = torch.cat([xs, B, C], dim=-1)
    starts = set(cu_seqlens or [0])
    conv = torch.zeros_like(xbc) + w["conv_bias"]
    for t in range(s):
        first = max(st for st in starts if st <= t)
        for j in range(W):
            if t - (W - 1) + j >= first:
                conv[t] = conv[t] + w["conv"][:, 0, j] * xbc[t - (W - 1) + j]
    xs, B, C = torch.split(F.silu(conv), CONV_BLOCKS, dim=-1)
    xs = xs.reshape(s, b, HEADS, P)
    B, C = (t.reshape(s, b, GROUPS, N).repeat_interleave(HEADS // GROUPS, dim=2) for t in (B, C))
    dt = F.softplus(dt + w["dt_bias"])
    A = -torch.exp(w["A_log"])
    h = torch.zeros(b, HEADS, P, N, dtype=x.dtype)
    ys = []
    for t in range(s):
        if t in starts:
            h = torch.zeros_like(h)
        h = (
            torch.exp(dt[t] * A)[..., None, None] * h
            + (dt[t][..., None] * xs[t])[..., None] * B[t][:, :, None]
        )
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[t]) + w["D"][:, None] * xs[t])
    y = torch.stack(ys).reshape(s, b, INNER) * F.silu(z)
    groups = y.unflatten(-1, (GROUPS, INNER // GROUPS))
    y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2) * w["norm"]
    return y @ w["out_proj"].T


def _full(layer: MambaMixer, grads: bool = False) -> dict:
    get = (lambda p: p.grad) if grads else (lambda p: p.detach())
    return {
        "in_proj": _gather(get(layer.in_proj.weight), IN_BLOCKS),
        "conv": _gather(get(layer.conv1d.weight), CONV_BLOCKS),
        "conv_bias": _gather(get(layer.conv1d.bias), CONV_BLOCKS),
        "A_log": _gather(get(layer.A_log), None),
        "dt_bias": _gather(get(layer.dt_bias), None),
        "D": _gather(get(layer.D), None),
        "norm": _gather(get(layer.norm.weight), None),
        "out_proj": _gather(get(layer.out_proj.weight), None, dim=1),
    }


def _layer_worker(tp: int, sp: bool) -> dict:
    ps.initialize_model_parallel(tp)
    torch.manual_seed(3)
    layer = MambaMixer(_config(tp, sp), d_model=HIDDEN)
    weights = _full(layer)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64)
    dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64)
    rank = ps.get_tensor_model_parallel_rank()
    per = SEQ // tp if sp else SEQ
    local = (x[rank * per : (rank + 1) * per] if sp else x).clone().requires_grad_(True)
    out, bias = layer(local)
    out.backward(dy[rank * per : (rank + 1) * per] if sp else dy)
    result = {
        "weights": weights,
        "out": _gather(out, None) if sp else out.detach(),
        "dx": _gather(local.grad, None) if sp else local.grad,
        "grads": _full(layer, grads=True),
        "bias": bias,
    }
    ps.destroy_model_parallel()
    return result


def _check_against_reference(result: dict) -> None:
    w = {k: v.clone().requires_grad_(True) for k, v in result["weights"].items()}
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64).requires_grad_(True)
    dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64)
    want = reference(x, w)
    want.backward(dy)
    torch.testing.assert_close(result["out"], want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(result["dx"], x.grad, rtol=1e-10, atol=1e-12)
    for name, grad in result["grads"].items():
        torch.testing.assert_close(grad, w[name].grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_serial_mixer_equals_the_reference():
    (result,) = run_distributed(1, _layer_worker, 1, False)
    w = result["weights"]
    assert result["bias"] is None and w["D"].eq(1).all() and w["norm"].eq(1).all()
    dt = F.softplus(w["dt_bias"])  # the initial step sizes within [dt_min, dt_max]
    assert ((dt > 0.001 - 1e-12) & (dt < 0.1 + 1e-12)).all(), dt
    _check_against_reference(result)


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_mixer_equals_serial(sp):
    (serial,) = run_distributed(1, _layer_worker, 1, False)
    for result in run_distributed(2, _layer_worker, 2, sp):
        for name, value in serial["weights"].items():
            assert torch.equal(result["weights"][name], value), name
        _check_against_reference(result)


def _packed_worker() -> list:
    ps.initialize_model_parallel()
    torch.manual_seed(3)
    layer = MambaMixer(_config(), d_model=HIDDEN)
    x = torch.randn(SEQ, 1, HIDDEN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    cu = torch.tensor([0, 5, 9, SEQ], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5
    )
    packed, _ = layer(x, packed_seq_params=params)
    alone = [layer(x[a:b])[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    ref = reference(x, _full(layer), cu.tolist())
    ps.destroy_model_parallel()
    return [packed.detach(), torch.cat(alone).detach(), ref.detach()]


def test_packed_rows_equal_each_sequence_alone():
    (result,) = run_distributed(1, _packed_worker)
    packed, alone, ref = result
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(packed, ref, rtol=1e-10, atol=1e-12)


def _hf_worker() -> tuple:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba2 import modeling_mamba2 as hf

    ps.initialize_model_parallel()
    torch.manual_seed(3)
    layer = MambaMixer(_config(dtype=torch.float32), d_model=HIDDEN)
    config = transformers.Mamba2Config(
        hidden_size=HIDDEN,
        num_heads=HEADS,
        head_dim=P,
        n_groups=GROUPS,
        state_size=N,
        conv_kernel=W,
        expand=INNER // HIDDEN,
        num_hidden_layers=1,
        layer_norm_epsilon=1e-5,
        use_conv_bias=True,
        use_bias=False,
        chunk_size=4,
    )
    theirs = hf.Mamba2Mixer(config, 0).float()
    w = _full(layer)
    with torch.no_grad():
        theirs.in_proj.weight.copy_(w["in_proj"])
        theirs.conv1d.weight.copy_(w["conv"])
        theirs.conv1d.bias.copy_(w["conv_bias"])
        theirs.A_log.copy_(w["A_log"])
        theirs.dt_bias.copy_(w["dt_bias"])
        theirs.D.copy_(w["D"])
        theirs.norm.weight.copy_(w["norm"])
        theirs.out_proj.weight.copy_(w["out_proj"])
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(9))
    ours, _ = layer(x)
    hf_out = (
        theirs.torch_forward(x.transpose(0, 1))
        if hasattr(theirs, "torch_forward")
        else theirs(x.transpose(0, 1))
    )
    ps.destroy_model_parallel()
    return ours.tolist(), hf_out.transpose(0, 1).tolist()  # plain lists: no shared storage to hand over


def test_equals_transformers_mamba2_mixer():
    (result,) = run_distributed(1, _hf_worker)
    ours, theirs = result
    # float32 in both
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5)


def _refusals_worker() -> list[str]:
    ps.initialize_model_parallel(2)
    out = []
    for kw in (
        dict(mamba_num_heads=3),
        dict(mamba_num_groups=1),
        dict(mamba_num_heads=6, mamba_num_groups=4),
    ):
        try:
            MambaMixer(_config(2, **kw), d_model=HIDDEN)
            out.append("accepted")
        except ValueError as e:
            out.append(str(e))
    ps.destroy_model_parallel()
    return out


def test_bad_configurations_are_refused_alike_on_every_rank():
    first, second = run_distributed(2, _refusals_worker)
    assert first == second
    heads, groups, ratio = first
    assert "the number of heads (3) must be divisible by the tensor-model-parallel size 2" in heads
    assert "mamba_num_groups (1) must be divisible by the tensor-model-parallel size 2" in groups
    assert "the number of heads (6) must be divisible by mamba_num_groups=4" in ratio
