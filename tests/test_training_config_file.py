"""megatron_ext.training.config_file.config_argv on a small parser of its own: a YAML or TOML file gives
the Namespace of the equivalent command line, sections hold flags, the command line overrides the file,
and every bad file or key is one ValueError naming the file and the key. The recipes of examples/configs/
are valid YAML with each key once."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from megatron_ext.training.config_file import config_argv
from tests.conftest import ROOT


def toy_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    p.add_argument("--tensor-model-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--no-load-rng", dest="load_rng", action="store_false")
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    p.add_argument("--data-path", nargs="+", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--config", default=None)
    return p


COMMAND_LINE = ["--tp", "2", "--lr", "1e-4", "--swiglu", "--no-load-rng", "--normalization", "RMSNorm",
                "--data-path", "0.3", "a", "0.7", "b", "--tokenizer-model", "Qwen/Qwen3-8B"]
YAML = """\
tensor-model-parallel-size: 2
lr: 1.0e-4
swiglu: true
no_load_rng: true
normalization: RMSNorm
data-path: [0.3, a, 0.7, b]
tokenizer-model: Qwen/Qwen3-8B
"""
TOML = """\
tp = 2
swiglu = true
[training]
lr = 1e-4
no-load-rng = true
[model]
normalization = "RMSNorm"
[data]
data_path = [0.3, "a", 0.7, "b"]
tokenizer_model = "Qwen/Qwen3-8B"
"""


def parse(path: Path, command_line: list[str] = ()) -> argparse.Namespace:
    parser = toy_parser()
    return parser.parse_args(config_argv(str(path), parser) + list(command_line))


def test_yaml_and_toml_equal_the_command_line(tmp_path):
    expected = toy_parser().parse_args(COMMAND_LINE)
    assert (expected.tensor_model_parallel_size, expected.lr, expected.load_rng) == (2, 1e-4, False)
    for name, text in (("run.yaml", YAML), ("run.yml", YAML), ("run.toml", TOML)):
        (tmp_path / name).write_text(text)
        assert parse(tmp_path / name) == expected, name
    # false switches emit nothing: the defaults stay
    (tmp_path / "off.yaml").write_text("swiglu: false\nno-load-rng: false\n")
    assert parse(tmp_path / "off.yaml") == toy_parser().parse_args([])
    # a float keeps its digits through the tokens
    (tmp_path / "lr.toml").write_text("lr = 0.1234567890123456789\n")
    assert parse(tmp_path / "lr.toml").lr == 0.1234567890123456789


def test_the_command_line_overrides_the_file(tmp_path):
    (tmp_path / "run.yaml").write_text(YAML)
    args = parse(tmp_path / "run.yaml",
                 ["--tensor-model-parallel-size", "8", "--lr", "0.5", "--data-path", "c"])
    assert (args.tensor_model_parallel_size, args.lr, args.data_path) == (8, 0.5, ["c"])
    assert args.swiglu and args.normalization == "RMSNorm"


def errors() -> dict[str, tuple[bytes | str, str, str]]:
    """file name: (its content, the key its error names, a phrase of the error)."""
    return {
        "unknown.yaml": ("hidden-sise: 64\n", "hidden-sise", "not a flag of this program"),
        "unknown.toml": ("[model]\nhidden-sise = 64\n", "model.hidden-sise", "not a flag of this program"),
        "spellings.yaml": ("tp: 2\ntensor_model_parallel_size: 4\n", "tensor_model_parallel_size", "once"),
        "sections.toml": ("[a]\nlr = 1.0\n[b]\nlr = 2.0\n", "b.lr", "once"),
        "switch.yaml": ("swiglu: 1\n", "swiglu", "true or false"),
        "bool.yaml": ("lr: true\n", "lr", "True"),
        "list.yaml": ("lr: [1, 2]\n", "lr", "list"),
        "listitem.yaml": ("data-path: [a, [b]]\n", "data-path", "list"),
        "mapping.yaml": ("model:\n  lr:\n    x: 1\n", "model.lr", "x"),
        "none.yaml": ("lr:\n", "lr", "None"),
        "nested.yaml": ("config: other.yaml\n", "config", "another"),
        "top.yaml": ("- tp\n- 2\n", "", "mapping"),
        "broken.yaml": ("lr: 1\ntp: [2\n", "", "line"),
        "broken.toml": ("lr = 1\ntp = \n", "", "line 2"),
        "latin.yaml": ("lr: 1 # \xe9\n".encode("latin-1"), "", "UTF-8"),
        "run.json": ("{}", "", ".yaml, .yml or .toml"),
    }


def test_each_bad_file_or_key_is_one_error_naming_both(tmp_path):
    for name, (content, key, phrase) in errors().items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ValueError) as error:
            config_argv(str(path), toy_parser())
        message = str(error.value)
        assert "\n" not in message and str(path) in message and phrase in message, (name, message)
        assert key in message, (name, message)
    for path in (tmp_path / "missing.yaml", tmp_path):  # no file; a directory
        with pytest.raises(ValueError, match=str(path)):
            config_argv(str(path), toy_parser())


def test_a_key_repeated_in_one_yaml_mapping_is_refused(tmp_path):
    path = tmp_path / "repeated.yaml"
    path.write_text("lr: 1.0\nlr: 2.0\n")
    with pytest.raises(ValueError, match=f"{path}.*lr"):
        config_argv(str(path), toy_parser())


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key repeated in one mapping (safe_load keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        repeated = sorted({str(k) for k in keys if keys.count(k) > 1})
        if repeated:
            raise yaml.constructor.ConstructorError(None, None, f"repeated keys {repeated}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def test_the_recipes_are_yaml_with_each_key_once():
    from megatron_ext.training.arguments import build_parser

    recipes = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
    assert {p.stem for p in recipes} >= {"llama3_8b", "qwen3_8b", "qwen3_30b_a3b", "mixtral_8x7b",
                                        "deepseek_v3", "gpt_oss_20b"}
    assert all((p.with_name(f"{p.stem}_tiny.yaml")).exists() for p in recipes if not p.stem.endswith("_tiny"))
    parser = build_parser()
    for path in recipes:
        text = path.read_text()
        assert text.startswith("# ") and "torchrun" in text, path.name
        assert f"--config examples/configs/{path.name}" in text, path.name
        content = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506  (a SafeLoader)
        assert isinstance(content, dict) and content, path.name
        tokens = config_argv(str(path), parser)  # every key a flag, once over the sections
        assert tokens and all(isinstance(t, str) for t in tokens), path.name
