"""examples/train_gpt.py on tokenized corpora: --data-path blends with --split, the vocabulary sized
by --tokenizer, validation loss, resuming at the next sample, --load-hf's own tokenizer, and the
bad inputs (one error, on every rank)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ext.datasets import IndexedDatasetBuilder
from megatron_ext.training import gpt_data
from tests.conftest import SMALL_GPT, load_train_gpt, make_tokenizer_dir, random_text
from tests.distributed import run_distributed

pytest.importorskip("tokenizers")

from megatron_ext.datasets import preprocess  # noqa: E402

STEPS = [
    "--tp",
    "1",
    "--pp",
    "1",
    "--steps",
    "4",
    "--dtype",
    "float64",
    "--split",
    "90,8,2",
    "--eval-interval",
    "2",
    "--eval-iters",
    "2",
]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """A tokenizer directory and two corpora tokenized with it."""
    root = tmp_path_factory.mktemp("data")
    tokenizer = make_tokenizer_dir(root / "tokenizer")
    prefixes = []
    for k, documents in enumerate((400, 200)):
        source = root / f"corpus{k}.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in random_text(k, documents)))
        result = preprocess.main(
            [
                "--input",
                str(source),
                "--output-prefix",
                str(root / f"corpus{k}"),
                "--tokenizer",
                str(tokenizer),
                "--append-eod",
                "--no-progress",
            ]
        )
        prefixes += result["prefixes"]
    return root, str(tokenizer), prefixes


def data_args(root, tokenizer, prefixes, *extra) -> list[str]:
    return (
        SMALL_GPT
        + STEPS
        + [
            "--data-path",
            "0.7",
            prefixes[0],
            "0.3",
            prefixes[1],
            "--tokenizer",
            tokenizer,
            "--data-cache-path",
            str(root / "cache"),
            *extra,
        ]
    )


def _runs_worker(root, tokenizer, prefixes, layouts) -> dict:
    train_gpt = load_train_gpt()
    out = {}
    for name, argv in layouts.items():
        log = train_gpt.train(train_gpt.parse_args(data_args(root, tokenizer, prefixes, *argv)))
        out[name] = (log["start_step"], log["losses"], log["val_losses"], log["config"]["vocab_size"])
    return out


@pytest.mark.slow
def test_training_on_tokens_evaluates_and_resumes(corpora, tmp_path):
    root, tokenizer, prefixes = corpora
    save = str(tmp_path / "ckpt")
    (serial,) = run_distributed(1, _runs_worker, root, tokenizer, prefixes, {"serial": []})
    parallel = run_distributed(
        2,
        _runs_worker,
        root,
        tokenizer,
        prefixes,
        {
            "dp2": ["--dp", "2"],
            # 64 x tp 2: the serial run's vocabulary of 384, so the same initial weights
            "tp2": ["--tp", "2", "--make-vocab-size-divisible-by", "64"],
            "first half": ["--dp", "2", "--steps", "2", "--save", save],
            "resumed": ["--dp", "2", "--load", save],
        },
    )
    assert parallel[0] == parallel[1]
    runs = {**serial, **parallel[0]}
    start, losses, val_losses, vocab = runs["serial"]
    assert start == 0 and len(losses) == 4 and vocab == 384  # 300 tokens, padded to a multiple of 128
    assert [step for step, _ in val_losses] == [2, 4]
    assert losses[-1] < losses[0] and all(4 < v < 7 for _, v in val_losses)  # ln 300 = 5.7: learning
    for name in ("dp2", "tp2"):  # parallel equals serial in float64
        assert runs[name][3] == 384
        got = torch.tensor(runs[name][1] + [v for _, v in runs[name][2]], dtype=torch.float64)
        want = torch.tensor(losses + [v for _, v in val_losses], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=0)
    # resuming after step 2 continues with the samples of step 3: the uninterrupted run's losses
    assert runs["first half"][0] == 0 and runs["resumed"][0] == 2
    torch.testing.assert_close(
        torch.tensor(runs["first half"][1] + runs["resumed"][1]),
        torch.tensor(runs["dp2"][1]),
        rtol=1e-12,
        atol=0,
    )
    assert runs["resumed"][2] == [runs["dp2"][2][1]]


def test_global_batches_are_the_consumed_samples_in_order(corpora):
    root, tokenizer, prefixes = corpora
    train, valid, test = gpt_data.build_datasets(
        ["2", prefixes[0], "1", prefixes[1]],
        "90,8,2",
        gpt_data.HuggingFaceTokenizer(tokenizer),
        16,
        3,
        gpt_data.split_sizes(5, 8, 2, 3),
        str(root / "cache_unit"),
    )
    # a weighted blend holds the sum of its parts, each rounded up: ceil(40 x 2/3) + ceil(40 / 3) = 41
    assert (len(train), len(valid), len(test)) == (41, (5 // 2 + 1) * 3 * 8, 0)
    for first in (0, 8, 32):
        per_rank = [gpt_data.global_batch_microbatches(train, first, 8, 2, d, 2) for d in range(2)]
        # micro-batch m of rank d: samples first + m x (b x dp) + d x b + [0, b), Megatron-LM's order
        for d in range(2):
            for m, mb in enumerate(per_rank[d]):
                for j in range(2):
                    sample = train[first + m * 4 + d * 2 + j]
                    for key in ("tokens", "labels", "loss_mask"):
                        assert torch.equal(mb[key][j], sample[key])
    with pytest.raises(
        ValueError, match=r"the dataset holds 41 samples; the global batch of samples \[40, 48\) "
    ):
        gpt_data.global_batch_microbatches(train, 40, 8, 2, 0, 1)
    assert (
        gpt_data.padded_vocab_size(300, 128, 1) == 384
        and gpt_data.padded_vocab_size(300, 128, 2) == 512
        and gpt_data.padded_vocab_size(300, 128, 4) == 512
    )


def test_bad_data_arguments(corpora, tmp_path):
    root, tokenizer, prefixes = corpora
    train_gpt = load_train_gpt()
    (tmp_path / "empty").mkdir()
    base = SMALL_GPT + ["--steps", "2", "--tokenizer", tokenizer]
    cases = [
        (
            ["--data-path", prefixes[0], "--tokenizer", str(tmp_path / "empty")],
            "holds no tokenizer: expected one of tokenizer.json",
        ),
        (SMALL_GPT + ["--data-path", prefixes[0]], "--data-path needs the corpus's tokenizer"),
        (
            ["--data-path", "1", prefixes[0], "-2", prefixes[1]],
            "the --data-path blend weight -2.0 of '" + prefixes[1] + "' must be a finite number > 0",
        ),
        (["--data-path", "1", prefixes[0], prefixes[1]], "3 entries cannot pair every weight with a prefix"),
        (["--data-path", "1", prefixes[0], prefixes[1], "2"], "weights and prefixes must alternate"),
        (["--data-path", prefixes[0], "--split", "0,0,0"], "split '0,0,0' sums to 0"),
        (["--data-path", prefixes[0], "--split", "0,1,0"], "--split '0,1,0' leaves no documents to train on"),
        (["--data-path", str(root / "nothing")], f"--data-path '{root / 'nothing'}': no "),
        (
            ["--data-path", prefixes[0], "--eval-interval", "2", "--split", "1,0,0"],
            "needs a validation share",
        ),
        (["--eval-interval", "2"], "--eval-interval needs --data-path"),
        (["--data", __file__, "--data-path", prefixes[0]], "--data (a text file) and --data-path"),
        (
            ["--data-path", prefixes[0], "--vocab-size", "256"],
            "--vocab-size 256 is smaller than the tokenizer's 300",
        ),
        # checked at start-up, not when rank 0 first writes the cache
        (
            ["--data-path", prefixes[0], "--data-cache-path", __file__],
            f"--data-cache-path {__file__!r} is not a directory",
        ),
        (
            ["--data-path", prefixes[0], "--data-cache-path", __file__ + "/cache"],
            f"--data-cache-path {__file__ + '/cache'!r} cannot be created: {__file__!r} is not a directory",
        ),
        (["--data-cache-path", str(tmp_path)], "--data-cache-path is where the index caches of --data-path"),
    ]
    for extra, message in cases:
        args = train_gpt.parse_args((base if extra[0] != SMALL_GPT[0] else []) + extra)
        with pytest.raises(ValueError) as error:
            train_gpt.check_args(args, 4)  # the default layout: tp 2 x pp 2
        assert message in str(error.value), (extra, str(error.value))


def _token_error_worker(prefix, tokenizer, cache) -> str:
    train_gpt = load_train_gpt()
    args = train_gpt.parse_args(
        SMALL_GPT
        + [
            "--steps",
            "1",
            "--tp",
            "1",
            "--pp",
            "1",
            "--dp",
            "2",
            "--data-path",
            prefix,
            "--tokenizer",
            tokenizer,
            "--split",
            "1,0,0",
            "--data-cache-path",
            cache,
        ]
    )
    try:
        train_gpt.train(args)
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.slow
def test_token_ids_beyond_the_vocabulary_stop_every_rank(corpora, tmp_path):
    root, tokenizer, _ = corpora
    builder = IndexedDatasetBuilder(str(tmp_path / "wide.bin"), dtype=__import__("numpy").int32)
    for k in range(40):
        builder.add_item(torch.arange(30) * 50 + k)  # ids up to 1489: another tokenizer's
        builder.end_document()
    builder.finalize(str(tmp_path / "wide.idx"))
    errors = run_distributed(
        2, _token_error_worker, str(tmp_path / "wide"), tokenizer, str(tmp_path / "cache")
    )
    assert errors[0] == errors[1]
    assert (
        errors[0].startswith("the train split holds token id ")
        and "outside the tokenizer's vocabulary of 300 tokens" in errors[0]
    )


def _hf_worker(hf_dir, prefix, cache) -> tuple[float, list]:
    """train_gpt's first loss from --load-hf (lr 0), and its first global batch."""
    from megatron_ext import parallel_state as ps

    train_gpt = load_train_gpt()
    argv = [
        "--tp",
        "1",
        "--pp",
        "1",
        "--steps",
        "1",
        "--lr",
        "0",
        "--seq-len",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--dtype",
        "float64",
        "--no-progress",
        "--plot",
        "",
        "--load-hf",
        hf_dir,
        "--data-path",
        prefix,
        "--split",
        "1,0,0",
        "--data-cache-path",
        cache,
    ]
    args = train_gpt.parse_args(argv)
    loss = train_gpt.train(args)["losses"][0]
    ps.initialize_model_parallel(1)
    tokenizer = gpt_data.HuggingFaceTokenizer(train_gpt.tokenizer_dir(args))
    train, _, _ = gpt_data.build_datasets([prefix], "1,0,0", tokenizer, 16, args.seed, [4, 0, None], cache)
    batches = gpt_data.global_batch_microbatches(train, 0, 4, 2, 0, 1)
    ps.destroy_model_parallel()
    return loss, batches


@pytest.mark.slow
def test_load_hf_trains_on_its_own_tokenizer(corpora, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.test_hf import _hf_config, _hf_model, _rms_norm_in_input_dtype

    root, tokenizer, prefixes = corpora
    hf_dir = tmp_path / "hf"
    _hf_model(_hf_config(vocab_size=300)).save_pretrained(hf_dir)
    make_tokenizer_dir(hf_dir)  # the model's tokenizer beside its weights
    ((loss, batches),) = run_distributed(1, _hf_worker, str(hf_dir), prefixes[0], str(tmp_path / "cache"))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    type(model.model.norm).forward = _rms_norm_in_input_dtype
    with torch.no_grad():
        want = (
            torch.stack(
                [
                    torch.nn.functional.cross_entropy(
                        model(b["tokens"]).logits.flatten(0, 1), b["labels"].flatten()
                    )
                    for b in batches
                ]
            )
            .mean()
            .item()
        )
    assert abs(loss - want) < 1e-9 * want
