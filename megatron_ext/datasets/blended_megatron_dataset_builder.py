"""Builds the train, valid and test datasets of a config: each split of each corpus as a
mid-level dataset (a GPTDataset), blended when several corpora contribute.

Rank 0 builds first and writes the index caches; the other ranks build after it, from the cache.
Where Megatron-core's ranks meet at a barrier, ours receive rank 0's outcome: an error rank 0 hit
is raised on every rank instead of leaving the others waiting."""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Union

import numpy
import torch

from megatron_ext.datasets.blended_dataset import BlendedDataset
from megatron_ext.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_ext.datasets.gpt_dataset import GPTDatasetConfig
from megatron_ext.datasets.megatron_dataset import LowLevelDataset, MegatronDataset
from megatron_ext.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)

MidLevelDataset = MegatronDataset
TopLevelDataset = Union[BlendedDataset, MidLevelDataset]
DistributedDataset = Union[TopLevelDataset, MidLevelDataset, LowLevelDataset, torch.utils.data.Dataset]


def _share_rank0_outcome(error: BaseException | None) -> None:
    """Every rank calls this where rank 0 may have failed alone (it built first): rank 0's error,
    if any, is raised on every rank. Takes the place of a barrier."""
    outcome = [None if error is None else (type(error).__name__, str(error))]
    torch.distributed.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        kind, message = outcome[0]
        exception = {"ValueError": ValueError, "IndexError": IndexError}.get(kind, RuntimeError)
        raise exception(f"{message} (raised on rank 0 while it built the datasets)")


def _on_rank0_first(build: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``build()`` on rank 0, its error kept for :func:`_share_rank0_outcome`."""
    if torch.distributed.get_rank() != 0:
        return None, None
    try:
        return build(), None
    except Exception as error:  # re-raised by _share_rank0_outcome on every rank
        return None, error


class BlendedMegatronDatasetBuilder:
    """Builds the splits of ``config`` with ``cls`` (e.g. GPTDataset): ``sizes`` the number of
    samples per split (None: one epoch); ``is_built_on_rank()`` says whether this rank needs
    the datasets (returning None where not). Megatron-core's signature and behaviour."""

    def __init__(
        self,
        cls: type[MidLevelDataset],
        sizes: list[int | None],
        is_built_on_rank: Callable[[], bool],
        config: BlendedMegatronDatasetConfig,
    ):
        self.cls = cls
        self.sizes = sizes
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        if len(sizes) != len(Split):
            raise ValueError(f"sizes must give {len(Split)} sample counts (train, valid, test), got {sizes}")
        for split, size in zip(Split, sizes):
            if size is not None and size < 0:
                raise ValueError(f"the {split.name} size must be >= 0 or None, got {size}")
        log_single_rank(
            logger,
            logging.INFO,
            f"Building {cls.__name__} splits with sizes={self.sizes} and config={self.config}",
        )
        if not self.config.mock:
            for split in Split:
                if self.config.blend_per_split is None:
                    weights_are_none = self.config.blend[1] is None
                else:
                    if self.config.blend_per_split[split.value] is None:
                        continue
                    weights_are_none = self.config.blend_per_split[split.value][1] is None
                if self.sizes[split.value] is None and not weights_are_none:
                    raise ValueError(
                        f"the {split.name} split has blend weights but no size: weights need a number of "
                        "samples"
                    )

    def build(self) -> list[TopLevelDataset | None]:
        """The dataset of each split (None for a split without data). Call on every rank."""
        datasets = self._build_blended_dataset_splits()
        for dataset in datasets:
            if dataset is not None and len(dataset) > 0:
                if isinstance(dataset, BlendedDataset):
                    assert dataset.size is None or dataset.size == len(dataset)
                elif isinstance(dataset, MegatronDataset):
                    assert dataset.num_samples is None or dataset.num_samples <= len(dataset)
        return datasets

    def _blend(
        self,
        megatron_datasets: list,
        prefixes: list[str],
        weights: list[float] | None,
        size: int | None,
        target: list[list[int]] | None,
        split_index: int,
    ):
        """The top-level dataset of one split over its mid-level ``megatron_datasets``."""
        if weights is not None and size is not None:
            size_i = sum(list(zip(*target))[split_index])  # as the targets asked, not ``size``
        elif weights is None:
            try:
                weights = [len(d) for d in megatron_datasets]
            except TypeError:  # not built on this rank
                weights = [0 for _ in prefixes]
            size_i = min(size, sum(weights)) if size is not None else None
        else:
            raise ValueError("Using client-specified weights requires client-specified size")
        synchronize = not (isinstance(self.config, GPTDatasetConfig) and self.config.fast_cache_load)
        return self.build_generic_dataset(
            BlendedDataset,
            self.is_built_on_rank,
            synchronize,
            megatron_datasets,
            weights,
            size_i,
            self.config,
        )

    def _mid_level_sizes(
        self, prefixes: list[str], weights: list[float] | None, sizes: list[int | None]
    ) -> tuple[list[list[int]] | None, list[list[int | None]]]:
        """The samples each corpus contributes per split (target), and those built (with surplus)."""
        if weights is None:
            return None, [[None for _ in Split] for _ in prefixes]
        return (
            _get_size_per_split_per_dataset(weights, sizes),
            _get_size_per_split_per_dataset(weights, sizes, surplus=self.config.mid_level_dataset_surplus),
        )

    def _build_blended_dataset_splits(self) -> list[TopLevelDataset | None]:
        if self.config.mock:
            try:
                return self._build_megatron_dataset_splits(None, self.config.split_matrix, self.sizes)
            except Exception as error:
                raise Exception(f"{self.cls.__name__} failed to build as a mock data generator") from error

        if self.config.blend:  # every split drawn from one blend
            prefixes, weights = self.config.blend
            if weights is not None:
                weights = normalize(weights)
            split = self.config.split_matrix
            if len(prefixes) == 1 and weights is None:
                return self._build_megatron_dataset_splits(prefixes[0], split, self.sizes)
            target, buffer = self._mid_level_sizes(prefixes, weights, self.sizes)
            megatron_datasets = self._build_megatron_datasets_parallel(prefixes, split, buffer)
            return [
                self._blend(megatron_datasets[i], prefixes, weights, self.sizes[i], target, i)
                if split[i] is not None
                else None
                for i in range(len(Split))
            ]

        blended_datasets = [None] * len(Split)  # a blend per split
        for i in range(len(Split)):
            blend = self.config.blend_per_split[i]
            if blend is None:
                continue
            split_spoof = [None] * len(Split)
            split_spoof[i] = (0.0, 1.0)
            sizes_spoof = [0] * len(Split)
            sizes_spoof[i] = self.sizes[i]
            prefixes, weights = blend
            if weights is not None:
                weights = normalize(weights)
            if len(prefixes) == 1:
                blended_datasets[i] = self._build_megatron_dataset_splits(
                    prefixes[0], split_spoof, sizes_spoof
                )[i]
                continue
            if self.config.multiple_validation_sets and i == Split.valid.value:
                if self.config.full_validation and sizes_spoof[i] is not None:
                    raise ValueError(
                        "full_validation builds one epoch of each validation set: give size None"
                    )
                blended_datasets[i] = [
                    self._build_megatron_dataset_splits(prefix, split_spoof, sizes_spoof)[i]
                    for prefix in prefixes
                ]
                continue
            target, buffer = self._mid_level_sizes(prefixes, weights, sizes_spoof)
            megatron_datasets = self._build_megatron_datasets_parallel(prefixes, split_spoof, buffer)[i]
            blended_datasets[i] = self._blend(megatron_datasets, prefixes, weights, self.sizes[i], target, i)
        return blended_datasets

    def _build_megatron_datasets_parallel(
        self, prefixes: list[str], split: list, sizes_per_dataset: list[list[int | None]]
    ) -> list[list[MegatronDataset | None]]:
        """Each prefix's split datasets, ``num_dataset_builder_threads`` at a time; per split, the
        list over prefixes."""

        def build_all(num_workers: int) -> list[list[MegatronDataset | None]]:
            out = [[] for _ in Split]
            with ThreadPoolExecutor(max_workers=num_workers) as executor:
                futures = [
                    executor.submit(self._build_megatron_dataset_splits, prefix, split, sizes, False)
                    for prefix, sizes in zip(prefixes, sizes_per_dataset)
                ]
                for future in futures:
                    for j, dataset in enumerate(future.result()):
                        out[j].append(dataset)
            return out

        threads = self.config.num_dataset_builder_threads
        fast = isinstance(self.config, GPTDatasetConfig) and self.config.fast_cache_load
        if not torch.distributed.is_initialized() or fast:
            return build_all(threads)
        built, error = _on_rank0_first(lambda: build_all(threads))
        _share_rank0_outcome(error)
        return built if torch.distributed.get_rank() == 0 else build_all(threads)

    def _build_megatron_dataset_splits(
        self,
        dataset_path: str | None,
        split: list,
        sizes: list[int | None],
        synchronize_ranks: bool = True,
    ) -> list[MidLevelDataset | None]:
        """The mid-level dataset of each split of one corpus (None where the split is empty)."""
        if torch.distributed.is_initialized() and not self.is_built_on_rank():
            for i in range(len(Split)):
                if split[i] is not None and synchronize_ranks:
                    _share_rank0_outcome(None)
            return [None] * len(Split)
        low_level_dataset = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level_dataset)
        fast = isinstance(self.config, GPTDatasetConfig) and self.config.fast_cache_load
        mid_level_datasets = []
        for i, _split in enumerate(Split):
            if split[i] is None:
                mid_level_datasets.append(None)
                continue
            indexed_indices = None
            if not fast:
                beg = int(round(split[i][0] * float(num_elements)))
                end = int(round(split[i][1] * float(num_elements)))
                indexed_indices = numpy.arange(start=beg, stop=end, step=1, dtype=numpy.int32)
            mid_level_datasets.append(
                self.build_generic_dataset(
                    self.cls,
                    self.is_built_on_rank,
                    synchronize_ranks,
                    low_level_dataset,
                    dataset_path,
                    indexed_indices,
                    sizes[i],
                    _split,
                    self.config,
                )
            )
        return mid_level_datasets

    @staticmethod
    def build_generic_dataset(
        cls: type[DistributedDataset] | Callable,
        is_built_on_rank: Callable[[], bool],
        synchronize_ranks: bool,
        *args: Any,
    ) -> DistributedDataset | Iterable | None:
        """``cls(*args)``: with a process group, on rank 0 first (it writes the caches), then on the
        other ranks that build; None on a rank that does not."""
        if not torch.distributed.is_initialized():
            return cls(*args)
        rank = torch.distributed.get_rank()
        dataset, error = None, None
        if rank == 0 and is_built_on_rank():
            dataset, error = _on_rank0_first(lambda: cls(*args))
            if isinstance(error, OSError):
                error = RuntimeError(
                    f"Failed to write dataset materials to the data cache directory ({error}). Please supply "
                    "a directory to which you have write access via the path_to_cache attribute in "
                    "BlendedMegatronDatasetConfig and retry."
                )
        if synchronize_ranks:
            _share_rank0_outcome(error)
        elif error is not None:
            raise error
        if rank != 0 and is_built_on_rank():
            dataset = cls(*args)
        return dataset


def _get_size_per_split_per_dataset(
    normalized_weights: list[float], target_size_per_split: list[int | None], surplus: float = 0.0
) -> list[list[int]]:
    """The samples to ask of each dataset per split: ceil(ceil(size x weight) x (1 + surplus))."""
    assert numpy.isclose(sum(normalized_weights), 1.0)
    return [
        [
            int(math.ceil(math.ceil(target_size * weight) * (1 + surplus)))
            for target_size in target_size_per_split
        ]
        for weight in normalized_weights
    ]
