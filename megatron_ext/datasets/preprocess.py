"""Tokenizes JSONL (one JSON object per line, the text under ``--json-keys``), Parquet (the text in
the columns of ``--json-keys``) or plain text (one document per line) into Megatron's ``.bin``/``.idx``
corpus, with a Hugging Face tokenizer from a local directory and several worker processes:

    python -m megatron_ext.datasets.preprocess --input corpus.jsonl --output-prefix out/corpus \\
        --tokenizer path/to/model --append-eod --workers 4

writes ``out/corpus_text_document.bin`` and ``.idx`` (Megatron-LM's ``tools/preprocess_data.py``
names), read unchanged by Megatron-core's IndexedDataset; train on the prefix
``out/corpus_text_document``. uint16 token ids below a 65,500-token vocabulary, int32 above.

``--input`` takes several files and globs ('data/part-*.jsonl.zst'), one corpus of them all in the
order given (a glob's matches sorted); ``.gz`` and ``.zst`` files are decompressed as they are read
(``.zst`` needs the ``zstandard`` package, Parquet ``pyarrow``). A key ``meta.body`` is the field
``body`` of the object under ``meta``. The files are written under temporary names and renamed
once complete: a run that fails leaves what was there before."""

from __future__ import annotations

import argparse
import glob
import gzip
import importlib
import io
import json
import multiprocessing
import os
import sys
import time
import warnings
import zlib

import numpy

from megatron_ext.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron_ext.datasets.tokenizer import HuggingFaceTokenizer

# Lines handed to a worker at a time.
CHUNK = 64
# What reading each compression and format needs beyond the standard library.
PACKAGES = {".zst": "zstandard", "parquet": "pyarrow"}


def input_format(path: str, given: str) -> str:
    if given != "auto":
        return given
    name = path[: -len(compression(path))] if compression(path) else path
    if name.endswith((".json", ".jsonl")):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def compression(path: str) -> str:
    return next((ext for ext in (".gz", ".zst") if path.endswith(ext)), "")


def expand_inputs(patterns: list[str]) -> list[str]:
    """The files of ``--input``: each a file, or a glob of at least one file."""
    paths: list[str] = []
    for pattern in patterns:
        if os.path.isfile(pattern):
            matches = [pattern]
        elif os.path.isdir(pattern):
            raise ValueError(f"--input {pattern!r} is a directory: expected a file or a glob such as "
                             f"{os.path.join(pattern, '*.jsonl')!r}")
        elif glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise ValueError(f"--input {pattern!r}: no file matches")
        else:
            raise ValueError(f"--input {pattern!r}: no such file")
        for path in matches:
            if path in paths:  # two overlapping globs would tokenize a file twice
                raise ValueError(f"--input names {path!r} twice")
            paths.append(path)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m megatron_ext.datasets.preprocess",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--input",
        required=True,
        nargs="+",
        help="JSONL, Parquet or text files (one document per line), .gz or .zst compressed, or globs of them",
    )
    p.add_argument(
        "--input-format",
        choices=["auto", "jsonl", "parquet", "text"],
        default="auto",
        help="auto: JSONL for .json/.jsonl files, Parquet for .parquet, text otherwise (before .gz/.zst)",
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="the JSONL keys or Parquet columns to tokenize, a corpus each; a.b is the field b of a",
    )
    p.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX_KEY_document.bin/.idx for each key (KEY is 'text' for text input)",
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        help="a local Hugging Face tokenizer or model directory (tokenizer.json, ...)",
    )
    p.add_argument(
        "--append-eod", action="store_true", help="end every non-empty document with the EOS token"
    )
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    prefix = args.output_prefix
    if not os.path.basename(prefix):
        raise ValueError(f"--output-prefix {prefix!r} ends in '/': expected a directory and a file name "
                         f"prefix, e.g. {os.path.join(prefix, 'corpus')!r}")
    args.inputs = expand_inputs(args.input)
    args.formats = [input_format(path, args.input_format) for path in args.inputs]
    for path, fmt in zip(args.inputs, args.formats):
        if fmt == "parquet" and compression(path):
            raise ValueError(f"--input {path!r}: a Parquet file compresses its own columns; expected no "
                             f"{compression(path)} around it")
        package = PACKAGES.get(compression(path)) or PACKAGES.get(fmt)
        if package is not None:
            try:
                importlib.import_module(package)
            except ImportError:
                raise ValueError(f"--input {path!r} needs the {package!r} package: pip install "
                                 f"{package}") from None
    if "text" in args.formats and set(args.formats) != {"text"}:
        raise ValueError("--input mixes text files (one document per line) with JSONL or Parquet files "
                         f"(the text under --json-keys): {args.inputs[args.formats.index('text')]!r}; "
                         "expected one or the other")
    return args


def describe(value) -> str:
    """A JSON value's kind, as an error message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list holding " + describe(next(v for v in value if not isinstance(v, str)))
    return f"a {type(value).__name__}"


def lookup(record: dict, key: str):
    """``record[key]``, or for a dotted key with no such field, the nested field it names."""
    if key in record:
        return record[key]
    value = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


class Encoder:
    """Turns input lines or records into token ids; one per worker process (the tokenizer loads
    once)."""

    tokenizer: HuggingFaceTokenizer | None = None

    def __init__(self, args: argparse.Namespace) -> None:
        self.path = args.tokenizer
        self.text = args.formats[0] == "text"
        self.keys = ["text"] if self.text else args.json_keys
        self.append_eod = args.append_eod

    def initializer(self) -> None:
        Encoder.tokenizer = HuggingFaceTokenizer(self.path)

    def texts(self, item: str | dict) -> tuple[dict, str | None]:
        """({key: text}, None) of one line or Parquet row, or ({}, what is wrong)."""
        if self.text:
            return {"text": item.rstrip("\n")}, None
        record, expected = item, f"expected a JSON object with the keys {self.keys}"
        if isinstance(item, str):
            try:
                record = json.loads(item)
            except json.JSONDecodeError as e:
                return {}, f"{expected}; not JSON ({e.msg} at column {e.colno})"
            if not isinstance(record, dict):
                return {}, f"{expected}; got {describe(record)}"
        try:
            texts = {key: lookup(record, key) for key in self.keys}
        except KeyError as e:
            return {}, f"{expected}; no key {e.args[0]!r}"
        for key, text in texts.items():
            if not isinstance(text, str) and not (
                isinstance(text, list) and all(isinstance(part, str) for part in text)
            ):
                return {}, (
                    f"expected the value of {key!r} to be a string or a list of strings, got {describe(text)}"
                )
        return texts, None

    def encode(self, item: tuple[int, int, str | dict, int | None]) -> tuple[int, int, dict, int, str | None]:
        """(file, line, {key: (token ids, sequence lengths)}, bytes read, an error message or None)
        of one input item (file, line, the line or Parquet row, bytes read or None for the line's)."""
        file, number, payload, size = item
        if isinstance(payload, str):
            try:
                line_size = len(payload.encode("utf-8"))
            except UnicodeEncodeError as e:  # the reader's surrogateescape kept the bytes that are not UTF-8
                byte = payload[e.start].encode("utf-8", "surrogateescape")[0]
                return file, number, {}, 0, (
                    f"not UTF-8 (byte 0x{byte:02x} at character {e.start + 1}); expected UTF-8 text"
                )
            size = line_size if size is None else size
        texts, error = self.texts(payload)
        if error is not None:
            return file, number, {}, size, error
        out = {}
        for key, text in texts.items():
            # a list of texts is a document of several sequences, as in Megatron-LM's tool
            ids, lengths = [], []
            for part in text if isinstance(text, list) else [text]:
                try:
                    part_ids = Encoder.tokenizer.tokenize(part)
                except TypeError:  # what the tokenizer raises for a lone surrogate, e.g. JSON's "\\ud800"
                    bad = next((i for i, c in enumerate(part) if "\ud800" <= c <= "\udfff"), None)
                    if bad is None:
                        raise
                    return file, number, {}, size, (
                        f"the value of {key!r} holds the lone surrogate \\u{ord(part[bad]):04x} at character "
                        f"{bad + 1}; expected UTF-8 text"
                    )
                if part_ids:
                    ids += part_ids
                    lengths.append(len(part_ids))
            if ids and self.append_eod:
                ids.append(Encoder.tokenizer.eod)
                lengths[-1] += 1
            out[key] = (ids, lengths)
        return file, number, out, size, None


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of every frame of a ``.zst`` file; a file that ends inside a frame is
    an EOFError (zstandard's stream_reader returns what it has, silently)."""

    def __init__(self, raw: io.BufferedReader) -> None:
        import zstandard

        self.raw, self.context, self.error = raw, zstandard.ZstdDecompressor(), zstandard.ZstdError
        self.frame, self.started = self.context.decompressobj(), False
        self.pending, self.offset = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.offset == len(self.pending):
            chunk = self.raw.read(1 << 17)
            if not chunk:
                if self.started and not self.frame.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            self.pending, self.offset = b"", 0
            while chunk:
                if self.frame.eof:  # the next frame of a concatenated file
                    self.frame = self.context.decompressobj()
                self.started = True
                try:
                    self.pending += self.frame.decompress(chunk)
                except self.error as e:
                    raise OSError(str(e)) from None
                chunk = self.frame.unused_data if self.frame.eof else b""
        n = min(len(buffer), len(self.pending) - self.offset)
        buffer[:n] = self.pending[self.offset : self.offset + n]
        self.offset += n
        return n


def _zstd_reader(raw: io.BufferedReader) -> io.BufferedReader:
    return io.BufferedReader(_ZstdReader(raw), 1 << 17)


def read_lines(file: int, path: str):
    """(file, line number, line, on-disk bytes read or None for the line's own) of a text or JSONL
    file; bytes that are not UTF-8 come through as surrogates for the worker to report."""
    ext = compression(path)
    try:
        with open(path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if ext == ".gz" else _zstd_reader(raw) if ext else raw
            text = io.TextIOWrapper(stream, encoding="utf-8", errors="surrogateescape")
            position = 0
            for number, line in enumerate(text, 1):
                size = None
                if ext:  # the compressed bytes behind the line, for the progress bar
                    size, position = raw.tell() - position, raw.tell()
                yield file, number, line, size
    except (OSError, EOFError, zlib.error) as e:
        how = {".gz": " as gzip", ".zst": " as zstd"}.get(ext, "")
        raise ValueError(f"{path}: cannot read it{how} ({e})") from None


def read_rows(file: int, path: str, keys: list[str]):
    """(file, row number, row as a dict of the key's columns, on-disk bytes read) of a Parquet
    file."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a Parquet file ({e})") from None
    names = parquet.schema_arrow.names
    columns = []
    for key in keys:
        column = key if key in names else key.split(".")[0]
        if column not in names:
            raise ValueError(f"{path}: no column {column!r}; expected the columns of --json-keys {keys} "
                             f"(it has {names})")
        columns.append(column)
    size, rows, number = os.path.getsize(path), max(parquet.metadata.num_rows, 1), 0
    try:
        for batch in parquet.iter_batches(batch_size=CHUNK * 16, columns=list(dict.fromkeys(columns))):
            for row in batch.to_pylist():
                number += 1
                # the file's bytes shared out over its rows, for the progress bar
                yield file, number, row, size * number // rows - size * (number - 1) // rows
    except (pyarrow.ArrowException, OSError) as e:
        raise ValueError(f"{path}: cannot read row {number + 1} ({e})") from None


def output_paths(prefix: str, key: str) -> tuple[str, str]:
    base = f"{prefix}_{key}_document"
    return base + ".bin", base + ".idx"


def make_output_dir(prefix: str) -> None:
    directory = os.path.dirname(os.path.abspath(prefix))
    parent = directory
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"--output-prefix {prefix!r}: {parent!r} is a file, not a directory")
    os.makedirs(directory, exist_ok=True)


def progress_bar(args: argparse.Namespace):
    if args.no_progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # no progress bar without tqdm; the summary line still comes
        return None
    return tqdm(
        total=sum(os.path.getsize(path) for path in args.inputs),
        unit="B",
        unit_scale=True,
        desc="tokenize",
        dynamic_ncols=True,
        file=sys.stderr,
    )


def tokenize(args: argparse.Namespace, encoder: Encoder, builders: dict, progress) -> list[list[int]]:
    """Adds every document of the inputs to ``builders``; returns the documents and tokens of each
    input."""
    counts = [[0, 0] for _ in args.inputs]
    items = (
        item
        for file, (path, fmt) in enumerate(zip(args.inputs, args.formats))
        for item in (read_rows(file, path, encoder.keys) if fmt == "parquet" else read_lines(file, path))
    )
    pool = None
    if args.workers > 1:
        pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
        encoded = pool.imap(encoder.encode, items, CHUNK)
    else:
        encoded = map(encoder.encode, items)
    start, documents, tokens = time.perf_counter(), 0, 0
    try:
        for file, number, ids, size, error in encoded:
            if error is not None:
                where = f"{args.inputs[file]}: row {number}" if args.formats[file] == "parquet" else (
                    f"{args.inputs[file]}:{number}")
                raise ValueError(f"{where}: {error}")
            for key, (doc, lengths) in ids.items():
                try:
                    builders[key].add_document(numpy.asarray(doc, dtype=numpy.int64), lengths)
                except OSError as e:  # a failed write (a full disk) names no file
                    e.filename = e.filename or builders[key].data_file.name
                    raise
                counts[file][1] += len(doc)
                tokens += len(doc)
            counts[file][0] += 1
            documents += 1
            if progress is not None:
                progress.update(size)
                if documents % CHUNK == 0:
                    rate = tokens / (time.perf_counter() - start)
                    progress.set_postfix(docs=documents, tok_s=f"{rate:.0f}", refresh=False)
    finally:
        if pool is not None:
            pool.terminate()
        if progress is not None:  # the exact count, drawn once more before any error line
            seconds = time.perf_counter() - start
            progress.set_postfix(docs=documents, tok_s=f"{tokens / seconds if seconds > 0 else 0:.0f}",
                                 refresh=False)
            progress.close()
    return counts


def write_error(e: OSError, prefix: str, temporary: dict[str, str]) -> ValueError:
    """An error writing the output, naming the file as the user knows it."""
    name = temporary.get(e.filename, e.filename) if e.filename else os.path.dirname(prefix) or "."
    return ValueError(f"--output-prefix {prefix!r}: cannot write {name}: {e.strerror or e}")


def main(argv: list[str] | None = None) -> dict:
    """Runs the tool; returns its figures (documents, tokens, seconds, tokens/s, outputs)."""
    args = parse_args(argv)
    encoder = Encoder(args)
    encoder.initializer()  # a missing or broken tokenizer fails here, before any worker starts
    vocab_size = Encoder.tokenizer.vocab_size
    dtype = DType.optimal_dtype(vocab_size)
    finals = {key: output_paths(args.output_prefix, key) for key in encoder.keys}
    # written under these names and renamed once complete, as checkpoints are
    temporary = {
        f"{path}.{os.getpid()}.tmp": path for key in encoder.keys for path in finals[key]
    }
    partial = dict(zip(temporary.values(), temporary))
    builders: dict[str, IndexedDatasetBuilder] = {}
    start = time.perf_counter()
    done = False
    try:
        make_output_dir(args.output_prefix)
        for key in encoder.keys:
            builders[key] = IndexedDatasetBuilder(partial[finals[key][0]], dtype=dtype)
        progress = progress_bar(args)
        counts = tokenize(args, encoder, builders, progress)
        for key, builder in builders.items():
            try:
                builder.finalize(partial[finals[key][1]])
            except OSError as e:
                e.filename = e.filename or partial[finals[key][1]]
                raise
        for key in encoder.keys:
            for path in finals[key]:
                os.replace(partial[path], path)
        done = True
    except OSError as e:
        raise write_error(e, args.output_prefix, temporary) from None
    finally:
        if not done:
            for builder in builders.values():
                builder.data_file.close()
            for path in temporary:
                if os.path.exists(path):
                    os.remove(path)
    seconds = time.perf_counter() - start
    for path, (documents, _) in zip(args.inputs, counts):
        if documents == 0:
            warnings.warn(f"{path} holds no documents", stacklevel=2)
    documents, tokens = (sum(c[i] for c in counts) for i in (0, 1))
    result = {
        "documents": documents,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "workers": args.workers,
        "dtype": numpy.dtype(dtype).name,
        "prefixes": [output_paths(args.output_prefix, key)[0][: -len(".bin")] for key in encoder.keys],
    }
    print(
        f"{documents} documents, {tokens} tokens in {seconds:.1f} s ({result['tokens_per_s']:.0f} tokens/s, "
        f"{args.workers} worker{'s' if args.workers > 1 else ''}): {', '.join(result['prefixes'])}",
        file=sys.stderr,
    )
    return result


if __name__ == "__main__":
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
