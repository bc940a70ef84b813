"""Inputs that must stop a run before any training, with one message naming the flag, file or field:
non-finite numbers, unwritable --save, an --export-hf that would mix or overwrite models, Hugging
Face directories that are broken or two models at once, and the checkpoint converter's files. And
the guard at every save: a state with a NaN or an infinity is never written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ROOT, SMALL, command_lines_end_in_one_error_line, load_train_gpt
from tests.distributed import run_distributed

TINY = SMALL + ["--layers", "2", "--dtype", "float64", "--tp", "1", "--pp", "1"]
LLAMA = ["--arch", "llama", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--tp", "1", "--pp", "1", "--no-progress",
         "--plot", ""]


def _refusal(argv: list[str], world: int = 1) -> str:
    train_gpt = load_train_gpt()
    with pytest.raises(ValueError) as error:
        train_gpt.check_args(train_gpt.parse_args(argv), world)
    return str(error.value)


def _accepts(argv: list[str], world: int = 1) -> None:
    train_gpt = load_train_gpt()
    train_gpt.check_args(train_gpt.parse_args(argv), world)


def test_numbers_must_be_finite_and_in_range():
    refused = {
        # the bound: Adam's first step moves the weights by lr / (1 - beta1), a float32 scalar
        ("--lr", "inf"): "--lr must be a finite number in [0, 3.40282e+37], got inf",
        ("--lr", "nan"): "--lr must be a finite number in [0, 3.40282e+37], got nan",
        ("--lr", "1e39"): "--lr must be a finite number in [0, 3.40282e+37], got 1e+39",
        ("--lr", "3.4e38"): "--lr must be a finite number in [0, 3.40282e+37], got 3.4e+38",
        ("--lr", "-1"): "--lr must be a finite number in [0, 3.40282e+37], got -1.0",
        ("--clip-grad", "nan"): "--clip-grad must be a finite number in [0, 3.40282e+38], got nan",
        ("--clip-grad", "-1"): "--clip-grad must be a finite number in [0, 3.40282e+38], got -1.0",
        ("--weight-decay", "inf"): "--weight-decay must be a finite number in [0, 3.40282e+38], got inf",
        ("--dropout", "nan"): "--dropout must be a finite number in [0, 1), got nan",
        ("--dropout", "1"): "--dropout must be a finite number in [0, 1), got 1.0",
        ("--timeout", "nan"): "--timeout must be a positive finite number of seconds, got nan",
        ("--timeout", "inf"): "--timeout must be a positive finite number of seconds, got inf",
    }
    for argv, message in refused.items():
        assert _refusal(TINY + list(argv)) == message, argv
    _accepts(TINY + ["--lr", "0", "--clip-grad", "1e30", "--weight-decay", "0.1", "--dropout", "0.5"])


def test_save_directory_is_checked_at_start(tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    assert _refusal(TINY + ["--save", str(file)]) == f"--save {str(file)!r} is not a directory"
    under = str(file / "x")
    assert _refusal(TINY + ["--save", under]) == (
        f"--save {under!r} cannot be created: {str(file)!r} is not a directory"
    )
    assert "cannot be created: '/dev/null' is not a directory" in _refusal(TINY + ["--save", "/dev/null/x"])
    _accepts(TINY + ["--save", str(tmp_path / "new" / "deeper")])  # made at the first save
    # the files written as the run goes or at its end: not a directory, in a directory that can be made
    for flag in ("--log-json", "--plot"):
        assert _refusal(TINY + [flag, str(tmp_path)]) == (
            f"{flag} {str(tmp_path)!r} is a directory; expected the path of a file"
        )
        assert _refusal(TINY + [flag, under]) == (
            f"{flag} {under!r}: its directory {str(file)!r} is not a directory"
        )
        _accepts(TINY + [flag, str(tmp_path / "new" / "out")])


def _hf_dir(path, **config_changes) -> str:
    """A Llama-shaped Hugging Face directory: config.json and one safetensors file (the tensors'
    shapes are not read by the start-up checks)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = dict(model_type="llama", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=96, vocab_size=256, max_position_embeddings=64,
                  rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False)
    config.update(config_changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f)
    save_file({"model.embed_tokens.weight": torch.zeros(256, 32)}, os.path.join(path, "model.safetensors"))
    return str(path)


def test_hf_directories_are_checked_at_start(tmp_path):
    good = _hf_dir(tmp_path / "good")
    _accepts(LLAMA + ["--load-hf", good])

    truncated = _hf_dir(tmp_path / "truncated")
    file = os.path.join(truncated, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 100)
    message = _refusal(LLAMA + ["--load-hf", truncated])
    expected = f"--load-hf {truncated!r}: {file!r} is not a readable safetensors file"
    assert message.startswith(expected), message

    neox = _hf_dir(tmp_path / "neox", model_type="gpt_neox")
    assert _refusal(LLAMA + ["--load-hf", neox]) == (
        f"--load-hf {neox!r}: model_type 'gpt_neox' is not supported: one of "
        "['llama', 'mistral', 'qwen2', 'qwen3', 'mixtral', 'qwen2_moe', 'qwen3_moe', 'deepseek_v2', "
        "'deepseek_v3', 'gpt_oss']"
    )
    headless = _hf_dir(tmp_path / "headless", num_attention_heads=None)
    assert _refusal(LLAMA + ["--load-hf", headless]) == (
        f"--load-hf {headless!r}: the Hugging Face config's 'num_attention_heads' must be a positive "
        "integer, got nothing (the field is missing)"
    )
    # the optional fields, when given, are checked and named too
    for change, message in (
        (dict(model_type=None), "the Hugging Face config has no 'model_type', expected one of ['llama', "),
        (dict(num_key_value_heads=0), "the Hugging Face config's 'num_key_value_heads' must be a positive "
                                      "integer, got 0"),
        (dict(num_key_value_heads=3), "the Hugging Face config's 'num_key_value_heads' (3) must divide "
                                      "'num_attention_heads' (4)"),
        (dict(head_dim=-8), "the Hugging Face config's 'head_dim' must be a positive integer, got -8"),
        (dict(rope_theta="1e4"), "the Hugging Face config's 'rope_theta' must be a positive finite number, "
                                 "got '1e4'"),
    ):
        path = _hf_dir(tmp_path / "fields", **change)
        assert _refusal(LLAMA + ["--load-hf", path]).startswith(f"--load-hf {path!r}: {message}"), change
    _accepts(LLAMA + ["--load-hf", _hf_dir(tmp_path / "fields", num_key_value_heads=2, head_dim=16)])
    invalid = _hf_dir(tmp_path / "invalid")
    with open(os.path.join(invalid, "config.json"), "w") as f:
        f.write('{"model_type": "llama",')
    message = _refusal(LLAMA + ["--load-hf", invalid])
    config = os.path.join(invalid, "config.json")
    assert message.startswith(f"--load-hf {invalid!r}: {config!r} is not valid JSON"), message

    # an index without weight_map; then a valid index beside a single-file model: two models
    indexed = _hf_dir(tmp_path / "indexed")
    index = os.path.join(indexed, "model.safetensors.index.json")
    shard = "model-00001-of-00001.safetensors"
    os.rename(os.path.join(indexed, "model.safetensors"), os.path.join(indexed, shard))
    with open(index, "w") as f:
        json.dump({"metadata": {}}, f)
    assert _refusal(LLAMA + ["--load-hf", indexed]) == (
        f"--load-hf {indexed!r}: {index!r} has no 'weight_map' (tensor name -> shard file)"
    )
    for weight_map, got in (({}, "an empty map"),
                            ({"model.embed_tokens.weight": 1}, "1 for 'model.embed_tokens.weight'")):
        with open(index, "w") as f:
            json.dump({"weight_map": weight_map}, f)
        assert _refusal(LLAMA + ["--load-hf", indexed]) == (
            f"--load-hf {indexed!r}: {index!r}: 'weight_map' must map tensor names to shard file names, "
            f"got {got}"
        )
    with open(index, "w") as f:
        json.dump({"weight_map": {"model.embed_tokens.weight": shard}}, f)
    _accepts(LLAMA + ["--load-hf", indexed])
    _hf_dir(indexed)  # a newer single-file model written beside the sharded one
    assert _refusal(LLAMA + ["--load-hf", indexed]) == (
        f"--load-hf {indexed!r}: {indexed!r} holds both model.safetensors.index.json and "
        "model.safetensors: two models, one sharded and one in a single file; remove one of them"
    )


def test_export_never_mixes_or_overwrites_models(tmp_path):
    source = _hf_dir(tmp_path / "source")
    old = _hf_dir(tmp_path / "old")
    assert _refusal(LLAMA + ["--load-hf", source, "--export-hf", source]) == (
        f"--export-hf {source!r} is the --load-hf directory: exporting would overwrite the model this run "
        "starts from; export to another directory"
    )
    assert _refusal(LLAMA + ["--load-hf", source, "--export-hf", source, "--export-hf-overwrite"]).startswith(
        f"--export-hf {source!r} is the --load-hf directory"
    )
    assert _refusal(LLAMA + ["--export-hf", old]) == (
        f"--export-hf {old!r} is not empty (config.json, model.safetensors): choose a new directory, or pass "
        "--export-hf-overwrite to replace the model in it"
    )
    assert _refusal(LLAMA + ["--export-hf-overwrite"]) == "--export-hf-overwrite needs --export-hf"
    run = str(tmp_path / "run")
    for flags, flag in ((["--save", run], "--save"), (["--load", run, "--save", run], "--save"),
                        (["--load", run, "--allow-fresh-start"], "--load")):
        (tmp_path / "run").mkdir(exist_ok=True)
        assert _refusal(LLAMA + flags + ["--export-hf", run, "--export-hf-overwrite"]) == (
            f"--export-hf {run!r} is the {flag} directory: the Hugging Face model would lie among the "
            "checkpoints; export to another directory"
        )
    file = tmp_path / "file"
    file.write_text("x")
    assert _refusal(LLAMA + ["--export-hf", str(file)]) == f"--export-hf {str(file)!r} is not a directory"
    _accepts(LLAMA + ["--export-hf", old, "--export-hf-overwrite"])
    _accepts(LLAMA + ["--export-hf", str(tmp_path / "new")])
    (tmp_path / "empty").mkdir()
    _accepts(LLAMA + ["--export-hf", str(tmp_path / "empty")])


def test_converter_refuses_what_it_cannot_read_or_write(tmp_path):
    """The converter's refusals in this process (the command line prints them as one `error:`
    line, exit 2: test_command_lines_end_in_one_error_line)."""
    from megatron_ext.training import convert
    from megatron_ext.dist_checkpointing.core import CheckpointingException

    missing, not_torch, out = tmp_path / "missing.pt", tmp_path / "notes.txt", tmp_path / "out"
    not_torch.write_text("not a checkpoint")
    out.mkdir()
    torch.save({"model": {}}, tmp_path / "other.pt")
    parts = {"model": {}, "optimizer": {}, "objects": {}, "common": {}}
    torch.save({**parts, "checkpoint": {"format": convert.FORMAT}}, tmp_path / "saved.pt")
    for argv, message in (
        (["from-torch", str(missing), str(tmp_path / "ckpt")],
         f"{str(missing)!r}: no such file (expected a file written by to-torch)"),
        (["from-torch", str(not_torch), str(tmp_path / "ckpt")],
         f"{str(not_torch)!r} is not a torch.save file written by to-torch (UnpicklingError: "),
        (["from-torch", str(tmp_path / "other.pt"), str(tmp_path / "ckpt")],
         f"{str(tmp_path / 'other.pt')!r} is not an unsharded megatron_ext checkpoint"),
        (["from-torch", str(tmp_path / "saved.pt"), str(not_torch / "ckpt")],
         f"cannot write {str(not_torch / 'ckpt')!r}: [Errno 20] Not a directory: "),
        (["to-torch", str(tmp_path / "ckpt"), str(out)],
         f"{str(out)!r} is a directory; expected the path of the file to write"),
        (["to-torch", str(tmp_path / "ckpt"), str(not_torch / "x.pt")],
         f"cannot write {str(not_torch / 'x.pt')!r}: {str(not_torch)!r} is not a directory"),
    ):
        with pytest.raises(CheckpointingException) as error:
            convert.main(argv)
        assert str(error.value).startswith(message), (argv, str(error.value))
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "other.pt", "out", "saved.pt"]


def _export_over_worker(old: str) -> dict:
    """Exports a trained model over an older sharded export (--export-hf-overwrite), then loads it."""
    train_gpt = load_train_gpt()
    run = [*LLAMA, "--dtype", "float64", "--tp", "1", "--pp", "1"]
    trained = train_gpt.train(train_gpt.parse_args(run + ["--steps", "2", "--export-hf", old,
                                                          "--export-hf-overwrite"]))
    files = sorted(os.listdir(old))
    dist.barrier()
    # the exported weights evaluated on step 1's batch (lr 0: no update) differ from the fresh model's
    loaded = train_gpt.train(train_gpt.parse_args(run + ["--steps", "1", "--lr", "0", "--load-hf", old]))
    fresh = train_gpt.train(train_gpt.parse_args(run + ["--steps", "1", "--lr", "0"]))
    return {"files": files, "trained": trained["losses"], "loaded": loaded["losses"],
            "fresh": fresh["losses"]}


@pytest.mark.slow  # training runs / subprocesses that import torch
def test_export_overwrite_replaces_the_old_model(tmp_path):
    old = _hf_dir(tmp_path / "old", num_hidden_layers=4)
    os.rename(os.path.join(old, "model.safetensors"), os.path.join(old, "model-00001-of-00001.safetensors"))
    with open(os.path.join(old, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}, f)
    (tmp_path / "old" / "README.md").write_text("notes kept beside the model")
    (result,) = run_distributed(1, _export_over_worker, old)
    assert result["files"] == ["README.md", "config.json", "model.safetensors"]
    # the loaded model is the one trained and exported (its step-1 loss is below the fresh model's)
    assert result["loaded"][0] < result["fresh"][0] - 1e-3 and result["trained"][0] == result["fresh"][0]


@pytest.mark.slow  # training runs / subprocesses that import torch
def test_command_lines_end_in_one_error_line(tmp_path):
    """train_gpt.py and the converter: exit 2 with one `error:` line, before any process group."""
    truncated = _hf_dir(tmp_path / "truncated")
    with open(os.path.join(truncated, "model.safetensors"), "r+b") as f:
        f.truncate(50)
    not_torch = tmp_path / "notes.txt"
    not_torch.write_text("not a checkpoint")
    (tmp_path / "out").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2"}
    convert = [sys.executable, "-m", "megatron_ext.dist_checkpointing.convert"]
    cases = (
        ([sys.executable, str(ROOT / "examples" / "train_gpt.py"), *LLAMA, "--load-hf", truncated],
         f"error: --load-hf {truncated!r}: "),
        ([sys.executable, str(ROOT / "examples" / "train_gpt.py"), *TINY, "--lr", "inf"],
         "error: --lr must be a finite number"),
        ([*convert, "from-torch", str(tmp_path / "missing.pt"), str(tmp_path / "ckpt")],
         f"error: {str(tmp_path / 'missing.pt')!r}: no such file (expected a file written by to-torch)"),
        ([*convert, "from-torch", str(not_torch), str(tmp_path / "ckpt")],
         f"error: {str(not_torch)!r} is not a torch.save file written by to-torch (UnpicklingError: "),
        ([*convert, "to-torch", str(tmp_path / "ckpt"), str(tmp_path / "out")],
         f"error: {str(tmp_path / 'out')!r} is a directory; expected the path of the file to write"),
    )
    command_lines_end_in_one_error_line([(argv, env, message) for argv, message in cases])
    assert not (tmp_path / "ckpt").exists()
    # without torchrun: the variables it sets are named, and how to launch
    plain = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    command_lines_end_in_one_error_line([(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), *TINY], plain,
        "error: RANK WORLD_SIZE MASTER_ADDR MASTER_PORT not set: launch with torchrun, e.g. torchrun "
        "--standalone --nproc-per-node 4 examples/train_gpt.py ARGS (or ./dev.sh train ARGS)")])


@pytest.mark.slow  # torchrun starts 2 workers that import torch
def test_launcher_ends_a_failed_run_with_the_workers_error_line(tmp_path):
    """``python -m megatron_ext.training.launch`` (what ./dev.sh train runs): torchrun's report of
    the failed workers, then their first `error:` line as the last line."""
    argv = [sys.executable, "-m", "megatron_ext.training.launch", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "examples" / "train_gpt.py"), *TINY, "--lr", "inf"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = done.stderr.strip().splitlines()
    error = "error: --lr must be a finite number"
    assert done.returncode == 1 and "Root Cause" in done.stderr, done.stderr
    assert lines[-1].startswith(error), lines[-3:]
    first = next(i for i, line in enumerate(lines) if line.startswith(error))
    assert len(lines) - first > 10, lines  # the workers' line came before torchrun's report too


def _nonfinite_save_worker(save_dir: str) -> dict:
    """A parameter (then an optimizer state) of rank 1 made non-finite after step 1's update, then
    every weight by a weight decay that overflows: the save at iteration 1 is refused on both ranks
    and writes nothing."""
    train_gpt = load_train_gpt()
    build = train_gpt.get_megatron_optimizer
    out = {}
    for poison in ("param", "state", "decay"):

        def poisoned(*a, **k):
            optimizer = build(*a, **k)
            step = optimizer.step

            def step_then_poison():
                result = step()
                if dist.get_rank() == 1:
                    if poison == "param":
                        optimizer.get_parameters()[0].data.view(-1)[0] = float("nan")
                    else:
                        next(iter(optimizer.optimizer.state.values()))["exp_avg"].view(-1)[0] = float("inf")
                return result

            optimizer.step = step_then_poison
            return optimizer

        # "decay": no poison; the largest --lr allowed with a weight decay that overflows float32
        train_gpt.get_megatron_optimizer = build if poison == "decay" else poisoned
        extra = ["--dtype", "float32", "--lr", "3.4e37", "--weight-decay", "1e30"] * (poison == "decay")
        args = train_gpt.parse_args(
            TINY + ["--dp", "2", "--steps", "2", "--save", save_dir, "--save-interval", "1", *extra]
        )
        try:
            train_gpt.train(args)
            out[poison] = "no error"
        except Exception as e:  # noqa: BLE001  (compared across ranks)
            out[poison] = f"{type(e).__name__}: {e}"
        out[poison + "_files"] = sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []
        train_gpt.get_megatron_optimizer = build
        dist.barrier()
    return out


@pytest.mark.slow  # training runs / subprocesses that import torch
def test_nonfinite_state_is_never_saved(tmp_path):
    save_dir = str(tmp_path / "run")
    first, second = run_distributed(2, _nonfinite_save_worker, save_dir)
    assert first == second
    final = os.path.join(save_dir, "iter_0000001")
    assert first["param"].startswith(
        f"CheckpointingException: cannot save checkpoint {final!r}: the state is not finite (NaN or Inf in "
        "rank 1: "
    ), first["param"]
    assert "rank 0" not in first["param"] and "rank 0" not in first["state"]
    assert first["param"].endswith("); nothing was written, no checkpoint was saved before")
    assert "rank 1: optimizer exp_avg of " in first["state"], first["state"]
    assert first["decay"].startswith(
        f"CheckpointingException: cannot save checkpoint {final!r}: the state is not finite (NaN or Inf in "
        "rank 0: embedding.word_embeddings.weight, "
    ), first["decay"]
    assert first["param_files"] == first["state_files"] == first["decay_files"] == []


def _token_id_worker() -> str:
    from megatron_ext.training import gpt_data

    top = 400 if dist.get_rank() == 1 else 7  # one rank's corpus from a larger tokenizer
    batch = {"tokens": torch.tensor([[1, top]]), "labels": torch.tensor([[top, 2]])}
    try:
        gpt_data.check_token_ids([batch], 300, "the train split", "cpu", 512)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_token_id_error_names_the_tokenizers_vocabulary_and_the_padded_models():
    """Under --vocab-size 512 with a 300-token tokenizer the ids must lie below 300: the message
    says whose vocabulary that is, on every rank."""
    first, second = run_distributed(2, _token_id_worker)
    assert first == second
    assert first.startswith(
        "the train split holds token id 400, outside the tokenizer's vocabulary of 300 tokens (the model's "
        "vocabulary of 512 only pads it): the corpus was tokenized with another tokenizer"), first
