"""megatron_ext's OptimizerParamScheduler against Megatron-core 0.16.1's, each over its own copy of
the same optimizer: every style, with and without warmup, per-group keys, a resume. Their lr and
weight decay are equal exactly (==): both evaluate the same expressions in the same order on Python
floats (IEEE doubles, the same libm cos / pow / sqrt), so not even one rounding differs. Skipped
when megatron-core is not installed (megatron_ext itself never imports it)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.optimizer_param_scheduler import (  # noqa: E402
    OptimizerParamScheduler as MCoreScheduler,
)
from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging as mcore_canonical_lr  # noqa: E402

from megatron_ext.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron_ext.optimizer_param_scheduler import (  # noqa: E402
    OptimizerParamScheduler,
    get_canonical_lr_for_logging,
)

# Groups as Megatron-LM's get_megatron_optimizer makes them: the plain one, wd_mult 0 (biases),
# a decoupled learning rate (max_lr / min_lr), and a group with its own weight-decay range.
GROUPS = [
    {"wd_mult": 1.0, "lr_mult": 1.0, "max_lr": 3e-3, "min_lr": 3e-5, "default_config": True},
    {"wd_mult": 0.0, "lr_mult": 1.0, "max_lr": 3e-3, "min_lr": 3e-5, "default_config": True},
    {"wd_mult": 1.0, "lr_mult": 1.0, "max_lr": 1e-2, "min_lr": 1e-4, "default_config": False},
    {"wd_mult": 0.5, "start_wd": 0.0, "end_wd": 0.3},
]
# A constant weight decay needs start_wd == end_wd in every group.
CONSTANT_WD_GROUPS = GROUPS[:3] + [{"wd_mult": 0.5, "start_wd": 0.2, "end_wd": 0.2}]
STYLES = [
    dict(lr_decay_style=s) for s in ("constant", "linear", "cosine", "inverse-square-root")
] + [dict(lr_decay_style="WSD", wsd_decay_steps=40, lr_wsd_decay_style=s)
     for s in ("linear", "cosine", "exponential", "minus_sqrt")]


def _pair(groups: list[dict], **kwargs) -> tuple:
    """Megatron-core's scheduler and ours, each over its own torch optimizer with ``groups``."""
    def optimizer():
        return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))], **g} for g in groups])

    return MCoreScheduler(optimizer(), **kwargs), OptimizerParamScheduler(optimizer(), **kwargs)


def _values(scheduler) -> list[tuple]:
    groups = scheduler.optimizer.param_groups
    return [(g["lr"], g["weight_decay"]) for g in groups] + [
        (scheduler.get_wd(), get_canonical_lr_for_logging(groups))]


def _settings(style: dict, warmup: int, wd_style: str) -> dict:
    return dict(init_lr=1e-5 if warmup else 3e-3, max_lr=3e-3, min_lr=3e-5, lr_warmup_steps=warmup,
                lr_decay_steps=120, start_wd=0.01, end_wd=0.01 if wd_style == "constant" else 0.1,
                wd_incr_steps=90, wd_incr_style=wd_style, **style)


@pytest.mark.parametrize("style", STYLES, ids=lambda s: s.get("lr_wsd_decay_style", s["lr_decay_style"]))
def test_same_lr_and_wd_as_megatron_core_at_every_step(style):
    # 0.25 * 120: a warmup given as a fraction of the decay (--lr-warmup-fraction) is a float
    for warmup in (0, 12, 0.25 * 120):
        for wd_style in ("linear", "cosine", "constant"):
            groups = CONSTANT_WD_GROUPS if wd_style == "constant" else GROUPS
            theirs, ours = _pair(groups, **_settings(style, warmup, wd_style))
            assert _values(ours) == _values(theirs)
            for _ in range(50):  # 3 "samples" a step: warmup, decay and the tail past lr_decay_steps
                theirs.step(increment=3)
                ours.step(increment=3)
                assert _values(ours) == _values(theirs), (warmup, wd_style, ours.num_steps)
                assert mcore_canonical_lr(ours.optimizer.param_groups) == _values(ours)[0][0]
            assert ours.state_dict() == theirs.state_dict()


@pytest.mark.parametrize("style", STYLES[1:3] + STYLES[4:5], ids=["linear", "cosine", "WSD"])
def test_resume_as_megatron_core(style):
    """A fresh scheduler of each kind loads the other's state dict (Megatron-LM's resume) and both
    go on as one."""
    settings = _settings(style, 12, "cosine")
    theirs, ours = _pair(GROUPS, **settings)
    for _ in range(17):
        theirs.step(increment=2)
        ours.step(increment=2)
    their_resumed, our_resumed = _pair(GROUPS, **settings)
    their_resumed.load_state_dict(ours.state_dict())
    our_resumed.load_state_dict(theirs.state_dict())
    for _ in range(30):
        assert _values(our_resumed) == _values(their_resumed) == _values(theirs)
        for scheduler in (theirs, their_resumed, our_resumed):
            scheduler.step(increment=2)


def test_over_megatron_ext_optimizer():
    """Over get_megatron_optimizer's groups (wd_mult 0 for biases, the decoupled learning rate of
    the embedding through max_lr / min_lr) both schedulers set the same values."""
    def optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 3))
        model[0].weight.is_embedding_or_output_parameter = True
        return get_megatron_optimizer(
            OptimizerConfig(lr=3e-3, min_lr=3e-5, weight_decay=0.1, decoupled_lr=1e-2, decoupled_min_lr=1e-4),
            [model])

    settings = _settings(STYLES[2], 12, "linear")
    theirs, ours = MCoreScheduler(optimizer(), **settings), OptimizerParamScheduler(optimizer(), **settings)
    assert len(ours.optimizer.param_groups) == 3
    for _ in range(50):
        theirs.step(increment=3)
        ours.step(increment=3)
        assert _values(ours) == _values(theirs)


def test_lr_mult_is_applied_where_megatron_core_ignores_it():
    """The one documented difference: a group's lr_mult (Megatron-core 0.16.1's scheduler never
    reads it; megatron_ext's optimizer starts the group at max_lr * lr_mult and the scheduler keeps
    that factor)."""
    theirs, ours = _pair([{"lr_mult": 2.0}], **_settings(STYLES[2], 12, "linear"))
    for _ in range(50):
        theirs.step(increment=3)
        ours.step(increment=3)
        assert ours.optimizer.param_groups[0]["lr"] == 2.0 * theirs.optimizer.param_groups[0]["lr"]
        assert ours.get_lr(ours.optimizer.param_groups[0]) == theirs.optimizer.param_groups[0]["lr"]


def test_megatron_core_unit_test_module_names():
    """What Megatron-core's own tests import from the module exists here with the same parameters."""
    import inspect

    import megatron.core.optimizer_param_scheduler as mcore

    import megatron_ext.optimizer_param_scheduler as ext

    for name in ("OptimizerParamScheduler", "ParamGroupOverride", "get_canonical_lr_for_logging",
                 "param_group_override_to_tuple", "combine_param_group_overrides"):
        assert hasattr(ext, name), name
    for method in ("__init__", "get_wd", "get_lr", "step", "state_dict", "load_state_dict"):
        ours = inspect.signature(getattr(ext.OptimizerParamScheduler, method)).parameters
        theirs = inspect.signature(getattr(mcore.OptimizerParamScheduler, method)).parameters
        assert [(p.name, p.kind, p.default) for p in ours.values()] == [
            (p.name, p.kind, p.default) for p in theirs.values()], method
