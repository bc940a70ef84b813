"""``--config FILE``: a YAML or TOML file of flags as command-line tokens, which the program parses
before the command line's own (so the command line overrides the file: argparse keeps the last
value). Keys are flag names without the dashes, with ``-`` or ``_``; a mapping whose key is not a
flag is a section of flags (one level)."""

from __future__ import annotations

import argparse
import os


def _unique_key_loader(yaml):
    """PyYAML's safe loader refusing a key repeated in one mapping (``safe_load`` keeps the last)."""

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            for i, key in enumerate(keys):
                if key in keys[:i]:
                    mark = node.value[i][0].start_mark
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key!r} given twice in one mapping", mark)
            return super().construct_mapping(node, deep=deep)

    return Loader


def _read(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"--config {path!r}: no such file")
    extension = os.path.splitext(path)[1].lower()
    if extension not in (".yaml", ".yml", ".toml"):
        raise ValueError(f"--config {path!r}: expected a .yaml, .yml or .toml file")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path!r}: cannot be read as UTF-8 text ({e})") from None
    if extension == ".toml":
        import tomllib

        try:
            content = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {path!r}: not valid TOML ({e})") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"--config {path!r}: YAML files need the PyYAML package (pip install pyyaml)"
                             ) from None
        try:
            content = yaml.load(text, Loader=_unique_key_loader(yaml))  # noqa: S506  (a SafeLoader)
        except yaml.YAMLError as e:
            raise ValueError(f"--config {path!r}: not valid YAML ({' '.join(str(e).split())})") from None
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise ValueError(f"--config {path!r}: expected a mapping of flags at the top, got "
                         f"{type(content).__name__}")
    return content


def _tokens(path: str, key: str, action: argparse.Action, value) -> list[str]:
    flag = action.option_strings[0]
    where = f"--config {path!r}: {key}"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {flag} is a switch, expected true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, bool) or value is None or isinstance(value, dict):
        raise ValueError(f"{where}: expected a value for {flag}, got {value!r}")
    if isinstance(value, list):
        if action.nargs not in ("+", "*") and not isinstance(action.nargs, int):
            raise ValueError(f"{where}: {flag} takes one value, got the list {value!r}")
        if any(isinstance(v, (bool, list, dict)) or v is None for v in value):
            raise ValueError(f"{where}: expected numbers or strings in the list of {flag}, got {value!r}")
        return [flag, *(repr(v) if isinstance(v, float) else str(v) for v in value)]
    return [flag, repr(value) if isinstance(value, float) else str(value)]


def config_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The command-line tokens of the flags in the file ``path``, for ``parser``."""
    actions = {option[2:].replace("_", "-"): action for action in parser._actions
               for option in action.option_strings if option.startswith("--")}
    entries, seen = [], {}
    for key, value in _read(path).items():
        name = str(key).replace("_", "-")
        if name not in actions and isinstance(value, dict):  # a section
            entries += [(f"{key}.{k}", str(k).replace("_", "-"), v) for k, v in value.items()]
        else:
            entries.append((str(key), name, value))
    tokens = []
    for key, name, value in entries:
        action = actions.get(name)
        if action is None or action.dest in ("help", "config"):
            what = "a --config file cannot name another" if name == "config" else "not a flag of this program"
            raise ValueError(f"--config {path!r}: {key}: {what} (docs/training_cli.md lists the flags)")
        if action.dest in seen:
            raise ValueError(f"--config {path!r}: {key} sets what {seen[action.dest]} sets: give it once")
        seen[action.dest] = key
        tokens += _tokens(path, key, action, value)
    return tokens
