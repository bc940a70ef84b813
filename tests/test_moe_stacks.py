"""examples/train_gpt.py with two mixture-of-experts stacks, trained at (tp, pp, ep, dp) = (2,1,1,1)
with sequence parallelism, (1,2,1,1), (1,1,2,1), (1,1,1,2) with the distributed optimizer and
(2,1,2,1) with sequence parallelism (expert tensor parallelism 2), the gpt-oss-style stack also at
cp 2, equal to the serial run in float64 (per-step losses and auxiliary losses, gradient norms,
final weights with the experts' biases and the attention sinks), each layout with one expert
implementation and one dispatcher, both at tp 2 x ep 2:

* DeepSeek-style: two dense layers, then two MoE layers with a shared expert, group-limited
  sigmoid routing with the expert bias and the scaling factor, the per-sequence balance loss and
  the z-loss (at pp 2 a stage of dense layers only and one of MoE layers only);
* gpt-oss-style: biases everywhere (the router's and the experts'), quick-GEGLU experts with the
  linear offset and a clamp that binds, top-k softmax routing, a sliding window (3 of the 8
  tokens) on the first layer and full attention on the second, learned attention sinks.

And a checkpoint of the DeepSeek-style stack saved at ep 2 resumes at ep 1 and at pp 2 (the keys
per layer: its layers differ) to the uninterrupted losses; the refusals of the new flags.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import load_train_gpt
from tests.distributed import run_distributed
from tests.test_moe_training import TINY, _check_messages, _full_weights, _merged, ps

STACKS = {
    "deepseek": ["--arch", "llama", "--ffn-hidden", "12", "--layers", "4",
                 "--moe-layer-freq", "([0]*2+[1]*2)",
                 "--num-experts", "8", "--moe-router-topk", "4", "--moe-router-num-groups", "4",
                 "--moe-router-group-topk", "2", "--moe-router-score-function", "sigmoid",
                 "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
                 "--moe-router-topk-scaling-factor", "2.5", "--moe-shared-expert-intermediate-size", "8",
                 "--moe-ffn-hidden-size", "6", "--moe-router-load-balancing-type", "seq_aux_loss",
                 "--moe-z-loss-coeff", "1e-3"],
    "gpt-oss": ["--arch", "llama", "--ffn-hidden", "12", "--add-bias-linear", "--quick-geglu",
                "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "0.05", "--num-experts", "4",
                "--moe-router-topk", "2", "--moe-ffn-hidden-size", "6", "--window-size", "3",
                "--window-attn-skip-freq", "2", "--softmax-type", "learnable"],
}
GROUPED = ["--moe-grouped-gemm"]
ALLGATHER, ALLTOALL = (["--moe-token-dispatcher-type", kind] for kind in ("allgather", "alltoall"))
SP = ["--sequence-parallel"]
DIST_OPT = ["--use-distributed-optimizer"]
# (tp, pp, ep, dp) -> {stack: flags}
WORLD_2 = {
    (2, 1, 1, 1): {"deepseek": ["--tp", "2", *SP, *GROUPED, *ALLGATHER],
                   "gpt-oss": ["--tp", "2", *SP, *ALLTOALL]},
    (1, 2, 1, 1): {"deepseek": ["--pp", "2", *ALLTOALL], "gpt-oss": ["--pp", "2", *GROUPED, *ALLGATHER]},
    (1, 1, 2, 1): {"deepseek": ["--ep", "2", *GROUPED, *ALLTOALL], "gpt-oss": ["--ep", "2", *ALLGATHER]},
    (1, 1, 1, 2): {"deepseek": [*DIST_OPT, *ALLGATHER], "gpt-oss": [*DIST_OPT, *GROUPED, *ALLTOALL]},
    "cp 2": {"gpt-oss": ["--cp", "2", *ALLTOALL]},  # the window crosses the ranks' chunks
}
TP2_EP2 = ["--tp", "2", *SP, "--ep", "2"]
WORLD_4 = {
    (2, 1, 2, 1): {"deepseek": [*TP2_EP2, *GROUPED, *ALLTOALL], "gpt-oss": [*TP2_EP2, *ALLTOALL]},
    (2, 1, 2, 1, "other"): {"deepseek": [*TP2_EP2, *ALLGATHER], "gpt-oss": [*TP2_EP2, *GROUPED, *ALLGATHER]},
}
SERIAL = {"deepseek": [], "gpt-oss": []}


def _argv(stack: str, flags: list[str]) -> list[str]:
    return TINY + ["--tp", "1", "--pp", "1"] + STACKS[stack] + flags


def _train(runs: list[tuple[str, str, list[str]]]) -> dict:
    """Per (layout, stack): losses, auxiliary losses, grad norms, final weights (this rank's)."""
    train_gpt = load_train_gpt()
    built, build = [], train_gpt.build_model
    train_gpt.build_model = lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    weights, destroy = [], ps.destroy_model_parallel

    def gather_then_destroy() -> None:
        weights.append(_full_weights(built[-1]))
        destroy()

    train_gpt.parallel_state = type(ps)("parallel_state")
    train_gpt.parallel_state.__dict__.update(vars(ps))
    train_gpt.parallel_state.destroy_model_parallel = gather_then_destroy
    out = {}
    for layout, stack, flags in runs:
        log = train_gpt.train(train_gpt.parse_args(_argv(stack, flags)))
        aux = [[d[name] for name in sorted(d)] for d in log["aux_losses"]]
        out[(layout, stack)] = (log["losses"], aux, log["grad_norms"], weights[-1])
    return out


@pytest.fixture(scope="module")
def serial():
    (ref,) = run_distributed(1, _train, [("serial", stack, flags) for stack, flags in SERIAL.items()])
    deepseek = ref[("serial", "deepseek")]
    assert [len(step) for step in deepseek[1]] == [2, 2, 2]  # seq_load_balancing_loss, z_loss
    assert all(v > 0 for step in deepseek[1] for v in step)
    gpt_oss = ref[("serial", "gpt-oss")][3]
    assert any(abs(v) > 1e-4 for v in gpt_oss["decoder.layers.0.mlp.experts.0.b2"])  # the biases trained
    assert "decoder.layers.0.mlp.router.bias" in gpt_oss
    assert "decoder.layers.1.self_attention.softmax_offset" in gpt_oss  # the learned sinks
    assert not any(".mlp.experts." in name for name in deepseek[3] if name.startswith("decoder.layers.0."))
    return ref


def _assert_equal_serial(serial: dict, results: dict) -> None:
    for (layout, stack), (losses, aux, norms, weights) in results.items():
        ref_losses, ref_aux, ref_norms, ref_weights = serial[("serial", stack)]
        label = f"{stack} (tp, pp, ep, dp)={layout}"
        for what, got, want in (("losses", losses, ref_losses), ("aux losses", aux, ref_aux),
                                ("grad norms", norms, ref_norms)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-9, atol=0,
                                       msg=lambda m: f"{label} {what}: {m}")
        assert len(ref_weights) > 10 and set(ref_weights) == set(weights), (
            label, set(ref_weights) ^ set(weights))
        for name, value in ref_weights.items():
            torch.testing.assert_close(torch.tensor(weights[name]), torch.tensor(value), rtol=1e-9,
                                       atol=1e-12, msg=lambda m: f"{label} {name}: {m}")


def _runs(table: dict) -> list[tuple]:
    return [(layout, stack, flags) for layout, stacks in table.items() for stack, flags in stacks.items()]


@pytest.mark.slow  # a 2-rank group, 9 trainings
def test_stacks_world_2_train_like_serial(serial):
    results = _merged(run_distributed(2, _train, _runs(WORLD_2), timeout=900))
    assert len(results) == 9
    _assert_equal_serial(serial, results)


@pytest.mark.slow  # a 4-rank group, 4 trainings
def test_stacks_world_4_train_like_serial(serial):
    results = _merged(run_distributed(4, _train, _runs(WORLD_4), timeout=900))
    assert len(results) == 4
    _assert_equal_serial(serial, results)


def _checkpoint_worker(save_dir: str) -> tuple[list[float], dict]:
    """The DeepSeek-style stack: 4 steps at ep 2 saving after step 2, then that checkpoint resumed
    at ep 1 (dp 2) and at pp 2 (a dense stage and an MoE stage)."""
    train_gpt = load_train_gpt()

    def run(*flags: str) -> dict:
        argv = _argv("deepseek", ["--steps", "4", "--use-distributed-optimizer", *flags])
        return train_gpt.train(train_gpt.parse_args(argv))

    full = run("--ep", "2", *GROUPED, "--save", save_dir, "--save-interval", "2")["losses"]
    ckpt = os.path.join(save_dir, "iter_0000002")
    resumed = {}
    for name, flags in {"ep 1": [], "pp 2": ["--pp", "2", *ALLTOALL]}.items():
        log = run(*flags, "--load", ckpt)
        resumed[name] = (log["start_step"], log["losses"])
    return full, resumed


@pytest.mark.slow  # a 2-rank group, 3 trainings
def test_deepseek_checkpoint_resumes_at_ep_1_and_pp_2(tmp_path):
    full, resumed = run_distributed(2, _checkpoint_worker, str(tmp_path / "run"), timeout=900)[0]
    assert len(full) == 4
    for name, (start, losses) in resumed.items():
        assert start == 2 and len(losses) == 2, name
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(full[2:]), rtol=1e-9, atol=0,
                                   msg=lambda m: f"{name}: {m}")


BAD = [
    (["--moe-layer-freq", "([0]*2+[1]*2)"], "--moe-layer-freq [0, 0, 1, 1] needs --num-experts"),
    (["--num-experts", "4", "--layers", "2", "--moe-layer-freq", "[0,1,1]"],
     "--moe-layer-freq [0, 1, 1] must list a 0 (dense) or 1 (MoE) for each of the --layers 2 layers"),
    (["--num-experts", "4", "--layers", "2", "--moe-layer-freq", "[0]*2"], "with at least one 1"),
    (["--num-experts", "4", "--moe-layer-freq", "0"],
     "--moe-layer-freq must be >= 1 or a list of 0/1, got 0"),
    (["--num-experts", "4", "--moe-router-group-topk", "2"],
     "--moe-router-group-topk (2) needs --moe-router-num-groups"),
    (["--num-experts", "4", "--moe-router-num-groups", "2"],
     "--moe-router-num-groups (2) needs --moe-router-group-topk"),
    (["--num-experts", "6", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2"],
     "--num-experts (6) must be divisible by --moe-router-num-groups (4)"),
    (["--num-experts", "4", "--moe-router-num-groups", "2", "--moe-router-group-topk", "3"],
     "--moe-router-group-topk (3) must not exceed --moe-router-num-groups (2)"),
    (["--num-experts", "8", "--moe-router-topk", "4", "--moe-router-num-groups", "4",
      "--moe-router-group-topk", "1"],
     "--moe-router-topk (4) is not reachable with --moe-router-group-topk (1) groups of 2 experts"),
    (["--num-experts", "4", "--moe-router-topk-scaling-factor", "0"],
     "--moe-router-topk-scaling-factor must be a finite number > 0, got 0.0"),
    (["--num-experts", "4", "--tp", "2", "--sequence-parallel", "--moe-shared-expert-intermediate-size", "7"],
     "--moe-shared-expert-intermediate-size 7 must be >= 1 and divisible by --tp 2"),
    (["--moe-shared-expert-intermediate-size", "8"],
     "--moe-shared-expert-intermediate-size 8 needs --num-experts"),
    (["--arch", "gpt", "--glu-linear-offset", "1"],
     "--glu-linear-offset and --activation-func-clamp-value shape a gated MLP: use --arch llama or "
     "--quick-geglu"),
    (["--arch", "llama", "--activation-func-clamp-value", "0"],
     "--activation-func-clamp-value must be a finite number > 0, got 0.0"),
    (["--arch", "llama", "--activation-func-clamp-value", "inf"],
     "--activation-func-clamp-value must be a finite number > 0, got inf"),
    (["--arch", "llama", "--glu-linear-offset", "nan"],
     "--glu-linear-offset must be a finite number, got nan"),
]


def test_bad_stack_arguments_raise():
    messages = _check_messages([argv for argv, _ in BAD], world_size=2)
    for message, (argv, expected) in zip(messages, BAD):
        assert expected in message, (argv, message)


def test_moe_layer_freq_parses_as_megatron_lm():
    from megatron_ext.training.arguments_model import moe_freq_type

    assert moe_freq_type("2") == 2
    assert moe_freq_type("([0]*1+[1]*3)") == [0, 1, 1, 1]
    assert moe_freq_type("[0]*3+[1]*58") == [0] * 3 + [1] * 58
    assert moe_freq_type("([1]*3+[0]*2)*2") == [1, 1, 1, 0, 0] * 2
    messages = _check_messages([["--num-experts", "4", "--moe-layer-freq", bad] for bad in
                                ("[__import__('os')]", "[0]*", "two", "(1)+[1]")], world_size=2)
    assert messages == [
        "--moe-layer-freq \"[__import__('os')]\" may hold only digits , [ ] ( ) + *",
        "--moe-layer-freq '[0]*' does not evaluate: invalid syntax (<string>, line 1)",
        "--moe-layer-freq 'two' is not an int or a list expression",
        "--moe-layer-freq '(1)+[1]' does not evaluate: unsupported operand type(s) for +: 'int' and 'list'",
    ]
