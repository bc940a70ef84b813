"""megatron_ext.datasets on its own (no Megatron-core): bad corpora, blends, splits, caches and
SFT records each get one clear error, on every rank; the packed SFT rows checked value by value."""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict

import numpy
import pytest
import torch

from megatron_ext.datasets import (
    BlendedMegatronDatasetBuilder,
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    IndexedDatasetBuilder,
    SFTDataset,
    SFTDatasetConfig,
    Split,
    get_blend_from_list,
)
from megatron_ext.datasets.blended_megatron_dataset_config import parse_and_normalize_split
from tests.distributed import run_distributed


class CharTokenizer:
    """Token id = character code (a..z are 97..122); EOD 0, pad 1."""

    vocab_size, eod, pad = 128, 0, 1
    unique_identifiers = OrderedDict([("class", "CharTokenizer")])

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def write_corpus(prefix: str, documents: list[list[int]], dtype=numpy.uint16) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def config(prefixes, split="90,10,0", weights=None, **kwargs) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        random_seed=1,
        sequence_length=8,
        blend=(prefixes, weights),
        split=split,
        tokenizer=CharTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        **kwargs,
    )


def corrupt(
    prefix: str, suffix: str, offset: int, data: bytes | None = None, size: int | None = None
) -> None:
    path = prefix + suffix
    raw = bytearray(open(path, "rb").read())
    if data is not None:
        raw[offset : offset + len(data)] = data
    if size is not None:
        raw = raw[:size]
    open(path, "wb").write(bytes(raw))


def test_bad_corpora_each_get_one_clear_error(tmp_path):
    docs = [list(range(2, 2 + n)) + [0] for n in (5, 9, 3, 12)]
    cases = {
        "missing .bin": (lambda p: os.remove(p + ".bin"), r"is missing '.*missing_bin\.bin'"),
        "missing .idx": (lambda p: os.remove(p + ".idx"), r"is missing '.*missing_idx\.idx'"),
        "truncated .bin": (
            lambda p: corrupt(p, ".bin", 0, size=20),
            r"\.bin' is truncated: 20 bytes, but its "
            r"index places tokens up to byte 66",
        ),
        "truncated .idx": (
            lambda p: corrupt(p, ".idx", 0, size=60),
            r"is truncated: 60 bytes, but its header "
            r"announces 4 sequences and 5 document indices \(122 bytes\)",
        ),
        "tiny .idx": (
            lambda p: corrupt(p, ".idx", 0, size=10),
            r"is truncated: 10 bytes, shorter than its "
            r"34-byte header",
        ),
        "magic": (
            lambda p: corrupt(p, ".idx", 0, b"NOTANIDX\x00"),
            r"is not a Megatron index file: it starts "
            r"with b'NOTANIDX\\x00', expected b'MMIDIDX\\x00\\x00'",
        ),
        "version": (
            lambda p: corrupt(p, ".idx", 9, struct.pack("<Q", 2)),
            r"has version 2; only version 1 exists",
        ),
        "dtype code": (
            lambda p: corrupt(p, ".idx", 17, struct.pack("<B", 9)),
            r"has token dtype code 9; "
            r"expected one of \[1, 2, 3, 4, 5, 6, 7, 8\]",
        ),
        "documents": (
            lambda p: corrupt(p, ".idx", 34 + 4 * 12 + 4 * 8, struct.pack("<q", 3)),
            r"its document indices \[0, \.\.\., 3\] must run from 0 to its sequence count 4",
        ),
    }
    for name, (damage, message) in cases.items():
        prefix = str(tmp_path / name.replace(" ", "_").replace(".", ""))
        write_corpus(prefix, docs)
        damage(prefix)
        for mmap in (True, False):
            with pytest.raises(ValueError, match=message):
                IndexedDataset(prefix, mmap=mmap)
    # the intact corpus reads back, also without memory maps
    write_corpus(str(tmp_path / "good"), docs)
    ds = IndexedDataset(str(tmp_path / "good"), mmap=False)
    assert [ds[i].tolist() for i in range(4)] == docs and ds.get(1, 2, 3).tolist() == [4, 5, 6]
    # ids the dtype cannot hold are refused when written, not wrapped around
    with pytest.raises(ValueError, match=r"token ids in \[0, 70000\] do not fit the dataset's dtype uint16"):
        write_corpus(str(tmp_path / "wide"), [[0, 70000]])


def test_bad_blends_and_splits(tmp_path):
    write_corpus(str(tmp_path / "a"), [[2, 3, 0]] * 20)
    a = str(tmp_path / "a")
    for split, message in (
        ("0,0,0", r"split '0,0,0' sums to 0; the weights must sum to a positive number"),
        ("-1,2", r"split '-1,2' must be up to 3 comma-separated numbers >= 0"),
        ("1,2,3,4", r"must be up to 3 comma-separated numbers"),
        ("", r"must be up to 3"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_and_normalize_split(split)
    assert parse_and_normalize_split("969,30,1") == [0.969, 0.03, 0.001]
    with pytest.raises(ValueError, match=r"the blend weight -0.5 of '.*a' must be a finite number > 0"):
        config([a, a], weights=[1.0, -0.5])
    with pytest.raises(ValueError, match=r"the blend has 1 weights for 2 prefixes; they must pair up"):
        config([a, a], weights=[1.0])
    with pytest.raises(
        ValueError, match=r"mixes weights and prefixes: \['b'\] stand where weights are expected"
    ):
        get_blend_from_list(["1", "a", "b", "c"])
    assert get_blend_from_list(["30", "a", "70", "b"]) == (["a", "b"], [30.0, 70.0])
    assert get_blend_from_list(["a", "b"]) == (["a", "b"], None)
    with pytest.raises(ValueError, match="split must be provided when blend is not None"):
        config([a], split=None)


def test_a_split_without_documents_asked_for_samples_raises(tmp_path):
    # 20 documents, 1% valid: round(0.99 x 20) = round(20) leaves the validation split empty.
    # (Megatron-core 0.16.1 loops forever in GPTDataset._get_num_epochs here.)
    write_corpus(str(tmp_path / "a"), [[2, 3, 4, 0]] * 20)
    builder = BlendedMegatronDatasetBuilder(
        GPTDataset, [10, 5, None], lambda: True, config([str(tmp_path / "a")], split="99,1,0")
    )
    with pytest.raises(
        ValueError,
        match=r"the valid split of '.*a' holds 0 documents and no tokens, yet 5 "
        r"samples are asked of it: widen its share of the split '99,1,0'",
    ):
        builder.build()
    # asking nothing of it is fine
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [10, None, None], lambda: True, config([str(tmp_path / "a")], split="99,1,0")
    ).build()
    assert len(train) == (2 * 80 - 1) // 8 and len(valid) == 0 and test is None  # 10 samples need 2 epochs


def _build_on_every_rank(prefix: str, split: str, sizes: list) -> str:
    """Builds the datasets on this rank; returns the error it raised, or 'built'."""
    cfg = config([prefix], split=split, path_to_cache=os.path.join(os.path.dirname(prefix), "cache"))
    try:
        datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
    except ValueError as e:
        return f"ValueError: {e}"
    return f"built {len(datasets[0])}"


def test_errors_reach_every_rank(tmp_path):
    write_corpus(str(tmp_path / "a"), [[2, 3, 4, 0]] * 20)
    prefix = str(tmp_path / "a")
    empty_split = run_distributed(2, _build_on_every_rank, prefix, "99,1,0", [10, 5, None])
    assert (
        empty_split[0].startswith("ValueError: the valid split of") and "holds 0 documents" in empty_split[0]
    )
    assert empty_split[1] == empty_split[0] + " (raised on rank 0 while it built the datasets)"
    missing = run_distributed(2, _build_on_every_rank, str(tmp_path / "b"), "9,1,0", [10, 5, None])
    assert missing[0] == missing[1] and "is missing" in missing[0]
    assert (
        run_distributed(2, _build_on_every_rank, prefix, "9,1,0", [10, 5, None]) == ["built 17"] * 2
    )  # 18 documents of 4 tokens, 2 epochs


def sft_dataset(tmp_path, records, seq_len, cp=None, seed=3, **kwargs) -> SFTDataset:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = (SFTDatasetConfig if kwargs else GPTDatasetConfig)(
        random_seed=seed,
        sequence_length=seq_len,
        blend=([str(path)], None),
        split="1,0,0",
        tokenizer=CharTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        context_parallel_size=cp,
        **kwargs,
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        SFTDataset, [None, None, None], lambda: True, cfg
    ).build()
    assert valid is None and test is None
    return train


def test_sft_rows_pack_sequences_with_the_loss_on_responses(tmp_path):
    records = [
        {"prompt": "ab", "response": "cd"},
        {"prompt": "e", "response": "fgh"},
        {"prompt": "ijk", "response": "l"},
    ]
    ds = sft_dataset(tmp_path, records, seq_len=12)
    a, b, c = (ds.dataset[i] for i in range(3))
    assert a == ([97, 98], [99, 100])
    # the records in the seeded order; each sequence is prompt + response + EOD (5, 5, 5 tokens):
    # two fit a row of 12 + 1 tokens, the third starts the next row
    order = numpy.random.RandomState(3).permutation(3).tolist()
    assert ds.rows == [order[:2], order[2:]] and len(ds) == 2
    sequences = {i: ds.dataset[i][0] + ds.dataset[i][1] + [0] for i in range(3)}
    response = {i: len(ds.dataset[i][1]) + 1 for i in range(3)}
    row = ds[0]
    first, second = (sequences[i] for i in order[:2])
    pack = first + second + [1] * 3  # 10 tokens, padded to 13 with the pad id
    assert row["tokens"].tolist() == pack[:-1] and row["labels"].tolist() == pack[1:]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]  # restart; padding continues
    assert row["cu_seqlens"].dtype == torch.int32 and row["cu_seqlens"].tolist() == [0, 5, 12]
    assert int(row["max_seqlen"]) == 7
    # the row's tail is padding (for the MoE router: GPTModel's padding_mask)
    assert row["padding_mask"].dtype == torch.bool
    assert row["padding_mask"].tolist() == [False] * 10 + [True] * 2
    # a label counts where it is a response token or the EOD of the same sequence
    want = [0.0] * 12
    for start, i in ((0, order[0]), (5, order[1])):
        for k in range(5 - response[i], 5):
            want[start + k - 1] = 1.0
    assert row["loss_mask"].tolist() == want
    assert (
        row["tokens"].dtype == row["labels"].dtype == torch.int64 and row["loss_mask"].dtype == torch.float32
    )
    # context parallelism: each sequence padded to a multiple of 2 x cp = 4 tokens (5 -> 8)
    ds = sft_dataset(tmp_path, records, seq_len=15, cp=2)
    assert [len(r) for r in ds.rows] == [2, 1]
    row = ds[0]
    assert row["cu_seqlens"].tolist() == [0, 8, 15]
    assert row["position_ids"].tolist() == list(range(8)) + list(range(7))
    assert row["padding_mask"].tolist() == [False] * 5 + [True] * 3 + [False] * 5 + [True] * 2
    # a sequence longer than a row is cut to the row
    ds = sft_dataset(tmp_path, [{"prompt": "abcdef", "response": "ghijklmnop"}], seq_len=8)
    row = ds[0]
    assert row["tokens"].tolist() == list(range(97, 105)) and row["labels"].tolist() == list(range(98, 106))
    assert row["cu_seqlens"].tolist() == [0, 8] and row["loss_mask"].tolist() == [0.0] * 5 + [1.0] * 3
    assert Split.train.value == 0


def test_sft_records_are_utf8_json_objects_of_strings(tmp_path):
    path = tmp_path / "sft.jsonl"
    expected = "expected a JSON object with 'prompt' and 'response' strings"
    cases = [
        ('{"question": "a"}', "got no 'prompt'"),
        ('{"prompt": "a"}', "got no 'response'"),
        ('{"prompt": 7, "response": "b"}', "got 'prompt': 7 (a number)"),
        ('{"prompt": "a", "response": null}', "got 'response': null"),
        ('{"prompt": ["a", "b"], "response": "c"}', 'got \'prompt\': ["a", "b"] (a list)'),
        ('{"prompt": "a", "response": true}', "got 'response': true (a boolean)"),
        ('["a", "b"]', "got a list"),
        ('{"prompt": "a", ', "got invalid JSON (Expecting property name enclosed in double quotes)"),
    ]
    for line, problem in cases:
        path.write_text(json.dumps({"prompt": "ok", "response": "fine"}) + "\n\n" + line + "\n")
        with pytest.raises(ValueError) as error:
            _build_sft(path)
        assert str(error.value) == f"{path}:3: {expected}, {problem}", line
    # not UTF-8: the file, the line and the byte
    path.write_bytes(b'{"prompt": "ok", "response": "fine"}\n{"prompt": "caf\xe9", "response": "x"}\n')
    with pytest.raises(ValueError) as error:
        _build_sft(path)
    assert str(error.value) == f"{path}:2: byte 16 of the line (0xe9) is not UTF-8: expected UTF-8 JSONL"


def _build_sft(path, seq_len=8, **kwargs) -> list:
    cfg = SFTDatasetConfig(
        random_seed=3, sequence_length=seq_len, blend=([str(path)], None), split="1,0,0",
        tokenizer=CharTokenizer(), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, **kwargs,
    )
    return BlendedMegatronDatasetBuilder(SFTDataset, [None, None, None], lambda: True, cfg).build()


def test_sft_padding_multiple_is_the_datas_not_the_layouts(tmp_path):
    records = [{"prompt": "a" * (k % 4 + 1), "response": "b" * (k % 3 + 1)} for k in range(12)]
    rows = {}
    for name, kwargs in {
        "pad 4": {"pad_seq_to_mult": 4},
        "pad 4 at cp 2": {"pad_seq_to_mult": 4, "cp": 2},
        "pad 8 at cp 2": {"pad_seq_to_mult": 8, "cp": 2},
        "Megatron-LM's default at cp 2": {"cp": 2},
        "pad 1": {"pad_seq_to_mult": 1},
    }.items():
        ds = sft_dataset(tmp_path, records, seq_len=24, **kwargs)
        rows[name] = [{k: v.tolist() for k, v in ds[i].items()} for i in range(len(ds))]
    # the rows depend on the multiple only: a cp 2 run and a serial run pad alike
    assert rows["pad 4 at cp 2"] == rows["pad 4"] == rows["Megatron-LM's default at cp 2"]
    for name in ("pad 4", "pad 8 at cp 2"):
        multiple = int(name.split()[1])
        for row in rows[name]:
            lengths = numpy.diff(row["cu_seqlens"])
            assert (lengths[:-1] % multiple == 0).all(), (name, row["cu_seqlens"])
    assert rows["pad 1"] != rows["pad 4"] and rows["pad 8 at cp 2"] != rows["pad 4"]
    for kwargs, message in (
        ({"pad_seq_to_mult": 6, "context_parallel_size": 2},
         "pad_seq_to_mult 6 is not a multiple of 2 x context_parallel_size = 4"),
        ({"pad_seq_to_mult": 0}, "pad_seq_to_mult must be an integer >= 1, got 0"),
        ({"pad_seq_to_mult": 2.0}, "pad_seq_to_mult must be an integer >= 1, got 2.0"),
    ):
        with pytest.raises(ValueError, match=message):
            _build_sft(tmp_path / "sft.jsonl", **kwargs)


def test_sft_records_longer_than_a_row_are_reported(tmp_path):
    from megatron_ext.training import gpt_data

    records = [
        {"prompt": "ab", "response": "cd"},  # line 1: fits
        {"prompt": "abcdef", "response": "ghijk"},  # 12 tokens: the response cut to 3 tokens
        {"prompt": "abcdefghi", "response": "jk"},  # 12 tokens: the prompt fills the row
        {"prompt": "abcdefgh", "response": "ij"},  # 11 tokens: one response label left
    ]
    ds = sft_dataset(tmp_path, records, seq_len=8)
    assert sorted(ds.truncated) == [1, 2, 3] and ds.untrained == [2]
    untrained_row = next(i for i, row in enumerate(ds.rows) if row == [2])
    assert ds[untrained_row]["loss_mask"].sum() == 0
    last_label_row = next(i for i, row in enumerate(ds.rows) if row == [3])
    assert ds[last_label_row]["loss_mask"].tolist() == [0.0] * 7 + [1.0]  # label 'i' of token 'h'
    path = str(tmp_path / "sft.jsonl")
    first = ds.dataset.lines[ds.truncated[0]]
    assert gpt_data.sft_truncation_warnings([ds, None, None], path, 8) == [
        f"3 of the train split's 4 records are longer than the 9 tokens of a row (--seq-len + 1) and are "
        f"cut on the right (the first: {path}:{first}); 1 of them keeps no response token and trains on "
        f"nothing (the first: {path}:3)"
    ]
    assert gpt_data.sft_truncation_warnings([sft_dataset(tmp_path, records[:1], seq_len=8)], path, 8) == []


def test_a_rewritten_corpus_refuses_the_old_cache(tmp_path):
    prefix = str(tmp_path / "a")
    cfg = config([prefix], split="90,10,0", path_to_cache=str(tmp_path / "cache"))
    write_corpus(prefix, [[2, 3, 4, 0]] * 20)
    before = BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 0], lambda: True, cfg).build()
    assert len(before[0]) == 17
    first_sample = before[0][0]["tokens"].tolist()
    # the same prefix rewritten: more documents, then as many documents of other lengths
    # (the cache: 2 epochs of the 18 train documents of 4 tokens, 17 samples of 8 + 1 tokens)
    for documents, now in (([[2, 3, 4, 0]] * 30, "27 and 13"), ([[2, 3, 4, 5, 6, 0]] * 20, "18 and 13")):
        write_corpus(prefix, documents)
        with pytest.raises(ValueError) as error:
            BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 0], lambda: True, cfg).build()
        message = str(error.value)
        assert message.startswith(f"the dataset index cache {tmp_path / 'cache'}/")
        assert "-GPTDataset-train-*.npy" in message
        assert f"does not match the corpus {prefix!r}: it indexes 36 documents (epochs included) and 17 " \
            f"samples of the train split, the corpus now gives {now} (it changed after" in message
        assert message.endswith(
            "delete those cache files and the next run rebuilds them"
        ), message
    for name in os.listdir(tmp_path / "cache"):
        os.remove(tmp_path / "cache" / name)
    after = BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 0], lambda: True, cfg).build()
    assert len(after[0]) == 13 and after[0][0]["tokens"].tolist() != first_sample
    # A split without documents caches no sample, and its cache loads again.
    empty = config([prefix], split="969,30,1", path_to_cache=str(tmp_path / "cache"))
    for _ in range(2):
        splits = BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 0], lambda: True, empty).build()
        assert len(splits[2]) == 0


def test_a_corrupt_cache_file_names_itself(tmp_path):
    prefixes = [str(tmp_path / "a"), str(tmp_path / "b")]
    for prefix in prefixes:
        write_corpus(prefix, [[2, 3, 4, 0]] * 20)
    cfg = config(prefixes, split="90,10,0", weights=[1.0, 1.0], path_to_cache=str(tmp_path / "cache"))
    BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 0], lambda: True, cfg).build()
    names = sorted(os.listdir(tmp_path / "cache"))
    for suffix, what in (("-GPTDataset-train-sample_index.npy", "dataset index cache file"),
                         ("-BlendedDataset-train-dataset_index.npy", "blend index cache file")):
        path = str(tmp_path / "cache" / next(n for n in names if n.endswith(suffix)))
        intact = open(path, "rb").read()
        for damaged in (intact[: len(intact) - 8], b"", b"not an array"):
            open(path, "wb").write(damaged)
            with pytest.raises(ValueError) as error:
                BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 0], lambda: True, cfg).build()
            assert str(error.value).startswith(f"the {what} {path!r} is corrupt or truncated (")
            assert str(error.value).endswith(
                "expected a NumPy .npy array: delete it and the next run rebuilds the cache"
            )
        os.remove(path)  # deleting it rebuilds it
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 0], lambda: True, cfg).build()
        assert open(path, "rb").read() == intact
