"""OptimizerParamScheduler: every learning-rate and weight-decay style against closed forms written
here (other algebraic forms of the same schedules, so each value is compared to 1e-13 relative:
a few roundings apart), the per-group keys, the state dict and a resume, and the refused
arguments. tests/test_megatron_core_optimizer_param_scheduler.py compares it with Megatron-core's."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ext.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_ext.optimizer_param_scheduler import OptimizerParamScheduler, get_canonical_lr_for_logging

MAX_LR, MIN_LR, INIT_LR = 0.1, 0.01, 0.002
START_WD, END_WD = 0.01, 0.1


def _optimizer(*groups: dict) -> torch.optim.Optimizer:
    """A plain torch optimizer with one parameter per group, the groups' extra keys kept."""
    groups = groups or ({},)
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))], **g} for g in groups], lr=0.0)


def _scheduler(optimizer: torch.optim.Optimizer, **overrides) -> OptimizerParamScheduler:
    kwargs = dict(
        init_lr=INIT_LR, max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=4, lr_decay_steps=20,
        lr_decay_style="linear", start_wd=START_WD, end_wd=END_WD, wd_incr_steps=10,
        wd_incr_style="linear",
    )
    kwargs.update(overrides)
    return OptimizerParamScheduler(optimizer, **kwargs)


def _values(optimizer) -> list[tuple]:
    return [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]


def _trace(scheduler: OptimizerParamScheduler, steps: int, increment: int = 1) -> list[list[tuple]]:
    """Every group's (lr, weight_decay) after construction and after each of ``steps`` steps."""
    out = [_values(scheduler.optimizer)]
    for _ in range(steps):
        scheduler.step(increment)
        out.append(_values(scheduler.optimizer))
    return out


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-13, abs_tol=1e-16)


def _expected_lr(n: int, style: str, warmup: int, decay: int, max_lr: float, min_lr: float,
                 wsd: int = 0, wsd_style: str = "") -> float:
    if warmup > 0 and n <= warmup:
        return INIT_LR * (1 - n / warmup) + max_lr * (n / warmup)
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1) / max(n, 1)))
    r = (n - warmup) / (decay - warmup)
    span = max_lr - min_lr
    if style == "linear":
        return max_lr - span * r
    if style == "cosine":
        return min_lr + span * math.cos(math.pi * r / 2) ** 2
    assert style == "WSD"
    if n <= decay - wsd:
        return max_lr
    q = (n - (decay - wsd)) / wsd
    return {
        "linear": max_lr - span * q,
        "cosine": min_lr + span * math.cos(math.pi * q / 2) ** 2,
        "exponential": min_lr + span * (2 ** (1 - q) - 1),
        "minus_sqrt": max_lr - span * math.sqrt(q),
    }[wsd_style]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
@pytest.mark.parametrize("warmup", [0, 4])
@pytest.mark.parametrize("min_lr", [0.0, MIN_LR])
def test_learning_rate_styles(style, warmup, min_lr):
    scheduler = _scheduler(_optimizer(), lr_decay_style=style, lr_warmup_steps=warmup, min_lr=min_lr)
    trace = _trace(scheduler, 24)
    for n, [(lr, _)] in enumerate(trace):
        assert _close(lr, _expected_lr(n, style, warmup, 20, MAX_LR, min_lr)), (n, lr)
    assert trace[-1][0][0] == (MAX_LR if style == "constant" else min_lr)
    if warmup:
        assert trace[0][0][0] == INIT_LR  # the constructor writes step 0: the warmup's start


@pytest.mark.parametrize("wsd_style", ["linear", "cosine", "exponential", "minus_sqrt"])
@pytest.mark.parametrize("warmup", [0, 2])
def test_wsd_styles(wsd_style, warmup):
    scheduler = _scheduler(_optimizer(), lr_decay_style="WSD", lr_warmup_steps=warmup,
                           wsd_decay_steps=6, lr_wsd_decay_style=wsd_style)
    trace = _trace(scheduler, 23)
    for n, [(lr, _)] in enumerate(trace):
        assert _close(lr, _expected_lr(n, "WSD", warmup, 20, MAX_LR, MIN_LR, 6, wsd_style)), (n, lr)
    assert _close(trace[14][0][0], MAX_LR) and trace[15][0][0] < MAX_LR  # annealing starts after 14
    assert _close(trace[20][0][0], MIN_LR) and trace[21][0][0] == MIN_LR


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_weight_decay_increment(style):
    end_wd = START_WD if style == "constant" else END_WD
    scheduler = _scheduler(_optimizer(), wd_incr_style=style, end_wd=end_wd)
    trace = _trace(scheduler, 14)
    for n, [(_, wd)] in enumerate(trace):
        r = min(n / 10, 1.0)
        expected = {
            "linear": START_WD * (1 - r) + END_WD * r,
            "cosine": START_WD + (END_WD - START_WD) * math.sin(math.pi * r / 2) ** 2,
            "constant": START_WD,
        }[style]
        assert _close(wd, expected), (n, wd)
    assert scheduler.get_wd() == trace[-1][0][1] == end_wd


def test_per_group_keys():
    """max_lr / min_lr / start_wd / end_wd of a group replace the scheduler's; lr_mult and wd_mult
    scale what the group gets; a group without the keys follows the scheduler's values."""
    groups = [{}, {"max_lr": 0.5, "min_lr": 0.05}, {"lr_mult": 2.0, "wd_mult": 0.0},
              {"wd_mult": 0.5, "start_wd": 0.0, "end_wd": 0.2}]
    scheduler = _scheduler(_optimizer(*groups), lr_decay_style="cosine")
    for n, lrs in enumerate(_trace(scheduler, 22)):
        r = min(n / 10, 1.0)
        base_lr = _expected_lr(n, "cosine", 4, 20, MAX_LR, MIN_LR)
        base_wd = START_WD * (1 - r) + END_WD * r
        assert _close(lrs[0][0], base_lr) and _close(lrs[0][1], base_wd)
        assert _close(lrs[1][0], _expected_lr(n, "cosine", 4, 20, 0.5, 0.05)) and _close(lrs[1][1], base_wd)
        assert _close(lrs[2][0], 2.0 * base_lr) and lrs[2][1] == 0.0
        assert _close(lrs[3][0], base_lr) and _close(lrs[3][1], 0.5 * 0.2 * r)
    # the warmup starts every group at the scheduler's init_lr, then climbs to the group's max_lr
    assert _trace(_scheduler(_optimizer(*groups)), 0)[0][1][0] == INIT_LR


def test_increment_counts_samples():
    """Megatron-LM steps by the global batch size: step(8) is eight steps of one."""
    by_one = _scheduler(_optimizer(), lr_decay_style="cosine")
    by_eight = _scheduler(_optimizer(), lr_decay_style="cosine")
    for _ in range(8):
        by_one.step(1)
    by_eight.step(8)
    assert by_eight.num_steps == 8 and _values(by_eight.optimizer) == _values(by_one.optimizer)


def test_drives_megatron_ext_optimizer():
    """get_megatron_optimizer's groups: biases and 1-D parameters at wd_mult 0, the embedding's
    at decoupled_lr / decoupled_min_lr (its max_lr / min_lr keys); the torch optimizer steps with
    the scheduled values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3, dtype=torch.float64),
                                torch.nn.Linear(3, 3, dtype=torch.float64))
    model[0].weight.is_embedding_or_output_parameter = True
    config = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=MAX_LR, min_lr=MIN_LR, weight_decay=0.05,
                             decoupled_lr=0.3, decoupled_min_lr=0.03, clip_grad=0.0,
                             params_dtype=torch.float64)
    optimizer = get_megatron_optimizer(config, [model])
    scheduler = _scheduler(optimizer, lr_decay_style="cosine", start_wd=0.05, end_wd=0.05,
                           wd_incr_style="constant")
    scheduler.step(6)
    by_param = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    weight, bias, embedding = model[1].weight, model[1].bias, model[0].weight
    groups = {name: by_param[id(p)] for name, p in [("w", weight), ("b", bias), ("e", embedding)]}
    assert _close(groups["w"]["lr"], _expected_lr(6, "cosine", 4, 20, MAX_LR, MIN_LR))
    assert _close(groups["b"]["lr"], groups["w"]["lr"])
    assert _close(groups["e"]["lr"], _expected_lr(6, "cosine", 4, 20, 0.3, 0.03))
    assert (groups["w"]["weight_decay"], groups["b"]["weight_decay"], groups["e"]["weight_decay"]) == (
        0.05, 0.0, 0.05)
    assert get_canonical_lr_for_logging(optimizer.param_groups) == groups["w"]["lr"]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        group = by_param[id(p)]
        expected = before[name] - group["lr"] * (1 + group["weight_decay"] * before[name])
        torch.testing.assert_close(p.detach(), expected, rtol=1e-15, atol=1e-15)


def test_state_dict_round_trip_and_resume():
    args = dict(lr_decay_style="cosine", wd_incr_style="cosine")
    original = _scheduler(_optimizer({}, {"max_lr": 0.5}), **args)
    for _ in range(7):
        original.step(2)
    state = original.state_dict()
    assert state == {"max_lr": MAX_LR, "lr_warmup_steps": 4, "num_steps": 14, "lr_decay_style": "cosine",
                     "lr_decay_steps": 20, "min_lr": MIN_LR, "start_wd": START_WD, "end_wd": END_WD,
                     "wd_incr_style": "cosine", "wd_incr_steps": 10}
    resumed = _scheduler(_optimizer({}, {"max_lr": 0.5}), **args)
    resumed.load_state_dict(state)
    assert resumed.num_steps == 14 and resumed.state_dict() == state
    assert _values(resumed.optimizer) == _values(original.optimizer)  # the next step's values
    assert _trace(resumed, 5, 2) == _trace(original, 5, 2)
    # loading into a stepped scheduler takes the checkpoint's count (not the sum)
    resumed.load_state_dict(state)
    assert resumed.num_steps == 14


def test_load_state_dict_checkpoint_or_class_values():
    saved = _scheduler(_optimizer(), max_lr=0.2, min_lr=0.0, lr_warmup_steps=2, lr_decay_steps=30,
                       end_wd=0.2, wd_incr_steps=5)
    saved.step(3)
    state = saved.state_dict()
    # use_checkpoint_opt_param_scheduler (the default): the checkpoint's settings, weight decay too
    taken = _scheduler(_optimizer())
    taken.load_state_dict(state)
    assert taken.state_dict() == state and _values(taken.optimizer) == _values(saved.optimizer)
    # override_opt_param_scheduler: the class's settings, the checkpoint's step count
    kept = _scheduler(_optimizer(), use_checkpoint_opt_param_scheduler=False,
                      override_opt_param_scheduler=True)
    kept.load_state_dict(state)
    assert kept.state_dict() == {**_scheduler(_optimizer()).state_dict(), "num_steps": 3}
    # neither: a differing value is an error naming both
    strict = _scheduler(_optimizer(), use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match=r"class input value 0.1 and checkpoint value 0.2 for learning rate"):
        strict.load_state_dict(state)
    same = _scheduler(_optimizer(), use_checkpoint_opt_param_scheduler=False)
    same.load_state_dict(same.state_dict())


def test_load_state_dict_older_keys():
    """The key names of older Megatron checkpoints; one without weight-decay keys keeps the class's."""
    scheduler = _scheduler(_optimizer())
    scheduler.load_state_dict({"start_lr": 0.2, "min_lr": 0.0, "warmup_iter": 2, "end_iter": 30,
                               "decay_style": "cosine", "num_iters": 5})
    assert (scheduler.max_lr, scheduler.min_lr, scheduler.lr_warmup_steps, scheduler.lr_decay_steps,
            scheduler.lr_decay_style, scheduler.num_steps) == (0.2, 0.0, 2, 30, "cosine", 5)
    assert (scheduler.start_wd, scheduler.end_wd, scheduler.wd_incr_steps) == (START_WD, END_WD, 10)
    assert _close(scheduler.optimizer.param_groups[0]["lr"], _expected_lr(5, "cosine", 2, 30, 0.2, 0.0))
    scheduler.load_state_dict({"max_lr": 0.2, "min_lr": 0.0, "warmup_steps": 2, "decay_steps": 30,
                               "lr_decay_style": "linear", "num_steps": 6})
    assert (scheduler.lr_decay_style, scheduler.num_steps) == ("linear", 6)


@pytest.mark.parametrize("overrides, message", [
    (dict(min_lr=-0.1), r"min_lr=-0.1 must be >= 0"),
    (dict(max_lr=0.001), r"max_lr=0.001 must be >= min_lr=0.01"),
    (dict(init_lr=0.2), r"init_lr=0.2 must be <= max_lr=0.1"),
    (dict(init_lr=-0.01), r"init_lr=-0.01 must be >= 0"),
    (dict(lr_decay_steps=0, lr_warmup_steps=0), r"lr_decay_steps=0 must be > 0"),
    (dict(lr_warmup_steps=20), r"lr_warmup_steps=20 must be < lr_decay_steps=20"),
    (dict(lr_warmup_steps=-1), r"lr_warmup_steps=-1 must be >= 0"),
    (dict(lr_decay_style="exponential"), r"lr_decay_style='exponential' is not one of"),
    (dict(lr_decay_style="WSD"), r"lr_decay_style='WSD' needs wsd_decay_steps >= 0, got None"),
    (dict(lr_decay_style="WSD", wsd_decay_steps=-2, lr_wsd_decay_style="linear"), r"got -2"),
    (dict(lr_decay_style="WSD", wsd_decay_steps=5), r"lr_wsd_decay_style=None is not one of"),
    (dict(start_wd=-0.01), r"start_wd=-0.01 must be >= 0"),
    (dict(end_wd=0.001), r"end_wd=0.001 must be >= start_wd=0.01"),
    (dict(wd_incr_style="exponential"), r"wd_incr_style='exponential' is not one of"),
    (dict(wd_incr_steps=0), r"wd_incr_style='linear' needs wd_incr_steps > 0, got 0"),
    (dict(wd_incr_steps=-3, wd_incr_style="constant", end_wd=START_WD), r"wd_incr_steps=-3 must be >= 0"),
    (dict(wd_incr_style="constant"), r"needs start_wd == end_wd, got start_wd=0.01 and end_wd=0.1"),
    (dict(override_opt_param_scheduler=True), r"override_opt_param_scheduler=True and use_checkpoint"),
])
def test_bad_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        _scheduler(_optimizer(), **overrides)


def test_bad_steps_and_groups():
    scheduler = _scheduler(_optimizer())
    with pytest.raises(ValueError, match=r"increment=-1 must be >= 0"):
        scheduler.step(-1)
    with pytest.raises(ValueError, match=r"num_steps=-2 must be >= 0"):
        scheduler.load_state_dict({**scheduler.state_dict(), "num_steps": -2})
    # a group's own constant weight decay that changes
    with pytest.raises(ValueError, match=r"start_wd=0.0 and end_wd=0.2"):
        _scheduler(_optimizer({"start_wd": 0.0, "end_wd": 0.2}), wd_incr_style="constant", end_wd=START_WD)
    # OptimizerConfig without min_lr: its groups carry min_lr=None, which only 'constant' never reads
    model = torch.nn.Linear(2, 2)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=MAX_LR), [model])
    with pytest.raises(ValueError, match=r"max_lr=0.1, min_lr=None; lr_decay_style='cosine' needs numbers"):
        _scheduler(optimizer, lr_decay_style="cosine")
    _scheduler(optimizer, lr_decay_style="constant", lr_warmup_steps=0)
    assert [g["lr"] for g in optimizer.param_groups] == [MAX_LR, MAX_LR]
