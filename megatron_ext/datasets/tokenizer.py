"""A Hugging Face tokenizer read from a local directory, with the attributes the datasets and the
preprocessing tool use (``vocab_size``, ``eod``, ``pad``, ``tokenize``, ``detokenize``,
``unique_identifiers``).

A directory with a ``tokenizer.json`` is read with the ``tokenizers`` library (its special tokens
from ``tokenizer_config.json``); any other goes through ``transformers.AutoTokenizer``. Both are
imported when a tokenizer is loaded, never when megatron_ext is."""

from __future__ import annotations

import json
import os
from collections import OrderedDict

# A tokenizer's files: one of these makes a directory a tokenizer directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json_object(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8; expected a JSON object") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


class HuggingFaceTokenizer:
    """The tokenizer of ``path`` (a model or tokenizer directory). ``eod`` is its end-of-sequence
    token (what ends each document); texts are encoded without added special tokens, as
    Megatron-core's Hugging Face tokenizer does by default."""

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise ValueError(f"the tokenizer directory {path!r} does not exist")
        if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
            raise ValueError(
                f"{path!r} holds no tokenizer: expected one of {', '.join(TOKENIZER_FILES)} (a Hugging "
                "Face model or tokenizer directory)"
            )
        self.path = path
        config_file = os.path.join(path, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_file):
            config = _read_json_object(config_file)
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tokenizer_file):
            from tokenizers import Tokenizer

            try:
                self._fast = Tokenizer.from_file(tokenizer_file)
            except Exception as e:  # the library raises a bare Exception for a file it cannot parse
                raise ValueError(
                    f"{tokenizer_file}: not a valid tokenizer file ({e}); expected the tokenizer.json a "
                    "Hugging Face tokenizer saves"
                ) from None
            self._auto = None
            eos = _token_content(config.get("eos_token"))
            pad = _token_content(config.get("pad_token"))
            self._eod = self._fast.token_to_id(eos) if eos is not None else None
            self._pad = self._fast.token_to_id(pad) if pad is not None else None
            self._vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
        else:
            from transformers import AutoTokenizer

            try:
                self._auto = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from None
            self._fast = None
            self._eod, self._pad = self._auto.eos_token_id, self._auto.pad_token_id
            self._vocab_size = len(self._auto)
        if self._eod is None:
            raise ValueError(
                f"the tokenizer in {path!r} has no end-of-sequence token (eos_token in "
                "tokenizer_config.json): "
                "documents need one to end with"
            )

    @property
    def vocab_size(self) -> int:
        """The number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int | None:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._auto(text, add_special_tokens=False).input_ids

    def detokenize(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=False)
        return self._auto.decode(list(ids))

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What identifies the tokenizer in a dataset's cache key."""
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("tokenizer_path", [os.path.abspath(self.path)]),
            ]
        )


class NullTokenizer:
    """Megatron-LM's NullTokenizer: no text, the ids 0 to ``vocab_size - 1`` as they are, and
    ``vocab_size`` itself the end of document, so its vocabulary holds ``vocab_size + 1`` ids (what
    ``--tokenizer-type NullTokenizer --vocab-size N`` sizes the model with, before padding)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"NullTokenizer needs a vocab_size >= 1, got {vocab_size}")
        self._ids = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._ids + 1

    @property
    def eod(self) -> int:
        return self._ids

    @property
    def eos(self) -> int:
        return self._ids

    @property
    def pad(self) -> None:
        return None

    def tokenize(self, text: str) -> list[int]:
        return [int(token) for token in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                            ("vocab_size", self._ids)])
