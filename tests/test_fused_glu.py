"""gpt-oss's gated unit, ``quick_gelu(gate.clamp(max=c)) * (up.clamp(-c, c) + offset)``:

* the fused kernel (``bias_swiglu`` with ``alpha``, ``linear_offset``, ``clamp_value``; the CPU
  twin of the CUDA kernel) equals the unfused torch chain (``transformer.mlp.glu``, Megatron-core's
  unfused path) forward and backward: float64 and float32 to a few units in the last place,
  bfloat16 to half a unit against the chain in float32; a clamped value's gradient is 0, at the
  bounds too (as torch 2.14.1's clamp);
* the dense MLP, ``SequentialMLP`` and ``GroupedMLP`` with ``quick_gelu``, ``glu_linear_offset=1``
  and ``activation_func_clamp_value=7`` (and biases) equal transformers' ``GptOssExperts`` /
  ``GptOssMLP`` holding the same weights, in float64 (skipped without transformers).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megatron_ext import _C
from megatron_ext.fusions import bias_swiglu, quick_geglu, quick_gelu, weighted_bias_quick_geglu_impl
from megatron_ext.fusions.fused_bias_geglu import QUICK_GELU_ALPHA, sigmoid_gate_alpha
from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.mlp import ParallelMLP, glu
from megatron_ext.transformer.moe import MoELayer
from tests.conftest import TIGHT, grads_of
from tests.distributed import run_distributed

ops = torch.ops.megatron_ext
BF16_HALF_ULP = dict(rtol=2.0**-8, atol=1e-6)
# (activation, linear offset, clamp): gpt-oss's, and the other corners of the kernel.
UNITS = [
    (quick_gelu, 1.0, 7.0),
    (quick_gelu, 0.0, None),
    (quick_gelu, -0.5, 1.5),
    (F.silu, 1.0, None),
    (F.silu, 0.0, 2.0),
]
SHAPES = [(5, 3, 2 * 37), (4, 2 * 40), (2, 2 * 1061), (2, 2)]  # vector lanes and tails, two blocks


def _randn(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0,
           scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _unit(act, offset, clamp):
    return types.SimpleNamespace(activation_func=act, glu_linear_offset=offset,
                                 activation_func_clamp_value=clamp)


def _fused(y, b, act, offset, clamp):
    return bias_swiglu(y, b, alpha=sigmoid_gate_alpha(act), linear_offset=offset, clamp_value=clamp)


def _chain(y, b, act, offset, clamp):
    return glu(_unit(act, offset, clamp), y + b if b is not None else y)


def _inputs(shape, dtype, seed):
    """y spread past the clamps."""
    return _randn(*shape, dtype=torch.float64, seed=seed, scale=4.0).to(dtype)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_unit_equals_unfused_chain(dtype, with_bias):
    for (act, offset, clamp), shape in zip(UNITS * 2, SHAPES * 3):
        label = f"{act.__name__} offset {offset} clamp {clamp} {shape} {dtype}"
        y = _inputs(shape, dtype, seed=len(label)).requires_grad_()
        b = _randn(shape[-1], dtype=dtype, seed=2).requires_grad_() if with_bias else None
        grad = _randn(*shape[:-1], shape[-1] // 2, dtype=dtype, seed=3)
        leaves = (y, b) if with_bias else (y,)
        out = _fused(y, b, act, offset, clamp)
        got = grads_of(out, grad, *leaves)
        ref_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        refs = [t.detach().to(ref_dtype).requires_grad_() for t in leaves]
        ref = _chain(refs[0], refs[1] if with_bias else None, act, offset, clamp)
        want = grads_of(ref, grad.to(ref_dtype), *refs)
        tol = {torch.float64: dict(rtol=1e-13, atol=1e-13), torch.float32: dict(rtol=2e-6, atol=2e-6),
               torch.bfloat16: BF16_HALF_ULP}[dtype]
        assert_close(out.to(ref_dtype), ref, **tol, msg=lambda m: f"{label} forward: {m}")
        assert_close(got[0].to(ref_dtype), want[0], **tol, msg=lambda m: f"{label} grad y: {m}")
        if with_bias and dtype != torch.bfloat16:  # bfloat16: a sum of rounded rows, checked by y's
            assert_close(got[1], want[1], rtol=tol["rtol"] * 10, atol=tol["atol"] * 10 * shape[0],
                         msg=lambda m: f"{label} grad bias: {m}")
        if clamp is not None and not with_bias and shape[-1] > 2:  # beyond the bounds nothing flows back
            gate, up = y.detach().chunk(2, -1)
            d_gate, d_up = got[0].chunk(2, -1)
            assert (gate > clamp).any() and (d_gate[gate > clamp] == 0).all(), label
            assert (up.abs() > clamp).any() and (d_up[up.abs() > clamp] == 0).all(), label
            assert (d_gate[gate < clamp] != 0).all(), label


def test_gradient_is_zero_at_the_clamp_bounds():
    """At the bounds themselves too (torch 2.14.1's clamp: where(min < x < max, grad, 0))."""
    gate = torch.tensor([6.5, 7.0, 7.5, -7.0, -9.0], dtype=torch.float64)
    up = torch.tensor([7.0, -7.0, 6.5, -6.5, 8.0], dtype=torch.float64)
    for width in (5, 37):  # the scalar tail and the vector lanes
        y = torch.cat([gate.repeat(width)[:width], up.repeat(width)[:width]]).view(1, -1).requires_grad_()
        (d_y,) = torch.autograd.grad(_fused(y, None, quick_gelu, 1.0, 7.0), y, torch.ones(1, width,
                                                                                      dtype=torch.float64))
        d_gate, d_up = d_y.view(2, width)
        g, u = y.detach().view(2, width)
        assert torch.equal(d_gate == 0, g >= 7.0) and torch.equal(d_up == 0, u.abs() >= 7.0), width


def test_plain_swiglu_is_unchanged_and_names():
    y = _randn(6, 4, 2 * 24, seed=5)
    assert torch.equal(ops.swiglu(y, None, 1.0, 0.0, None), ops.swiglu(y, None))
    assert_close(_fused(y, None, F.silu, 0.0, None), F.silu(y[..., :24]) * y[..., 24:], rtol=0, atol=1e-15)
    assert_close(quick_geglu(y, 1.0), quick_gelu(y[..., :24]) * (y[..., 24:] + 1), rtol=0, atol=0)
    assert_close(quick_gelu(y), y * torch.sigmoid(1.702 * y), rtol=0, atol=0)
    assert sigmoid_gate_alpha(quick_gelu) == QUICK_GELU_ALPHA and sigmoid_gate_alpha(F.silu) == 1.0
    assert sigmoid_gate_alpha(F.gelu) is None
    b, w = _randn(48, seed=6), _randn(6, 4, 1, seed=7)
    assert_close(weighted_bias_quick_geglu_impl(y, b, w, linear_offset=1.0, clamp_value=7.0),
                 _chain(y, b, quick_gelu, 1.0, 7.0) * w, rtol=1e-13, atol=1e-13)


def test_cpu_capability_variants_agree():
    y, b = _randn(5, 2 * 37, seed=8, scale=4.0), _randn(2 * 37, seed=9)
    g = _randn(5, 37, seed=10)
    chosen, results = _C.cpu_capability(), {}
    try:
        for capability in _C.supported_cpu_capabilities():
            _C._set_cpu_capability(capability)
            results[capability] = [ops.swiglu_forward(y, b, QUICK_GELU_ALPHA, 1.0, 7.0),
                                   ops.swiglu_backward(g, y, b, QUICK_GELU_ALPHA, 1.0, 7.0)]
    finally:
        _C._set_cpu_capability(chosen)
    for capability, values in results.items():
        for got, want in zip(values, results[chosen]):
            assert_close(got, want, rtol=1e-15, atol=1e-15, msg=capability)


def test_opcheck():
    y = _randn(3, 4, 10, seed=11, scale=4.0).requires_grad_()
    b = _randn(10, seed=12).requires_grad_()
    g = _randn(3, 4, 5, seed=13)
    for bias in (None, b):
        for clamp in (None, 2.0):
            args = (QUICK_GELU_ALPHA, 1.0, clamp)
            torch.library.opcheck(ops.swiglu.default, (y, bias, *args))
            plain = None if bias is None else bias.detach()
            torch.library.opcheck(ops.swiglu_forward.default, (y.detach(), plain, *args))
            torch.library.opcheck(ops.swiglu_backward.default, (g, y.detach(), plain, *args))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(clamp_value=0.0), r"clamp_value must be positive and finite \(or None\), got 0"),
        (dict(clamp_value=-1.0), r"clamp_value must be positive and finite \(or None\), got -1"),
        (dict(clamp_value=float("inf")), r"clamp_value must be positive and finite \(or None\), got inf"),
        (dict(clamp_value=float("nan")), r"clamp_value must be positive and finite \(or None\), got nan"),
        (dict(alpha=float("inf")), r"alpha must be finite, got inf"),
        (dict(linear_offset=float("nan")), r"linear_offset must be finite, got nan"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    y = _randn(3, 8)
    with pytest.raises(ValueError, match=message):
        bias_swiglu(y, **kwargs)
    with torch.inference_mode(), pytest.raises(ValueError, match=message):
        bias_swiglu(y, **kwargs)


# --- against transformers' gpt-oss --------------------------------------------------------------

H, FFN, E, K = 8, 6, 4, 2


def _gpt_oss_config(**kwargs) -> TransformerConfig:
    settings = dict(
        num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FFN, num_moe_experts=E,
        moe_router_topk=K, moe_ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=quick_gelu,
        glu_linear_offset=1.0, activation_func_clamp_value=7.0, add_bias_linear=True,
        params_dtype=torch.float64, use_cpu_initialization=True, init_method_std=1.5,
        moe_aux_loss_coeff=0.0,
    )
    settings.update(kwargs)
    return TransformerConfig(**settings)


def _hf_modules():
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    config = GptOssConfig(hidden_size=H, intermediate_size=FFN, num_local_experts=E, num_experts_per_tok=K,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=4)
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 7.0)
    return gpt_oss, config


def _load_hf_experts(hf_experts, expert_weights) -> None:
    """gate_up_proj [E, h, 2 ffn] interleaves gate and up columns; ours stacks [gate; up] rows."""
    with torch.no_grad():
        for e, (w1, b1, w2, b2) in enumerate(expert_weights):
            gate, up = w1.chunk(2, 0)
            hf_experts.gate_up_proj[e] = torch.stack([gate.T, up.T], dim=-1).reshape(H, 2 * FFN)
            hf_experts.gate_up_proj_bias[e] = torch.stack(b1.chunk(2), dim=-1).reshape(-1)
            hf_experts.down_proj[e] = w2.T
            hf_experts.down_proj_bias[e] = b2


def _expert_tensors(layer: MoELayer, grads: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """Each expert's (W1 [2 ffn, h], b1, W2 [h, ffn], b2), or their gradients, either implementation."""
    experts = layer.experts
    of = (lambda p: p.grad) if grads else (lambda p: p.detach())
    if hasattr(experts, "local_experts"):
        return [tuple(of(p) for p in (x.linear_fc1.weight, x.linear_fc1.bias, x.linear_fc2.weight,
                                      x.linear_fc2.bias))
                for x in experts.local_experts]
    n = experts.num_local_experts
    w1, w2 = of(experts.weight1).view(n, H, -1), of(experts.weight2).view(n, -1, H)
    b1, b2 = of(experts.bias1), of(experts.bias2)
    return [(w1[e].T, b1[e], w2[e].T, b2[e]) for e in range(n)]


def _dense_mlp_check() -> None:
    from megatron_ext import parallel_state

    gpt_oss, hf_config = _hf_modules()
    parallel_state.initialize_model_parallel()
    for fused in (False, True):
        config = _gpt_oss_config(num_moe_experts=None, bias_activation_fusion=fused)
        torch.manual_seed(1)
        mlp = ParallelMLP(config)
        with torch.no_grad():
            mlp.dense_h_to_4h.bias.normal_(0, 2.0)
            mlp.dense_4h_to_h.bias.normal_(0, 1.0)
        hf = gpt_oss.GptOssExperts(hf_config).double()
        weights = (mlp.dense_h_to_4h.weight, mlp.dense_h_to_4h.bias, mlp.dense_4h_to_h.weight,
                   mlp.dense_4h_to_h.bias)
        _load_hf_experts(hf, [tuple(t.detach() for t in weights)] * E)
        x = _randn(7, H, seed=14, scale=2.0).requires_grad_()
        out, bias = mlp(x)
        out = out + bias
        hf_x = x.detach().clone().requires_grad_()
        # Every token to expert 0 with weight 1: one expert's MLP.
        ref = hf(hf_x, torch.zeros(7, 1, dtype=torch.long), torch.ones(7, 1, dtype=torch.float64))
        fc1 = x.detach() @ weights[0].detach().T + weights[1].detach()
        assert (fc1[:, :FFN] > 7).any() and (fc1.abs()[:, FFN:] > 7).any()  # the clamp binds
        assert_close(out, ref, **TIGHT)
        grad = _randn(7, H, seed=15)
        assert_close(grads_of(out, grad, x)[0], grads_of(ref, grad, hf_x)[0], **TIGHT)


@pytest.mark.slow  # one spawned process
def test_dense_mlp_equals_gpt_oss_expert():
    pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    run_distributed(1, _dense_mlp_check)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_moe_layer_equals_gpt_oss_mlp(grouped, fused):
    gpt_oss, hf_config = _hf_modules()
    config = _gpt_oss_config(moe_grouped_gemm=grouped, bias_activation_fusion=fused)
    torch.manual_seed(2)
    layer = MoELayer(config, layer_number=1)
    with torch.no_grad():  # biases of some size (they start at 0)
        for p in layer.experts.parameters():
            if p.dim() == 1 or p.shape[0] == E:
                p.normal_(0, 1.5)
    hf = gpt_oss.GptOssMLP(hf_config).double()
    with torch.no_grad():
        hf.router.weight.copy_(layer.router.weight)
        hf.router.bias.copy_(layer.router.bias)
    _load_hf_experts(hf.experts, _expert_tensors(layer))
    x = _randn(5, 2, H, seed=16, scale=2.0).requires_grad_()
    out, _ = layer(x)
    hf_x = x.detach().transpose(0, 1).clone().requires_grad_()  # [b, s, h]
    ref, _ = hf(hf_x)
    assert_close(out, ref.transpose(0, 1), **TIGHT)
    grad = _randn(5, 2, H, seed=17)
    (out * grad).sum().backward()
    (ref * grad.transpose(0, 1)).sum().backward()
    assert_close(x.grad, hf_x.grad.transpose(0, 1), **TIGHT)
    assert_close(layer.router.weight.grad, hf.router.weight.grad, **TIGHT)
    assert_close(layer.router.bias.grad, hf.router.bias.grad, **TIGHT)
    hf_experts = hf.experts
    for e, (w1, b1, w2, b2) in enumerate(_expert_tensors(layer, grads=True)):
        gate_up, bias_up = hf_experts.gate_up_proj.grad[e], hf_experts.gate_up_proj_bias.grad[e]
        assert_close(w1, torch.cat([gate_up[:, ::2].T, gate_up[:, 1::2].T]), **TIGHT)
        assert_close(b1, torch.cat([bias_up[::2], bias_up[1::2]]), **TIGHT)
        assert_close(w2, hf_experts.down_proj.grad[e].T, **TIGHT)
        assert_close(b2, hf_experts.down_proj_bias.grad[e], **TIGHT)
