"""The configuration every Megatron dataset is built from: seed, sequence length, the blend (one
for all splits or one per split), the split and where the index cache lives."""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field

from megatron_ext.datasets.utils import Split, check_blend_weights, log_single_rank, normalize

logger = logging.getLogger(__name__)


@dataclass
class BlendedMegatronDatasetConfig:
    """Megatron-core's dataset configuration, field for field. ``tokenizer`` is any object with the
    attributes the datasets read (``eod``, ``vocab_size``, ``pad`` where it has one, and
    ``unique_identifiers``, part of the cache key), such as a
    :class:`megatron_ext.datasets.tokenizer.HuggingFaceTokenizer`."""

    random_seed: int
    sequence_length: int
    blend: tuple[list[str], list[float] | None] | None = None
    blend_per_split: list[tuple[list[str], list[float] | None] | None] | None = None
    multiple_validation_sets: bool | None = None
    full_validation: bool | None = None
    split: str | None = None
    split_matrix: list[tuple[float, float] | None] | None = field(init=False, default=None)
    num_dataset_builder_threads: int = 1
    path_to_cache: str | None = None
    mmap_bin_files: bool = True
    mock: bool = field(init=False, default=False)
    tokenizer: object | None = None
    mid_level_dataset_surplus: float = 0.005
    allow_ambiguous_pad_tokens: bool | None = False
    fast_cache_load: bool = False
    defer_npy_index_mmap: bool = False

    def __post_init__(self) -> None:
        if self.sequence_length < 1:
            raise ValueError(f"sequence_length must be >= 1, got {self.sequence_length}")
        if (self.fast_cache_load or self.defer_npy_index_mmap) and self.path_to_cache is None:
            raise ValueError("fast_cache_load and defer_npy_index_mmap read the cache: give path_to_cache")
        if self.fast_cache_load and self.blend is not None:
            raise ValueError("fast_cache_load works with blend_per_split, not with blend")
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None:
                raise ValueError("blend and blend_per_split are incompatible")
            if self.split is not None:
                raise ValueError("split and blend_per_split are incompatible")
            if len(self.blend_per_split) != len(Split):
                raise ValueError(
                    f"blend_per_split must contain {len(Split)} blends (train, valid, test), got "
                    f"{len(self.blend_per_split)}"
                )
            for split in Split:
                blend = self.blend_per_split[split.value]
                if blend is None:
                    log_single_rank(logger, logging.INFO, f"blend not provided for {split.name} split")
                else:
                    check_blend_weights(blend[0], blend[1], f"{split.name} blend")
        else:
            if self.blend is not None:
                check_blend_weights(self.blend[0], self.blend[1])
                if self.split is None:
                    raise ValueError("split must be provided when blend is not None")
            else:
                self.mock = True
                log_single_rank(
                    logger, logging.INFO, "Let mock = True, as both blend and blend_per_split are None"
                )
                self.split = "1,1,1"
            self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))
            log_single_rank(logger, logging.INFO, f"Let split_matrix = {self.split_matrix}")


def parse_and_normalize_split(split: str) -> list[float]:
    """The split string's train, valid and test weights ("969,30,1"; missing ones are 0) divided
    by their sum, which must be positive."""
    values = list(map(float, re.findall(r"[.0-9]+", split)))
    if not values or len(values) > len(Split) or re.search(r"-", split):
        raise ValueError(
            f"split {split!r} must be up to {len(Split)} comma-separated numbers >= 0 (train, valid, "
            "test), such as '969,30,1'"
        )
    values = values + [0.0] * (len(Split) - len(values))
    if sum(values) <= 0:
        raise ValueError(
            f"split {split!r} sums to {sum(values):g}; the weights must sum to a positive number"
        )
    return normalize(values)


def convert_split_vector_to_split_matrix(
    vector_a: list[float], vector_b: list[float] | None = None
) -> list[tuple[float, float] | None]:
    """The [begin, end) fraction of the data of each split: [0.99, 0.01, 0.0] ->
    [(0, 0.99), (0.99, 1.0), None]. With ``vector_b``, each split's overlap of both (None if
    empty)."""
    if vector_b is None:
        vector_b = vector_a
    bounds_a = functools.reduce(lambda acc, x: acc + [acc[-1] + x], vector_a, [0])
    bounds_b = functools.reduce(lambda acc, x: acc + [acc[-1] + x], vector_b, [0])
    matrix = []
    for (a0, a1), (b0, b1) in zip(zip(bounds_a[:-1], bounds_a[1:]), zip(bounds_b[:-1], bounds_b[1:])):
        matrix.append(None if min(a1, b1) <= max(a0, b0) else (max(a0, b0), min(a1, b1)))
    return matrix
