"""Checkpoints of fully sharded runs (--use-megatron-fsdp): a run saved under FSDP loads under the
plain distributed optimizer and the reverse, and under FSDP at another data-parallel size, each
at another (tp, pp, dp) layout (two model chunks a rank and experts included), and continues with
the uninterrupted serial run's losses (float64, 1e-9); --export-hf of a fully sharded run writes
the tensors of the same run without FSDP; --no-load-optim starts 16-bit main copies from the
loaded weights, with and without FSDP."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import TIGHT, checkpoint_run
from tests.distributed import run_distributed

pytestmark = pytest.mark.slow  # trains the example GPT 22 times

FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--data-parallel-sharding-strategy"]
OGP, OG = [*FSDP, "optim_grads_params"], [*FSDP, "optim_grads"]
DISTOPT = ["--use-distributed-optimizer"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
CKPT = "iter_0000002"

# The runs saved after step 2 of 4: (model, layout, flags).
SAVES = {
    "fsdp dp4": ("dense", (1, 1, 4), OGP),
    "distopt tp2 pp2": ("dense", (2, 2, 1), DISTOPT),
    "fsdp pp2 vp2 dp2": ("dense", (1, 2, 2), [*OGP, "--virtual-pipeline", "2"]),  # two chunks a rank
    "fsdp moe ep2 dp4": ("moe", (1, 1, 4), [*MOE, *OGP, "--ep", "2"]),  # expert buckets too
}
# Each resumed from a saved run: (saved run, layout, flags).
RESUMES = {
    "fsdp dp4 -> distopt tp2 pp2": ("fsdp dp4", (2, 2, 1), DISTOPT),
    "fsdp dp4 -> fsdp optim_grads_params pp2 dp2": ("fsdp dp4", (1, 2, 2), OGP),
    "fsdp dp4 -> fsdp optim_grads tp2 dp2": ("fsdp dp4", (2, 1, 2), OG),
    "distopt tp2 pp2 -> fsdp optim_grads_params dp4": ("distopt tp2 pp2", (1, 1, 4), OGP),
    "distopt tp2 pp2 -> fsdp optim_grads pp2 dp2": ("distopt tp2 pp2", (1, 2, 2), OG),
    "fsdp pp2 vp2 dp2 -> distopt tp2 pp2": ("fsdp pp2 vp2 dp2", (2, 2, 1), DISTOPT),
    "fsdp moe ep2 dp4 -> distopt tp2 pp2":
        ("fsdp moe ep2 dp4", (2, 2, 1), [*MOE, *DISTOPT, "--sequence-parallel"]),
    "fsdp moe ep2 dp4 -> fsdp ep4 dp4": ("fsdp moe ep2 dp4", (1, 1, 4), [*MOE, *OGP, "--ep", "4"]),
    # the weights reach the shards from the model's loaded values alone
    "fsdp dp4 -> fsdp optim_grads_params pp2 dp2, no optimizer state":
        ("fsdp dp4", (1, 2, 2), [*OGP, "--no-load-optim"]),
    "fsdp dp4 -> distopt tp2 pp2, no optimizer state":
        ("fsdp dp4", (2, 2, 1), [*DISTOPT, "--no-load-optim"]),
}


def _serial_losses() -> dict[str, list[float]]:
    return {"dense": checkpoint_run((1, 1, 1))["losses"], "moe": checkpoint_run((1, 1, 1), *MOE)["losses"]}


def _fsdp_checkpoints_worker(tmp: str):
    """Trains and saves SAVES, resumes RESUMES, exports a Llama-shaped run with and without FSDP.
    Returns the saving runs' losses, the resumed runs' (start, losses) and the two exports'
    tensors (as lists)."""
    from safetensors.torch import load_file

    saved = {}
    for name, (_, layout, flags) in SAVES.items():
        save_dir = os.path.join(tmp, name.replace(" ", "_"))
        saved[name] = checkpoint_run(layout, *flags, "--save", save_dir, "--save-interval", "2")["losses"]
    resumed = {}
    for label, (name, layout, flags) in RESUMES.items():
        run = checkpoint_run(layout, *flags, "--load", os.path.join(tmp, name.replace(" ", "_"), CKPT))
        resumed[label] = (run["start_step"], run["losses"])
    exports = {}
    for label, flags in {"fsdp": OGP, "distopt": DISTOPT}.items():
        hf_dir = os.path.join(tmp, f"hf_{label}")
        checkpoint_run((1, 2, 2), "--arch", "llama", *flags, "--export-hf", hf_dir)
        tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
        exports[label] = {k: v.tolist() for k, v in tensors.items()}
    return saved, resumed, exports


@pytest.fixture(scope="module")
def fsdp_checkpoints(tmp_path_factory):
    (serial,) = run_distributed(1, _serial_losses)
    results = run_distributed(4, _fsdp_checkpoints_worker, str(tmp_path_factory.mktemp("fsdp_ckpt")))
    for r in results[1:]:  # every rank reports the same global losses
        assert r[:2] == results[0][:2]
    return serial, *results[0]


def test_saving_runs_match_serial(fsdp_checkpoints):
    serial, saved, _, _ = fsdp_checkpoints
    for losses in serial.values():
        assert len(losses) == 4 and losses[-1] < losses[0]
    for name, losses in saved.items():  # saving after step 2 changes nothing the run computes
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(serial[SAVES[name][0]]), rtol=1e-9,
                                   atol=0, msg=lambda m: f"{name}: {m}")


def test_resumed_across_sharding_and_layouts_match_serial(fsdp_checkpoints):
    serial, _, resumed, _ = fsdp_checkpoints
    dense = serial["dense"]
    fresh_adam = resumed.pop("fsdp dp4 -> distopt tp2 pp2, no optimizer state")[1]
    assert abs(fresh_adam[0] - dense[2]) <= 1e-9 * dense[2] and abs(fresh_adam[1] - dense[3]) > 1e-6
    for label, (start, losses) in resumed.items():
        assert start == 2 and len(losses) == 2, label
        # without the optimizer state: the same weights give the same first loss, a fresh Adam
        # another second step, the one it takes without FSDP
        model = SAVES[RESUMES[label][0]][0]
        expected = fresh_adam if label.endswith("no optimizer state") else serial[model][2:]
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(expected), rtol=1e-9, atol=0, msg=lambda m: f"{label}: {m}"
        )


def test_export_hf_of_fully_sharded_run_equals_unsharded(fsdp_checkpoints):
    *_, exports = fsdp_checkpoints
    fsdp, distopt = exports["fsdp"], exports["distopt"]
    assert sorted(fsdp) == sorted(distopt) and "model.layers.3.mlp.down_proj.weight" in fsdp
    for name, expected in distopt.items():
        # float64: the two runs reduce the same gradients in another order
        torch.testing.assert_close(
            torch.tensor(fsdp[name], dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
            msg=lambda m: f"{name}: {m}", **TIGHT,
        )


def _sixteen_bit_fresh_optimizer_worker(tmp: str) -> dict[str, float]:
    """bf16 runs at dp 4 saved after 2 steps, resumed with --no-load-optim, with and without
    FSDP: the largest difference, right after the load, between the optimizer's float32 main
    copies and the loaded weights they update."""
    from tests.conftest import SMALL, load_train_gpt

    out = {}
    for label, flags in {"distopt": DISTOPT, "fsdp": [*FSDP, "optim_grads_params"]}.items():
        base = SMALL + ["--bf16", "--tp", "1", "--pp", "1", "--dp", "4", *flags]
        train_gpt = load_train_gpt()
        train_gpt.train(train_gpt.parse_args(base + ["--steps", "2", "--save", os.path.join(tmp, label)]))
        train_gpt = load_train_gpt()
        resume, differences = train_gpt.resume, []

        def checked_resume(args, model, optimizer, scheduler, differences=differences, resume=resume):
            start = resume(args, model, optimizer, scheduler)
            differences += [(s.main - s.piece().float()).abs().max().item() for s in optimizer._slots]
            return start

        train_gpt.resume = checked_resume
        train_gpt.train(train_gpt.parse_args(base + ["--steps", "3", "--no-load-optim",
                                                     "--load", os.path.join(tmp, label, CKPT)]))
        assert differences, label
        out[label] = max(differences)
    return out


def test_no_load_optim_takes_main_params_from_loaded_weights(tmp_path):
    # As Megatron-LM's load_checkpoint: without the optimizer state, the main copies of 16-bit
    # weights start from the loaded weights, not from the weights the run was built with.
    (differences, *_) = run_distributed(4, _sixteen_bit_fresh_optimizer_worker, str(tmp_path))
    assert differences == {"distopt": 0.0, "fsdp": 0.0}
