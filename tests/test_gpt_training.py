"""The example training run computes the same per-step losses in every tp x pp x dp layout as
the serial run: within 1e-9 relative in float64 and 1e-5 in float32, with both schedules."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_ext import parallel_state as ps
from tests.conftest import SMALL, assert_losses_match, load_train_gpt, train_layouts
from tests.distributed import run_distributed

pytestmark = pytest.mark.slow  # trains the example GPT at many layouts

DTYPES = ["float64", "float32"]
SCHEDULES = ["1f1b", "gpipe"]


@pytest.fixture(scope="module")
def serial_losses():
    (ref,) = run_distributed(1, train_layouts, [(1, 1, 1)], DTYPES, SCHEDULES, [])
    losses = ref[(1, 1, 1, "float64", "1f1b")]
    assert len(losses) == 5 and losses[-1] < losses[0]  # it trains
    return ref


@pytest.mark.parametrize(
    "world,layouts",
    [
        (2, [(2, 1, 1), (1, 2, 1), (1, 1, 2)]),
        (4, [(2, 2, 1), (2, 1, 2), (1, 2, 2)]),
        (8, [(2, 2, 2)]),
    ],
)
def test_layouts_match_serial(serial_losses, world, layouts):
    results = run_distributed(world, train_layouts, layouts, DTYPES, SCHEDULES, [])
    for rank_result in results:  # every rank reports the global loss
        assert rank_result == results[0]
    assert_losses_match(serial_losses, results[0])


def test_recompute_and_dropout(serial_losses):
    # Recomputation replays the forward's RNG states, so with dropout the losses equal those of
    # the run without recomputation; without dropout both equal the serial losses.
    plain, recomputed = (
        run_distributed(4, train_layouts, [(2, 2, 1)], ["float64"], ["1f1b"], extra)[0][
            (2, 2, 1, "float64", "1f1b")
        ]
        for extra in (["--dropout", "0.1"], ["--dropout", "0.1", "--recompute"])
    )
    torch.testing.assert_close(torch.tensor(recomputed), torch.tensor(plain), rtol=1e-12, atol=0)
    assert plain != serial_losses[(1, 1, 1, "float64", "1f1b")]  # dropout did something


# --- virtual pipeline (interleaved 1F1B) -----------------------------------------------------------


def test_virtual_pipeline_layouts_match_serial(serial_losses):
    # Model chunks per stage: the interleaved schedule (and GPipe over the chunks) trains to the
    # serial losses; the tied embedding lives in chunk 0 of the first stage and the last chunk of
    # the last stage.
    vp = ["--virtual-pipeline", "2"]
    results = run_distributed(4, train_layouts, [(2, 2, 1), (1, 2, 2)], ["float64"], SCHEDULES, vp)
    for rank_result in results:
        assert rank_result == results[0]
    assert_losses_match(serial_losses, results[0])
    # Four stages of two chunks each (8 layers; 4 micro-batches) and three chunks of two stages.
    deep = ["--layers", "12"]
    (reference,) = run_distributed(1, train_layouts, [(1, 1, 1)], ["float64"], ["1f1b"], deep)
    for layouts, chunks in (([(1, 4, 1)], "3"), ([(1, 2, 2)], "3")):
        results = run_distributed(4, train_layouts, layouts, ["float64"], ["1f1b"],
                                  deep + ["--virtual-pipeline", chunks])
        assert_losses_match(reference, results[0])


# --- zero-bubble schedules ------------------------------------------------------------------------


def test_zero_bubble_schedules_match_serial(serial_losses):
    # ZB-H1 (one chunk per rank) and ZB-V (two chunks per rank in a V: rank 0 holds the embedding
    # and the loss) train to the serial losses, also with sequence parallelism, the distributed
    # optimizer and recomputation, whose weight gradients all wait for the W halves.
    zero_bubble = ["zb-h1", "zb-v"]
    results = run_distributed(4, train_layouts, [(2, 2, 1)], ["float64"], zero_bubble, [])
    for rank_result in results:
        assert rank_result == results[0]
    assert_losses_match(serial_losses, results[0])
    dp2 = run_distributed(4, train_layouts, [(1, 2, 2)], ["float64"], ["zb-h1"], [])
    assert_losses_match(serial_losses, dp2[0])
    extra = ["--sequence-parallel", "--use-distributed-optimizer", "--recompute"]
    combined = run_distributed(4, train_layouts, [(2, 2, 1)], ["float64"], zero_bubble, extra)
    assert_losses_match(serial_losses, combined[0])


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (
            ["--pp", "2", "--layers", "6", "--virtual-pipeline", "2"],
            2,
            "--layers 6 is not divisible by --pp x --virtual-pipeline = 2 x 2",
        ),
        (
            ["--pp", "1", "--virtual-pipeline", "2"],
            1,
            "--virtual-pipeline 2 needs a value >= 1 and --pp >= 2",
        ),
        (["--tp", "2", "--heads", "3", "--hidden", "48"], 2, "--heads 3 is not divisible by --tp 2"),
        (["--pp", "2", "--layers", "3"], 2, "--layers 3 is not divisible by --pp 2"),
        (["--pp", "1", "--schedule", "zb-h1"], 1, "--schedule zb-h1 needs --pp >= 2"),
        (
            ["--pp", "2", "--schedule", "zb-v", "--virtual-pipeline", "3", "--layers", "6"],
            2,
            "--schedule zb-v runs 2 model chunks per rank, got --virtual-pipeline 3",
        ),
        (
            ["--pp", "2", "--schedule", "zb-v", "--global-batch-size", "4"],
            2,
            "--schedule zb-v needs at least 2 x --pp - 1 = 3 micro-batches per step, got",
        ),
        (
            ["--dp", "2", "--global-batch-size", "6", "--micro-batch-size", "2"],
            2,
            "--global-batch-size 6 is not divisible by --micro-batch-size x dp = 2 x 2",
        ),
        (["--tp", "2", "--pp", "2", "--dp", "1"], 8, "world size 8 != tp x cp x pp x dp = 2 x 1 x 2 x 1"),
        (["--tp", "3", "--pp", "1"], 4, "world size 4 is not divisible by tp x cp x pp = 3"),
        (["--tp", "1", "--pp", "1", "--data", "/nonexistent/corpus.txt"], 1, "no such file"),
        (
            ["--tp", "2", "--pp", "1", "--hidden", "30", "--heads", "4"],
            2,
            "--hidden 30 is not divisible by --heads 4",
        ),
        (["--timeout", "0"], 1, "--timeout must be a positive finite number of seconds, got 0.0"),
        (
            ["--arch", "llama", "--num-query-groups", "3"],
            1,
            "--num-query-groups 3 must be a positive divisor of --heads 4",
        ),
        (
            [
                "--arch",
                "llama",
                "--tp",
                "4",
                "--pp",
                "1",
                "--heads",
                "8",
                "--num-query-groups",
                "6",
                "--hidden",
                "48",
            ],
            4,
            "--num-query-groups 6 must be a positive divisor of --heads 8",
        ),
        (
            [
                "--arch",
                "llama",
                "--tp",
                "4",
                "--pp",
                "1",
                "--heads",
                "12",
                "--num-query-groups",
                "6",
                "--hidden",
                "48",
            ],
            4,
            "--num-query-groups 6 must be a multiple or a divisor of --tp 4",
        ),
        (
            ["--arch", "llama", "--ffn-hidden", "30", "--tp", "4", "--pp", "1"],
            4,
            "--ffn-hidden 30 must be >= 1 and divisible by --tp 4",
        ),
        (
            ["--export-hf", "/tmp/out"],
            1,
            "--export-hf writes Llama- or DeepSeek-shaped models: use --arch llama, --arch deepseek or "
            "--load-hf",
        ),
        (["--load-hf", "/nonexistent/model"], 1, "--load-hf '/nonexistent/model' holds no config.json"),
        (["--data-parallel-sharding-strategy", "optim"], 2,
         "--data-parallel-sharding-strategy optim needs --use-megatron-fsdp"),
        (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"], 2,
         "--data-parallel-sharding-strategy optim_grads_params shards the optimizer state: it needs "
         "--use-distributed-optimizer"),
        (["--suggested-communication-unit-size", "1000"], 2,
         "--suggested-communication-unit-size needs --use-megatron-fsdp"),
        (["--init-model-with-meta-device"], 2,
         "--init-model-with-meta-device needs --use-megatron-fsdp with a"),
        (["--init-model-with-meta-device", "--use-megatron-fsdp", "--use-distributed-optimizer",
          "--data-parallel-sharding-strategy", "optim", "--load-hf", "."], 2,
         "--init-model-with-meta-device draws random weights; --load-hf reads them"),
    ],
)
def test_bad_arguments_raise_before_training(argv, world, message):
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(SMALL + ["--tp", "1", "--pp", "1"] + argv)
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        train_gpt.check_args(args, world)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_device_cuda_without_a_gpu_is_refused():
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(SMALL + ["--tp", "1", "--pp", "1", "--device", "cuda"])
    with pytest.raises(ValueError, match="--device cuda: this torch sees no CUDA GPU"):
        train_gpt.check_args(args, 1)
    with pytest.raises(ValueError, match="--device cuda: this torch sees no CUDA GPU"):
        train_gpt.main(SMALL + ["--device", "cuda"])


def test_timeout_default_follows_the_device():
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(SMALL + ["--tp", "1", "--pp", "1", "--device", "cpu"])
    train_gpt.check_args(args, 1)
    assert args.timeout == 120.0
    args = train_gpt.parse_args(SMALL + ["--tp", "1", "--pp", "1", "--device", "cpu", "--timeout", "7.5"])
    train_gpt.check_args(args, 1)
    assert args.timeout == 7.5
    if torch.cuda.is_available():  # NCCL's watchdog ends the process: a longer default
        args = train_gpt.parse_args(SMALL + ["--tp", "1", "--pp", "1", "--device", "cuda"])
        train_gpt.check_args(args, 1)
        assert args.timeout == 600.0


def _bad_arguments_worker(cases):
    train_gpt = load_train_gpt()
    messages = []
    for argv in cases:
        with pytest.raises(ValueError) as error:
            train_gpt.train(train_gpt.parse_args(SMALL + argv))
        messages.append(str(error.value))
    assert not ps.model_parallel_is_initialized()  # refused before the groups were built
    return messages


def test_bad_arguments_raise_on_every_rank():
    cases = [
        ["--tp", "2", "--pp", "1", "--heads", "3", "--hidden", "48"],
        ["--tp", "1", "--pp", "2", "--layers", "3"],
    ]
    messages = run_distributed(2, _bad_arguments_worker, cases)
    assert messages[0] == messages[1]
    assert "--heads 3 is not divisible by --tp 2" in messages[0][0]
    assert "--layers 3 is not divisible by --pp 2" in messages[0][1]


def _dying_rank_worker():
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(SMALL + ["--tp", "1", "--pp", "2", "--steps", "50", "--timeout", "20"])
    if dist.get_rank() == 1:
        original = train_gpt.step_microbatches

        def die_at_step_3(corpus, step, a, device):
            if step == 3:
                os._exit(17)
            return original(corpus, step, a, device)

        train_gpt.step_microbatches = die_at_step_3
    train_gpt.train(args)


def test_a_dying_rank_makes_the_others_fail_not_hang():
    with pytest.raises(AssertionError) as failure:
        run_distributed(2, _dying_rank_worker, timeout=90)
    report = str(failure.value)
    assert "rank 1" in report and "exited with code 17" in report
    assert "rank 0" in report and "Error" in report  # rank 0 raised instead of waiting forever


# --- sequence parallelism -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "world,layouts,dtypes",
    [
        (2, [(2, 1, 1)], DTYPES),
        (4, [(2, 2, 1), (2, 1, 2), (4, 1, 1)], DTYPES),
        (8, [(2, 2, 2)], ["float64"]),
    ],
)
def test_sequence_parallel_layouts_match_serial(serial_losses, world, layouts, dtypes):
    results = run_distributed(world, train_layouts, layouts, dtypes, SCHEDULES, ["--sequence-parallel"])
    for rank_result in results:
        assert rank_result == results[0]
    assert_losses_match(serial_losses, results[0])


def test_sequence_parallel_recompute_and_dropout():
    sp = ["--sequence-parallel", "--dropout", "0.1"]
    plain, recomputed = (
        run_distributed(4, train_layouts, [(2, 2, 1)], ["float64"], ["1f1b"], sp + extra)[0][
            (2, 2, 1, "float64", "1f1b")
        ]
        for extra in ([], ["--recompute"])
    )
    torch.testing.assert_close(torch.tensor(recomputed), torch.tensor(plain), rtol=1e-12, atol=0)


def _sequence_parallel_rng_worker():
    from megatron_ext import tensor_parallel
    from megatron_ext.models import GPTModel
    from megatron_ext.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    config = TransformerConfig(
        tensor_model_parallel_size=2, num_layers=2, hidden_size=16, num_attention_heads=2,
        hidden_dropout=0.5, attention_dropout=0.0, params_dtype=torch.float64,
        use_cpu_initialization=True, sequence_parallel=True,
    )
    model = GPTModel(config, vocab_size=64, max_sequence_length=8, post_process=False, init_seed=3)
    marked = sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False))
    tokens = torch.arange(16).view(2, 8) % 64
    positions = torch.arange(8).expand(2, 8)

    # The embedding dropout draws from the model-parallel stream: reproduce it from that state.
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved, default_state = tracker.get_states(), torch.get_rng_state()
    model.train()
    dropped = model.embedding(tokens, positions)
    tracker.set_states(saved)
    torch.set_rng_state(default_state)
    model.eval()
    clean = model.embedding(tokens, positions)
    with tracker.fork():
        expected = torch.nn.functional.dropout(clean, p=0.5, training=True)
    torch.testing.assert_close(dropped, expected, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), default_state)  # the default stream did not move

    # The stage's output (what the pipeline sends) is [s / tp, b, h].
    hidden = model(tokens, positions)
    masks = [torch.empty_like(dropped) for _ in range(2)]
    dist.all_gather(masks, (dropped == 0).double(), group=ps.get_tensor_model_parallel_group())
    return {"embedding": tuple(clean.shape), "stage": tuple(hidden.shape), "marked": marked,
            "masks_differ": not torch.equal(masks[0], masks[1])}


def test_sequence_parallel_shapes_marks_and_dropout_stream():
    results = run_distributed(2, _sequence_parallel_rng_worker)
    for out in results:
        assert out["embedding"] == (4, 2, 16) and out["stage"] == (4, 2, 16)
        assert out["masks_differ"]  # each tensor-parallel rank drops its own positions
        for layer in (0, 1):
            for name in ("input_layernorm", "post_attention_layernorm"):
                assert f"decoder.layers.{layer}.{name}.weight" in out["marked"]
                assert f"decoder.layers.{layer}.{name}.bias" in out["marked"]
            assert f"decoder.layers.{layer}.self_attention.dense.bias" in out["marked"]
            assert f"decoder.layers.{layer}.mlp.dense_4h_to_h.bias" in out["marked"]
        assert not any("query_key_value" in n or "word_embeddings" in n for n in out["marked"])
