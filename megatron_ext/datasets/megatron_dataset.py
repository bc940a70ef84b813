"""The base of the datasets the builder makes splits of: what identifies one (and names its index
cache files), and the pad token."""

from __future__ import annotations

import hashlib
import json
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Iterable, Union

import numpy
import torch

from megatron_ext.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_ext.datasets.indexed_dataset import IndexedDataset
from megatron_ext.datasets.utils import Split

LowLevelDataset = Union[IndexedDataset, Iterable]

_PAD_TOKEN_ID = -1


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """A split of a low-level dataset (its documents ``indices``), ``num_samples`` samples long (or
    one epoch for None).

    ``unique_description`` (JSON of the class, path, sample count, split and the config's key
    attributes) and its MD5 ``unique_description_hash`` are Megatron-core's, character for
    character: they name the cache files, so either library reads the other's cache."""

    def __init__(
        self,
        dataset: LowLevelDataset,
        dataset_path: str | None,
        indices: numpy.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config

        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attr in self._key_config_attributes():
            self.unique_identifiers[attr] = getattr(self.config, attr)
        self.unique_description = json.dumps(
            self.unique_identifiers, indent=4, default=lambda obj: obj.unique_identifiers
        )
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8"), usedforsecurity=False
        ).hexdigest()
        self._pad_token_id = self._resolve_pad_token_id()

    def _resolve_pad_token_id(self) -> int:
        """The tokenizer's pad id, or -1 (never a token) when it has none or it is also a special
        token (EOD or EOS) and ambiguous pad tokens are not allowed."""
        tokenizer = self.config.tokenizer
        try:
            pad = tokenizer.pad
        except Exception:  # no tokenizer, or one without a pad token
            pad = None
        if pad is None:
            return _PAD_TOKEN_ID
        specials = []
        try:
            specials = [v for k, v in tokenizer.special_tokens_dict.items() if k != "pad_token"]
        except (AttributeError, IndexError, ValueError):
            pass
        if not specials:
            for name in ("eos", "eod"):
                try:
                    specials.append(getattr(tokenizer, name))
                except (AttributeError, NotImplementedError):
                    pass
        if pad in specials:
            warnings.warn(
                "The pad token id in the tokenizer collides with another special token id. "
                + (
                    "Pad tokens present in the data are masked out as padding."
                    if self.config.allow_ambiguous_pad_tokens
                    else "Tokens with that id are not treated as padding."
                )
            )
            if not self.config.allow_ambiguous_pad_tokens:
                return _PAD_TOKEN_ID
        return pad

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: LowLevelDataset) -> int:
        """The number of elements (sequences, documents) the splits divide."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: BlendedMegatronDatasetConfig) -> LowLevelDataset:
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> list[str]:
        """The config attributes that identify the dataset (and its cache)."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int:
        pass

    @abstractmethod
    def __getitem__(self, idx: int) -> dict[str, torch.Tensor | numpy.ndarray]:
        pass
