"""Supervised fine-tuning data: prompt/response records packed several to a row, the loss on the
responses only.

A JSONL file holds one record per line, ``{"prompt": "...", "response": "..."}``. Each record
becomes one sequence, prompt tokens + response tokens + EOD; sequences are packed in a seeded
shuffled order into rows of ``sequence_length`` + 1 tokens (the extra one is the last label), a
sequence too long for a row truncated on the right. Each row gives ``tokens``, ``labels`` (the next
token), ``loss_mask`` (1 where the label is a response token or the EOD of the same sequence),
``position_ids`` restarting at every sequence, ``padding_mask`` (True at the tokens that pad a
sequence to the multiple below or fill the row's tail; Megatron-core's ``GPTModel(padding_mask=)``,
which keeps them out of the MoE router's losses and counts), and ``cu_seqlens`` (int32,
``[0, len1, len1 + len2, ..., sequence_length]``, the last sequence absorbing the row's padding, as
Megatron-LM's SFT data does) with ``max_seqlen``: what a ``PackedSeqParams`` of the THD format is built from.
Every sequence is padded to a multiple of ``SFTDatasetConfig.pad_seq_to_mult`` tokens (default, and
with a plain ``GPTDatasetConfig``: 2 x ``context_parallel_size`` when that is > 1, as Megatron-LM
pads), so that each splits into the 2 x cp chunks of context parallelism on its own. The padding
multiple, not the layout, decides which records share a row: runs at several cp sizes train the same
rows when they pad alike."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy
import torch

from megatron_ext.datasets.gpt_dataset import GPTDatasetConfig
from megatron_ext.datasets.megatron_dataset import MegatronDataset
from megatron_ext.datasets.utils import Split


@dataclass
class SFTDatasetConfig(GPTDatasetConfig):
    """A GPTDatasetConfig with the packing's padding multiple: ``pad_seq_to_mult`` (Megatron Bridge's
    name), each sequence padded to a multiple of it; None: 2 x ``context_parallel_size`` when that is
    > 1, else 1. With context parallelism it must be a multiple of 2 x ``context_parallel_size``."""

    pad_seq_to_mult: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        multiple, cp = self.pad_seq_to_mult, self.context_parallel_size or 1
        not_positive_int = isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1
        if multiple is not None and not_positive_int:
            raise ValueError(f"pad_seq_to_mult must be an integer >= 1, got {multiple!r}")
        if multiple is not None and cp > 1 and multiple % (2 * cp):
            raise ValueError(
                f"pad_seq_to_mult {multiple} is not a multiple of 2 x context_parallel_size = {2 * cp}: each "
                "sequence must split into 2 x cp chunks"
            )


_JSON_KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
               dict: "an object", type(None): "null"}  # the JSON names of what json.loads gives


def _record_problem(record) -> str | None:
    """What keeps a parsed JSONL line from being a prompt/response record; None for a record."""
    if not isinstance(record, dict):
        return f"got {_JSON_KINDS.get(type(record), type(record).__name__)}"
    for key in ("prompt", "response"):
        if key not in record:
            return f"got no {key!r}"
        if record[key] is None:
            return f"got {key!r}: null"
        if not isinstance(record[key], str):
            return f"got {key!r}: {json.dumps(record[key])[:40]} ({_JSON_KINDS[type(record[key])]})"
    return None


class SFTLowLevelDataset:
    """The records of a JSONL file (UTF-8), tokenized: item i is (prompt ids, response ids), read
    from line ``lines[i]`` of the file."""

    def __init__(self, dataset_path: str, tokenizer) -> None:
        self.records: list[tuple[list[int], list[int]]] = []
        self.lines: list[int] = []
        try:
            f = open(dataset_path, "rb")
        except OSError as e:
            raise ValueError(f"cannot read the SFT records {dataset_path!r}: {e}") from None
        expected = "expected a JSON object with 'prompt' and 'response' strings"
        with f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{dataset_path}:{number}: byte {e.start + 1} of the line (0x{raw[e.start]:02x}) "
                        "is not UTF-8: expected UTF-8 JSONL"
                    ) from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{dataset_path}:{number}: {expected}, got invalid JSON ({e.msg})"
                    ) from None
                problem = _record_problem(record)
                if problem is not None:
                    raise ValueError(f"{dataset_path}:{number}: {expected}, {problem}")
                prompt, response = record["prompt"], record["response"]
                self.records.append((tokenizer.tokenize(prompt), tokenizer.tokenize(response)))
                self.lines.append(number)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, idx: int) -> tuple[list[int], list[int]]:
        return self.records[idx]


class SFTDataset(MegatronDataset):
    """Packed rows of the records ``indices`` of an :class:`SFTLowLevelDataset`:
    ``num_samples`` rows (cycling over the packed rows), or each packed row once for None.

    A record longer than a row is cut on the right: ``truncated`` lists those records (indices of
    the low-level dataset), ``untrained`` those of them left without a response token, which train
    on nothing."""

    def __init__(
        self,
        dataset: SFTLowLevelDataset,
        dataset_path: str | None,
        indices: numpy.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        self.eod = config.tokenizer.eod
        self.pad_id = self.eod if self._pad_token_id < 0 else self._pad_token_id
        cp = config.context_parallel_size or 1
        multiple = getattr(config, "pad_seq_to_mult", None)
        self.pad_multiple = (2 * cp if cp > 1 else 1) if multiple is None else multiple
        self.truncated: list[int] = []
        self.untrained: list[int] = []
        order = numpy.random.RandomState(config.random_seed).permutation(numpy.asarray(indices))
        self.rows = self._pack([int(i) for i in order])
        if num_samples and not self.rows:
            raise ValueError(
                f"the {index_split.name} split of {dataset_path!r} holds no records, yet {num_samples} "
                "rows are asked of it"
            )

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: SFTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> SFTLowLevelDataset:
        return SFTLowLevelDataset(dataset_path, config.tokenizer)

    def _sequence(self, record: int) -> tuple[list[int], list[float], int]:
        """A record's tokens and, per token, whether it is a target (response or EOD), padded to
        a multiple of ``pad_multiple``; and the number of tokens before the padding."""
        prompt, response = self.dataset[record]
        tokens = list(prompt) + list(response)
        target = [0.0] * len(prompt) + [1.0] * len(response)
        if not tokens or tokens[-1] != self.eod:
            tokens.append(self.eod)
            target.append(1.0)
        padding = -len(tokens) % self.pad_multiple
        return tokens + [self.pad_id] * padding, target + [0.0] * padding, len(tokens)

    def _pack(self, order: list[int]) -> list[list[int]]:
        """Records, in ``order``, grouped into rows of at most sequence_length + 1 tokens."""
        capacity = self.config.sequence_length + 1
        rows, row, used = [], [], 0
        for record in order:
            sequence, target, content = self._sequence(record)
            length = min(len(sequence), capacity)
            if content > capacity:  # cut: it fills a row of its own
                self.truncated.append(record)
                # the row's labels are its tokens 1.. (a sequence's first token is never one)
                if not any(target[1:capacity]):
                    self.untrained.append(record)
            if row and used + length > capacity:
                rows.append(row)
                row, used = [], 0
            row.append(record)
            used += length
        if row:
            rows.append(row)
        return rows

    def __len__(self) -> int:
        return self.num_samples if self.num_samples is not None else len(self.rows)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        length = self.config.sequence_length
        capacity = length + 1
        tokens, targets, positions, cu_seqlens, padding = [], [], [], [0], []
        for record in self.rows[idx % len(self.rows)]:
            sequence, target, content = self._sequence(record)
            sequence, target = sequence[: capacity - len(tokens)], target[: capacity - len(tokens)]
            padding += [False] * min(content, len(sequence)) + [True] * (len(sequence) - content)
            tokens += sequence
            # the first token of a sequence is never a label of the one before it
            targets += [0.0] + target[1:]
            positions += range(len(sequence))
            cu_seqlens.append(len(tokens))
        positions += range(positions[-1] + 1, positions[-1] + 1 + capacity - len(tokens))
        padding += [True] * (capacity - len(tokens))
        tokens += [self.pad_id] * (capacity - len(tokens))
        targets += [0.0] * (capacity - len(targets))
        cu_seqlens[-1] = length  # the last sequence takes the padding (and the extra label token)
        cu = torch.tensor(cu_seqlens, dtype=torch.int32)
        return {
            "tokens": torch.tensor(tokens[:-1], dtype=torch.int64),
            "labels": torch.tensor(tokens[1:], dtype=torch.int64),
            "loss_mask": torch.tensor(targets[1:], dtype=torch.float32),
            "position_ids": torch.tensor(positions[:-1], dtype=torch.int64),
            "padding_mask": torch.tensor(padding[:-1], dtype=torch.bool),
            "cu_seqlens": cu,
            "max_seqlen": (cu[1:] - cu[:-1]).max(),
        }
