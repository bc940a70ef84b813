"""A weighted mix of datasets: sample i is sample ``dataset_sample_index[i]`` of dataset
``dataset_index[i]``, the two arrays built in C++ so that each dataset's share of any prefix of the
samples stays as close as possible to its weight (Megatron-core's arrays and cache files)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import OrderedDict

import numpy
import torch

from megatron_ext.datasets import helpers
from megatron_ext.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_ext.datasets.megatron_dataset import MegatronDataset
from megatron_ext.datasets.utils import load_index_cache, log_single_rank, normalize

logger = logging.getLogger(__name__)

_VERBOSE = False


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``; with ``size`` None,
    exactly ``weights[i]`` (integers) samples of dataset i. Each sample is the dataset's dict plus
    ``dataset_id``."""

    def __init__(
        self,
        datasets: list[MegatronDataset],
        weights: list[int | float],
        size: int | None,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights; they must pair up")
        if not 0 < len(datasets) < 32767:
            raise ValueError(f"a blend holds 1 to 32766 datasets, got {len(datasets)}")
        if any(type(d) is not type(datasets[0]) for d in datasets):
            raise ValueError("the blended datasets must be of one class")
        if any(d.index_split != datasets[0].index_split for d in datasets):
            raise ValueError("the blended datasets must be of one split")
        if not all(w > 0 for w in weights):
            raise ValueError(f"blend weights must be > 0, got {list(weights)}")
        if any(type(w) is not type(weights[0]) for w in weights):
            raise ValueError(f"blend weights must be all ints or all floats, got {list(weights)}")
        if size is None and any(w != int(w) for w in weights):
            raise ValueError(
                f"without a size the weights are sample counts and must be integers, got {weights}"
            )
        if len(datasets) == 1:
            log_single_rank(logger, logging.WARNING, "Building a BlendedDataset for a single MegatronDataset")
        if size is not None:
            weights = normalize(weights)
        self.datasets = datasets
        self.split = self.datasets[0].index_split
        self.weights = weights
        self.size = size
        self.config = config

        unique_identifiers = OrderedDict()
        unique_identifiers["class"] = type(self).__name__
        unique_identifiers["datasets"] = [dataset.unique_identifiers for dataset in self.datasets]
        unique_identifiers["split"] = self.split.name
        unique_identifiers["weights"] = self.weights
        unique_identifiers["size"] = self.size
        self.unique_description = json.dumps(
            unique_identifiers, indent=4, default=lambda obj: obj.unique_identifiers
        )
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8"), usedforsecurity=False
        ).hexdigest()
        self.dataset_index, self.dataset_sample_index = self._build_indices()

    def __len__(self) -> int:
        if self.config.defer_npy_index_mmap:
            return self.size if self.size is not None else sum(self.weights)
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> dict:
        if self.dataset_index is None:
            self.dataset_index = load_index_cache(self.path_to_dataset_index, "blend index cache file")
            self.dataset_sample_index = load_index_cache(
                self.path_to_dataset_sample_index, "blend index cache file"
            )
        dataset_id = self.dataset_index[idx]
        dataset_sample_id = self.dataset_sample_index[idx]
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][dataset_sample_id]}

    def _cache_path(self, path_to_cache: str, suffix: str) -> str:
        return os.path.join(
            path_to_cache, f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}-{suffix}"
        )

    def _build_indices(self) -> tuple[numpy.ndarray, numpy.ndarray]:
        """The dataset index (int16) and the dataset sample index (int64): loaded from the cache, or
        built (by rank 0 where a cache is written) and saved."""
        path_to_cache = self.config.path_to_cache
        if self.config.defer_npy_index_mmap:
            self.path_to_dataset_index = self._cache_path(path_to_cache, "dataset_index.npy")
            self.path_to_dataset_sample_index = self._cache_path(path_to_cache, "dataset_sample_index.npy")
            return None, None
        names = ("description.txt", "dataset_index.npy", "dataset_sample_index.npy")
        paths = {name: self._cache_path(path_to_cache, name) for name in names} if path_to_cache else {}
        cache_hit = bool(paths) and (self.config.fast_cache_load or all(map(os.path.isfile, paths.values())))
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if cache_hit or (paths and not rank0):
            log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} indices")
            return tuple(load_index_cache(paths[name], "blend index cache file") for name in names[1:])

        log_single_rank(logger, logging.INFO, f"Build and save the {type(self).__name__} indices")
        t_beg = time.time()
        size = self.size if self.size is not None else sum(self.weights)
        dataset_index = numpy.zeros(size, dtype=numpy.int16)
        dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
        if self.size is not None:
            helpers.build_blending_indices(
                dataset_index, dataset_sample_index, self.weights, len(self.datasets), self.size, _VERBOSE
            )
        else:
            helpers.build_exhaustive_blending_indices(
                dataset_index, dataset_sample_index, self.weights, len(self.datasets)
            )
        indices, counts = numpy.unique(dataset_index, return_counts=True)
        for i, (index, count) in enumerate(zip(indices, counts)):
            if len(self.datasets[index]) < count:
                raise IndexError(
                    f"The {self.split.name} blend oversamples the contributing datasets and, for example, "
                    f"requests {count} samples from {type(self.datasets[index]).__name__} number {i} in "
                    f"excess of its size {len(self.datasets[index])}. The current value of the config "
                    f"attribute mid_level_dataset_surplus may be increased, e.g. two- or ten-fold, from its "
                    f"current value ({self.config.mid_level_dataset_surplus}) to ensure a sufficient "
                    f"mid-level dataset sample margin from which to draw."
                )
        if paths:
            os.makedirs(path_to_cache, exist_ok=True)
            with open(paths["description.txt"], "wt") as writer:
                writer.write(self.unique_description)
            numpy.save(paths["dataset_index.npy"], dataset_index, allow_pickle=True)
            numpy.save(paths["dataset_sample_index.npy"], dataset_sample_index, allow_pickle=True)
        log_single_rank(logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds")
        return dataset_index, dataset_sample_index
