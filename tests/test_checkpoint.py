"""Sharded checkpoints: a run saved at one (tp, pp, dp) layout and resumed at another computes the
uninterrupted run's losses (float64, 1e-9); saves are atomic; checkpoints of another model or
with a corrupted file are refused on every rank; the unsharded conversion round-trips."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.test_gpt_training import SMALL, _train_gpt

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = ["--steps", "4", "--dtype", "float64"]


def _args(train_gpt, tp: int, pp: int, dp: int, *extra: str):
    return train_gpt.parse_args(SMALL + STEPS + ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), *extra])


def _run(layout, *extra):
    train_gpt = _train_gpt()
    return train_gpt.train(_args(train_gpt, *layout, *extra))


def _save_then_resume_worker(save_dir: str, layouts, dropout: str):
    """Trains 4 steps at tp 2 x pp 2 saving after step 2, then resumes that checkpoint at each of
    ``layouts`` (with this world size); returns the uninterrupted and the resumed losses."""
    full = _run((2, 2, 1), "--save", save_dir, "--save-interval", "2", "--dropout", dropout) if dist.get_world_size() == 4 else None
    ckpt = os.path.join(save_dir, "iter_0000002")
    resumed = {layout: _run(layout[:3], "--load", ckpt, "--dropout", dropout, *layout[3:]) for layout in layouts}
    return full, {k: (v["start_step"], v["losses"]) for k, v in resumed.items()}


@pytest.fixture(scope="module")
def saved_at_tp2_pp2(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("ckpt") / "run")
    layouts = [(2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2)]
    results = run_distributed(4, _save_then_resume_worker, save_dir, layouts, "0.0")
    full, resumed = results[0]
    for r in results[1:]:  # every rank reports the same global losses
        assert r[1] == resumed
    return save_dir, full, resumed


def _assert_resumed_equal(full_losses, start, losses):
    assert start == 2 and len(losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(full_losses[2:]), rtol=1e-9, atol=0)


def test_resume_at_other_layouts_matches_uninterrupted(saved_at_tp2_pp2):
    save_dir, full, resumed = saved_at_tp2_pp2
    assert len(full["losses"]) == 4 and full["losses"][-1] < full["losses"][0]
    for layout, (start, losses) in resumed.items():
        _assert_resumed_equal(full["losses"], start, losses)
    # the serial run (one process) resumes the same checkpoint
    ((_, serial),) = run_distributed(1, _save_then_resume_worker, save_dir, [(1, 1, 1)], "0.0")
    _assert_resumed_equal(full["losses"], *serial[(1, 1, 1)])
    # the final save (after step 4) is the newest
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "4"
    marker = json.load(open(os.path.join(save_dir, "iter_0000002", "checkpoint.json")))
    assert marker["iteration"] == 2 and marker["layout"] == {"tp": 2, "pp": 2, "dp": 1, "vpp": 1}
    assert marker["metadata"]["data"]["consumed_samples"] == 16


def test_same_layout_restores_rng_streams(tmp_path):
    # With dropout the losses depend on every random stream; they equal the uninterrupted run's
    # only if the tracker's and the CPU generator's states are restored.
    (full, resumed), *_ = run_distributed(
        4, _save_then_resume_worker, str(tmp_path / "run"), [(2, 2, 1), (2, 2, 1, "--no-load-rng")], "0.1"
    )
    _assert_resumed_equal(full["losses"], *resumed[(2, 2, 1)])
    start, fresh_streams = resumed[(2, 2, 1, "--no-load-rng")]
    assert start == 2 and abs(fresh_streams[0] - full["losses"][2]) > 1e-6
