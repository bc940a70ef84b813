"""The training program as a user starts it: the ``megatron-ext-train`` console script under torchrun
prints the step report before the first step and Megatron-LM's --log-interval lines, and writes the
TensorBoard scalars of every step and evaluation (read back with TensorBoard's event reader) equal
to its JSON lines; ``--config`` files hold any flag, the command line overriding them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_ext.training.arguments import parse_args

TINY = ("--tp 1 --pp 2 --layers 2 --hidden 32 --heads 4 --seq-len 16 --micro-batch-size 2 "
        "--global-batch-size 4 --lr 1e-2").split() + ["--plot", ""]


def _scalars(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_console_script_reports_logs_and_writes_tensorboard(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "megatron-ext-train")
    assert os.access(script, os.X_OK), f"{script}: the console script is not installed"
    tb, log = tmp_path / "tb", tmp_path / "log.jsonl"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    flags = ("--train-iters 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 255 --eval-interval 2 "
             "--eval-iters 1 --log-interval 2 --lr-decay-style linear --min-lr 1e-3").split()
    argv = [*torchrun, "--no-python", script, *TINY, *flags, "--tensorboard-dir", str(tb),
            "--log-json", str(log)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    # the step report, once, before the first step's line
    report = [i for i, line in enumerate(out) if line.startswith("step report")]
    assert len(report) == 1 and out[report[0]] == (
        "step report (world 2): tp 1, pp 2, cp 1, ep 1, etp none, dp 1, vpp none"
    )
    assert out[report[0] + 1].startswith("parameters: ") and "tokens per step: 4 x 16 = 64" in out
    lines = [line for line in out if line.startswith("iteration ")]
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [2, 4] and report[0] < out.index(
        lines[0]
    )
    assert sum(line.startswith("validation loss at iteration ") for line in out) == 2
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if "step" in r and "event" not in r]
    evals = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("event") == "eval"]
    # the --log-interval line: the mean loss of its two steps
    mean = (steps[2]["loss"] + steps[3]["loss"]) / 2
    assert (
        f"lm loss: {mean:.6E}" in lines[1] and f"learning rate: {steps[3]['learning_rate']:.6E}" in lines[1]
    )
    scalars = _scalars(tb)
    for tag, key in (
        ("lm loss", "loss"),
        ("learning-rate", "learning_rate"),
        ("grad-norm", "grad_norm"),
        ("tokens-per-sec", "tokens_per_s"),
    ):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4], tag
        assert [v for _, v in scalars[tag]] == pytest.approx([r[key] for r in steps], rel=1e-6), (
            tag
        )  # float32
    assert [s for s, _ in scalars["lm loss validation"]] == [2, 4]
    assert [v for _, v in scalars["lm loss validation"]] == pytest.approx(
        [r["val_loss"] for r in evals], rel=1e-6
    )
    assert [v for _, v in scalars["lm loss validation ppl"]] == pytest.approx(
        [r["val_ppl"] for r in evals], rel=1e-6
    )
    assert all(v > 0 for _, v in scalars["mem-max-rss-bytes"])
    # the linear decay from 1e-2 to 1e-3 over the 4 steps' 16 samples, read at 0, 4, 8, 12 samples
    assert [r["learning_rate"] for r in steps] == pytest.approx(
        [1e-2 - 9e-3 * k / 4 for k in range(4)], rel=1e-12
    )


def test_config_file_holds_flags_and_the_command_line_overrides_them(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(
        "# a run's settings\ntensor-model-parallel-size: 2\nnum_layers: 6\nswiglu: true\n"
        "lr: 1.0e-4\nmodel:\n  hidden-size: 64\n  num-attention-heads: 8\n"
        "data-path: [0.3, a, 0.7, b]\n"
    )
    toml_file = tmp_path / "run.toml"
    toml_file.write_text(
        "tensor-model-parallel-size = 2\nnum_layers = 6\nswiglu = true\nlr = 1.0e-4\n"
        "data-path = [0.3, 'a', 0.7, 'b']\n[model]\nhidden-size = 64\nnum-attention-heads = 8\n"
    )
    for path in (yaml_file, toml_file):
        args = parse_args(["--config", str(path), "--num-layers", "8", "--seed", "7"])
        assert (args.tp, args.layers, args.swiglu, args.lr, args.hidden, args.heads, args.seed) == (
            2,
            8,
            True,
            1e-4,
            64,
            8,
            7,
        )
        assert args.data_path == ["0.3", "a", "0.7", "b"]
        assert args.config is None or args.config == str(path)
        # what the file and the command line give equals the command line alone
        alone = parse_args(
            [
                "--tp",
                "2",
                "--layers",
                "8",
                "--swiglu",
                "--lr",
                "1e-4",
                "--hidden",
                "64",
                "--heads",
                "8",
                "--data-path",
                "0.3",
                "a",
                "0.7",
                "b",
                "--seed",
                "7",
            ]
        )
        assert {k: v for k, v in vars(args).items() if k != "config"} == {
            k: v for k, v in vars(alone).items() if k != "config"
        }
    for argv, message in (
        (["--config", str(tmp_path / "missing.yaml")], "missing.yaml"),
        (["--config", str(yaml_file), "--config", str(toml_file)], "--config is given more than once"),
        (["--config"], "argument --config: expected one argument"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_args(argv)
    bad = tmp_path / "bad.yaml"
    bad.write_text("tensor-parallel-size: 2\n")
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        parse_args(["--config", str(bad)])


def test_config_file_errors_name_the_file_and_the_key(tmp_path):
    cases = {
        "switch.yaml": ("swiglu: 1\n", "swiglu: --swiglu is a switch, expected true or false, got 1"),
        "twice.yaml": ("tp: 2\nparallel:\n  tensor_model_parallel_size: 4\n",
                       "parallel.tensor_model_parallel_size sets what tp sets: give it once"),
        "list.yaml": ("num-layers: [2, 4]\n",
                      "num-layers: --num-layers takes one value, got the list [2, 4]"),
        "none.yaml": ("lr:\n", "lr: expected a value for --lr, got None"),
        "nested.yaml": ("config: other.yaml\n", "config: a --config file cannot name another"),
        "top.yaml": ("- tp\n- 2\n", "expected a mapping of flags at the top, got list"),
        "broken.yaml": ("tp: [2\n", "not valid YAML"),
        "broken.toml": ("tp = \n", "not valid TOML"),
        "run.json": ("{}", "expected a .yaml, .yml or .toml file"),
        "unknown.toml": ("[model]\nhidden-sise = 64\n", "model.hidden-sise: not a flag of this program"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError) as error:
            parse_args(["--config", str(tmp_path / name)])
        assert str(error.value).startswith(f"--config {str(tmp_path / name)!r}: "), name
        assert message in str(error.value), (name, str(error.value))
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("seed: 1 # \xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="cannot be read as UTF-8"):
        parse_args(["--config", str(latin)])
    # a switch set false in the file is off; store_false switches turn off with true
    (tmp_path / "off.yaml").write_text("swiglu: false\nno-check-for-nan-in-loss-and-grad: true\n")
    args = parse_args(["--config", str(tmp_path / "off.yaml")])
    assert not args.swiglu and not args.check_for_nan_in_loss_and_grad


def test_the_example_is_a_short_program_over_the_package():
    from tests.conftest import ROOT

    example = (ROOT / "examples" / "train_gpt.py").read_text()
    assert len(example.splitlines()) < 200
    # the program's pieces (model provider, forward step) handed to the package's run
    assert "run(model_provider=model_provider, forward_step_func=forward_step)" in example
