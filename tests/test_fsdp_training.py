"""The training program under fully sharded data parallelism (``--use-megatron-fsdp``): each
sharding strategy, with tensor (sequence-parallel), context, pipeline (1F1B, interleaved, ZB-H1)
and expert parallelism (expert tensor parallelism included), and with full and selective
recomputation, trains every ``--arch``: a GPT (its
embedding tied to the output layer across pipeline stages), a Llama model with two
multi-token-prediction depths and a DeepSeek-V3-style model (multi-latent attention, routed
experts, a multi-token-prediction depth) to the serial run's losses, grad norms and final weights
in float64. Every run has several micro-batches per rank: a micro-batch's gradient reduced twice,
or not at all, moves every weight."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_deepseek_training import DEEPSEEK, LLAMA_MTP, MTP_RTOL, _train
from tests.test_moe_training import _merged

pytestmark = pytest.mark.slow  # 75 trainings of 3 steps at 4 ranks

STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--data-parallel-sharding-strategy"]
# 16 rows a step: 2 micro-batches of 2 per rank at dp 4, 4 at dp 2, 8 serially.
BASES = {
    "gpt": ["--arch", "gpt", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--micro-batch-size", "2",
            "--steps", "3", "--lr", "1e-2", "--clip-grad", "0.5", "--dtype", "float64", "--no-progress",
            "--plot", "", "--layers", "4", "--global-batch-size", "16"],  # the tied embedding across stages
    "deepseek": DEEPSEEK + ["--layers", "4", "--global-batch-size", "16"],
    "llama": LLAMA_MTP + ["--layers", "4", "--global-batch-size", "16"],
}
# (tp, cp, pp, ep, dp) and the schedule -> flags; the world is tp x cp x pp x dp = 4.
LAYOUTS = {
    ((1, 1, 1, 1, 4), "1f1b"): ["--tp", "1", "--pp", "1"],
    ((2, 1, 1, 1, 2), "1f1b"): ["--tp", "2", "--pp", "1", "--sequence-parallel"],
    ((1, 2, 1, 1, 2), "1f1b"): ["--tp", "1", "--pp", "1", "--cp", "2"],
    ((1, 1, 2, 1, 2), "1f1b"): ["--tp", "1", "--pp", "2"],
    ((1, 1, 2, 1, 2), "interleaved"): ["--tp", "1", "--pp", "2", "--virtual-pipeline", "2"],
    ((1, 1, 2, 1, 2), "zb-h1"): ["--tp", "1", "--pp", "2", "--schedule", "zb-h1"],
    ((1, 1, 1, 2, 2), "1f1b"): ["--tp", "1", "--pp", "1", "--ep", "2", "--etp", "2"],
    # recomputation: a unit's forward runs again inside its backward
    ((1, 1, 2, 1, 2), "full recompute"): ["--tp", "1", "--pp", "2", "--recompute"],
    ((2, 1, 1, 1, 2), "selective recompute"): ["--tp", "2", "--pp", "1", "--sequence-parallel",
                                               "--recompute-activations"],
}
SERIAL = {"serial": ["--tp", "1", "--pp", "1"]}


def _runs(arch: str, runs: list) -> dict:
    flags = {}
    for layout, schedule, strategy in runs:
        flags[(layout, schedule, strategy)] = LAYOUTS[(layout, schedule)] + FSDP + [strategy]
    return _train(list(flags), BASES[arch], flags)


def _serial(archs: list) -> dict:
    return {arch: _train(["serial"], BASES[arch], SERIAL)["serial"] for arch in archs}


@pytest.mark.parametrize("arch", sorted(BASES))
def test_every_strategy_and_layout_trains_like_serial(arch):
    (serial,) = run_distributed(1, _serial, [arch])
    ref_losses, ref_mtp, ref_norms, ref_weights = serial[arch]
    assert ref_losses[-1] < ref_losses[0] and all(n > 0 for n in ref_norms), (ref_losses, ref_norms)
    runs = [(layout, schedule, s) for (layout, schedule) in LAYOUTS for s in STRATEGIES]
    if arch != "deepseek":  # no experts: the expert layout is the dp 4 one
        runs = [r for r in runs if r[0][3] == 1]
    results = _merged(run_distributed(4, _runs, arch, runs, timeout=1500))
    assert len(results) == len(runs)
    for run, (losses, mtp, norms, weights) in results.items():
        for what, got, want, rtol in (("losses", losses, ref_losses, 1e-9),
                                      ("mtp losses", mtp, ref_mtp, MTP_RTOL),
                                      ("grad norms", norms, ref_norms, 1e-9)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=rtol, atol=0,
                                       msg=lambda m: f"{arch} {run} {what}: {m}")
        if "output_layer.weight" in set(weights) - set(ref_weights):  # the last stage's tied copy
            tied = [n for n in ref_weights if n.endswith("word_embeddings.weight")]
            torch.testing.assert_close(torch.tensor(weights.pop("output_layer.weight")),
                                       torch.tensor(ref_weights[tied[0]]), rtol=1e-9, atol=1e-12)
        assert set(weights) == set(ref_weights), (run, set(weights) ^ set(ref_weights))
        for name, value in ref_weights.items():
            torch.testing.assert_close(torch.tensor(weights[name]), torch.tensor(value), rtol=1e-9,
                                       atol=1e-12, msg=lambda m: f"{arch} {run} {name}: {m}")


META = ["--init-model-with-meta-device"]
# Built on the meta device and drawn unit by unit as FullyShardedDataParallel shards it.
META_RUNS = {
    "gpt": [((1, 1, 2, 1, 2), "1f1b"), ((1, 1, 2, 1, 2), "interleaved")],  # the tied copy across stages
    "llama": [((2, 1, 1, 1, 2), "1f1b")],
    "deepseek": [((1, 1, 1, 2, 2), "1f1b"), ((1, 1, 2, 1, 2), "1f1b")],
}


def _meta_runs(runs: list) -> dict:
    out = {}
    for arch, layout, schedule in runs:
        run = (arch, layout, schedule)
        flags = {run: LAYOUTS[(layout, schedule)] + FSDP + ["optim_grads_params"] + META}
        out.update(_train(list(flags), BASES[arch], flags))
    return out


def test_meta_device_model_trains_like_serial():
    """``--init-model-with-meta-device``: the model no rank ever holds whole trains to the serial
    run's losses, grad norms and final weights (the weights drawn are the serial model's)."""
    serial = run_distributed(1, _serial, sorted(META_RUNS))[0]
    runs = [(arch, layout, schedule) for arch in sorted(META_RUNS) for layout, schedule in META_RUNS[arch]]
    results = _merged(run_distributed(4, _meta_runs, runs, timeout=1500))
    assert len(results) == len(runs)
    for (arch, layout, schedule), (losses, mtp, norms, weights) in results.items():
        ref_losses, ref_mtp, ref_norms, ref_weights = serial[arch]
        for what, got, want, rtol in (("losses", losses, ref_losses, 1e-9),
                                      ("mtp losses", mtp, ref_mtp, MTP_RTOL),
                                      ("grad norms", norms, ref_norms, 1e-9)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=rtol, atol=0,
                                       msg=lambda m: f"{arch} {layout} {schedule} {what}: {m}")
        if "output_layer.weight" in set(weights) - set(ref_weights):  # the last stage's tied copy
            tied = [n for n in ref_weights if n.endswith("word_embeddings.weight")]
            torch.testing.assert_close(torch.tensor(weights.pop("output_layer.weight")),
                                       torch.tensor(ref_weights[tied[0]]), rtol=1e-9, atol=1e-12)
        assert set(weights) == set(ref_weights), (arch, layout, set(weights) ^ set(ref_weights))
        for name, value in ref_weights.items():
            torch.testing.assert_close(torch.tensor(weights[name]), torch.tensor(value), rtol=1e-9,
                                       atol=1e-12, msg=lambda m: f"{arch} {layout} {name}: {m}")
