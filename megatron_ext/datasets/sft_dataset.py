"""Supervised fine-tuning data: prompt/response records packed several to a row, the loss on the
responses only.

A JSONL file holds one record per line, ``{"prompt": "...", "response": "..."}``. Each record
becomes one sequence, prompt tokens + response tokens + EOD; sequences are packed in a seeded
shuffled order into rows of ``sequence_length`` + 1 tokens (the extra one is the last label), a
sequence too long for a row truncated on the right. Each row gives ``tokens``, ``labels`` (the next
token), ``loss_mask`` (1 where the label is a response token or the EOD of the same sequence),
``position_ids`` restarting at every sequence, and ``cu_seqlens`` (int32, ``[0, len1, len1 + len2,
..., sequence_length]``, the last sequence absorbing the row's padding, as Megatron-LM's SFT data
does) with ``max_seqlen``: what a ``PackedSeqParams`` of the THD format is built from. With
``context_parallel_size`` > 1 every sequence is padded to a multiple of 2 x cp tokens."""

from __future__ import annotations

import json

import numpy
import torch

from megatron_ext.datasets.gpt_dataset import GPTDatasetConfig
from megatron_ext.datasets.megatron_dataset import MegatronDataset
from megatron_ext.datasets.utils import Split


class SFTLowLevelDataset:
    """The records of a JSONL file, tokenized: item i is (prompt ids, response ids)."""

    def __init__(self, dataset_path: str, tokenizer) -> None:
        self.records: list[tuple[list[int], list[int]]] = []
        try:
            f = open(dataset_path, encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read the SFT records {dataset_path!r}: {e}") from None
        with f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    prompt, response = record["prompt"], record["response"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(
                        f"{dataset_path}:{number}: expected a JSON object with 'prompt' and 'response' "
                        "strings"
                    ) from None
                self.records.append((tokenizer.tokenize(prompt), tokenizer.tokenize(response)))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, idx: int) -> tuple[list[int], list[int]]:
        return self.records[idx]


class SFTDataset(MegatronDataset):
    """Packed rows of the records ``indices`` of an :class:`SFTLowLevelDataset`:
    ``num_samples`` rows (cycling over the packed rows), or each packed row once for None."""

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
        self.pad_multiple = 2 * cp if cp > 1 else 1
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

    def _sequence(self, record: int) -> tuple[list[int], list[float]]:
        """A record's tokens and, per token, whether it is a target (response or EOD), padded to
        the context-parallel multiple."""
        prompt, response = self.dataset[record]
        tokens = list(prompt) + list(response)
        target = [0.0] * len(prompt) + [1.0] * len(response)
        if not tokens or tokens[-1] != self.eod:
            tokens.append(self.eod)
            target.append(1.0)
        padding = -len(tokens) % self.pad_multiple
        return tokens + [self.pad_id] * padding, target + [0.0] * padding

    def _pack(self, order: list[int]) -> list[list[int]]:
        """Records, in ``order``, grouped into rows of at most sequence_length + 1 tokens."""
        capacity = self.config.sequence_length + 1
        rows, row, used = [], [], 0
        for record in order:
            length = min(len(self._sequence(record)[0]), capacity)
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
        tokens, targets, positions, cu_seqlens = [], [], [], [0]
        for record in self.rows[idx % len(self.rows)]:
            sequence, target = self._sequence(record)
            sequence, target = sequence[: capacity - len(tokens)], target[: capacity - len(tokens)]
            tokens += sequence
            # the first token of a sequence is never a label of the one before it
            targets += [0.0] + target[1:]
            positions += range(len(sequence))
            cu_seqlens.append(len(tokens))
        padding = capacity - len(tokens)
        positions += range(positions[-1] + 1, positions[-1] + 1 + padding)
        tokens += [self.pad_id] * padding
        targets += [0.0] * padding
        cu_seqlens[-1] = length  # the last sequence takes the padding (and the extra label token)
        cu = torch.tensor(cu_seqlens, dtype=torch.int32)
        return {
            "tokens": torch.tensor(tokens[:-1], dtype=torch.int64),
            "labels": torch.tensor(tokens[1:], dtype=torch.int64),
            "loss_mask": torch.tensor(targets[1:], dtype=torch.float32),
            "position_ids": torch.tensor(positions[:-1], dtype=torch.int64),
            "cu_seqlens": cu,
            "max_seqlen": (cu[1:] - cu[:-1]).max(),
        }
