"""Group-limited routing (DeepSeek-V2/V3's device- and node-limited top-k): the router's weights
and choice equal a plain token-by-token formula in float64, forward and backward, for softmax
(before or after the top-k) and sigmoid scores, with and without the expert bias and the scaling
factor; the same numbers as Megatron-core 0.16.1's ``topk_routing_with_score_function`` (when
megatron-core is installed); the bad settings raise one clear ValueError."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from megatron_ext.transformer import TransformerConfig
from megatron_ext.transformer.moe import MoELayer
from megatron_ext.transformer.moe.router_utils import topk_routing_with_score_function
from tests.conftest import TIGHT

E, H = 8, 6

# (score function, pre-softmax, expert bias, scaling factor, topk, num_groups, group_topk)
CASES = [
    ("softmax", False, False, None, 4, 4, 2),
    ("softmax", True, False, 2.5, 3, 4, 2),
    ("softmax", False, False, 1.5, 2, 2, 1),
    ("sigmoid", False, False, None, 4, 4, 2),
    ("sigmoid", False, True, None, 4, 4, 2),
    ("sigmoid", False, True, 2.5, 6, 4, 3),
    ("sigmoid", True, True, 2.5, 1, 2, 1),
]


def serial_routing(logits, topk, num_groups, group_topk, score_function, pre_softmax, bias, scaling):
    """Each token on its own: the groups' scores, the chosen groups, the chosen experts, their
    weights. Returns [tokens, E] weights (0 where not chosen) and the chosen experts per token."""
    per_group = E // num_groups
    rows, chosen_sets = [], []
    for t in range(logits.shape[0]):
        row = logits[t]
        if score_function == "softmax":
            ranked = torch.softmax(row, -1) if pre_softmax else row
        else:
            ranked = torch.sigmoid(row) + (bias if bias is not None else 0)
        values = ranked.tolist()
        group_score = [
            sum(sorted(values[g * per_group:(g + 1) * per_group], reverse=True)[: topk // group_topk])
            for g in range(num_groups)
        ]
        groups = sorted(range(num_groups), key=lambda g: -group_score[g])[:group_topk]
        candidates = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(candidates, key=lambda e: -values[e])[:topk]
        if score_function == "softmax":
            weights = torch.softmax(row, -1)[chosen] if pre_softmax else torch.softmax(row[chosen], -1)
        else:
            weights = torch.sigmoid(row)[chosen]
            if topk > 1:
                weights = weights / weights.sum()
        if scaling:
            weights = weights * scaling
        out = torch.zeros(E, dtype=logits.dtype)
        rows.append(out.index_put((torch.tensor(chosen),), weights))
        chosen_sets.append(set(chosen))
    return torch.stack(rows), chosen_sets


def test_group_limited_routing_equals_serial_formula():
    gen = torch.Generator().manual_seed(11)
    for case in CASES:
        score_function, pre, with_bias, scaling, topk, groups, group_topk = case
        logits = torch.randn(24, E, dtype=torch.float64, generator=gen, requires_grad=True)
        bias = torch.randn(E, dtype=torch.float32, generator=gen) * 0.3 if with_bias else None
        probs, routing_map = topk_routing_with_score_function(
            logits, topk, use_pre_softmax=pre, num_groups=groups, group_topk=group_topk,
            scaling_factor=scaling, score_function=score_function, expert_bias=bias,
        )
        ref_logits = logits.detach().clone().requires_grad_(True)
        ref, chosen = serial_routing(ref_logits, topk, groups, group_topk, score_function, pre, bias, scaling)
        assert [set(torch.nonzero(r).flatten().tolist()) for r in routing_map] == chosen, case
        torch.testing.assert_close(probs, ref, **TIGHT, msg=lambda m: f"{case}: {m}")
        weight = torch.randn(24, E, dtype=torch.float64, generator=gen)
        (probs * weight).sum().backward()
        (ref * weight).sum().backward()
        torch.testing.assert_close(logits.grad, ref_logits.grad, **TIGHT, msg=lambda m: f"{case} grad: {m}")
        # The groups bind: the plain top-k picks experts outside the chosen groups for some token.
        plain, _ = serial_routing(logits.detach(), topk, 1, 1, score_function, pre, bias, scaling)
        if group_topk < groups and topk > 1:  # one expert from one group: the plain top-1
            assert not torch.equal(plain != 0, routing_map), case


def test_router_routes_by_groups():
    """TopKRouter reads moe_router_num_groups / moe_router_group_topk (and the expert bias)."""
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=4,
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_ffn_hidden_size=4,
        params_dtype=torch.float64, add_bias_linear=False, use_cpu_initialization=True,
    )
    torch.manual_seed(2)
    layer = MoELayer(config, layer_number=1)
    layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, E))
    x = torch.randn(5, 3, H, dtype=torch.float64)
    probs, routing_map = layer.router(x)
    logits = x.reshape(-1, H) @ layer.router.weight.detach().T
    ref, chosen = serial_routing(logits, 4, 4, 2, "sigmoid", False, layer.router.expert_bias, 2.5)
    assert [set(torch.nonzero(r).flatten().tolist()) for r in routing_map] == chosen
    torch.testing.assert_close(probs.detach(), ref, **TIGHT)


def test_group_limited_routing_equals_megatron_core():
    """In float32: Megatron-core takes the softmax and the sigmoid in float32 for any input (float64
    stays float64 here)."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    gen = torch.Generator().manual_seed(5)
    close = dict(rtol=1e-6, atol=1e-7)
    for case in CASES:
        score_function, pre, with_bias, scaling, topk, groups, group_topk = case
        logits = torch.randn(32, E, dtype=torch.float32, generator=gen)
        bias = torch.randn(E, dtype=torch.float32, generator=gen) * 0.3 if with_bias else None
        kwargs = dict(use_pre_softmax=pre, num_groups=groups, group_topk=group_topk, scaling_factor=scaling,
                      score_function=score_function, expert_bias=bias)
        ours = [logits.clone().requires_grad_(True) for _ in range(2)]
        probs, routing_map = topk_routing_with_score_function(ours[0], topk, **kwargs)
        ref_probs, ref_map = moe_utils.topk_routing_with_score_function(ours[1], topk, **kwargs)
        assert torch.equal(routing_map, ref_map), case
        torch.testing.assert_close(probs, ref_probs, **close, msg=lambda m: f"{case}: {m}")
        weight = torch.randn(32, E, dtype=torch.float32, generator=gen)
        (probs * weight).sum().backward()
        (ref_probs * weight).sum().backward()
        torch.testing.assert_close(ours[0].grad, ours[1].grad, **close, msg=lambda m: f"{case} grad: {m}")


def _config(**kwargs) -> TransformerConfig:
    settings = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=4,
                    moe_ffn_hidden_size=4, add_bias_linear=False)
    settings.update(kwargs)
    return TransformerConfig(**settings)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(moe_router_group_topk=2), r"moe_router_group_topk \(2\) needs moe_router_num_groups"),
        (dict(moe_router_num_groups=4), r"moe_router_num_groups \(4\) needs moe_router_group_topk"),
        (dict(moe_router_num_groups=3, moe_router_group_topk=2),
         r"num_moe_experts \(8\) must be divisible by moe_router_num_groups \(3\)"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=5),
         r"moe_router_group_topk \(5\) must not exceed moe_router_num_groups \(4\)"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=1),
         r"moe_router_topk \(4\) is not reachable with moe_router_group_topk \(1\) groups of 2 experts: "
         r"at most 2"),
        (dict(moe_router_topk=1, moe_router_num_groups=4, moe_router_group_topk=2),
         r"moe_router_topk \(1\) must be at least moe_router_group_topk \(2\)"),
        (dict(moe_router_num_groups=0, moe_router_group_topk=2),
         r"moe_router_num_groups must be a positive integer, got 0"),
        (dict(moe_router_topk_limited_devices=2, moe_router_num_groups=4, moe_router_group_topk=2),
         r"moe_router_topk_limited_devices is deprecated and replaced"),
    ],
)
def test_bad_group_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _config(**kwargs)


def test_bad_group_arguments_raise_in_the_function():
    logits = torch.randn(4, E, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"moe_router_group_topk \(2\) needs moe_router_num_groups"):
        topk_routing_with_score_function(logits, 4, group_topk=2)
    with pytest.raises(ValueError, match=r"moe_router_topk \(6\) is not reachable"):
        topk_routing_with_score_function(logits, 6, num_groups=4, group_topk=2)


def test_topk_limited_devices_is_device_limited_routing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = _config(moe_router_topk_limited_devices=2, expert_model_parallel_size=4)
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (4, 2)
    assert any("deprecated" in str(w.message) for w in caught)


def test_every_valid_group_setting_is_accepted():
    for groups, group_topk, topk in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)):
        if group_topk <= groups and group_topk <= topk <= group_topk * (E // groups):
            _config(moe_router_topk=topk, moe_router_num_groups=groups, moe_router_group_topk=group_topk,
                    moe_router_pre_softmax=True)
