"""The run's TensorBoard and W&B writers (megatron_ext.training.metrics): the event file read back
with TensorBoard's own reader, W&B through a stand-in module that records its calls, the errors for a
missing package, and the memory helper."""

from __future__ import annotations

import math
import re
import resource
import sys
import types

import pytest
import torch

from megatron_ext.training import metrics
from megatron_ext.training.metrics import MetricsWriter
from tests.distributed import run_distributed

STEPS = {
    1: dict(loss=2.5, learning_rate=1e-3, grad_norm=0.75, tokens_per_s=1000.0,
            moe_losses={"load_balancing_loss": 1.25, "z_loss": 0.125}, mtp_losses={"mtp_1 loss": 2.75},
            memory={"mem-max-rss-bytes": 4096}),
    2: dict(loss=2.25, learning_rate=2e-3, grad_norm=None, tokens_per_s=1500.0, loss_scale=65536.0,
            moe_losses={"load_balancing_loss": 1.0, "z_loss": 0.25}, mtp_losses={"mtp_1 loss": 2.5},
            memory={"mem-max-rss-bytes": 8192}),
    3: dict(loss=float("nan"), learning_rate=3e-3, grad_norm=float("inf"), tokens_per_s=2000.0,
            moe_losses={"load_balancing_loss": 0.5, "z_loss": 0.5}, mtp_losses={"mtp_1 loss": 2.0},
            memory={"mem-max-rss-bytes": 8192}),
    4: dict(loss=2.0, learning_rate=4e-3, grad_norm=0.5, tokens_per_s=2500.0,
            moe_losses={"load_balancing_loss": 0.25, "z_loss": 1.0}, mtp_losses={"mtp_1 loss": 1.5},
            memory={"mem-max-rss-bytes": 16384}),
}


def _events(path):
    """TensorBoard's own reader over the event files in ``path`` (imported here, not at the top: the
    GPU run, ``pytest -m cuda`` on a machine without the test tools, collects this file too)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path))
    events.Reload()
    return events


def _scalars(path) -> dict[str, list[tuple[int, float]]]:
    events = _events(path)
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _texts(path) -> dict[str, list[tuple[int, str]]]:
    events = _events(path)
    out = {}
    for tag in events.Tags()["tensors"]:
        out[tag] = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]
    return out


def test_tensorboard_event_file_holds_the_tags_steps_and_values(tmp_path):
    with MetricsWriter(tensorboard_dir=str(tmp_path), log_interval=2, config={"lr": 1e-3, "tp": 2},
                       start_step=0) as writer:
        for step, values in STEPS.items():
            writer.log_train(step, **values)
        writer.log_eval(3, 2.0, math.exp(2.0))  # evaluations ignore the interval
        writer.text("note", "hello", step=4)
    written = _scalars(tmp_path)
    # steps 2 and 4 only; None left out; the router's and MTP's names as given
    assert written == {
        "lm loss": [(2, 2.25), (4, 2.0)],
        "learning-rate": [(2, pytest.approx(2e-3)), (4, pytest.approx(4e-3))],
        "grad-norm": [(4, 0.5)],
        "tokens-per-sec": [(2, 1500.0), (4, 2500.0)],
        "loss-scale": [(2, 65536.0)],
        "load_balancing_loss": [(2, 1.0), (4, 0.25)],
        "z_loss": [(2, 0.25), (4, 1.0)],
        "mtp_1 loss": [(2, 2.5), (4, 1.5)],
        "mem-max-rss-bytes": [(2, 8192.0), (4, 16384.0)],
        "lm loss validation": [(3, 2.0)],
        "lm loss validation ppl": [(3, pytest.approx(math.exp(2.0), rel=1e-7))],  # float32 in the file
    }
    assert _texts(tmp_path) == {
        "lr/text_summary": [(0, "0.001")], "tp/text_summary": [(0, "2")], "note/text_summary": [(4, "hello")],
    }


def test_nonfinite_values_are_written_as_they_are(tmp_path):
    with MetricsWriter(tensorboard_dir=str(tmp_path)) as writer:
        writer.log_train(3, **STEPS[3])
    written = _scalars(tmp_path)
    assert math.isnan(written["lm loss"][0][1]) and written["lm loss"][0][0] == 3
    assert written["grad-norm"] == [(3, math.inf)]


class _FakeWandb(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("wandb")
        self.calls: list[tuple] = []

    def init(self, project=None, name=None, dir=None, config=None):
        self.calls.append(("init", project, name, dir, config))

    def log(self, values, step=None):
        self.calls.append(("log", dict(values), step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_gets_init_log_and_finish(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    save_dir = tmp_path / "wandb"
    writer = MetricsWriter(wandb_project="proj", wandb_exp_name="run-1", wandb_save_dir=str(save_dir),
                           config={"lr": 1e-3})
    writer.log_train(1, **STEPS[1])
    writer.log_train(2, **STEPS[2])
    writer.log_eval(2, 2.0, 7.5)
    writer.text("ignored", "by W&B")
    writer.close()
    writer.close()  # a second close does nothing
    assert save_dir.is_dir()
    assert fake.calls == [
        ("init", "proj", "run-1", str(save_dir), {"lr": 1e-3}),
        ("log", {"lm loss": 2.5, "learning-rate": 1e-3, "grad-norm": 0.75, "tokens-per-sec": 1000.0,
                 "load_balancing_loss": 1.25, "z_loss": 0.125, "mtp_1 loss": 2.75,
                 "mem-max-rss-bytes": 4096.0}, 1),
        ("log", {"lm loss": 2.25, "learning-rate": 2e-3, "tokens-per-sec": 1500.0, "loss-scale": 65536.0,
                 "load_balancing_loss": 1.0, "z_loss": 0.25, "mtp_1 loss": 2.5,
                 "mem-max-rss-bytes": 8192.0}, 2),
        ("log", {"lm loss validation": 2.0, "lm loss validation ppl": 7.5}, 2),
        ("finish",),
    ]


def test_missing_packages_and_bad_values_raise(tmp_path, monkeypatch):
    # None in sys.modules makes the import fail as for an absent package
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")] + [
        "tensorboard", "torch.utils.tensorboard"
    ]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=r"^--tensorboard-dir needs the tensorboard package "
                                         r"\(pip install tensorboard\)$"):
        MetricsWriter(tensorboard_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"^--wandb-project needs the wandb package \(pip install wandb\)$"):
        MetricsWriter(wandb_project="proj", wandb_exp_name="run")
    with pytest.raises(ValueError, match=r"^--wandb-project 'proj' needs --wandb-exp-name"):
        MetricsWriter(wandb_project="proj")
    for bad in (0, -1, 1.5, True):
        message = f"MetricsWriter: log_interval {bad!r}: expected an integer >= 1"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            MetricsWriter(log_interval=bad)
    with pytest.raises(ValueError, match=r"the tag 'lm loss' is given twice"):
        metrics.train_step_values(loss=1.0, learning_rate=None, grad_norm=None, tokens_per_s=None,
                                  moe_losses={"lm loss": 2.0})
    # no writer asked for: nothing is imported, every call is a no-op
    with MetricsWriter() as writer:
        writer.log_train(1, **STEPS[1])
        writer.text("config", "x")


def test_memory_stats_on_the_cpu_is_the_peak_rss():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats = metrics.memory_stats("cpu")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert list(stats) == ["mem-max-rss-bytes"]
    assert before <= stats["mem-max-rss-bytes"] <= after


def _ranks_worker(path: str) -> list:
    """Every rank builds the writer and logs; rank 0 alone writes (the W&B stand-in records the calls of
    its own process)."""
    import os

    fake = _FakeWandb()
    sys.modules["wandb"] = fake
    try:
        writer = MetricsWriter(tensorboard_dir=path, wandb_project="p", wandb_exp_name="r")
        writer.log_train(1, **STEPS[1])
        writer.close()
    finally:
        del sys.modules["wandb"]
    files = sorted(os.listdir(path)) if os.path.isdir(path) else []
    return [writer.active, [c[0] for c in fake.calls], files]


def test_only_global_rank_zero_writes(tmp_path):
    results = run_distributed(2, _ranks_worker, str(tmp_path / "tb"))
    assert results[0][:2] == [True, ["init", "log", "finish"]]
    assert results[1][:2] == [False, []]
    assert len(results[0][2]) == 1 and results[0][2][0].startswith("events.out.tfevents.")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_stats_on_cuda_is_the_allocator_counters():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats(device)
    x = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    stats = metrics.memory_stats(device)
    assert set(stats) == {"mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes",
                          "mem-allocated-count"}
    assert stats["mem-max-allocated-bytes"] >= stats["mem-allocated-bytes"] >= x.numel()
    assert stats["mem-allocated-count"] >= 1
