"""examples/train_gpt.py --sft: supervised fine-tuning on packed rows of prompt/response records.

- Packed equals unpacked: the same records trained as packed rows (one row per micro-batch, a
  PackedSeqParams over its sequences) and with each sequence as a row of its own (padded, the
  padding masked out, no PackedSeqParams) give the same losses, validation losses, gradient norms
  and trained weights in float64. Both runs average alike: the loss is summed over the response
  tokens of every micro-batch and divided by their count over the whole global batch
  (``calculate_per_token_loss``), so it does not matter how the tokens lie in rows.
- Parallel equals serial: (tp, cp, pp, dp) = (2,1,1,1) with sequence parallelism, (1,2,1,1) with
  the p2p and a2a comm types, (1,1,2,1) (also interleaved, whose middle stages read the boundaries
  too) and (1,1,1,2) against the serial run on the same rows (each sequence padded to a multiple of
  2 x cp = 4 tokens in every run, as the cp 2 runs need).
- Refusals: --sft with --data / --data-path, --micro-batch-size > 1, no tokenizer, a missing file,
  no train records; a record without prompt/response stops every rank with the same error.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from megatron_ext import parallel_state as ps
from megatron_ext.training import gpt_data
from tests.conftest import load_train_gpt, make_tokenizer_dir, random_text
from tests.distributed import run_distributed
from tests.test_context_parallel_training import _full_weights

pytest.importorskip("tokenizers")

ARCHS = {"gpt": ["--arch", "gpt"], "llama": ["--arch", "llama", "--num-query-groups", "2"]}
BASE = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "32", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--lr", "1e-2", "--steps", "3", "--dtype", "float64",
        "--split", "90,10,0", "--eval-interval", "3", "--eval-iters", "1", "--no-progress", "--plot", "",
        "--tp", "1", "--pp", "1"]
LAYOUTS = {  # world size 2
    # 64 x tp 2: the serial run's vocabulary of 384 (300 tokens), so the same initial weights
    "tp2 sequence-parallel": ["--tp", "2", "--sequence-parallel", "--make-vocab-size-divisible-by", "64"],
    "cp2 p2p": ["--cp", "2", "--cp-comm-type", "p2p"],
    "cp2 a2a": ["--cp", "2", "--cp-comm-type", "a2a"],
    "pp2": ["--pp", "2"],
    "dp2": ["--dp", "2"],
    # interleaved: each rank's second or first chunk is a middle stage, which reads the boundaries too
    "pp2 virtual-pipeline 2": ["--pp", "2", "--virtual-pipeline", "2", "--layers", "4"],
}
GPT_LAYOUTS = ("cp2 p2p", "pp2")  # learned positions restarting per sequence, the tied embedding over pp


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """A tokenizer directory and a JSONL file of 120 prompt/response records of 1 to 9 words each."""
    root = tmp_path_factory.mktemp("sft")
    tokenizer = make_tokenizer_dir(root / "tokenizer")
    texts = random_text(7, 240, max_words=10)
    path = root / "sft.jsonl"
    pairs = zip(texts[::2], texts[1::2])
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
    return root, str(tokenizer), str(path)


def _unpacked(microbatch: dict) -> dict:
    """A packed row's sequences, each a row of its own: cut at the row's boundaries, padded at the
    end with token 0 and loss mask 0; positions from 0 (the example's default without
    position_ids), no boundaries."""
    bounds = microbatch["cu_seqlens"].reshape(-1).tolist()
    length = microbatch["tokens"].size(1)
    rows = {key: [] for key in ("tokens", "labels", "loss_mask")}
    for start, end in zip(bounds[:-1], bounds[1:]):
        for key, values in rows.items():
            piece = microbatch[key][0, start:end]
            values.append(torch.cat([piece, piece.new_zeros(length - (end - start))]))
    return {key: torch.stack(values) for key, values in rows.items()}


def _rows_as_at_cp2():
    """gpt_data with the SFT rows built as at cp 2 (each sequence padded to a multiple of 4)."""
    build = gpt_data.build_sft_datasets

    def build_sft_datasets(path, split, tokenizer, seq_len, seed, sizes, context_parallel_size=1):
        return build(path, split, tokenizer, seq_len, seed, sizes, 2)

    return types.SimpleNamespace(**{**vars(gpt_data), "build_sft_datasets": build_sft_datasets})


def _train_worker(tokenizer: str, jsonl: str, runs: dict) -> dict:
    """Per run name: (losses, validation losses, grad norms, trained weights of this rank's share,
    most sequences in a row). ``runs``: name -> (argv, unpacked, rows as at cp 2)."""
    out = {}
    for name, (argv, unpacked, as_cp2) in runs.items():
        train_gpt = load_train_gpt()
        built, weights, sequences = [], [], [0]
        build, destroy = train_gpt.build_model, ps.destroy_model_parallel
        train_gpt.build_model = lambda *a, **k: built.append(build(*a, **k)) or built[-1]

        def gather_then_destroy() -> None:
            weights.append(_full_weights(built[-1]))
            destroy()

        train_gpt.parallel_state = types.SimpleNamespace(**vars(ps))
        train_gpt.parallel_state.destroy_model_parallel = gather_then_destroy
        if as_cp2:
            train_gpt.gpt_data = _rows_as_at_cp2()
        microbatches_of = train_gpt.microbatches_of

        def reading(*args, **kwargs):
            microbatches = microbatches_of(*args, **kwargs)
            sequences[0] = max([sequences[0]] + [mb["cu_seqlens"].numel() - 1 for mb in microbatches])
            return [_unpacked(mb) for mb in microbatches] if unpacked else microbatches

        train_gpt.microbatches_of = reading
        log = train_gpt.train(train_gpt.parse_args(BASE + ["--sft", jsonl, "--tokenizer", tokenizer] + argv))
        out[name] = (log["losses"], log["val_losses"], log["grad_norms"], weights[-1], sequences[0])
    return out


def _merged(results: list[dict]) -> dict:
    merged = {}
    for rank_result in results:
        for name, (losses, val, norms, weights, sequences) in rank_result.items():
            merged.setdefault(name, (losses, val, norms, {}, sequences))[3].update(weights)
    return merged


def _assert_same_training(got: tuple, want: tuple, label: str) -> None:
    for what, index in (("losses", 0), ("grad norms", 2)):
        torch.testing.assert_close(torch.tensor(got[index]), torch.tensor(want[index]), rtol=1e-9, atol=0,
                                   msg=lambda m: f"{label} {what}: {m}")
    assert [step for step, _ in got[1]] == [step for step, _ in want[1]] == [3], label
    torch.testing.assert_close(torch.tensor([v for _, v in got[1]]), torch.tensor([v for _, v in want[1]]),
                               rtol=1e-9, atol=0, msg=lambda m: f"{label} validation: {m}")
    # (a last pipeline stage holds a copy of the tied embedding: output_layer.weight)
    assert len(want[3]) > 10 and set(want[3]) <= set(got[3]), (label, set(want[3]) - set(got[3]))
    for name, value in want[3].items():
        torch.testing.assert_close(torch.tensor(got[3][name]), torch.tensor(value), rtol=1e-9, atol=1e-12,
                                   msg=lambda m: f"{label} {name}: {m}")


@pytest.fixture(scope="module")
def serial(records):
    """The packed and unpacked serial runs of each arch on the natural rows, and the serial run on
    the rows as at cp 2."""
    _, tokenizer, jsonl = records
    runs = {}
    for arch, argv in ARCHS.items():
        runs[f"{arch} packed"] = (argv, False, False)
        runs[f"{arch} unpacked"] = (argv, True, False)
        runs[f"{arch} rows as at cp 2"] = (argv, False, True)
    runs["llama 4 layers rows as at cp 2"] = (ARCHS["llama"] + ["--layers", "4"], False, True)
    return _merged(run_distributed(1, _train_worker, tokenizer, jsonl, runs))


@pytest.mark.slow  # seven serial training runs
def test_packed_rows_train_as_each_sequence_on_its_own(serial):
    for arch in ARCHS:
        packed = serial[f"{arch} packed"]
        assert packed[4] >= 3, packed[4]  # rows of several sequences
        assert packed[0][-1] < packed[0][0] and 4 < packed[1][0][1] < 7, packed  # learning; ln 300 = 5.7
        _assert_same_training(serial[f"{arch} unpacked"], packed, f"{arch} unpacked")
        # the rows padded for cp 2 hold other sequences together: another training
        assert serial[f"{arch} rows as at cp 2"][0] != packed[0]


def _bad_record_worker(tokenizer: str, jsonl: str) -> str:
    train_gpt = load_train_gpt()
    try:
        train_gpt.train(train_gpt.parse_args(BASE + ["--dp", "2", "--sft", jsonl, "--tokenizer", tokenizer]))
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.slow  # eight training runs on two ranks
def test_sft_layouts_train_like_serial(records, serial, tmp_path):
    _, tokenizer, jsonl = records
    runs = {f"llama {name}": (ARCHS["llama"] + argv, False, True) for name, argv in LAYOUTS.items()}
    runs.update({f"gpt {name}": (ARCHS["gpt"] + LAYOUTS[name], False, True) for name in GPT_LAYOUTS})
    results = _merged(run_distributed(2, _train_worker, tokenizer, jsonl, runs, timeout=600))
    for name, result in results.items():
        reference = "llama 4 layers" if "virtual-pipeline" in name else name.split()[0]
        _assert_same_training(result, serial[f"{reference} rows as at cp 2"], name)
    # a record without a response stops both ranks with the same error
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "w1 w2", "response": "w3"}) + "\n" + json.dumps({"prompt": "w4"}))
    errors = run_distributed(2, _bad_record_worker, tokenizer, str(bad))
    assert errors[0] == errors[1] == f"{bad}:2: expected a JSON object with 'prompt' and 'response' strings"


def test_bad_sft_arguments(records, tmp_path):
    root, tokenizer, jsonl = records
    train_gpt = load_train_gpt()
    (tmp_path / "empty").mkdir()
    base = ["--tp", "1", "--pp", "1", "--micro-batch-size", "1", "--global-batch-size", "4", "--sft", jsonl,
            "--tokenizer", tokenizer]
    cases = [
        (["--data-path", str(root / "corpus")],
         "--sft (prompt/response records) and --data-path exclude each other"),
        (["--data", jsonl], "--sft (prompt/response records) and --data exclude each other"),
        (["--micro-batch-size", "2"], "use --micro-batch-size 1, got 2"),
        (["--tokenizer", str(tmp_path / "empty")], "holds no tokenizer"),
        (["--sft", str(tmp_path / "none.jsonl")], f"--sft '{tmp_path / 'none.jsonl'}': no such file"),
        (["--split", "0,1,0"], "--split '0,1,0' leaves no records to train on"),
        (["--eval-interval", "2", "--split", "1,0,0"], "needs a validation share"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError) as error:
            train_gpt.check_args(train_gpt.parse_args(base + extra), 1)
        assert message in str(error.value), (extra, str(error.value))
    args = train_gpt.parse_args(base[:-2])
    with pytest.raises(ValueError, match="--sft needs the tokenizer of its records"):
        train_gpt.check_args(args, 1)
    args = train_gpt.parse_args(base + ["--eval-interval", "2"])
    train_gpt.check_args(args, 1)  # a valid run: the tokenizer's 300 tokens sized the model
    assert args.vocab_size == 384 and args.tokens == 300
