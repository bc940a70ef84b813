"""megatron_ext.datasets against Megatron-core 0.16.1's megatron.core.datasets: the same files, the
same index arrays (C++ builders included), the same samples of every split, blends, caches read
both ways. Megatron-core's classes are the reference; these tests skip without it."""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict

import numpy
import pytest
import torch

from megatron_ext.datasets import gpt_dataset as ours_gpt
from megatron_ext.datasets import (
    BlendedDataset,
    BlendedMegatronDatasetBuilder,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    MockGPTDataset,
    helpers,
)

mcore = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
from megatron.core.datasets import gpt_dataset as mc_gpt  # noqa: E402
from megatron.core.datasets import helpers as mc_helpers  # noqa: E402
from megatron.core.datasets import indexed_dataset as mc_indexed  # noqa: E402
from megatron.core.datasets.blended_dataset import BlendedDataset as McBlendedDataset  # noqa: E402

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


class StubTokenizer:
    """What the datasets read of a tokenizer, and what names it in the cache key."""

    def __init__(self, vocab_size: int = 1000, eod: int = 0, pad: int | None = None):
        self.vocab_size, self.eod, self._pad = vocab_size, eod, pad
        self.unique_identifiers = OrderedDict([("class", "StubTokenizer"), ("vocab_size", vocab_size)])

    @property
    def pad(self):
        if self._pad is None:
            raise AttributeError("no pad token")
        return self._pad


def write_corpus(
    prefix: str,
    lengths: list[int],
    seed: int,
    vocab: int = 1000,
    eod: int = 0,
    dtype=numpy.uint16,
    builder_cls=IndexedDatasetBuilder,
) -> list[numpy.ndarray]:
    """A corpus of one-sequence documents of ``lengths`` random tokens, each ending in EOD."""
    rng = numpy.random.default_rng(seed)
    docs = []
    builder = builder_cls(prefix + ".bin", dtype=dtype)
    for n in lengths:
        doc = rng.integers(1, vocab, size=n).astype(numpy.int64)
        doc[-1] = eod
        # some EOD tokens inside documents too, for the reset/mask options
        doc[rng.random(n) < 0.05] = eod
        docs.append(doc)
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return docs


def random_lengths(rng, count: int, high: int = 90) -> list[int]:
    return rng.integers(1, high, size=count).tolist()


def test_index_files_byte_for_byte_both_ways(tmp_path):
    rng = numpy.random.default_rng(0)
    for dtype in (numpy.uint16, numpy.int32):
        lengths = random_lengths(rng, 37)
        ours, theirs = str(tmp_path / f"ours_{dtype.__name__}"), str(tmp_path / f"theirs_{dtype.__name__}")
        docs = write_corpus(ours, lengths, seed=1, dtype=dtype)
        write_corpus(theirs, lengths, seed=1, dtype=dtype, builder_cls=mc_indexed.IndexedDatasetBuilder)
        for suffix in (".bin", ".idx"):
            assert open(ours + suffix, "rb").read() == open(theirs + suffix, "rb").read()
        # documents of several sequences, and a corpus appended to another (add_document, add_index)
        for cls, prefix in (
            (IndexedDatasetBuilder, ours + "_multi"),
            (mc_indexed.IndexedDatasetBuilder, theirs + "_multi"),
        ):
            builder = cls(prefix + ".bin", dtype=dtype)
            builder.add_document(torch.arange(1, 11), [3, 7])
            builder.add_document(torch.arange(5, 9), [4])
            builder.add_document(["12", "0", "7"], [1, 2])  # token ids as numeric strings (numpy converts)
            builder.add_document([3, 1], [2])
            builder.add_index(ours if cls is IndexedDatasetBuilder else theirs)
            builder.finalize(prefix + ".idx")
        for suffix in (".bin", ".idx"):
            assert (
                open(ours + "_multi" + suffix, "rb").read() == open(theirs + "_multi" + suffix, "rb").read()
            )
        # each library reads the other's files to the same values
        for reader, prefix in ((IndexedDataset, theirs), (mc_indexed.IndexedDataset, ours)):
            for mmap in (True, False):
                ds = reader(prefix, mmap=mmap)
                assert len(ds) == len(docs) and ds.index.dtype == dtype
                assert ds.document_indices.tolist() == list(range(len(docs) + 1))
                assert ds.sequence_lengths.tolist() == lengths
                for i in (0, 5, len(docs) - 1):
                    numpy.testing.assert_array_equal(ds[i], docs[i])
                    numpy.testing.assert_array_equal(
                        ds.get(i, offset=min(1, lengths[i] - 1)), docs[i][min(1, lengths[i] - 1) :]
                    )
                for got, want in zip(ds[3:9], docs[3:9]):
                    numpy.testing.assert_array_equal(got, want)
        multi = IndexedDataset(theirs + "_multi")
        assert multi.document_indices.tolist() == [0, 2, 3, 5, 6] + [6 + i for i in range(1, len(docs) + 1)]
        numpy.testing.assert_array_equal(multi[1], numpy.arange(4, 11))
        assert [multi[i].tolist() for i in (3, 4, 5)] == [[12], [0, 7], [3, 1]]


def _edge_configs(rng):
    """(sizes, document_index, seq_length, epochs, tokens_per_epoch, drop_last, extra) cases."""
    cases = []
    for _ in range(6):  # random corpora, several epochs
        sizes = rng.integers(1, 200, size=int(rng.integers(2, 60))).astype(numpy.int32)
        docs = numpy.arange(len(sizes), dtype=numpy.int32)
        epochs = int(rng.integers(1, 4))
        document_index = numpy.concatenate([rng.permutation(docs) for _ in range(epochs)]).astype(numpy.int32)
        cases.append((sizes, document_index, int(rng.integers(2, 64)), epochs, int(sizes.sum())))
    one = numpy.array([57], dtype=numpy.int32)  # one document
    cases.append((one, numpy.zeros(1, dtype=numpy.int32), 8, 1, 57))
    cases.append((one, numpy.zeros(3, dtype=numpy.int32), 8, 3, 57))
    long_docs = numpy.array([300, 5, 1000, 2], dtype=numpy.int32)  # documents longer than the sequence
    cases.append((long_docs, numpy.array([2, 0, 3, 1], dtype=numpy.int32), 16, 1, int(long_docs.sum())))
    cases.append(
        (numpy.array([16, 16, 16], dtype=numpy.int32), numpy.arange(3, dtype=numpy.int32), 16, 1, 48)
    )
    return [case + (drop, extra) for case in cases for drop in (True, False) for extra in (1, 0)]


def test_index_builders_equal_helpers_cpp():
    rng = numpy.random.default_rng(1)
    for sizes, document_index, seq, epochs, tokens, drop, extra in _edge_configs(rng):
        args = (sizes, document_index, seq, epochs, tokens, drop, extra)
        want = mc_helpers.build_sample_idx_int32(*args)
        for build in (helpers.build_sample_idx_int32, helpers.build_sample_idx_int64):
            got = build(*args)
            assert got.shape == want.shape and got.dtype == (
                numpy.int32 if build is helpers.build_sample_idx_int32 else numpy.int64
            )
            numpy.testing.assert_array_equal(got, want)
        got = helpers.build_sample_idx(sizes, document_index, seq, epochs, tokens, drop, bool(extra))
        numpy.testing.assert_array_equal(
            got, mc_helpers.build_sample_idx(sizes, document_index, seq, epochs, tokens, drop, bool(extra))
        )
    for num_datasets in (1, 2, 3, 7):
        weights = rng.random(num_datasets) + 0.01
        weights = (weights / weights.sum()).tolist()
        size = int(rng.integers(1, 5000))
        out = []
        for module in (helpers, mc_helpers):
            index, sample = numpy.zeros(size, numpy.int16), numpy.zeros(size, numpy.int64)
            module.build_blending_indices(index, sample, weights, num_datasets, size, False)
            out.append((index, sample))
        numpy.testing.assert_array_equal(out[0][0], out[1][0])
        numpy.testing.assert_array_equal(out[0][1], out[1][1])
        counts = rng.integers(1, 400, size=num_datasets).tolist()
        out = []
        for module in (helpers, mc_helpers):
            index, sample = numpy.zeros(sum(counts), numpy.int16), numpy.zeros(sum(counts), numpy.int64)
            module.build_exhaustive_blending_indices(index, sample, counts, num_datasets)
            out.append((index, sample))
        numpy.testing.assert_array_equal(out[0][0], out[1][0])
        numpy.testing.assert_array_equal(out[0][1], out[1][1])
        assert numpy.bincount(out[0][0], minlength=num_datasets).tolist() == counts


def test_index_builders_refuse_what_they_cannot_fill():
    sizes = numpy.array([4, 5], dtype=numpy.int32)
    with pytest.raises(ValueError, match=r"document_indices\[1\] = 7 is outside the 2 sequence lengths"):
        helpers.build_sample_idx_int32(sizes, numpy.array([0, 7], dtype=numpy.int32), 4, 1, 9)
    with pytest.raises(ValueError, match="dataset_index must be a numpy.int16 array, got int32"):
        helpers.build_blending_indices(
            numpy.zeros(4, numpy.int32), numpy.zeros(4, numpy.int64), [1.0], 1, 4, False
        )
    with pytest.raises(ValueError, match="dataset_sample_index holds 2 entries; 4 are needed"):
        helpers.build_blending_indices(
            numpy.zeros(4, numpy.int16), numpy.zeros(2, numpy.int64), [1.0], 1, 4, False
        )
    with pytest.raises(ValueError, match="weights has 2 entries; num_datasets is 3"):
        helpers.build_blending_indices(
            numpy.zeros(4, numpy.int16), numpy.zeros(4, numpy.int64), [0.5, 0.5], 3, 4, False
        )
    with pytest.raises(ValueError, match="sizes must be >= 1, got 0 for dataset 1"):
        helpers.build_exhaustive_blending_indices(
            numpy.zeros(4, numpy.int16), numpy.zeros(4, numpy.int64), [4, 0], 2
        )


def gpt_config(module, tmp_path, name: str, blend=None, blend_per_split=None, split="969,30,1", **options):
    tokenizer = StubTokenizer()
    settings = dict(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    settings.update(options)
    return module.GPTDatasetConfig(
        random_seed=1234,
        sequence_length=32,
        blend=blend,
        blend_per_split=blend_per_split,
        split=None if blend_per_split else split,
        path_to_cache=str(tmp_path / name),
        tokenizer=tokenizer,
        **settings,
    )


def build_both(tmp_path, sizes, **config):
    """The splits built by megatron_ext and by Megatron-core (each with its own cache)."""
    ours = BlendedMegatronDatasetBuilder(
        GPTDataset, sizes, lambda: True, gpt_config(ours_gpt, tmp_path, "cache_ours", **config)
    ).build()
    theirs = mcore.BlendedMegatronDatasetBuilder(
        mc_gpt.GPTDataset, sizes, lambda: True, gpt_config(mc_gpt, tmp_path, "cache_theirs", **config)
    ).build()
    return ours, theirs


def assert_same_samples(ours, theirs, every: int = 1):
    assert (ours is None) == (theirs is None)
    if ours is None:
        return
    assert len(ours) == len(theirs) and len(ours) > 0
    for i in range(0, len(ours), every):
        a, b = ours[i], theirs[i]
        assert a.keys() == b.keys()
        for key in a:
            if key == "dataset_id":
                assert int(a[key]) == int(b[key])
                continue
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), (i, key)


@pytest.fixture(autouse=True)
def rank_zero_without_a_group(monkeypatch):
    """Megatron-core's BlendedDataset asks torch.distributed for the rank even without a process
    group (megatron_ext's does not): rank 0 of a single-process run."""
    if not torch.distributed.is_initialized():
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)


@pytest.fixture
def corpora(tmp_path):
    rng = numpy.random.default_rng(7)
    prefixes = []
    for k, count in enumerate((120, 60, 30)):
        prefix = str(tmp_path / f"corpus{k}")
        write_corpus(prefix, random_lengths(rng, count), seed=10 + k)
        prefixes.append(prefix)
    return prefixes


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True),
        dict(reset_position_ids=True, eod_mask_loss=True, create_attention_mask=False),
        dict(add_extra_token_to_sequence=False, drop_last_partial_validation_sequence=False),
    ],
)
def test_gpt_dataset_splits_equal_megatron(tmp_path, corpora, options):
    # one corpus, every split, more samples than one epoch holds (several epochs, the last one apart)
    ours, theirs = build_both(tmp_path, [700, 40, 8], blend=([corpora[0]], None), split="90,7,3", **options)
    for a, b in zip(ours, theirs):
        assert type(a).__name__ == "GPTDataset"
        assert_same_samples(a, b)
    # one epoch (sizes None), valid split partial sequence kept or dropped
    ours, theirs = build_both(
        tmp_path / "epoch", [None, None, None], blend=([corpora[1]], None), split="80,20,0", **options
    )
    assert ours[2] is None
    for a, b in zip(ours, theirs):
        assert_same_samples(a, b)


def test_blends_equal_megatron(tmp_path, corpora):
    # weighted blend over the splits
    ours, theirs = build_both(
        tmp_path / "weighted",
        [300, 30, 6],
        blend=(corpora, [0.5, 0.3, 0.2]),
        split="90,8,2",
        eod_mask_loss=True,
    )
    for a, b in zip(ours, theirs):
        assert isinstance(a, BlendedDataset) and isinstance(b, McBlendedDataset)
        numpy.testing.assert_array_equal(a.dataset_index, b.dataset_index)
        numpy.testing.assert_array_equal(a.dataset_sample_index, b.dataset_sample_index)
        assert_same_samples(a, b, every=3)
    # weights from the datasets' sizes, exhaustive (no size)
    ours, theirs = build_both(
        tmp_path / "sizes", [None, None, None], blend=(corpora[:2], None), split="90,10,0"
    )
    for a, b in zip(ours, theirs):
        assert_same_samples(a, b, every=2)
    # a blend per split
    per_split = [(corpora[:2], [2.0, 1.0]), ([corpora[2]], None), (corpora[1:], None)]
    ours, theirs = build_both(tmp_path / "per_split", [100, None, 20], blend_per_split=per_split)
    for a, b in zip(ours, theirs):
        assert_same_samples(a, b)


def test_mock_dataset_equals_megatron(tmp_path):
    configs = [
        module.GPTDatasetConfig(
            random_seed=5,
            sequence_length=64,
            tokenizer=StubTokenizer(vocab_size=300),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=True,
        )
        for module in (ours_gpt, mc_gpt)
    ]
    ours = BlendedMegatronDatasetBuilder(MockGPTDataset, [50, 10, 10], lambda: True, configs[0]).build()
    theirs = mcore.BlendedMegatronDatasetBuilder(
        mc_gpt.MockGPTDataset, [50, 10, 10], lambda: True, configs[1]
    ).build()
    for a, b in zip(ours, theirs):
        for i in (0, 7, len(a) - 1):
            for key in SAMPLE_KEYS:
                assert torch.equal(a[i][key], b[i][key])


def _cache_files(path) -> dict[str, bytes]:
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


def test_caches_interchangeable(tmp_path, corpora, monkeypatch):
    blend = dict(blend=(corpora, [0.6, 0.3, 0.1]), split="90,8,2", reset_position_ids=True)
    ours, theirs = build_both(tmp_path, [200, 20, 5], **blend)
    # the same file names (hashes of the same descriptions) and the same bytes
    assert _cache_files(tmp_path / "cache_ours") == _cache_files(tmp_path / "cache_theirs")
    assert len(os.listdir(tmp_path / "cache_ours")) == 3 * 4 * 3 + 3 * 3  # 3 corpora x 3 splits, 3 blends

    def no_building(*args, **kwargs):
        raise AssertionError("an index was built although the cache holds it")

    # each library reads the other's cache, building nothing
    shutil.rmtree(tmp_path / "cache_ours")
    shutil.copytree(tmp_path / "cache_theirs", tmp_path / "cache_ours")
    monkeypatch.setattr(helpers, "build_sample_idx", no_building)
    monkeypatch.setattr(mc_helpers, "build_sample_idx", no_building)
    monkeypatch.setattr(helpers, "build_blending_indices", no_building)
    monkeypatch.setattr(mc_helpers, "build_blending_indices", no_building)
    ours_from_theirs = BlendedMegatronDatasetBuilder(
        GPTDataset, [200, 20, 5], lambda: True, gpt_config(ours_gpt, tmp_path, "cache_ours", **blend)
    ).build()
    theirs_from_ours = mcore.BlendedMegatronDatasetBuilder(
        mc_gpt.GPTDataset, [200, 20, 5], lambda: True, gpt_config(mc_gpt, tmp_path, "cache_ours", **blend)
    ).build()
    for a, b, c in zip(ours, ours_from_theirs, theirs_from_ours):
        assert_same_samples(a, b, every=4)
        assert_same_samples(a, c, every=4)
