"""Tokenizes JSONL (one JSON object per line, the text under ``--json-keys``) or plain text (one
document per line) into Megatron's ``.bin``/``.idx`` corpus, with a Hugging Face tokenizer from a
local directory and several worker processes:

    python -m megatron_ext.datasets.preprocess --input corpus.jsonl --output-prefix out/corpus \\
        --tokenizer path/to/model --append-eod --workers 4

writes ``out/corpus_text_document.bin`` and ``.idx`` (Megatron-LM's ``tools/preprocess_data.py``
names), read unchanged by Megatron-core's IndexedDataset; train on the prefix
``out/corpus_text_document``. uint16 token ids below a 65,500-token vocabulary, int32 above."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy

from megatron_ext.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron_ext.datasets.tokenizer import HuggingFaceTokenizer

# Lines handed to a worker at a time.
CHUNK = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m megatron_ext.datasets.preprocess",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", required=True, help="a JSONL file, or a text file with one document per line")
    p.add_argument(
        "--input-format",
        choices=["auto", "jsonl", "text"],
        default="auto",
        help="auto: JSONL for .json/.jsonl files, text otherwise",
    )
    p.add_argument(
        "--json-keys", nargs="+", default=["text"], help="the JSONL keys to tokenize, a corpus each"
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
    if not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input!r}: no such file")
    if args.input_format == "auto":
        args.input_format = "jsonl" if args.input.endswith((".json", ".jsonl")) else "text"
    return args


class Encoder:
    """Turns input lines into token ids; one per worker process (the tokenizer loads once)."""

    tokenizer: HuggingFaceTokenizer | None = None

    def __init__(self, args: argparse.Namespace) -> None:
        self.path = args.tokenizer
        self.keys = args.json_keys if args.input_format == "jsonl" else ["text"]
        self.jsonl = args.input_format == "jsonl"
        self.append_eod = args.append_eod

    def initializer(self) -> None:
        Encoder.tokenizer = HuggingFaceTokenizer(self.path)

    def encode(self, numbered_line: tuple[int, str]) -> tuple[dict, int, str | None]:
        """({key: (token ids, sequence lengths)}, bytes read, an error message or None) of one
        input line."""
        number, line = numbered_line
        if self.jsonl:
            try:
                record = json.loads(line)
                texts = {key: record[key] for key in self.keys}
            except (json.JSONDecodeError, KeyError, TypeError):
                return {}, len(line), f"line {number}: expected a JSON object with the keys {self.keys}"
        else:
            texts = {"text": line.rstrip("\n")}
        out = {}
        for key, text in texts.items():
            # a list of texts is a document of several sequences, as in Megatron-LM's tool
            ids, lengths = [], []
            for part in text if isinstance(text, list) else [text]:
                part_ids = Encoder.tokenizer.tokenize(part)
                if part_ids:
                    ids += part_ids
                    lengths.append(len(part_ids))
            if ids and self.append_eod:
                ids.append(Encoder.tokenizer.eod)
                lengths[-1] += 1
            out[key] = (ids, lengths)
        return out, len(line.encode("utf-8")), None


def output_paths(prefix: str, key: str) -> tuple[str, str]:
    base = f"{prefix}_{key}_document"
    return base + ".bin", base + ".idx"


def main(argv: list[str] | None = None) -> dict:
    """Runs the tool; returns its figures (documents, tokens, seconds, tokens/s, outputs)."""
    args = parse_args(argv)
    encoder = Encoder(args)
    encoder.initializer()  # a missing or broken tokenizer fails here, before any worker starts
    vocab_size = Encoder.tokenizer.vocab_size
    dtype = DType.optimal_dtype(vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    builders = {
        key: IndexedDatasetBuilder(output_paths(args.output_prefix, key)[0], dtype=dtype)
        for key in encoder.keys
    }
    progress = None
    if not args.no_progress:
        try:
            from tqdm import tqdm
        except ImportError:  # no progress bar without tqdm; the summary line still comes
            tqdm = None
    if not args.no_progress and tqdm is not None:
        progress = tqdm(
            total=os.path.getsize(args.input),
            unit="B",
            unit_scale=True,
            desc="tokenize",
            dynamic_ncols=True,
            file=sys.stderr,
        )
    start = time.perf_counter()
    documents = tokens = 0
    with open(args.input, encoding="utf-8") as f:
        lines = enumerate(f, 1)
        pool = None
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
            encoded = pool.imap(encoder.encode, lines, CHUNK)
        else:
            encoded = map(encoder.encode, lines)
        try:
            for ids, size, error in encoded:
                if error is not None:
                    raise ValueError(f"{args.input}: {error}")
                for key, (doc, lengths) in ids.items():
                    builders[key].add_document(numpy.asarray(doc, dtype=numpy.int64), lengths)
                    tokens += len(doc)
                documents += 1
                if progress is not None:
                    progress.update(size)
                    if documents % CHUNK == 0:
                        progress.set_postfix(
                            docs=documents, tok_s=f"{tokens / (time.perf_counter() - start):.0f}"
                        )
        finally:
            if pool is not None:
                pool.terminate()
    for key, builder in builders.items():
        builder.finalize(output_paths(args.output_prefix, key)[1])
    seconds = time.perf_counter() - start
    if progress is not None:
        progress.close()
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
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
