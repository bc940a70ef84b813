"""GatedDeltaNet (Megatron-core's linear-attention layer) on megatron_ext's ops: at tensor-parallel
size 1 and 2 (with and without sequence parallelism) its weights are the serial layer's, and its
output and every gradient equal, in float64, a reference written here from the layer's definition
with a token-by-token recurrence; packed rows equal each sequence alone; transformers' Qwen3-Next
layer given the same weights computes the same output; bad configurations are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext import parallel_state as ps
from megatron_ext.distributed.finalize_model_grads import allreduce_layernorm_grads
from megatron_ext.packed_seq_params import PackedSeqParams
from megatron_ext.ssm import GatedDeltaNet
from megatron_ext.transformer import TransformerConfig
from tests.distributed import run_distributed

HIDDEN, KEY_HEADS, VALUE_HEADS, DK, DV, W = 16, 2, 4, 8, 6, 4
SEQ, BATCH = 12, 2


def _config(tp: int = 1, sp: bool = False, dtype=torch.float64, **kw) -> TransformerConfig:
    fields = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, tensor_model_parallel_size=tp,
        sequence_parallel=sp, params_dtype=dtype, use_cpu_initialization=True, normalization="RMSNorm",
        activation_func=F.silu, linear_conv_kernel_dim=W, linear_key_head_dim=DK, linear_value_head_dim=DV,
        linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
    )
    fields.update(kw)
    return TransformerConfig(**fields)


def _blocks() -> list[int]:
    qk, v = KEY_HEADS * DK, VALUE_HEADS * DV
    return [qk, qk, v, v, VALUE_HEADS, VALUE_HEADS]


def reference(x: torch.Tensor, w: dict, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """The layer from its definition, one token at a time: x ``[s, b, h]``; w the full weights."""
    s, b, _ = x.shape
    q, k, v, z, beta, alpha = torch.split(x @ w["in_proj"].T, _blocks(), dim=-1)
    qkv = torch.cat([q, k, v], dim=-1)  # [s, b, C]
    starts = set(cu_seqlens or [0])
    conv = torch.zeros_like(qkv)
    for t in range(s):
        first = max(st for st in starts if st <= t)
        for j in range(W):  # weight[c, j] meets the input W - 1 - j steps back
            src = t - (W - 1) + j
            if src >= first:
                conv[t] = conv[t] + w["conv"][:, 0, j] * qkv[src]
    q, k, v = torch.split(F.silu(conv), [KEY_HEADS * DK, KEY_HEADS * DK, VALUE_HEADS * DV], dim=-1)
    q, k = (t.reshape(s, b, KEY_HEADS, DK) for t in (q, k))
    q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    rep = VALUE_HEADS // KEY_HEADS
    q, k = (t.repeat_interleave(rep, dim=2) for t in (q, k))
    v = v.reshape(s, b, VALUE_HEADS, DV)
    g = -w["A_log"].exp() * F.softplus(alpha + w["dt_bias"])
    beta = beta.sigmoid()
    state = torch.zeros(b, VALUE_HEADS, DK, DV, dtype=x.dtype)
    outs = []
    for t in range(s):
        if t in starts:
            state = torch.zeros_like(state)
        state = g[t].exp()[..., None, None] * state
        err = v[t] - torch.einsum("bhkv,bhk->bhv", state, k[t])
        state = state + torch.einsum("bhk,bhv->bhkv", k[t], beta[t][..., None] * err)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[t] * DK**-0.5))
    o = torch.stack(outs)  # [s, b, heads, DV]
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * w["norm"]
    o = o * F.silu(z.reshape(s, b, VALUE_HEADS, DV))
    return o.reshape(s, b, -1) @ w["out_proj"].T


def _gather(t: torch.Tensor, sizes: list[int] | None, dim: int = 0) -> torch.Tensor:
    """The full tensor from the tensor-parallel ranks' parts (each block of ``sizes`` split)."""
    group = ps.get_tensor_model_parallel_group()
    world = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    if sizes is None:
        return torch.cat(parts, dim=dim)
    local = [n // world for n in sizes]
    split = [torch.split(p, local, dim=dim) for p in parts]
    return torch.cat([torch.cat([sp[i] for sp in split], dim=dim) for i in range(len(sizes))], dim=dim)


def _full(layer: GatedDeltaNet, grads: bool = False) -> dict:
    get = (lambda p: p.main_grad if hasattr(p, "main_grad") else p.grad) if grads else (lambda p: p.detach())
    return {
        "in_proj": _gather(get(layer.in_proj.weight), _blocks()),
        "conv": _gather(get(layer.conv1d.weight), _blocks()[:3]),
        "A_log": _gather(get(layer.A_log), None),
        "dt_bias": _gather(get(layer.dt_bias), None),
        "norm": get(layer.out_norm.weight),
        "out_proj": _gather(get(layer.out_proj.weight), None, dim=1),
    }


def _layer_worker(tp: int, sp: bool) -> dict:
    ps.initialize_model_parallel(tp)
    torch.manual_seed(3)
    layer = GatedDeltaNet(_config(tp, sp))
    weights = _full(layer)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64)
    dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64)
    rank = ps.get_tensor_model_parallel_rank()
    per = SEQ // tp if sp else SEQ
    local = x[rank * per : (rank + 1) * per] if sp else x
    local = local.clone().requires_grad_(True)
    out, bias = layer(local)
    out.backward(dy[rank * per : (rank + 1) * per] if sp else dy)
    # The norm's gradient is its heads' part on each rank, summed (with or without sequence
    # parallelism) by finalize_model_grads' tensor-parallel reduction.
    allreduce_layernorm_grads([layer])
    result = {
        "weights": weights, "out": _gather(out, None) if sp else out.detach(),
        "dx": _gather(local.grad, None) if sp else local.grad, "grads": _full(layer, grads=True),
        "bias": bias, "marked": getattr(layer.out_norm.weight, "partial_over_tensor_parallel", False),
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


def test_serial_layer_equals_the_reference():
    (result,) = run_distributed(1, _layer_worker, 1, False)
    assert result["bias"] is None and result["marked"]
    assert result["weights"]["dt_bias"].eq(1).all()
    assert ((-result["weights"]["A_log"]).exp() <= 1).all()  # A in [1, 16]
    _check_against_reference(result)


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_layer_equals_serial(sp):
    (serial,) = run_distributed(1, _layer_worker, 1, False)
    for result in run_distributed(2, _layer_worker, 2, sp):
        for name, value in serial["weights"].items():  # drawn over all heads, then split
            assert torch.equal(result["weights"][name], value), name
        _check_against_reference(result)


def _packed_worker() -> list:
    ps.initialize_model_parallel()
    torch.manual_seed(3)
    layer = GatedDeltaNet(_config())
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SEQ, 1, HIDDEN, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 5, 9, SEQ], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=5, max_seqlen_kv=5)
    packed, _ = layer(x, packed_seq_params=params)
    alone = [layer(x[a:b])[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    ref = reference(x, {k: v for k, v in _full(layer).items()}, cu.tolist())
    ps.destroy_model_parallel()
    return [packed.detach(), torch.cat(alone).detach(), ref.detach()]


def test_packed_rows_equal_each_sequence_alone():
    (result,) = run_distributed(1, _packed_worker)
    packed, alone, ref = result
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(packed, ref, rtol=1e-10, atol=1e-12)


def _hf_worker() -> tuple:
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    ps.initialize_model_parallel()
    torch.manual_seed(3)
    layer = GatedDeltaNet(_config(dtype=torch.float32, layernorm_epsilon=1e-6))
    config = transformers.Qwen3NextConfig(
        hidden_size=HIDDEN, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=W, num_hidden_layers=1,
        layer_types=["linear_attention"], rms_norm_eps=1e-6, hidden_act="silu",
    )
    theirs = hf.Qwen3NextGatedDeltaNet(config, 0).float()
    w = _full(layer)
    q, k, v, z, b, a = torch.split(w["in_proj"], _blocks(), dim=0)
    rep = VALUE_HEADS // KEY_HEADS
    # transformers interleaves the blocks per key head: [q_h, k_h, v of its value heads, z of them].
    qkvz = torch.cat([torch.cat([q[h * DK:(h + 1) * DK], k[h * DK:(h + 1) * DK],
                                 v[h * rep * DV:(h + 1) * rep * DV], z[h * rep * DV:(h + 1) * rep * DV]])
                      for h in range(KEY_HEADS)])
    ba = torch.cat([torch.cat([b[h * rep:(h + 1) * rep], a[h * rep:(h + 1) * rep]])
                    for h in range(KEY_HEADS)])
    with torch.no_grad():
        theirs.in_proj_qkvz.weight.copy_(qkvz)
        theirs.in_proj_ba.weight.copy_(ba)
        theirs.conv1d.weight.copy_(w["conv"])
        theirs.A_log.copy_(w["A_log"])
        theirs.dt_bias.copy_(w["dt_bias"])
        theirs.norm.weight.copy_(w["norm"])
        theirs.out_proj.weight.copy_(w["out_proj"])
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(9))
    ours, _ = layer(x)
    hf_out = theirs(x.transpose(0, 1)).transpose(0, 1)
    ps.destroy_model_parallel()
    return ours.tolist(), hf_out.tolist()  # plain lists: no shared storage to hand over


def test_equals_transformers_qwen3_next_layer():
    (result,) = run_distributed(1, _hf_worker)
    ours, theirs = result
    # float32 throughout (transformers computes the recurrence in float32): a few ulps per step.
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5)


def _refusals_worker() -> list[str]:
    ps.initialize_model_parallel(2)
    out = []
    for kw in (dict(linear_num_key_heads=3, linear_num_value_heads=6),
               dict(linear_num_key_heads=4, linear_num_value_heads=6),
               dict(activation_func=F.gelu)):
        try:
            GatedDeltaNet(_config(2, **kw))
            out.append("accepted")
        except ValueError as e:
            out.append(str(e))
    layer = GatedDeltaNet(_config(2))
    try:
        layer(torch.zeros(SEQ, 1, HIDDEN, dtype=torch.float64), torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool))
        out.append("accepted")
    except ValueError as e:
        out.append(str(e))
    ps.destroy_model_parallel()
    return out


def test_bad_configurations_are_refused_alike_on_every_rank():
    first, second = run_distributed(2, _refusals_worker)
    assert first == second
    heads, ratio, act, mask = first
    assert "linear_num_key_heads=3 must be a positive multiple of the tensor-model-parallel size 2" in heads
    assert "linear_num_value_heads=6 must be a multiple of linear_num_key_heads=4" in ratio
    assert "must be SiLU" in act
    assert "takes no attention_mask" in mask
