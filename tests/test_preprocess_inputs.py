"""python -m megatron_ext.datasets.preprocess on what real corpora bring: compressed JSONL, Parquet,
several files and globs, nested keys, broken lines and files, unwritable outputs, and a rerun that
fails without touching the corpus already written."""

from __future__ import annotations

import errno
import gzip
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, make_tokenizer_dir, random_text

pytest.importorskip("tokenizers")

from megatron_ext.datasets import IndexedDataset, preprocess  # noqa: E402
from megatron_ext.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: E402


@pytest.fixture
def tokenizer_dir(tmp_path):
    return make_tokenizer_dir(tmp_path / "tokenizer")


def run(inputs, prefix, tokenizer, *extra: str) -> dict:
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs
    return preprocess.main(
        ["--input", *map(str, inputs), "--output-prefix", str(prefix), "--tokenizer", str(tokenizer),
         "--append-eod", "--no-progress", *extra]
    )


def files(prefix) -> dict[str, bytes]:
    return {s: open(f"{prefix}{s}", "rb").read() for s in (".bin", ".idx")}


def listing(path) -> list[str]:
    return sorted(os.listdir(path))


def write_jsonl(path, texts, key="text") -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps({key: t}) + "\n" for t in texts)


def command(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_ext.datasets.preprocess", *argv],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_failed_rerun_keeps_the_corpus(tmp_path, tokenizer_dir):
    """A rerun that fails halfway (a broken line 150 of 200) leaves the corpus of the run before
    byte for byte, and no temporary file beside it."""
    good = tmp_path / "good.jsonl"
    write_jsonl(good, random_text(0, 200))
    out = tmp_path / "out"
    prefix = run(good, out / "corpus", tokenizer_dir)["prefixes"][0]
    before, names = files(prefix), listing(out)
    texts = random_text(1, 200)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": t}) + "\n" if i != 149 else "{broken\n"
                           for i, t in enumerate(texts)))
    for workers in ("1", "2"):
        with pytest.raises(ValueError, match="150: expected a JSON object"):
            run(bad, out / "corpus", tokenizer_dir, "--workers", workers)
        assert files(prefix) == before and listing(out) == names
    assert len(IndexedDataset(prefix)) == 200
    # a run that succeeds replaces both files
    write_jsonl(bad, texts)
    run(bad, out / "corpus", tokenizer_dir)
    assert files(prefix) != before and listing(out) == names and len(IndexedDataset(prefix)) == 200


def test_one_error_line_per_bad_input(tmp_path, tokenizer_dir, monkeypatch):
    ok = tmp_path / "ok.jsonl"
    write_jsonl(ok, ["w1 w2"])
    values = tmp_path / "values.jsonl"
    for value, got in ((3, "a number (3)"), (None, "null"), ([1, 2], "a list holding a number (1)"),
                       (["w1", None], "a list holding null"), ({"a": "w1"}, "an object")):
        values.write_text(json.dumps({"text": "w1"}) + "\n" + json.dumps({"text": value}) + "\n")
        with pytest.raises(ValueError) as e:
            run(values, tmp_path / "o" / "x", tokenizer_dir)
        assert str(e.value) == (f"{values}:2: expected the value of 'text' to be a string or a list of "
                                f"strings, got {got}")
    # non-UTF-8 text, plain and compressed
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"w1 w2\nw3 caf\xe9\n")
    with pytest.raises(ValueError, match=r"^.*latin.txt:2: not UTF-8 \(byte 0xe9 at character 7\); "
                       "expected UTF-8 text$"):
        run(latin, tmp_path / "o" / "x", tokenizer_dir)
    with gzip.open(tmp_path / "latin.jsonl.gz", "wb") as f:
        f.write(b'{"text": "w1"}\n{"text": "w2"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl.gz:3: not UTF-8 \(byte 0xe9"):
        run(tmp_path / "latin.jsonl.gz", tmp_path / "o" / "x", tokenizer_dir)
    (tmp_path / "escaped.jsonl").write_text('{"text": "w1 \\ud800 w2"}\n')  # valid JSON, no UTF-8 text
    with pytest.raises(ValueError, match=r"escaped.jsonl:1: the value of 'text' holds the lone surrogate "
                       r"\\ud800 at character 4; expected UTF-8 text$"):
        run(tmp_path / "escaped.jsonl", tmp_path / "o" / "x", tokenizer_dir, "--workers", "2")
    # broken tokenizer files, each named
    broken = make_tokenizer_dir(tmp_path / "broken")
    text = (broken / "tokenizer.json").read_text()
    (broken / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=f"^{broken / 'tokenizer.json'}: not a valid tokenizer file"):
        run(ok, tmp_path / "o" / "x", broken)
    make_tokenizer_dir(broken)
    (broken / "tokenizer_config.json").write_text("{'eos_token': '<eos>'}")
    with pytest.raises(ValueError, match=f"^{broken / 'tokenizer_config.json'}:1: not JSON"):
        run(ok, tmp_path / "o" / "x", broken)
    (broken / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(ValueError, match=f"^{broken / 'tokenizer_config.json'}: expected a JSON object"):
        run(ok, tmp_path / "o" / "x", broken)
    # unwritable outputs: under a regular file, a prefix ending in '/'
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=f"{tmp_path / 'a_file'}' is a file, not a directory"):
        run(ok, tmp_path / "a_file" / "sub" / "x", tokenizer_dir)
    with pytest.raises(ValueError, match="ends in '/': expected a directory and a file name prefix"):
        run(ok, f"{tmp_path}/o/", tokenizer_dir)
    # a read-only file system and a full disk, simulated: root writes through chmod, and an
    # unprivileged test can mount nothing, so the builder's file raises what the kernel would
    out = tmp_path / "out"
    prefix = run(ok, out / "c", tokenizer_dir)["prefixes"][0]
    before, names = files(prefix), listing(out)

    def read_only(self, path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    with monkeypatch.context() as m:
        m.setattr(IndexedDatasetBuilder, "__init__", read_only)
        with pytest.raises(ValueError, match=f"cannot write {prefix}.bin: Read-only file system$"):
            run(ok, out / "c", tokenizer_dir)
    assert files(prefix) == before and listing(out) == names
    write_jsonl(tmp_path / "many.jsonl", random_text(2, 50))
    real_add = IndexedDatasetBuilder.add_document

    def fills_the_disk(self, tensor, lengths, modes=None):
        if len(self.document_indices) > 20:  # some documents reach the file first
            self.data_file.write(b"\0" * 3)
            self.data_file.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_add(self, tensor, lengths, modes)

    with monkeypatch.context() as m:
        m.setattr(IndexedDatasetBuilder, "add_document", fills_the_disk)
        with pytest.raises(ValueError, match=f"cannot write {prefix}.bin: No space left on device$"):
            run(tmp_path / "many.jsonl", out / "c", tokenizer_dir)
    assert files(prefix) == before and listing(out) == names
    # the command line: one line, no traceback, exit status 2
    done = command("--input", str(latin), "--output-prefix", str(tmp_path / "o" / "x"),
                   "--tokenizer", str(tokenizer_dir), "--no-progress")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and "latin.txt:2: not UTF-8" in done.stderr


def test_compressed_parquet_several_files_and_nested_keys(tmp_path, tokenizer_dir):
    """Every way in gives the bytes of the plain JSONL run."""
    zstandard = pytest.importorskip("zstandard")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    texts = random_text(3, 120) + [""]
    reverse = [" ".join(reversed(t.split())) for t in texts]
    records = [{"text": t, "meta": {"body": r, "n": i}} for i, (t, r) in enumerate(zip(texts, reverse))]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in records))
    want = files(run(plain, tmp_path / "plain", tokenizer_dir)["prefixes"][0])
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(plain.read_text())
    # two zstd frames, as concatenated .zst files are
    half = len(plain.read_bytes()) // 2
    lines = plain.read_bytes()
    cut = lines.index(b"\n", half) + 1
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.compress(lines[:cut]) + zstandard.compress(lines[cut:]))
    pq.write_table(pyarrow.Table.from_pylist(records), tmp_path / "c.parquet", row_group_size=50)
    for name in ("c.jsonl.gz", "c.jsonl.zst", "c.parquet"):
        result = run(tmp_path / name, tmp_path / name.replace(".", "_"), tokenizer_dir, "--workers", "2")
        assert files(result["prefixes"][0]) == want, name
        assert result["documents"] == len(texts)
    # several files and a glob: one corpus, the files in the order given, a glob's sorted
    parts = [texts[:40], texts[40:90], texts[90:]]
    for k, part in enumerate(parts):
        write_jsonl(tmp_path / f"part-{k}.jsonl", part)
    gz = tmp_path / "part-1.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write((tmp_path / "part-1.jsonl").read_text())
    listed = run([tmp_path / "part-0.jsonl", gz, tmp_path / "part-2.jsonl"], tmp_path / "listed",
                 tokenizer_dir)
    assert files(listed["prefixes"][0]) == want
    globbed = run(tmp_path / "part-*.jsonl", tmp_path / "globbed", tokenizer_dir)
    assert files(globbed["prefixes"][0]) == want and globbed["documents"] == len(texts)
    # nested keys: meta.body in JSONL and Parquet, as the same texts under "text" give
    write_jsonl(tmp_path / "reverse.jsonl", reverse)
    want_reverse = files(run(tmp_path / "reverse.jsonl", tmp_path / "reverse", tokenizer_dir)["prefixes"][0])
    for name in ("plain.jsonl", "c.parquet"):
        result = run(tmp_path / name, tmp_path / f"nested_{name}", tokenizer_dir, "--json-keys", "text",
                     "meta.body")
        assert [p[len(str(tmp_path)) :] for p in result["prefixes"]] == [
            f"/nested_{name}_text_document", f"/nested_{name}_meta.body_document"]
        assert files(result["prefixes"][0]) == want and files(result["prefixes"][1]) == want_reverse
    # what is missing or wrong is one error naming the file and the row or line
    with pytest.raises(ValueError, match=r"c.parquet: no column 'body'; expected the columns of --json-keys"):
        run(tmp_path / "c.parquet", tmp_path / "x", tokenizer_dir, "--json-keys", "body")
    with pytest.raises(ValueError, match=r"c.parquet: row 1: expected the value of 'meta.n' to be a string"):
        run(tmp_path / "c.parquet", tmp_path / "x", tokenizer_dir, "--json-keys", "meta.n")
    with pytest.raises(ValueError, match=r"plain.jsonl:1: expected a JSON object with the keys \['meta.x'\]"):
        run(plain, tmp_path / "x", tokenizer_dir, "--json-keys", "meta.x")
    with pytest.raises(ValueError, match=r"--input '.*nothing-\*.jsonl': no file matches"):
        run(tmp_path / "nothing-*.jsonl", tmp_path / "x", tokenizer_dir)
    (tmp_path / "trunc.jsonl.gz").write_bytes(gzip.compress(lines)[:-30])
    with pytest.raises(ValueError, match=r"trunc.jsonl.gz: cannot read it as gzip"):
        run(tmp_path / "trunc.jsonl.gz", tmp_path / "x", tokenizer_dir)
    (tmp_path / "not.parquet").write_text("w1\n")
    with pytest.raises(ValueError, match=r"not.parquet: not a Parquet file"):
        run(tmp_path / "not.parquet", tmp_path / "x", tokenizer_dir)


def test_missing_packages_and_empty_inputs(tmp_path, tokenizer_dir, monkeypatch):
    (tmp_path / "c.jsonl.zst").write_bytes(b"")
    (tmp_path / "c.parquet").write_bytes(b"")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "zstandard", None)  # what an environment without it imports
        m.setitem(sys.modules, "pyarrow", None)
        m.setitem(sys.modules, "pyarrow.parquet", None)
        for name, package in (("c.jsonl.zst", "zstandard"), ("c.parquet", "pyarrow")):
            with pytest.raises(ValueError, match=f"{name}' needs the '{package}' package"):
                run(tmp_path / name, tmp_path / "x", tokenizer_dir)
    (tmp_path / "empty.jsonl").write_text("")
    write_jsonl(tmp_path / "one.jsonl", ["w1"])
    with pytest.warns(UserWarning, match="empty.jsonl holds no documents") as caught:
        result = run([tmp_path / "empty.jsonl", tmp_path / "one.jsonl"], tmp_path / "e", tokenizer_dir)
    assert len(caught) == 1 and result["documents"] == 1
    assert len(IndexedDataset(result["prefixes"][0])) == 1


def test_progress_bar_counts_exactly_and_stops_at_an_error(tmp_path, tokenizer_dir, capsys):
    pytest.importorskip("tqdm")
    source = tmp_path / "c.jsonl"
    write_jsonl(source, random_text(4, 100))
    preprocess.main(["--input", str(source), "--output-prefix", str(tmp_path / "o"), "--tokenizer",
                     str(tokenizer_dir), "--workers", "2"])
    stderr = capsys.readouterr().err
    bars = stderr.split("\n")[-3].split("\r")
    assert "100%" in bars[-1] and "docs=100," in bars[-1], stderr
    assert stderr.split("\n")[-2].startswith("100 documents")
    # the bar of a run that fails is drawn for the last time before the error line, not after it
    with open(source, "a") as f:
        f.write("{broken\n")
    done = command("--input", str(source), "--output-prefix", str(tmp_path / "o"), "--tokenizer",
                   str(tokenizer_dir))
    assert done.returncode == 2
    last_bar, error, end = done.stderr.split("\n")[-3:]
    assert "docs=100," in last_bar.split("\r")[-1] and end == "", done.stderr
    assert error == f"error: {source}:101: expected a JSON object with the keys ['text']; not JSON " \
        "(Expecting property name enclosed in double quotes at column 2)"
