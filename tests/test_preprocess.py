"""python -m megatron_ext.datasets.preprocess: JSONL and text into .bin/.idx with a Hugging Face
tokenizer (built here with the ``tokenizers`` package), read by Megatron-core's IndexedDataset."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy
import pytest

from tests.conftest import ROOT, make_tokenizer_dir, random_text

pytest.importorskip("tokenizers")

from megatron_ext.datasets import HuggingFaceTokenizer, IndexedDataset  # noqa: E402
from megatron_ext.datasets import preprocess  # noqa: E402


@pytest.fixture
def tokenizer_dir(tmp_path):
    return make_tokenizer_dir(tmp_path / "tokenizer")


def test_tokenizer_reads_the_directory(tokenizer_dir):
    tok = HuggingFaceTokenizer(str(tokenizer_dir))
    assert (tok.vocab_size, tok.eod, tok.pad) == (300, 1, 2)
    assert tok.tokenize("w0 w5 w296 nope") == [3, 8, 299, 0]
    assert tok.detokenize([3, 8]) == "w0 w5"


def test_preprocess_output_read_by_megatron_core(tmp_path, tokenizer_dir):
    mc_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    lines = random_text(0, 300) + [""]  # an empty document too
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "meta": i}) + "\n" for i, t in enumerate(lines)))
    text = tmp_path / "corpus.txt"
    text.write_text("".join(t + "\n" for t in lines))
    tok = HuggingFaceTokenizer(str(tokenizer_dir))
    want = [tok.tokenize(t) + ([tok.eod] if t else []) for t in lines]
    outputs = []
    for source, workers in ((jsonl, 1), (jsonl, 2), (text, 2)):
        prefix = tmp_path / f"out_{source.suffix[1:]}_{workers}" / "corpus"
        result = preprocess.main(
            [
                "--input",
                str(source),
                "--output-prefix",
                str(prefix),
                "--tokenizer",
                str(tokenizer_dir),
                "--append-eod",
                "--workers",
                str(workers),
                "--no-progress",
            ]
        )
        assert result["documents"] == len(lines) and result["tokens"] == sum(map(len, want))
        assert result["dtype"] == "uint16" and result["prefixes"] == [f"{prefix}_text_document"]
        ds = mc_indexed.IndexedDataset(result["prefixes"][0])
        assert ds.index.dtype == numpy.uint16
        # one sequence per non-empty document; the empty document has none
        assert ds.document_indices.tolist() == [0] + numpy.cumsum([1 if w else 0 for w in want]).tolist()
        got = [ds[i].tolist() for i in range(len(ds))]
        assert got == [w for w in want if w]
        outputs.append({s: open(result["prefixes"][0] + s, "rb").read() for s in (".bin", ".idx")})
    assert outputs[0] == outputs[1] == outputs[2]  # workers and input format change nothing
    # a JSON list of texts is a document of several sequences, as in Megatron-LM's tool
    listed = tmp_path / "listed.jsonl"
    listed.write_text(json.dumps({"text": ["w1 w2", "w3"]}) + "\n")
    result = preprocess.main(
        [
            "--input",
            str(listed),
            "--output-prefix",
            str(tmp_path / "listed"),
            "--tokenizer",
            str(tokenizer_dir),
            "--append-eod",
            "--no-progress",
        ]
    )
    ds = IndexedDataset(result["prefixes"][0])
    assert ds.document_indices.tolist() == [0, 2] and [ds[0].tolist(), ds[1].tolist()] == [[4, 5], [6, 1]]


def test_preprocess_bad_inputs(tmp_path, tokenizer_dir):
    (tmp_path / "empty_dir").mkdir()
    good = tmp_path / "ok.jsonl"
    good.write_text(json.dumps({"text": "w1"}) + "\n")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps({"text": "w1"}) + "\n{not json\n")
    cases = [
        (
            ["--input", str(good), "--tokenizer", str(tmp_path / "empty_dir")],
            "holds no tokenizer: expected one of tokenizer.json",
        ),
        (["--input", str(good), "--tokenizer", str(tmp_path / "nowhere")], "does not exist"),
        (["--input", str(tmp_path / "missing.jsonl"), "--tokenizer", str(tokenizer_dir)], "no such file"),
        (
            ["--input", str(bad_json), "--tokenizer", str(tokenizer_dir)],
            "bad.jsonl:2: expected a JSON object with the keys ['text']",
        ),
        (
            ["--input", str(good), "--tokenizer", str(tokenizer_dir), "--workers", "0"],
            "--workers must be >= 1",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(ValueError) as error:
            preprocess.main(argv + ["--output-prefix", str(tmp_path / "out"), "--no-progress"])
        assert message in str(error.value), (argv, str(error.value))
    # the command line: one line on stderr, exit status 2
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_ext.datasets.preprocess",
            "--input",
            str(good),
            "--tokenizer",
            str(tmp_path / "empty_dir"),
            "--output-prefix",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "holds no tokenizer" in done.stderr
