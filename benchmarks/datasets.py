"""Data pipeline against megatron-core 0.16.1 in the same run: building the GPT datasets of a
synthetic corpus (index building with a cold cache, loading with a warm one) and preprocessing
JSONL into .bin/.idx.

    python benchmarks/datasets.py [--tokens 150000000] [--reps 3]

Build: a two-corpus blend (weights 0.7, 0.3, split 969,30,1) of random documents written with
IndexedDatasetBuilder under --dir (not in the repository), BlendedMegatronDatasetBuilder over
GPTDataset with train samples for two epochs, megatron_ext's against Megatron-core's (its own
helpers_cpp), interleaved. Cold: the cache directory emptied before each run (outside the time);
warm: every index read from the cache. Preprocessing: a byte-level BPE tokenizer trained here with
the ``tokenizers`` package; ``python -m megatron_ext.datasets.preprocess`` with 1 and 2 workers
against the same tokenizer feeding Megatron-core's IndexedDatasetBuilder in one process
(Megatron-LM's tools/preprocess_data.py itself imports megatron.training, which needs
TransformerEngine). Times are wall seconds; peak extra memory is common.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from datetime import timedelta

import numpy
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, require_megatron_core, run_interleaved, summarize, write_json  # noqa: E402

from megatron_ext import datasets as ours  # noqa: E402
from megatron_ext.datasets import preprocess  # noqa: E402

VOCAB = 50000


class Tokenizer:
    """What the GPT datasets read of a tokenizer (and what names it in the cache key)."""

    vocab_size, eod = VOCAB, 0
    unique_identifiers = {"class": "BenchTokenizer", "vocab_size": VOCAB}


def write_corpus(prefix: str, tokens: int, seed: int) -> int:
    """Random documents (lengths 1..2047, EOD-terminated) totalling about ``tokens``; returns their count."""
    rng = numpy.random.default_rng(seed)
    builder = ours.IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    written = documents = 0
    while written < tokens:
        lengths = rng.integers(1, 2048, size=min(4096, (tokens - written) // 1024 + 1))
        block = rng.integers(1, VOCAB, size=int(lengths.sum()), dtype=numpy.uint16)
        block[numpy.cumsum(lengths) - 1] = 0
        for doc in numpy.split(block, numpy.cumsum(lengths)[:-1]):
            builder.add_document(doc, [len(doc)])
        written += int(lengths.sum())
        documents += len(lengths)
    builder.finalize(prefix + ".idx")
    return documents


def build_variants(args, prefixes: list[str], mc) -> tuple[dict, dict]:
    samples = 2 * args.tokens // args.seq_len  # two epochs of the train split
    sizes = [samples, samples // 100, 0]  # as train_gpt.py asks: train, valid, no test

    def builder(module, cls, builder_cls, cache):
        def build(*_):  # the cold runs' prepare() result: nothing
            config = module.GPTDatasetConfig(
                random_seed=1234,
                sequence_length=args.seq_len,
                blend=(prefixes, [0.7, 0.3]),
                split="969,30,1",
                path_to_cache=cache,
                tokenizer=Tokenizer(),
                reset_position_ids=False,
                reset_attention_mask=False,
                eod_mask_loss=False,
            )
            datasets = builder_cls(cls, sizes, lambda: True, config).build()
            assert len(datasets[0]) >= sizes[0]

        return build

    caches = {
        "megatron_ext": os.path.join(args.dir, "cache_ours"),
        "megatron-core": os.path.join(args.dir, "cache_mc"),
    }
    variants = {
        "megatron_ext": builder(
            ours.gpt_dataset, ours.GPTDataset, ours.BlendedMegatronDatasetBuilder, caches["megatron_ext"]
        )
    }
    if mc is not None:
        gpt, blended = mc
        variants["megatron-core"] = builder(
            gpt, gpt.GPTDataset, blended.BlendedMegatronDatasetBuilder, caches["megatron-core"]
        )
    return variants, caches


def preprocess_variants(args, source: str, tokenizer_dir: str, mc_indexed) -> dict:
    def ours_run(workers):
        def run():
            return preprocess.main(
                [
                    "--input",
                    source,
                    "--output-prefix",
                    os.path.join(args.dir, f"pre_{workers}"),
                    "--tokenizer",
                    tokenizer_dir,
                    "--append-eod",
                    "--workers",
                    str(workers),
                    "--no-progress",
                ]
            )

        return run

    variants = {f"megatron_ext {w} worker{'s' if w > 1 else ''}": ours_run(w) for w in args.workers}
    if mc_indexed is not None:

        def theirs():
            tokenizer = ours.HuggingFaceTokenizer(tokenizer_dir)
            builder = mc_indexed.IndexedDatasetBuilder(
                os.path.join(args.dir, "pre_mc.bin"),
                dtype=mc_indexed.DType.optimal_dtype(tokenizer.vocab_size),
            )
            with open(source) as f:
                for line in f:
                    ids = tokenizer.tokenize(json.loads(line)["text"]) + [tokenizer.eod]
                    builder.add_document(ids, [len(ids)])
            builder.finalize(os.path.join(args.dir, "pre_mc.idx"))

        variants["megatron-core IndexedDatasetBuilder, 1 process"] = theirs
    return variants


def make_text(args) -> tuple[str, str]:
    """A JSONL corpus of random English-like words and a byte-level BPE tokenizer trained on it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = numpy.random.default_rng(0)
    letters = numpy.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    weights = numpy.linspace(2.0, 0.1, len(letters))
    words = [
        "".join(rng.choice(letters, size=int(n), p=weights / weights.sum()))
        for n in rng.integers(2, 10, 5000)
    ]
    source = os.path.join(args.dir, "text.jsonl")
    with open(source, "w") as f:
        for _ in range(args.documents):
            text = " ".join(rng.choice(words, size=int(rng.integers(50, 400))))
            f.write(json.dumps({"text": text}) + "\n")
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<eos>"])
    tokenizer.train([source], trainer)
    tokenizer_dir = os.path.join(args.dir, "tokenizer")
    os.makedirs(tokenizer_dir, exist_ok=True)
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>"}, f)
    return source, tokenizer_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=150_000_000, help="tokens of the synthetic corpus (uint16)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--documents", type=int, default=20000, help="JSONL documents to preprocess")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/tmp/megatron_ext_datasets_bench", help="where the corpora go")
    p.add_argument("--json", default=None)
    p.add_argument("--without-megatron-core", action="store_true")
    args = p.parse_args()
    require_megatron_core(args.without_megatron_core)
    mc = mc_indexed = None
    if not args.without_megatron_core:
        from megatron.core.datasets import blended_megatron_dataset_builder, gpt_dataset
        from megatron.core.datasets import indexed_dataset as mc_indexed

        mc = (gpt_dataset, blended_megatron_dataset_builder)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    # Megatron-core's BlendedDataset asks for the rank: a one-process group, as in training
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(minutes=30))
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    prefixes = [os.path.join(args.dir, "corpus0"), os.path.join(args.dir, "corpus1")]
    documents = [
        write_corpus(prefixes[0], int(args.tokens * 0.7), 0),
        write_corpus(prefixes[1], int(args.tokens * 0.3), 1),
    ]
    corpus_bytes = sum(os.path.getsize(prefix + ".bin") for prefix in prefixes)
    print(f"corpus: {corpus_bytes / 2**20:.0f} MiB of uint16 tokens, {sum(documents)} documents")

    variants, caches = build_variants(args, prefixes, mc)

    def empty_caches():
        for path in caches.values():
            shutil.rmtree(path, ignore_errors=True)

    cold = summarize([run_interleaved(variants, args.reps, prepare=empty_caches)])
    print_table(
        "GPT datasets, cold cache (index building + saving)",
        cold,
        baseline="megatron-core" if mc else None,
        unit="s",
    )
    warm = summarize([run_interleaved(variants, args.reps)])
    print_table(
        "GPT datasets, warm cache (loading)", warm, baseline="megatron-core" if mc else None, unit="s"
    )

    source, tokenizer_dir = make_text(args)
    pre_variants = preprocess_variants(args, source, tokenizer_dir, mc_indexed)
    tokens = preprocess.main(
        [
            "--input",
            source,
            "--output-prefix",
            os.path.join(args.dir, "pre_count"),
            "--tokenizer",
            tokenizer_dir,
            "--append-eod",
            "--no-progress",
        ]
    )["tokens"]
    pre = summarize([run_interleaved(pre_variants, args.reps)])
    for name, s in pre.items():
        workers = int(name.split()[1]) if name.startswith("megatron_ext") else 1
        s["tokens_per_s"] = tokens / s["median_s"]
        s["tokens_per_s_per_worker"] = s["tokens_per_s"] / workers
    print_table(f"preprocessing {args.documents} JSONL documents, {tokens} tokens", pre, unit="s")
    for name, s in pre.items():
        print(f"  {name}: {s['tokens_per_s']:.0f} tokens/s, {s['tokens_per_s_per_worker']:.0f} per worker")
    write_json(
        "datasets",
        {
            "corpus": {
                "tokens": args.tokens,
                "bytes": corpus_bytes,
                "documents": documents,
                "seq_len": args.seq_len,
                "blend": [0.7, 0.3],
                "split": "969,30,1",
            },
            "build_cold": cold,
            "build_warm": warm,
            "preprocess": {"documents": args.documents, "tokens": tokens, "variants": pre},
        },
        args.json,
    )
    dist.destroy_process_group()
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
