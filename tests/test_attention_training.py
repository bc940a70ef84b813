"""examples/train_gpt.py with sliding windows on alternate layers and learnable attention sinks:
Llama (rotary, grouped-query attention) at (tp, cp, pp, dp) = (2,1,1,1) with sequence parallelism,
(1,2,1,1) with every comm type (p2p with selective core_attn recomputation), (1,1,2,1) with full
recomputation and (1,1,1,2), each equal to the serial run in float64: per-step losses, gradient
norms and the final weights, the sinks included. The serial run itself differs from one without
the window and from one with the window on no layer, so the window and the sinks are in it. The
example's refusals of bad window flags."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_context_parallel_training import _bad_arguments_worker, _merged, _train

# A clipping threshold no gradient reaches: the gradient norm is computed, and compared, every step.
CLIP = ("--clip-grad", "1000")
ATTENTION = ("--window-size", "5", "--window-attn-skip-freq", "2", "--softmax-type", "learnable", *CLIP)
SERIAL = [
    ((1, 1, 1, 1), "p2p", ATTENTION),
    ((1, 1, 1, 1), "p2p", CLIP),
    # the window on no layer (every layer full attention), the sinks kept
    ((1, 1, 1, 1), "p2p", ("--window-size", "5", "--window-attn-skip-freq", "1", *ATTENTION[4:])),
]
WORLD_2 = [
    ((2, 1, 1, 1), "p2p", ATTENTION + ("--sequence-parallel",)),
    ((1, 2, 1, 1), "p2p", ATTENTION + ("--recompute-granularity", "selective")),
    ((1, 2, 1, 1), "all_gather", ATTENTION),
    ((1, 2, 1, 1), "a2a", ATTENTION),
    ((1, 1, 2, 1), "p2p", ATTENTION + ("--recompute",)),
    ((1, 1, 1, 2), "p2p", ATTENTION),
]


def _close(actual, expected, label: str, atol: float = 0.0) -> None:
    torch.testing.assert_close(
        torch.tensor(actual), torch.tensor(expected), rtol=1e-9, atol=atol, msg=lambda m: f"{label}: {m}"
    )


@pytest.mark.slow  # a serial and a 2-rank group, 9 short trainings
def test_windows_and_sinks_train_like_serial():
    (serial,) = run_distributed(1, _train, SERIAL, ["llama"])
    losses, norms, weights = serial[(SERIAL[0][0], "p2p", ATTENTION, "llama")]
    for other in SERIAL[1:]:
        assert serial[(*other, "llama")][0] != losses, other  # the window and the sinks change the run
    sinks = [name for name in weights if name.endswith("self_attention.softmax_offset")]
    assert len(sinks) == 4, sorted(weights)
    assert all(norm > 0 for norm in norms), norms
    results = _merged(run_distributed(2, _train, WORLD_2, ["llama"]))
    assert len(results) == len(WORLD_2)
    for (layout, comm, extra, _), (got_losses, got_norms, got_weights) in results.items():
        label = f"(tp, cp, pp, dp)={layout} {comm} {' '.join(extra)}"
        _close(got_losses, losses, f"{label} losses")
        _close(got_norms, norms, f"{label} grad norms")
        assert set(weights) <= set(got_weights), (label, set(weights) - set(got_weights))
        for name, value in weights.items():
            _close(got_weights[name], value, f"{label} {name}", atol=1e-12)


def test_bad_attention_arguments_raise_on_every_rank(tmp_path):
    cases = [
        (["--window-size", "0"], "--window-size must be >= 1 (the tokens a query sees, itself included)"),
        (["--window-attn-skip-freq", "2"], "--window-attn-skip-freq needs --window-size"),
        (["--window-size", "4", "--window-attn-skip-freq", "[1,0]"],
         "--window-attn-skip-freq [1, 0] must list 0 or 1 for each of the --layers 4 layers"),
        (["--window-size", "4", "--window-attn-skip-freq", "0"], "--window-attn-skip-freq must be >= 1"),
        (["--arch", "llama", "--softmax-type", "learnable", "--export-hf", "{tmp}"],
         "--export-hf writes Llama or Mistral configs, which have no attention sinks"),
    ]
    argv = [["--tp", "1", "--pp", "1", *(a.format(tmp=tmp_path / "hf") for a in args)] for args, _ in cases]
    for messages in run_distributed(2, _bad_arguments_worker, argv):
        for message, (_, expected) in zip(messages, cases):
            assert expected in message, (expected, message)
