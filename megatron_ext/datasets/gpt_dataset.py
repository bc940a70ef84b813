"""GPT samples from a tokenized corpus: fixed-length windows over the split's documents, shuffled,
with the labels, loss mask, position ids and attention mask Megatron-core's GPTDataset gives.

Three index arrays (Megatron-core's, cached as ``.npy`` under the hash of the dataset's
description, so either library reads the other's cache):

- the document index: the split's documents repeated once per epoch, shuffled (the last epoch
  separately when it is short, so a partial epoch still spreads over the corpus);
- the sample index: where each sample starts, as (position in the document index, token offset),
  built in C++ (``megatron_ext._C.build_sample_idx_*``);
- the shuffle index: a permutation of the samples.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from math import ceil

import numpy
import torch

from megatron_ext.datasets import helpers
from megatron_ext.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_ext.datasets.indexed_dataset import IndexedDataset
from megatron_ext.datasets.megatron_dataset import MegatronDataset
from megatron_ext.datasets.utils import Split, load_index_cache, log_single_rank

logger = logging.getLogger(__name__)


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """The GPT dataset's configuration (Megatron-core's fields and defaults)."""

    reset_position_ids: bool | None = None
    reset_attention_mask: bool | None = None
    eod_mask_loss: bool | None = None
    create_attention_mask: bool = True
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True
    object_storage_cache_path: str | None = None
    data_parallel_size: int = 1
    sequence_parallel_size: int = 0
    hybrid_context_parallel: bool = False
    sequences_per_dataset: dict[str, tuple[int, int]] | None = None
    token_dtype_code: int | None = field(init=False, default=None)
    context_parallel_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError("GPTDatasetConfig needs a tokenizer (its eod token ends documents)")
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name) is None:
                raise ValueError(f"GPTDatasetConfig needs {name} (True or False)")
        vocab_size = getattr(self.tokenizer, "vocab_size", None)
        self.token_dtype_code = (
            None if vocab_size is None else (4 if vocab_size > numpy.iinfo(numpy.uint16).max + 1 else 8)
        )
        if self.sequences_per_dataset is not None and self.token_dtype_code is None:
            raise ValueError("sequences_per_dataset needs a tokenizer with a vocab_size")


class GPTDataset(MegatronDataset):
    """The samples of one split of an :class:`IndexedDataset` (its sequences ``indexed_indices``):
    ``num_samples`` of them (or one epoch for None), each a dict of ``tokens``, ``labels``,
    ``loss_mask``, ``position_ids`` and, when ``create_attention_mask``, ``attention_mask``
    ([1, s, s], True where attention is masked out)."""

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: str | None,
        indexed_indices: numpy.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss]
        )
        self.masks_and_position_ids_are_cached = False
        self.cached_attention_mask = None
        self.cached_loss_mask = None
        self.cached_position_ids = None
        self.document_index, self.sample_index, self.shuffle_index = (
            self._build_document_sample_shuffle_indices()
        )

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """GPT splits the corpus by sequence."""
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        sequences_per_dataset = None
        if config.sequences_per_dataset:
            sequences_per_dataset = config.sequences_per_dataset[dataset_path]
        return IndexedDataset(
            dataset_path,
            multimodal=False,
            mmap=config.mmap_bin_files,
            fast_cache_load=config.fast_cache_load,
            sequences_per_dataset=sequences_per_dataset,
            dtype_code=config.token_dtype_code,
        )

    def _drop_last_partial_sequence(self) -> bool:
        if self.index_split == Split.valid:
            return self.config.drop_last_partial_validation_sequence
        return True

    def __len__(self) -> int:
        if self.config.defer_npy_index_mmap:
            return self._num_samples_of_corpus(self._get_num_tokens_per_epoch())
        return self.sample_index.shape[0] - 1

    def _num_samples_of_corpus(self, num_tokens_per_epoch: int) -> int:
        """The sample count build_sample_idx gives for the split's documents as they are now."""
        tokens = self._get_num_epochs(num_tokens_per_epoch) * num_tokens_per_epoch
        # An empty split (no tokens) has no sample, not minus one.
        tokens = max(tokens - self.config.add_extra_token_to_sequence, 0)
        if self._drop_last_partial_sequence():
            return tokens // self.config.sequence_length
        return ceil(float(tokens) / self.config.sequence_length)

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """Sample ``idx``; None gives a padding sample (sample 0 with a zero loss mask)."""
        text, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        text = torch.from_numpy(text).long()
        if self.config.add_extra_token_to_sequence:
            tokens = text[:-1].contiguous()
            labels = text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id

        if not (self.masks_and_position_ids_are_cacheable and self.masks_and_position_ids_are_cached):
            attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
                tokens,
                self.config.tokenizer.eod,
                self.config.reset_position_ids,
                self.config.reset_attention_mask,
                self.config.eod_mask_loss,
                self.config.create_attention_mask,
            )
            if self.masks_and_position_ids_are_cacheable:
                self.cached_attention_mask = attention_mask
                self.cached_loss_mask = loss_mask
                self.cached_position_ids = position_ids
                self.masks_and_position_ids_are_cached = True
        else:
            attention_mask = self.cached_attention_mask
            loss_mask = self.cached_loss_mask.clone()
            position_ids = self.cached_position_ids

        loss_mask[labels == self._pad_token_id] = 0.0  # padding is never a target
        tokens[tokens == self._pad_token_id] = 0  # ...and must be a valid embedding row
        labels[labels == self._pad_token_id] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)

        sample = {"tokens": tokens, "labels": labels}
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _query_document_sample_shuffle_indices(self, idx: int) -> tuple[numpy.ndarray, numpy.ndarray]:
        """The tokens of sample ``idx`` (sequence_length + the extra token, padded with the pad id
        at the end of the stream) and the ids of the documents they come from."""
        if self.shuffle_index is None:  # defer_npy_index_mmap: map the cache on first use
            self.shuffle_index = load_index_cache(self.path_to_shuffle_index)
            self.sample_index = load_index_cache(self.path_to_sample_index)
            self.document_index = load_index_cache(self.path_to_document_index)
        idx = self.shuffle_index[idx]
        doc_beg, offset_beg = self.sample_index[idx]
        doc_end, offset_end = self.sample_index[idx + 1]
        extra = self.config.add_extra_token_to_sequence
        document_ids, parts = [], []
        for i in range(doc_beg, doc_end + 1):
            document_ids.append(self.document_index[i])
            offset = offset_beg if i == doc_beg else 0
            length = None if i < doc_end else offset_end - offset + extra
            parts.append(self.dataset.get(self.document_index[i], offset=int(offset), length=length))
        length = sum(map(len, parts))
        wanted = self.config.sequence_length + extra
        if length < wanted:
            parts.append([self._pad_token_id] * (wanted - length))
        return (numpy.concatenate(parts, dtype=numpy.int64), numpy.array(document_ids, dtype=numpy.int64))

    def _cache_paths(self, path_to_cache: str) -> dict[str, str]:
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        return {
            affix: os.path.join(path_to_cache, f"{base}-{affix}")
            for affix in ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")
        }

    def _build_document_sample_shuffle_indices(self) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """The three indices: loaded from the cache when all its files are there; otherwise built
        (by rank 0 only, when a cache directory is given and a process group is running: the
        other ranks read rank 0's cache after the builder's barrier) and saved."""
        if self.config.defer_npy_index_mmap:
            paths = self._cache_paths(self.config.path_to_cache)
            self.path_to_document_index = paths["document_index.npy"]
            self.path_to_sample_index = paths["sample_index.npy"]
            self.path_to_shuffle_index = paths["shuffle_index.npy"]
            return None, None, None

        path_to_cache = self.config.path_to_cache
        if path_to_cache is None and not self.config.mock:
            path_to_cache = os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
        paths = self._cache_paths(path_to_cache) if path_to_cache else {}
        cache_hit = bool(paths) and (self.config.fast_cache_load or all(map(os.path.isfile, paths.values())))
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if cache_hit or (paths and not rank0):
            log_single_rank(
                logger, logging.INFO, f"Load the {type(self).__name__} {self.index_split.name} indices"
            )
            indices = tuple(
                load_index_cache(paths[name])
                for name in ("document_index.npy", "sample_index.npy", "shuffle_index.npy")
            )
            if not self.config.fast_cache_load:
                self._check_cache_fits_corpus(paths, *indices)
            return indices

        log_single_rank(
            logger, logging.INFO, f"Build and save the {type(self).__name__} {self.index_split.name} indices"
        )
        t_beg = time.time()
        sequence_length = self.config.sequence_length
        extra = self.config.add_extra_token_to_sequence
        num_tokens_per_epoch = self._get_num_tokens_per_epoch()
        num_epochs = self._get_num_epochs(num_tokens_per_epoch)
        separate_final_epoch = False
        if num_epochs > 1:
            # The last epoch is shuffled apart when less than 80% of it is used.
            num_samples_sans_final_epoch = (
                (num_epochs - 1) * num_tokens_per_epoch - extra
            ) // sequence_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (num_tokens_per_epoch - extra) // sequence_length
            separate_final_epoch = num_samples_from_final_epoch < int(0.80 * num_samples_per_epoch)

        numpy_random_state = numpy.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(
            self.indices, num_epochs, numpy_random_state, separate_final_epoch
        )
        sequence_lengths = self.dataset.sequence_lengths
        if len(document_index) * 2 > len(sequence_lengths):
            sequence_lengths = sequence_lengths.copy()  # read densely: one sequential pass is faster
        sample_index = helpers.build_sample_idx(
            sequence_lengths,
            document_index,
            sequence_length,
            num_epochs,
            num_tokens_per_epoch,
            self._drop_last_partial_sequence(),
            extra,
        )
        num_samples = sample_index.shape[0] - 1
        shuffle_index = _build_shuffle_index(
            num_samples_sans_final_epoch if separate_final_epoch else num_samples,
            num_samples,
            numpy_random_state,
        )
        if paths:
            os.makedirs(path_to_cache, exist_ok=True)
            with open(paths["description.txt"], "wt") as writer:
                writer.write(self.unique_description)
            numpy.save(paths["document_index.npy"], document_index, allow_pickle=True)
            numpy.save(paths["sample_index.npy"], sample_index, allow_pickle=True)
            numpy.save(paths["shuffle_index.npy"], shuffle_index, allow_pickle=True)
        log_single_rank(logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds")
        log_single_rank(logger, logging.INFO, f"> total number of samples: {num_samples}")
        log_single_rank(logger, logging.INFO, f"> total number of epochs: {num_epochs}")
        return document_index, sample_index, shuffle_index

    def _check_cache_fits_corpus(
        self, paths: dict[str, str], document_index: numpy.ndarray, sample_index: numpy.ndarray, _
    ) -> None:
        """Raises ValueError where the cached indices were built for another corpus under the same
        prefix (the cache key holds the prefix, not the corpus's contents, as Megatron-core's does):
        the split's documents and samples counted again from the corpus must match the cache's."""
        num_tokens_per_epoch = self._get_num_tokens_per_epoch()
        documents = self._get_num_epochs(num_tokens_per_epoch) * len(self.indices)
        samples = self._num_samples_of_corpus(num_tokens_per_epoch)
        cached = (document_index.shape[0], sample_index.shape[0] - 1)
        if cached != (documents, samples):
            prefix = paths["document_index.npy"][: -len("document_index.npy")]
            raise ValueError(
                f"the dataset index cache {prefix}*.npy does not match the corpus {self.dataset_path!r}: it "
                f"indexes {cached[0]} documents (epochs included) and {cached[1]} samples of the "
                f"{self.index_split.name} split, the corpus now gives {documents} and {samples} (it changed "
                "after the cache was built); delete those cache files and the next run rebuilds them"
            )

    def _get_num_tokens_per_epoch(self) -> int:
        return int(numpy.sum(self.dataset.sequence_lengths[self.indices]))

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        """The epochs needed for ``num_samples`` samples (1 for None). Raises ValueError where the
        split holds no tokens but samples are asked of it (Megatron-core loops forever there)."""
        if self.num_samples is None:
            return 1
        requested = self.num_samples * self.config.sequence_length + self.config.add_extra_token_to_sequence
        if num_tokens_per_epoch <= 0 and self.num_samples > 0:
            raise ValueError(
                f"the {self.index_split.name} split of {self.dataset_path!r} holds "
                f"{len(self.indices)} documents and no tokens, yet {self.num_samples} samples are "
                f"asked of it: widen its share of the split {self.config.split!r} or ask for none"
            )
        return max(1, -(-requested // max(num_tokens_per_epoch, 1)))


def _build_document_index(
    documents: numpy.ndarray,
    num_epochs: int,
    numpy_random_state: numpy.random.RandomState,
    separate_final_epoch: bool,
) -> numpy.ndarray:
    """``documents`` once per epoch (int32), shuffled, the last epoch apart when asked."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(numpy.asarray(documents), num_epochs).astype(numpy.int32)
        numpy_random_state.shuffle(document_index)
        return document_index
    first = _build_document_index(documents, num_epochs - 1, numpy_random_state, False)
    last = _build_document_index(documents, 1, numpy_random_state, False)
    return numpy.concatenate((first, last))


def _build_shuffle_index(
    num_samples: int, total_size: int, numpy_random_state: numpy.random.RandomState
) -> numpy.ndarray:
    """A shuffle of [0, num_samples) followed by one of [num_samples, total_size) (uint32 unless
    the size needs int64)."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(0, num_samples, dtype=dtype)
    numpy_random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    numpy_random_state.shuffle(last)
    return numpy.concatenate((first, last))


def _get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The left-to-right attention mask ([1, s, s], True = masked out; None unless asked), the
    loss mask (float; 0 at EOD tokens with ``eod_mask_loss``) and the position ids of ``data``.
    With ``reset_position_ids`` positions restart after each EOD token; with
    ``reset_attention_mask`` no token attends across one."""
    seq_length = data.numel()
    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    eod = data == eod_token
    if eod_mask_loss:
        loss_mask[eod] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    # the document each token belongs to: the number of EOD tokens before it
    document = torch.cumsum(eod.long(), 0) - eod.long()
    if reset_position_ids:
        starts = torch.zeros(seq_length, dtype=torch.long, device=data.device)
        after_eod = eod.nonzero().flatten() + 1
        after_eod = after_eod[after_eod < seq_length]
        starts[after_eod] = after_eod
        position_ids = position_ids - torch.cummax(starts, 0).values
    attention_mask = None
    if create_attention_mask:
        visible = torch.ones((seq_length, seq_length), dtype=torch.bool, device=data.device).tril()
        if reset_attention_mask:
            visible &= document[:, None] == document[None, :]
        attention_mask = (~visible).unsqueeze(0)
    return attention_mask, loss_mask, position_ids


class MockGPTLowLevelDataset:
    """Megatron-core's synthetic corpus: 100,000 documents of random lengths in [1, 4096) (NumPy
    seed 0), document i of length n being the ids 1, ..., n - 1 (mod the vocabulary) and EOD."""

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod_token = tokenizer.eod
        rng = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=numpy.int32
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        length = self.sequence_lengths[idx]
        return numpy.int64(
            numpy.concatenate([(numpy.arange(length - 1) + 1) % self.vocab_size, [self.eod_token]])
        )

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> numpy.ndarray:
        if length is None:
            length = self.sequence_lengths[idx] - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """A GPTDataset over :class:`MockGPTLowLevelDataset` (a config with no blend is mock)."""

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset,
        dataset_path: str | None,
        indices: numpy.ndarray,
        num_samples: int,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset needs a mock config: one with neither blend nor blend_per_split")
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None, config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)
