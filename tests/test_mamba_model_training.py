"""examples/train_gpt.py with a Mamba-2 hybrid (``--hybrid-override-pattern "M*ME"``: Mamba-2,
attention, Mamba-2, routed experts; Megatron-core's MambaModel) trained at (tp, pp, ep, dp) =
(2,1,1,1) with sequence parallelism, (1,2,1,1), (1,2,1,1) interleaved (which Megatron-core's
MambaStack refuses), (1,1,2,2), and (1,1,1,2) with the distributed optimizer
and with fully sharded data parallelism (optim_grads_params; also built on the meta device)
equals the serial run in float64: losses, grad norms and every final weight; the flags' refusals."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_train_gpt
from tests.distributed import run_distributed
from tests.test_deepseek_training import _train
from tests.test_gated_delta_net_training import LAYOUTS, serial_block_order
from tests.test_moe_training import _merged

HEADS, P, GROUPS, N = 4, 4, 2, 4
BASE = [
    "--arch", "llama", "--layers", "4", "--hidden", "16", "--heads", "2", "--ffn-hidden", "12",
    "--hybrid-override-pattern", "M*ME", "--mamba-state-dim", str(N), "--mamba-head-dim", str(P),
    "--mamba-num-groups", str(GROUPS), "--mamba-num-heads", str(HEADS),
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--seq-len", "8", "--micro-batch-size", "2", "--global-batch-size", "8", "--steps", "3", "--lr", "1e-2",
    "--clip-grad", "0.5", "--dtype", "float64", "--no-progress", "--plot", "",
]


def _serial_order(name: str, value: list, tp: int) -> list:
    """The mixer's blocks: [z, x, B, C, dt] of in_proj, [x, B, C] of conv1d."""
    inner, groups = HEADS * P, GROUPS * N
    if name.endswith("mixer.in_proj.weight"):
        return serial_block_order(value, [inner, inner, groups, groups, HEADS], tp)
    if name.endswith("mixer.conv1d.weight") or name.endswith("mixer.conv1d.bias"):
        return serial_block_order(value, [inner, groups, groups], tp)
    return value


def _runs(layouts: list) -> dict:
    return _train(layouts, BASE, LAYOUTS)


def test_hybrid_mamba_model_trains_like_serial_in_every_layout():
    (serial,) = run_distributed(1, _runs, [(1, 1, 1, 1)])
    ref_losses, _, ref_norms, ref_weights = serial[(1, 1, 1, 1)]
    assert ref_losses[-1] < ref_losses[0] and all(n > 0 for n in ref_norms), (ref_losses, ref_norms)
    assert "decoder.layers.0.mixer.A_log" in ref_weights and "decoder.layers.2.mixer.D" in ref_weights
    assert "decoder.layers.1.self_attention.query_key_value.weight" in ref_weights
    assert not any(n.startswith("decoder.layers.1.mlp") for n in ref_weights)  # attention only
    assert "layer 4 expert bias" in ref_weights  # the E layer: experts only
    layouts = [layout for layout in LAYOUTS if layout != (1, 1, 1, 1)]
    results = _merged(run_distributed(2, _runs, layouts, timeout=900))
    for layout in layouts:
        losses, _, norms, weights = results[layout]
        for what, got, want in (("losses", losses, ref_losses), ("grad norms", norms, ref_norms)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-9, atol=0,
                                       msg=lambda m: f"{layout} {what}: {m}")
        assert set(weights) == set(ref_weights), (layout, set(weights) ^ set(ref_weights))
        for name, value in ref_weights.items():
            got = _serial_order(name, weights[name], layout[0])
            torch.testing.assert_close(torch.tensor(got), torch.tensor(value), rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"{layout} {name}: {m}")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hybrid-override-pattern", "M*M*", "--save", "x"], "--save with a Mamba-2 hybrid"),
        (["--hybrid-override-pattern", "M*M*", "--cp", "2"],
         "--cp 2 with a Mamba-2 hybrid: not supported yet"),
    ],
)
def test_bad_flags_are_refused(argv, message):
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(["--arch", "llama", "--layers", "4", "--hidden", "16", "--heads", "2",
                                 "--seq-len", "8", "--tp", "1", "--pp", "1"] + argv)
    with pytest.raises(ValueError, match=message):
        train_gpt.check_args(args, 2)
