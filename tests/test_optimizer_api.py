"""get_megatron_optimizer with Megatron-core's signature: ParamKey matching, parameter groups from
config_overrides (and their effect on the update), ChainedOptimizer, reload_model_params, and
pg_collection with its validation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from megatron_ext.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_ext.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    ProxyDict,
    _get_param_groups,
    check_config_overrides_consistency,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron_ext.optimizer_param_scheduler import ParamGroupOverride, combine_param_group_overrides
from megatron_ext.process_groups_config import ProcessGroupCollection
from tests.distributed import run_distributed

GROUP_KEYS = {
    "params",
    "is_expert_parallel",
    "default_config",
    "wd_mult",
    "lr_mult",
    "is_decoupled_lr",
    "max_lr",
    "min_lr",
}


class Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.conv = torch.nn.Linear(4, 6, dtype=dtype)
        self.fc = torch.nn.Linear(6, 3, dtype=dtype)
        self.q_layernorm = torch.nn.LayerNorm(3, bias=False, dtype=dtype)
        self.norm = torch.nn.LayerNorm(3, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.q_layernorm(self.fc(torch.tanh(self.conv(x)))))


def _names(model: torch.nn.Module, groups: list[dict]) -> list[list[str]]:
    name = {p: n for n, p in model.named_parameters()}
    return [[name[p] for p in g["params"]] for g in groups]


def test_param_key_matches():
    matrix, vector = torch.nn.Parameter(torch.empty(3, 3)), torch.nn.Parameter(torch.empty(3))
    one_dim = ParamPredicate(name="one_dim", fn=lambda p: p.dim() == 1)
    assert ParamKey(name="*.bias").matches(matrix, "layer.0.bias")  # * spans dots
    assert not ParamKey(name="*.bias").matches(matrix, "layer.bias.extra")
    assert ParamKey(name="*.bias*").matches(matrix, "layer.biasx")
    assert ParamKey(name=("a.*", "b.*")).matches(matrix, "b.weight")
    assert ParamKey(predicate=one_dim).matches(vector, "w") and not ParamKey(predicate=one_dim).matches(
        matrix, "w"
    )
    assert ParamKey(name="*.bias", predicate=one_dim).matches(vector, "w")  # any field matching is enough
    assert not ParamKey(name="*.bias", predicate=one_dim).matches(matrix, "w")
    marked = torch.nn.Parameter(torch.empty(2))
    marked.is_embedding_or_output_parameter = True
    assert ParamKey(attr="is_embedding_or_output_parameter").matches(marked, "x")
    marked.is_embedding_or_output_parameter = False  # a false attribute does not match
    assert not ParamKey(attr="is_embedding_or_output_parameter").matches(marked, "x")
    named = ParamWithNamePredicate(name="qk", fn=lambda p, n: "q_layernorm" in n)
    assert ParamKey(with_name_predicate=named).matches(matrix, "a.q_layernorm.weight")
    assert not ParamKey().matches(vector, "anything")
    # Predicates compare and hash by name, so keys can be dictionary keys.
    same = ParamPredicate(name="one_dim", fn=lambda p: False)
    assert same == one_dim and {ParamKey(predicate=one_dim): 1}[ParamKey(predicate=same)] == 1


def test_param_groups_from_overrides():
    net = Net()
    config = OptimizerConfig(lr=0.1, min_lr=0.01)
    # None: Megatron's standard overrides (no decay on biases and 1-D parameters), default group first.
    groups = _get_param_groups([net], config, None)
    assert [set(g) for g in groups] == [GROUP_KEYS | {"wd_mult"}] * 2
    assert [(g["wd_mult"], g["lr_mult"], g["max_lr"], g["min_lr"], g["default_config"]) for g in groups] == [
        (1.0, 1.0, 0.1, 0.01, True),
        (0.0, 1.0, 0.1, 0.01, True),
    ]
    assert _names(net, groups) == [
        ["conv.weight", "fc.weight"],
        ["conv.bias", "fc.bias", "q_layernorm.weight", "norm.weight", "norm.bias"],
    ]
    # {}: one group, everything decayed.
    assert _names(net, _get_param_groups([net], config, {})) == [[n for n, _ in net.named_parameters()]]
    # apply_wd_to_qk_layernorm: the q/k LayerNorm weights are decayed.
    qk = _get_param_groups([net], OptimizerConfig(lr=0.1, apply_wd_to_qk_layernorm=True), None)
    assert _names(net, qk)[0] == ["conv.weight", "fc.weight", "q_layernorm.weight"]
    # decoupled_lr: parameters marked is_embedding_or_output_parameter get their own learning rate.
    net.conv.weight.is_embedding_or_output_parameter = True
    decoupled = _get_param_groups(
        [net], OptimizerConfig(lr=0.1, decoupled_lr=0.5, decoupled_min_lr=0.05), None
    )
    assert [(g["max_lr"], g["min_lr"], g["wd_mult"], g["default_config"]) for g in decoupled] == [
        (0.1, None, 1.0, True),
        (0.5, 0.05, 1.0, False),
        (0.1, None, 0.0, True),
    ]
    assert _names(net, decoupled)[1] == ["conv.weight"]
    del net.conv.weight.is_embedding_or_output_parameter
    # Overlapping keys: each parameter takes the union of its matches; groups ordered by override.
    overrides = {
        ParamKey(name="*conv*"): ParamGroupOverride(wd_mult=0.0),
        ParamKey(name="conv.weight"): ParamGroupOverride(min_lr=10.0, max_lr=20.0),
    }
    assert check_config_overrides_consistency(config, overrides)
    groups = _get_param_groups([net], config, overrides)
    assert _names(net, groups) == [
        ["fc.weight", "fc.bias", "q_layernorm.weight", "norm.weight", "norm.bias"],
        ["conv.weight"],
        ["conv.bias"],
    ]
    assert [(g["wd_mult"], g["max_lr"], g["min_lr"], g["default_config"]) for g in groups] == [
        (1.0, 0.1, 0.01, True),
        (0.0, 20.0, 10.0, False),
        (0.0, 0.1, 0.01, True),
    ]
    with pytest.raises(
        ValueError, match="conflicting overrides for one parameter: wd_mult=0.0 and wd_mult=0.5"
    ):
        _get_param_groups(
            [net],
            config,
            {ParamKey(name="conv.*"): {"wd_mult": 0.0}, ParamKey(name="*.bias"): {"wd_mult": 0.5}},
        )
    with pytest.raises(ValueError, match="Field optimizer should not be overriden"):
        check_config_overrides_consistency(config, {ParamKey(name="*"): {"optimizer": "sgd"}})
    assert combine_param_group_overrides([{"wd_mult": 0.0}, None, {"max_lr": 1.0}]) == {
        "wd_mult": 0.0,
        "max_lr": 1.0,
    }
    standard = get_standard_config_overrides(OptimizerConfig(lr=0.1, decoupled_lr=0.5))
    assert list(standard.values()) == [{"wd_mult": 0.0}, {"max_lr": 0.5}]


# --- the update, chaining, reloading, process groups -------------------------------------------------


def _adamw_reference(
    model: torch.nn.Module, grads: dict[str, torch.Tensor], groups: list[tuple[list[str], dict]]
):
    """What torch's AdamW does to copies of ``model``'s parameters with ``grads``, per group."""
    params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
    for n, p in params.items():
        p.grad = grads[n].clone()
    torch.optim.AdamW(
        [{"params": [params[n] for n in names], **settings} for names, settings in groups]
    ).step()
    return {n: p.detach() for n, p in params.items()}


def _backward(model: torch.nn.Module, seed: int) -> None:
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def _optimizer_worker() -> dict:
    ps.initialize_model_parallel()  # dp 2
    rank = dist.get_rank()
    out = {}

    # config_overrides: conv.weight without weight decay and at half the learning rate.
    # (Names as the chunk gives them: "module." first under DistributedDataParallel.)
    overrides = {ParamKey(name="*conv.weight"): ParamGroupOverride(wd_mult=0.0, lr_mult=0.5)}
    for distributed in (False, True):
        torch.manual_seed(0)
        net = Net()
        model = DistributedDataParallel(
            None, DistributedDataParallelConfig(use_distributed_optimizer=distributed), net
        )
        optimizer = get_megatron_optimizer(
            config=OptimizerConfig(
                lr=0.1, weight_decay=0.2, clip_grad=0.0, use_distributed_optimizer=distributed
            ),
            model_chunks=[model],
            config_overrides=overrides,
        )
        assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(0.1, 0.2), (0.05, 0.0)]
        _backward(model, seed=rank)
        model.finish_grad_sync()
        grads = {n: p.main_grad.clone() for n, p in net.named_parameters()}
        if distributed:  # each rank holds its slice: gather the averaged gradients for the reference
            reference = DistributedDataParallel(None, DistributedDataParallelConfig(), Net())
            reference.module.load_state_dict(net.state_dict())
            _backward(reference, seed=rank)
            reference.finish_grad_sync()
            grads = {n: p.main_grad.clone() for n, p in reference.module.named_parameters()}
        expected = _adamw_reference(
            net,
            grads,
            [
                (
                    [n for n, _ in net.named_parameters() if n != "conv.weight"],
                    {"lr": 0.1, "weight_decay": 0.2},
                ),
                (["conv.weight"], {"lr": 0.05, "weight_decay": 0.0}),
            ],
        )
        assert optimizer.step()[0]
        for n, p in net.named_parameters():
            torch.testing.assert_close(
                p.detach(), expected[n], rtol=1e-12, atol=1e-14, msg=lambda m: f"{n}: {m}"
            )
        out[distributed] = True

    # ChainedOptimizer: two optimizers over two halves step like one over both, clipped by one norm.
    torch.manual_seed(1)
    first, second = Net(), Net()
    both = torch.nn.ModuleList([first, second])
    twin = torch.nn.ModuleList([Net(), Net()])
    twin.load_state_dict(both.state_dict())
    config = OptimizerConfig(lr=0.1, clip_grad=0.01)
    chained = ChainedOptimizer(
        [get_megatron_optimizer(config, [first]), get_megatron_optimizer(config, [second])]
    )
    single = get_megatron_optimizer(config, [twin])
    for modules in ((first, second), tuple(twin)):
        for i, m in enumerate(modules):
            _backward(m, seed=10 + i)
    finished = [chained.step(), single.step()]
    assert finished[0][0] and finished[1][0]
    torch.testing.assert_close(finished[0][1], finished[1][1], rtol=1e-12, atol=0)  # the global norm
    for p, q in zip(both.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15)
    assert (
        len(chained.param_groups) == 4 and isinstance(chained.state, ProxyDict) and len(chained.state) == 14
    )
    chained.param_groups[2]["lr"] = 0.3  # the second optimizer's first group
    assert chained.chained_optimizers[1].param_groups[0]["lr"] == 0.3
    with pytest.raises(RuntimeError, match="there are 2 chained optimizers, not one"):
        chained.optimizer

    # reload_model_params: main copies from the model parameters or from a state dict.
    bf16 = DistributedDataParallel(
        None, DistributedDataParallelConfig(use_distributed_optimizer=True), Net(torch.bfloat16)
    )
    for module in (bf16, Net(torch.bfloat16)):
        with torch.no_grad():
            for p in module.parameters():
                p.fill_(1.0)
        distributed = module is bf16
        opt = get_megatron_optimizer(
            OptimizerConfig(lr=0.1, bf16=True, use_distributed_optimizer=distributed), [module]
        )
        assert isinstance(opt, Float16OptimizerWithFloat16Params) != distributed
        with torch.no_grad():
            for p in module.parameters():
                p.fill_(2.0)
        assert all(bool((m == 1.0).all()) for g in opt.param_groups for m in g["params"])
        opt.reload_model_params()
        assert all(
            bool((m == 2.0).all()) and m.dtype == torch.float32 for g in opt.param_groups for m in g["params"]
        )
        opt.reload_model_params({k: torch.full_like(v, 3.0) for k, v in module.state_dict().items()})
        assert all(bool((m == 3.0).all()) for g in opt.param_groups for m in g["params"])
        assert all(bool((p == 2.0).all()) for p in module.parameters())  # the model is left alone
        with pytest.raises(ValueError, match="the state_dict has no tensor for"):
            opt.reload_model_params({})

    # pg_collection: what is missing is named, in Megatron-core's order; gloo groups are refused.
    model = DistributedDataParallel(
        None, DistributedDataParallelConfig(use_distributed_optimizer=True), Net()
    )
    config = OptimizerConfig(lr=0.1)
    pgs = ProcessGroupCollection()
    for missing, value in (
        ("dp", dist.group.WORLD),
        ("expt_dp", None),
        ("intra_dist_opt", None),
        ("mp", None),
        ("tp_ep_pp", None),
    ):
        with pytest.raises(ValueError, match=f"{missing} process group is required"):
            get_megatron_optimizer(config, [model], pg_collection=pgs, use_gloo_process_groups=False)
        setattr(pgs, missing, value)
    with pytest.raises(ValueError, match="Gloo process groups are not supported"):
        get_megatron_optimizer(config, [model], pg_collection=pgs)
    # With complete groups the optimizer equals the one on parallel_state's groups.
    pgs = ProcessGroupCollection(
        dp=ps.get_data_parallel_group(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        expt_dp=None,
        intra_dist_opt=None,
        mp=ps.get_model_parallel_group(),
        tp_ep_pp=None,
        tp=ps.get_tensor_model_parallel_group(),
    )
    results = []
    for groups in (pgs, None):
        torch.manual_seed(2)
        model = DistributedDataParallel(
            None, DistributedDataParallelConfig(use_distributed_optimizer=True), Net()
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(lr=0.1, clip_grad=0.05, use_distributed_optimizer=True),
            [model],
            use_gloo_process_groups=groups is None,
            pg_collection=groups,
        )
        _backward(model, seed=rank)
        model.finish_grad_sync()
        results.append((opt.step()[1], [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(p, q) for p, q in zip(results[0][1], results[1][1]))
    assert isinstance(get_megatron_optimizer(config, Net()), FP32Optimizer)
    return out


def test_optimizer_overrides_chaining_reload_and_groups():
    for out in run_distributed(2, _optimizer_worker):
        assert out == {False: True, True: True}
