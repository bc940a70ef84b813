"""examples/train_gpt.py --sft: supervised fine-tuning on packed rows of prompt/response records.

- Packed equals unpacked: the same records trained as packed rows (one row per micro-batch, a
  PackedSeqParams over its sequences) and with each sequence as a row of its own (padded, the
  padding masked out, no PackedSeqParams) give the same losses, validation losses, gradient norms
  and trained weights in float64. Both runs average alike: the loss is summed over the response
  tokens of every micro-batch and divided by their count over the whole global batch
  (``calculate_per_token_loss``), so it does not matter how the tokens lie in rows.
- Parallel equals serial: (tp, cp, pp, dp) = (2,1,1,1) with sequence parallelism, (1,2,1,1) with
  the p2p and a2a comm types, (1,1,2,1) (also interleaved, whose middle stages read the boundaries
  too) and (1,1,1,2) against the serial run of the same command line (--pad-seq-to-mult 4 in every
  run, as the cp 2 runs need: the rows are the data's, not the layout's); a checkpoint saved at cp 2
  resumes serially on the same rows.
- With mixture-of-experts layers (4 experts, top 2, the balance and z losses) ep 2, tp 2 x ep 2
  (sequence-parallel) and cp 2 x ep 2 train like serial, router losses included; the rows'
  padding reaches the routers as padding_mask: a padded row's tracked router losses are those of
  the row without its padding.
- Nothing is trained silently: a step or an evaluation whose rows hold no response token stops
  every rank; the log counts each step's response tokens.
- --export-hf writes the tokenizer beside the weights.
- Refusals: --sft with --data / --data-path, --micro-batch-size > 1, no tokenizer, a missing file,
  no train records, a padding multiple that does not split at --cp; a record without
  prompt/response stops every rank with the same error.
"""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

from megatron_ext import parallel_state as ps
from megatron_ext.training import gpt_data
from tests.conftest import TOKENIZER_WORDS, load_train_gpt, make_tokenizer_dir, random_text
from tests.distributed import run_distributed
from tests.test_moe_training import _full_weights  # (experts by global index, gathered over ep)

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


# Each record padded to a multiple of 4 tokens: the rows of every run that can reach cp 2.
PAD4 = ["--pad-seq-to-mult", "4"]


def _train_worker(tokenizer: str, jsonl: str, runs: dict) -> dict:
    """Per run name: (losses, validation losses, grad norms, trained weights of this rank's share,
    most sequences in a row, the router's tracked losses). ``runs``: name -> (argv, unpacked)."""
    out = {}
    for name, (argv, unpacked) in runs.items():
        train_gpt = load_train_gpt()
        built, weights, sequences = [], [], [0]
        build, destroy = train_gpt.build_model, ps.destroy_model_parallel
        train_gpt.build_model = lambda *a, **k: built.append(build(*a, **k)) or built[-1]

        def gather_then_destroy() -> None:
            weights.append(_full_weights(built[-1]))
            destroy()

        train_gpt.parallel_state = types.SimpleNamespace(**vars(ps))
        train_gpt.parallel_state.destroy_model_parallel = gather_then_destroy
        microbatches_of = train_gpt.microbatches_of

        def reading(*args, **kwargs):
            microbatches = microbatches_of(*args, **kwargs)
            sequences[0] = max([sequences[0]] + [mb["cu_seqlens"].numel() - 1 for mb in microbatches])
            return [_unpacked(mb) for mb in microbatches] if unpacked else microbatches

        train_gpt.microbatches_of = reading
        log = train_gpt.train(train_gpt.parse_args(BASE + ["--sft", jsonl, "--tokenizer", tokenizer] + argv))
        aux = [[step[key] for key in sorted(step)] for step in log["aux_losses"]]
        out[name] = (log["losses"], log["val_losses"], log["grad_norms"], weights[-1], sequences[0], aux)
    return out


def _merged(results: list[dict]) -> dict:
    merged = {}
    for rank_result in results:
        for name, (losses, val, norms, weights, sequences, aux) in rank_result.items():
            merged.setdefault(name, (losses, val, norms, {}, sequences, aux))[3].update(weights)
    return merged


def _assert_same_training(got: tuple, want: tuple, label: str) -> None:
    for what, index in (("losses", 0), ("grad norms", 2), ("router losses", 5)):
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
    """The packed and unpacked serial runs of each arch on the natural rows (the Llama one exported
    to Hugging Face), and the serial runs on the rows padded to multiples of 4."""
    root, tokenizer, jsonl = records
    runs = {}
    for arch, argv in ARCHS.items():
        runs[f"{arch} packed"] = (argv, False)
        runs[f"{arch} unpacked"] = (argv, True)
        runs[f"{arch} pad 4"] = (argv + PAD4, False)
    runs["llama packed"] = (ARCHS["llama"] + ["--export-hf", str(root / "export")], False)
    runs["llama 4 layers pad 4"] = (ARCHS["llama"] + ["--layers", "4"] + PAD4, False)
    return _merged(run_distributed(1, _train_worker, tokenizer, jsonl, runs))


@pytest.mark.slow  # seven serial training runs
def test_packed_rows_train_as_each_sequence_on_its_own(serial):
    for arch in ARCHS:
        packed = serial[f"{arch} packed"]
        assert packed[4] >= 3, packed[4]  # rows of several sequences
        assert packed[0][-1] < packed[0][0] and 4 < packed[1][0][1] < 7, packed  # learning; ln 300 = 5.7
        _assert_same_training(serial[f"{arch} unpacked"], packed, f"{arch} unpacked")
        # the rows padded to multiples of 4 hold other sequences together: another training
        assert serial[f"{arch} pad 4"][0] != packed[0]


def _errors_worker(tokenizer: str, runs: list[list[str]]) -> list[str]:
    """Each run's ValueError, or 'trained'."""
    out = []
    for argv in runs:
        train_gpt = load_train_gpt()
        try:
            train_gpt.train(train_gpt.parse_args(BASE + ["--tokenizer", tokenizer] + argv))
            out.append("trained")
        except ValueError as e:
            out.append(str(e))
    return out


@pytest.mark.slow  # nine training runs on two ranks, one on one
def test_sft_layouts_train_like_serial(records, serial, tmp_path):
    _, tokenizer, jsonl = records
    runs = {f"llama {name}": (ARCHS["llama"] + argv + PAD4, False) for name, argv in LAYOUTS.items()}
    runs.update({f"gpt {name}": (ARCHS["gpt"] + LAYOUTS[name] + PAD4, False) for name in GPT_LAYOUTS})
    save = str(tmp_path / "ckpt")
    runs["llama cp2 first two steps"] = (ARCHS["llama"] + LAYOUTS["cp2 p2p"] + PAD4 + ["--steps", "2",
                                                                                      "--save", save], False)
    results = _merged(run_distributed(2, _train_worker, tokenizer, jsonl, runs, timeout=600))
    first_two = results.pop("llama cp2 first two steps")
    for name, result in results.items():
        reference = "llama 4 layers" if "virtual-pipeline" in name else name.split()[0]
        _assert_same_training(result, serial[f"{reference} pad 4"], name)
    # the checkpoint of cp 2 resumes serially on the same rows: the serial run's last step
    resumed = run_distributed(1, _train_worker, tokenizer, jsonl,
                              {"resumed": (ARCHS["llama"] + PAD4 + ["--load", save], False)})[0]["resumed"]
    want = serial["llama pad 4"]
    for got, expected in ((first_two[0] + resumed[0], want[0]), (first_two[2] + resumed[2], want[2]),
                          (resumed[1], want[1])):  # losses, grad norms, validation
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-9, atol=0)
    for name, value in want[3].items():
        torch.testing.assert_close(torch.tensor(resumed[3][name]), torch.tensor(value), rtol=1e-9, atol=1e-12)
    # a record without a response stops both ranks with the same error; so does a resume on other rows
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "w1 w2", "response": "w3"}) + "\n" + json.dumps({"prompt": "w4"}))
    errors = run_distributed(2, _errors_worker, tokenizer, [
        ["--dp", "2", "--sft", str(bad)], ARCHS["llama"] + ["--dp", "2", "--sft", jsonl, "--load", save]])
    assert errors[0] == errors[1]
    assert errors[0][0] == f"{bad}:2: expected a JSON object with 'prompt' and 'response' strings, got no " \
        "'response'"
    assert errors[0][1] == ("the checkpoint was trained on --sft rows padded with --pad-seq-to-mult 4, this "
                            "run has 1: other rows; give --pad-seq-to-mult 4")


# Mixture-of-experts layers, every router loss on: 4 experts, top 2, the balance loss and the z-loss.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "1e-3"]
MOE_LAYOUTS = {  # world size 2
    "ep2": ["--ep", "2"],
    "tp2 ep2 sequence-parallel": ["--tp", "2", "--ep", "2", "--etp", "1", "--sequence-parallel",
                                  "--make-vocab-size-divisible-by", "64"],
    "cp2 ep2": ["--cp", "2", "--ep", "2"],  # each cp rank's share of the router losses
}


@pytest.mark.slow  # one serial and two 2-rank trainings
def test_sft_with_experts_trains_like_serial(records):
    _, tokenizer, jsonl = records
    argv = ARCHS["llama"] + MOE + PAD4
    (serial_moe,) = [_merged(run_distributed(1, _train_worker, tokenizer, jsonl, {"serial": (argv, False)}))]
    want = serial_moe["serial"]
    assert len(want[5]) == 3 and all(len(step) == 2 and min(step) > 0 for step in want[5]), want[5]
    assert any(".mlp.experts.3.w1" in name for name in want[3])
    runs = {name: (argv + flags, False) for name, flags in MOE_LAYOUTS.items()}
    results = _merged(run_distributed(2, _train_worker, tokenizer, jsonl, runs, timeout=600))
    for name, result in results.items():
        _assert_same_training(result, want, name)


def _without_padding(microbatch: dict) -> dict:
    """The packed row with its padding tokens cut out (each sequence's and the tail), boundaries
    to match; no padding mask."""
    keep = ~microbatch["padding_mask"][0]
    bounds = microbatch["cu_seqlens"].reshape(-1).tolist()
    lengths = [int(keep[start:end].sum()) for start, end in zip(bounds[:-1], bounds[1:])]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    out = {key: microbatch[key][:, keep] for key in ("tokens", "labels", "loss_mask", "position_ids")}
    return dict(out, cu_seqlens=cu[None], max_seqlen=torch.tensor([max(lengths)]))


def _router_losses_worker(tokenizer: str, jsonl: str) -> dict:
    """The routers' tracked losses (per name, per layer) of forward_step on a padded SFT row, on
    the row without its padding, and on the row with its padding unmarked."""
    from megatron_ext import tensor_parallel
    from megatron_ext.models.gpt import GPTModel
    from megatron_ext.transformer import TransformerConfig
    from megatron_ext.transformer.moe.router_utils import get_moe_layer_wise_logging_tracker

    train_gpt = load_train_gpt()
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
        moe_ffn_hidden_size=12, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=1e-3, params_dtype=torch.float64, pipeline_dtype=torch.float64,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.5,
        calculate_per_token_loss=True)
    model = GPTModel(config, vocab_size=300, max_sequence_length=32, init_seed=7)
    tokens = gpt_data.HuggingFaceTokenizer(tokenizer)
    sizes = gpt_data.split_sizes(3, 4, 1, 1)
    (train, _, _) = gpt_data.build_sft_datasets(jsonl, "90,10,0", tokens, 32, 1234, sizes, pad_seq_to_mult=4)
    rows = [gpt_data.global_batch_microbatches(train, i, 1, 1, 0, 1, keys=gpt_data.SFT_KEYS)[0]
            for i in range(8)]
    # a row with a record's padding before another record, and a tail
    row = next(mb for mb in rows if (mb["padding_mask"][0, :-1] & ~mb["padding_mask"][0, 1:]).any()
               and mb["padding_mask"][0, -1])
    unmarked = {key: value for key, value in row.items() if key != "padding_mask"}
    out = {"padding": int(row["padding_mask"].sum())}
    for name, microbatch in (("masked", row), ("valid only", _without_padding(row)), ("unmarked", unmarked)):
        get_moe_layer_wise_logging_tracker().clear()
        train_gpt.forward_step(iter([microbatch]), model)
        out[name] = {k: v["values"].tolist() for k, v in get_moe_layer_wise_logging_tracker().items()}
    get_moe_layer_wise_logging_tracker().clear()
    return out


def test_router_losses_of_a_padded_row_are_those_of_its_tokens(records):
    """forward_step hands the SFT row's padding to the model as padding_mask: the routers'
    balance and z losses are those of the row without its padding."""
    _, tokenizer, jsonl = records
    (out,) = run_distributed(1, _router_losses_worker, tokenizer, jsonl)
    assert out["padding"] >= 2
    masked, valid, unmarked = out["masked"], out["valid only"], out["unmarked"]
    assert sorted(masked) == ["load_balancing_loss", "z_loss"]
    for name, values in masked.items():
        assert len(values) == 2 and min(values) > 0, name
        torch.testing.assert_close(torch.tensor(values), torch.tensor(valid[name]), rtol=1e-12, atol=0,
                                   msg=lambda m: f"{name}: {m}")
        assert (torch.tensor(values) - torch.tensor(unmarked[name])).abs().min() > 1e-8, name


def test_rows_without_a_response_token_stop_the_run(records, tmp_path):
    root, tokenizer, _ = records
    long_prompt = " ".join(TOKENIZER_WORDS[:40])  # 40 tokens: more than a row of --seq-len 32 + 1
    short = [{"prompt": f"w{k} w{k + 1}", "response": f"w{k + 2}"} for k in range(36)]
    long = [{"prompt": long_prompt, "response": "w5"}] * 4
    files = {}
    for name, records_ in (("all long", long * 10), ("long validation", short + long)):
        files[name] = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in records_))
    log = tmp_path / "log.jsonl"
    (errors,) = run_distributed(1, _errors_worker, tokenizer, [
        ["--sft", str(files["all long"])],
        ["--sft", str(files["long validation"]), "--eval-interval", "1", "--log-json", str(log)],
    ])
    assert errors[0] == ("step 1: the train rows [0, 4) hold no response token to train on: their records' "
                         "prompts fill the --seq-len 32 rows; give a longer --seq-len or shorter prompts")
    assert errors[1] == ("the validation rows [0, 4) hold no response token to evaluate: their records' "
                         "prompts fill the --seq-len 32 rows")
    # the step before it logged its response tokens
    steps = [e for e in map(json.loads, log.read_text().splitlines()) if "step" in e and "loss" in e]
    train, _, _ = gpt_data.build_sft_datasets(str(files["long validation"]), "90,10,0",
                                              gpt_data.HuggingFaceTokenizer(tokenizer), 32, 1234,
                                              gpt_data.split_sizes(3, 4, 1, 1))
    assert [e["loss_tokens"] for e in steps] == [int(sum(train[i]["loss_mask"].sum() for i in range(4)))]
    assert steps[0]["loss_tokens"] > 4


@pytest.mark.slow  # uses the serial runs
def test_export_hf_writes_the_tokenizer(records, serial):
    transformers = pytest.importorskip("transformers")
    root, tokenizer, _ = records
    export = root / "export"
    files = set(os.listdir(export))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files, files
    exported, original = (transformers.AutoTokenizer.from_pretrained(d) for d in (export, tokenizer))
    text = "w3 w17 w296 w0"
    assert exported(text)["input_ids"] == original(text)["input_ids"] == [6, 20, 299, 3]
    assert exported.eos_token == "<eos>" and exported.pad_token == "<pad>"


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
        (["--pad-seq-to-mult", "0"], "--pad-seq-to-mult must be >= 1, got 0"),
        (["--data-cache-path", str(tmp_path)],
         "--data-cache-path is where the index caches of --data-path go: it needs --data-path"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError) as error:
            train_gpt.check_args(train_gpt.parse_args(base + extra), 1)
        assert message in str(error.value), (extra, str(error.value))
    args = train_gpt.parse_args(base[:-2])
    with pytest.raises(ValueError, match="--sft needs the tokenizer of its records"):
        train_gpt.check_args(args, 1)
    with pytest.raises(ValueError, match="--pad-seq-to-mult pads the records of --sft: it needs --sft"):
        train_gpt.check_args(train_gpt.parse_args(["--tp", "1", "--pp", "1", "--pad-seq-to-mult", "4"]), 1)
    for multiple in ("1", "6"):  # the padding must split into 2 x cp chunks
        with pytest.raises(ValueError) as error:
            train_gpt.check_args(train_gpt.parse_args(base + ["--cp", "2", "--pad-seq-to-mult", multiple]), 2)
        assert str(error.value) == (
            "--sft at --cp 2 splits every record into 2 x --cp = 4 chunks: give --pad-seq-to-mult a multiple "
            f"of 4, got {multiple} (the same value at every layout the run trains or resumes at, so that all "
            "train the same rows)")
    train_gpt.check_args(train_gpt.parse_args(base + ["--cp", "2", "--pad-seq-to-mult", "8"]), 2)
    args = train_gpt.parse_args(base + ["--eval-interval", "2"])
    train_gpt.check_args(args, 1)  # a valid run: the tokenizer's 300 tokens sized the model
    assert args.vocab_size == 384 and args.tokens == 300
