"""examples/train_gpt.py with Gated DeltaNet layers (``--experimental-attention-variant
gated_delta_net --linear-attention-freq 2``: linear attention, then full attention with its output
gated (``--attention-output-gate``), twice) and routed
experts trained at (tp, pp, ep, dp) = (2,1,1,1) with sequence parallelism, (1,2,1,1), (1,2,1,1)
interleaved, (1,1,2,2), and (1,1,1,2) with the distributed optimizer
and with fully sharded data parallelism (optim_grads_params; also built on the meta device)
equals the serial run in float64:
losses, grad norms and every final weight; the flags' refusals."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_train_gpt
from tests.distributed import run_distributed
from tests.test_deepseek_training import _train
from tests.test_moe_training import _merged

KEY_HEADS, VALUE_HEADS, DK, DV = 2, 4, 4, 4
BASE = [
    "--arch", "llama", "--layers", "4", "--hidden", "16", "--heads", "2", "--ffn-hidden", "12",
    "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
    "--attention-output-gate",  # Qwen3-Next's full-attention layers
    "--linear-key-head-dim", str(DK), "--linear-value-head-dim", str(DV),
    "--linear-num-key-heads", str(KEY_HEADS), "--linear-num-value-heads", str(VALUE_HEADS),
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--seq-len", "8", "--micro-batch-size", "2", "--global-batch-size", "8", "--steps", "3", "--lr", "1e-2",
    "--clip-grad", "0.5", "--dtype", "float64", "--no-progress", "--plot", "",
]
LAYOUTS = {  # (tp, pp, ep, dp) -> flags; the world is tp x pp x dp
    (1, 1, 1, 1): ["--tp", "1", "--pp", "1"],
    (2, 1, 1, 1): ["--tp", "2", "--pp", "1", "--sequence-parallel"],
    (1, 2, 1, 1): ["--tp", "1", "--pp", "2"],
    (1, 2, 1, 1, "vp"): ["--tp", "1", "--pp", "2", "--virtual-pipeline", "2"],
    (1, 1, 2, 2): ["--tp", "1", "--pp", "1", "--ep", "2"],
    (1, 1, 1, 2): ["--tp", "1", "--pp", "1", "--use-distributed-optimizer"],
    (1, 1, 1, 2, "fsdp"): ["--tp", "1", "--pp", "1", "--use-distributed-optimizer", "--use-megatron-fsdp",
                           "--data-parallel-sharding-strategy", "optim_grads_params"],
    (1, 1, 1, 2, "fsdp meta"): ["--tp", "1", "--pp", "1", "--use-distributed-optimizer",
                                "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                "optim_grads_params", "--init-model-with-meta-device"],
}


def serial_block_order(value: list, blocks: list[int], tp: int) -> list:
    """A block-split weight gathered rank after rank (each rank holds its part of every block, as the
    recurrent layers' in_proj and conv1d are split) put back in its serial block order."""
    parts = torch.tensor(value).chunk(tp)
    split = [torch.split(p, [b // tp for b in blocks]) for p in parts]
    return torch.cat([torch.cat([s[i] for s in split]) for i in range(len(blocks))]).tolist()


def _serial_order(name: str, value: list, tp: int) -> list:
    """Gated DeltaNet's blocks: [q, k, v, z, beta, alpha] of in_proj, [q, k, v] of conv1d."""
    qk, v = KEY_HEADS * DK, VALUE_HEADS * DV
    if name.endswith("self_attention.in_proj.weight"):
        return serial_block_order(value, [qk, qk, v, v, VALUE_HEADS, VALUE_HEADS], tp)
    if name.endswith("self_attention.conv1d.weight"):
        return serial_block_order(value, [qk, qk, v], tp)
    return value


def _runs(layouts: list) -> dict:
    return _train(layouts, BASE, LAYOUTS)


def test_hybrid_model_trains_like_serial_in_every_layout():
    (serial,) = run_distributed(1, _runs, [(1, 1, 1, 1)])
    ref_losses, _, ref_norms, ref_weights = serial[(1, 1, 1, 1)]
    assert ref_losses[-1] < ref_losses[0] and all(n > 0 for n in ref_norms), (ref_losses, ref_norms)
    assert "decoder.layers.0.self_attention.A_log" in ref_weights  # layer 1: linear attention
    assert "decoder.layers.1.self_attention.query_key_value.weight" in ref_weights  # layer 2: full attention
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


VARIANT = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--experimental-attention-variant", "gated_delta_net"],
         "--experimental-attention-variant gated_delta_net and --linear-attention-freq go together"),
        (["--linear-attention-freq", "2"],
         "--experimental-attention-variant gated_delta_net and --linear-attention-freq go together"),
        (VARIANT + ["--save", "x"], "--save with --experimental-attention-variant gated_delta_net"),
        (VARIANT + ["--cp", "2"],
         "--cp 2 with --experimental-attention-variant gated_delta_net: not supported yet"),
    ],
)
def test_bad_flags_are_refused(argv, message):
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(["--arch", "llama", "--layers", "4", "--hidden", "16", "--heads", "2",
                                 "--seq-len", "8", "--tp", "1", "--pp", "1"] + argv)
    with pytest.raises(ValueError, match=message):
        train_gpt.check_args(args, 2)
