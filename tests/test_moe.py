"""The mixture-of-experts layer on one process: its output and gradients (with the load-balancing
and z losses) equal autograd of a plain serial formula in float64, for both dispatchers and both
expert implementations; token dropping keeps the tokens the serial rule keeps; bad settings raise."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.moe import MoELayer
from megatron_ext.transformer.moe.router_utils import (
    MoEAuxLossAutoScaler,
    get_moe_layer_wise_logging_tracker,
    save_to_aux_losses_tracker,
)
from tests.conftest import TIGHT
from tests.distributed import run_distributed

E, K, H, FFN = 4, 2, 8, 6


def moe_config(**kwargs) -> TransformerConfig:
    settings = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_ffn_hidden_size=FFN,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
        add_bias_linear=False,
        init_method_std=0.5,
        moe_aux_loss_coeff=0.0,
    )
    settings.update(kwargs)
    return TransformerConfig(**settings)


def expert_weights(layer: MoELayer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(W1 [ffn*g, h], W2 [h, ffn]) of each expert, whatever the implementation."""
    experts = layer.experts
    if hasattr(experts, "local_experts"):
        return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in experts.local_experts]
    n = experts.num_local_experts
    w1 = experts.weight1.view(n, H, -1).transpose(1, 2)
    w2 = experts.weight2.view(n, -1, H).transpose(1, 2)
    return [(w1[e], w2[e]) for e in range(n)]


def serial_moe(x, router_w, weights, config, drop_capacity=None):
    """The layer written out token by token: returns (output, aux_loss + z_loss)."""
    tokens = x.reshape(-1, H)
    logits = tokens @ router_w.T
    n = tokens.shape[0]
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:
            top, idx = torch.topk(torch.softmax(logits, -1), K, dim=1)
            gate = top
        else:
            top, idx = torch.topk(logits, K, dim=1)
            gate = torch.softmax(top, -1)
    else:
        scores = torch.sigmoid(logits)
        top, idx = torch.topk(scores, K, dim=1)
        gate = top / top.sum(-1, keepdim=True)
    if config.moe_router_topk_scaling_factor:
        gate = gate * config.moe_router_topk_scaling_factor
    chosen = [[(int(idx[t, j]), gate[t, j]) for j in range(K)] for t in range(n)]
    if drop_capacity is not None:
        kept = set()
        for e in range(E):
            mine = [(t, g) for t in range(n) for (ee, g) in chosen[t] if ee == e]
            if config.moe_token_drop_policy == "probs":
                mine.sort(key=lambda tg: -float(tg[1]))
                kept |= {(t, e) for t, _ in mine[:drop_capacity]}
            else:  # Megatron-core's rule: the rows torch.topk takes from the expert's 0/1 column
                column = torch.zeros(n, dtype=torch.int32)
                column[[t for t, _ in mine]] = 1
                rows = torch.topk(column, k=min(drop_capacity, n), dim=0, sorted=False).indices.tolist()
                kept |= {(t, e) for t in rows if column[t]}
        chosen = [[(e, g) for e, g in chosen[t] if (t, e) in kept] for t in range(n)]
    act = F.silu if config.gated_linear_unit else F.gelu
    rows = []
    for t in range(n):
        y = torch.zeros(H, dtype=x.dtype)
        for e, g in chosen[t]:
            w1, w2 = weights[e]
            h = tokens[t] @ w1.T
            if config.gated_linear_unit:
                h = act(h[:FFN]) * h[FFN:]
            else:
                h = act(h)
            y = y + g * (h @ w2.T)
        rows.append(y)
    out = torch.stack(rows).reshape(x.shape)
    extra = torch.zeros((), dtype=x.dtype)
    if config.moe_aux_loss_coeff:
        probs = (
            torch.softmax(logits, -1)
            if config.moe_router_score_function == "softmax"
            else (torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True))
        )
        counts = torch.zeros(E, dtype=x.dtype)
        for e in torch.topk(probs, K, dim=1).indices.flatten().tolist():
            counts[e] += 1
        f = counts / (n * K)
        p = probs.mean(0)
        extra = extra + config.moe_aux_loss_coeff * E * (f * p).sum()
    if config.moe_z_loss_coeff:
        extra = extra + config.moe_z_loss_coeff * (torch.logsumexp(logits, -1) ** 2).mean()
    return out, extra


CASES = [
    dict(),
    dict(gated_linear_unit=True, activation_func=F.silu),
    dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5),
    dict(moe_router_pre_softmax=True, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01),
    dict(moe_aux_loss_coeff=0.3, gated_linear_unit=True, activation_func=F.silu),
    dict(moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.2, moe_z_loss_coeff=0.05),
    dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.2,
         moe_z_loss_coeff=0.05),
]


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("grouped", [False, True])
def test_layer_equals_serial_formula(dispatcher, grouped):
    for case in CASES:
        config = moe_config(moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped, **case)
        torch.manual_seed(3)
        layer = MoELayer(config, layer_number=1)
        x = torch.randn(5, 2, H, dtype=torch.float64, requires_grad=True)
        grad_out = torch.randn(5, 2, H, dtype=torch.float64)
        out, bias = layer(x)
        assert bias is None
        out.backward(grad_out)
        params = [layer.router.weight] + [p for p in layer.experts.parameters()]
        got = [x.grad] + [p.grad for p in params]

        ref_params = [p.detach().clone().requires_grad_(True) for p in params]
        x_ref = x.detach().clone().requires_grad_(True)
        if grouped:
            n = E
            w1 = ref_params[1].view(n, H, -1).transpose(1, 2)
            w2 = ref_params[2].view(n, -1, H).transpose(1, 2)
            weights = [(w1[e], w2[e]) for e in range(n)]
        else:
            weights = [(ref_params[1 + 2 * e], ref_params[2 + 2 * e]) for e in range(E)]
        ref_out, extra = serial_moe(x_ref, ref_params[0], weights, config)
        torch.testing.assert_close(out, ref_out, **TIGHT, msg=lambda m: f"{case}: {m}")
        ((ref_out * grad_out).sum() + extra).backward()
        for name, a, b in zip(
            ["x", "router"] + [f"expert param {i}" for i in range(len(params) - 1)],
            got,
            [x_ref.grad] + [p.grad for p in ref_params],
        ):
            torch.testing.assert_close(a, b, **TIGHT, msg=lambda m: f"{case} {dispatcher} {name}: {m}")


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_capacity_drops_the_serial_tokens(dispatcher):
    # with and without the router's losses (attached to the scores, they change nothing forward)
    for policy, factor, coeff in itertools.product(["probs", "position"], [0.5, 1.0], [0.0, 0.1]):
        config = moe_config(
            moe_token_dispatcher_type=dispatcher,
            moe_expert_capacity_factor=factor,
            moe_token_drop_policy=policy,
            moe_aux_loss_coeff=coeff,
            moe_z_loss_coeff=coeff or None,
        )
        torch.manual_seed(5)
        layer = MoELayer(config, layer_number=1)
        x = torch.randn(6, 2, H, dtype=torch.float64, requires_grad=True)
        out, _ = layer(x)
        capacity = math.ceil(12 * K / E * factor)
        weights = [(w1.detach(), w2.detach()) for w1, w2 in expert_weights(layer)]
        ref, _ = serial_moe(x.detach(), layer.router.weight.detach(), weights, config, drop_capacity=capacity)
        label = f"{policy} {factor} {coeff}"
        torch.testing.assert_close(out.detach(), ref, **TIGHT, msg=lambda m: f"{label}: {m}")
        dropped = (
            out.detach() - serial_moe(x.detach(), layer.router.weight.detach(), weights, config)[0]
        ).abs()
        assert dropped.max() > 1e-3  # some token was dropped


def test_pad_to_capacity_equals_dropping_with_alltoall():
    for coeff in (0.0, 0.1):  # with and without the router's losses
        outs, grads = [], []
        for pad in (False, True):
            config = moe_config(
                moe_token_dispatcher_type="alltoall",
                moe_expert_capacity_factor=1.0,
                moe_pad_expert_input_to_capacity=pad,
                moe_aux_loss_coeff=coeff,
                moe_z_loss_coeff=coeff or None,
            )
            torch.manual_seed(5)
            layer = MoELayer(config, layer_number=1)
            x = torch.randn(6, 2, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
            outs.append(layer(x)[0])
            outs[-1].square().sum().backward()
            grads.append(layer.router.weight.grad)
        torch.testing.assert_close(outs[0], outs[1], **TIGHT)
        torch.testing.assert_close(grads[0], grads[1], **TIGHT)


def test_aux_loss_scaled_and_tracked():
    config = moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    torch.manual_seed(3)
    layer = MoELayer(config, layer_number=1)
    x = torch.randn(4, 2, H, dtype=torch.float64, requires_grad=True)
    get_moe_layer_wise_logging_tracker().clear()
    grads = []
    for scale in (1.0, 0.25):
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float64))
        layer.zero_grad()
        layer(x)[0].sum().mul(0).backward()  # only the auxiliary losses reach the router
        grads.append(layer.router.weight.grad.clone())
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(grads[1], grads[0] * 0.25, **TIGHT)
    assert grads[0].abs().max() > 0
    tracker = get_moe_layer_wise_logging_tracker()
    ref = serial_moe(
        x.detach(),
        layer.router.weight.detach(),
        [(a.detach(), b.detach()) for a, b in expert_weights(layer)],
        moe_config(moe_aux_loss_coeff=1.0),
    )[1]
    # Two forwards were tracked.
    torch.testing.assert_close(tracker["load_balancing_loss"]["values"][0], 2 * ref, **TIGHT)
    # A deeper model later in the process: the entry grows, keeping what it holds.
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), 3, 3)
    values = tracker["load_balancing_loss"]["values"]
    assert values.tolist() == [(2 * ref).item(), 0.0, 0.5]
    tracker.clear()


def _shared_experts_and_expert_bias() -> None:
    from megatron_ext import parallel_state

    parallel_state.initialize_model_parallel()
    x = torch.randn(4, 2, H, dtype=torch.float64)
    for coeff in (0.0, 0.1):  # with and without the router's losses
        config = moe_config(moe_shared_expert_intermediate_size=10, moe_aux_loss_coeff=coeff,
                            moe_z_loss_coeff=coeff or None)
        torch.manual_seed(3)
        layer = MoELayer(config, layer_number=1)
        shared = layer.shared_experts(x)
        routed = serial_moe(
            x, layer.router.weight.detach(), [(a.detach(), b.detach()) for a, b in expert_weights(layer)],
            config,
        )[0]
        torch.testing.assert_close(layer(x)[0].detach(), routed + shared.detach(), **TIGHT)
        assert shared.abs().max() > 0

    config = moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    layer = MoELayer(config, layer_number=1)
    layer.router.expert_bias.copy_(torch.tensor([0.0, 10.0, 0.0, 10.0]))
    _, routing_map = layer.router(x)
    assert routing_map[:, 1].all() and routing_map[:, 3].all()
    assert layer.router.local_tokens_per_expert.tolist() == [0.0, 8.0, 0.0, 8.0]


@pytest.mark.slow  # one spawned process
def test_shared_experts_and_expert_bias():
    run_distributed(1, _shared_experts_and_expert_bias)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(num_moe_experts=4, moe_router_topk=5),
            r"moe_router_topk \(5\) must be between 1 and num_moe_experts \(4\)",
        ),
        (
            dict(num_moe_experts=6, expert_model_parallel_size=4),
            r"num_moe_experts \(6\) must be divisible by "
            r"expert_model_parallel_size \(4\)",
        ),
        (
            dict(num_moe_experts=None, expert_model_parallel_size=2),
            r"expert_model_parallel_size=2 needs num_moe_experts",
        ),
        (dict(moe_token_dispatcher_type="flex"), r"moe_token_dispatcher_type='flex' is not one of"),
        (dict(moe_router_load_balancing_type="switch"), r"moe_router_load_balancing_type='switch'"),
        (dict(moe_pad_expert_input_to_capacity=True), r"moe_pad_expert_input_to_capacity needs"),
        (dict(moe_expert_capacity_factor=-1.0), r"moe_expert_capacity_factor must be a positive number"),
        (
            dict(moe_ffn_hidden_size=5, expert_tensor_parallel_size=2),
            r"moe_ffn_hidden_size \(5\) must be divisible",
        ),
    ],
)
def test_bad_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        moe_config(**kwargs)


def test_expert_bias_step_and_layer_pattern():
    from megatron_ext.transformer.moe.router_utils import get_updated_expert_bias
    from megatron_ext.transformer.transformer_layer import is_moe_layer

    tokens = torch.tensor([1.0, 5.0, 3.0, 3.0])
    updated = get_updated_expert_bias(tokens, torch.tensor([0.5, 0.5, 0.0, 0.0]), 0.25)
    torch.testing.assert_close(updated, torch.tensor([0.75, 0.25, 0.0, 0.0]))
    config = moe_config(num_layers=4, moe_layer_freq=2)
    assert [is_moe_layer(config, n) for n in range(1, 5)] == [True, False, True, False]
    config = moe_config(num_layers=4, moe_layer_freq=[0, 1, 1, 0])
    assert [is_moe_layer(config, n) for n in range(1, 5)] == [False, True, True, False]
    with pytest.raises(ValueError, match=r"moe_layer_freq must be a positive integer or a list of"):
        moe_config(num_layers=4, moe_layer_freq=[1, 0])
