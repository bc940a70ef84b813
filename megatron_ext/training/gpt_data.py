"""The training run's tokenized data: Megatron's blended GPT datasets over ``.bin``/``.idx``
corpora, or packed supervised fine-tuning rows of prompt/response records, read as global batches
in order of consumed samples, as Megatron-LM's pretraining sampler reads them.

Global batch k of a run holds the samples [k x G, (k + 1) x G) of the train split (G the global
batch size), so the data position is the number of consumed samples, which checkpoints keep.
Micro-batch m of data-parallel rank d holds the samples ``m x (b x dp) + d x b + [0, b)`` of it
(b the micro-batch size). Evaluation e reads the validation samples [e x K x G, (e + 1) x K x G)
for K evaluation iterations, continuing through the split as Megatron-LM's does."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_ext.comm_errors import reported
from megatron_ext.datasets import (
    BlendedMegatronDatasetBuilder,
    GPTDataset,
    GPTDatasetConfig,
    HuggingFaceTokenizer,
    MockGPTDataset,
    NullTokenizer,
    SFTDataset,
    SFTDatasetConfig,
    Split,
    get_blend_from_list,
)
from megatron_ext.datasets.blended_megatron_dataset_config import parse_and_normalize_split
from megatron_ext.datasets.tokenizer import TOKENIZER_FILES
from megatron_ext.datasets.utils import check_blend_weights

__all__ = [
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SFT_KEYS",
    "TOKENIZER_FILES",
    "build_datasets",
    "build_sft_datasets",
    "check_token_ids",
    "global_batch_microbatches",
    "padded_vocab_size",
    "parse_blend",
    "sft_truncation_warnings",
    "split_share",
    "split_sizes",
]


def parse_blend(data_path: list[str], split: str) -> tuple[list[str], list[float] | None]:
    """The (prefixes, weights) of ``[W1] PREFIX1 [W2 PREFIX2 ...]``, checked with ``split``:
    ValueError for weights that are not positive or do not pair with prefixes, or a split that
    does not sum to a positive number."""
    if len(data_path) % 2 == 0:
        # pairs: every other entry must be a weight (a prefix list of even length has no numbers)
        numbers = [_is_number(entry) for entry in data_path[0::2]]
        if any(numbers) and not all(numbers):
            raise ValueError(
                f"--data-path {' '.join(data_path)}: weights and prefixes must alternate, "
                "W1 PREFIX1 W2 PREFIX2 ..."
            )
    elif len(data_path) > 1 and _is_number(data_path[0]):
        raise ValueError(
            f"--data-path {' '.join(data_path)}: {len(data_path)} entries cannot pair every weight "
            "with a prefix (W1 PREFIX1 W2 PREFIX2 ...)"
        )
    prefixes, weights = get_blend_from_list(data_path)
    check_blend_weights(prefixes, weights, "--data-path blend")
    parse_and_normalize_split(split)
    return prefixes, weights


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def split_share(split: str, name: str) -> float:
    """The share of the documents that ``split`` gives to the split ``name`` (train, valid, test)."""
    return parse_and_normalize_split(split)[Split[name].value]


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron-LM's model vocabulary: the tokenizer's, rounded up to a multiple of
    ``make_vocab_size_divisible_by`` x tp."""
    multiple = make_vocab_size_divisible_by * tp
    return math.ceil(vocab_size / multiple) * multiple


def split_sizes(steps: int, global_batch_size: int, eval_interval: int | None, eval_iters: int) -> list:
    """The samples asked of the train, valid and test splits: Megatron-LM's counts for train and
    valid, none of the test split (nothing reads it)."""
    evaluations = steps // eval_interval + 1 if eval_interval else 0
    return [steps * global_batch_size, evaluations * eval_iters * global_batch_size, 0]


def build_datasets(
    data_path: list[str] | None,
    split: str,
    tokenizer: HuggingFaceTokenizer,
    seq_len: int,
    seed: int,
    sizes: list,
    path_to_cache: str | None = None,
) -> list:
    """The train, valid and test datasets (None for an empty split) of the blend ``data_path``
    (``[W1] PREFIX1 [W2 PREFIX2 ...]``), or Megatron-core's mock documents where it is None."""
    blend = get_blend_from_list(data_path) if data_path is not None else None
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=blend,
        split=split,
        path_to_cache=path_to_cache,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    dataset_type = GPTDataset if data_path is not None else MockGPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, sizes, lambda: True, config).build()


def build_sft_datasets(
    path: str,
    split: str,
    tokenizer: HuggingFaceTokenizer,
    seq_len: int,
    seed: int,
    sizes: list,
    pad_seq_to_mult: int = 1,
) -> list:
    """The train, valid and test datasets (None for an empty split) of packed rows of the
    prompt/response records in the JSONL file ``path``, split by record; every sequence padded to
    a multiple of ``pad_seq_to_mult`` tokens. The rows depend on the data and this multiple, not on
    the layout that trains them."""
    config = SFTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=([path], None),
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        pad_seq_to_mult=pad_seq_to_mult,
    )
    return BlendedMegatronDatasetBuilder(SFTDataset, sizes, lambda: True, config).build()


def sft_truncation_warnings(datasets: list, path: str, seq_len: int) -> list[str]:
    """A line per split of packed rows that cuts records longer than a row, naming the first one
    (FILE:LINE) and the records left without a response token."""
    out = []
    for name, dataset in zip(("train", "validation", "test"), datasets):
        if dataset is None or not dataset.truncated:
            continue
        lines = dataset.dataset.lines
        message = (
            f"{len(dataset.truncated)} of the {name} split's {len(dataset.indices)} records are longer than "
            f"the {seq_len + 1} tokens of a row (--seq-len + 1) and are cut on the right (the first: "
            f"{path}:{lines[dataset.truncated[0]]})"
        )
        if dataset.untrained:
            one = len(dataset.untrained) == 1
            message += (
                f"; {len(dataset.untrained)} of them keep{'s' if one else ''} no response token and "
                f"train{'s' if one else ''} on nothing (the first: {path}:{lines[dataset.untrained[0]]})"
            )
        out.append(message)
    return out


# What a micro-batch of packed rows holds: the GPT sample's tensors, the positions restarting at
# every sequence, the padding (for the MoE router) and the boundaries a PackedSeqParams is built from.
SFT_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "padding_mask", "cu_seqlens", "max_seqlen")


def global_batch_microbatches(
    dataset,
    first_sample: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device | str = "cpu",
    keys: tuple[str, ...] = ("tokens", "labels", "loss_mask"),
) -> list[dict]:
    """This data-parallel rank's micro-batches of the global batch that starts at sample
    ``first_sample``: dicts of the samples' ``keys`` stacked (``tokens``, ``labels`` and
    ``loss_mask``: [b, s] each; ``SFT_KEYS`` for packed rows, whose ``cu_seqlens`` stack only at
    b = 1)."""
    if first_sample + global_batch_size > len(dataset):
        raise ValueError(
            f"the dataset holds {len(dataset)} samples; the global batch of samples [{first_sample}, "
            f"{first_sample + global_batch_size}) runs past it"
        )
    stride = micro_batch_size * dp_size
    out = []
    for start in range(first_sample + dp_rank * micro_batch_size, first_sample + global_batch_size, stride):
        samples = [dataset[i] for i in range(start, start + micro_batch_size)]
        out.append(
            {
                key: torch.stack([s[key] for s in samples]).to(device)
                for key in keys
            }
        )
    return out


def check_token_ids(microbatches: list[dict], vocab_size: int, what: str, device: torch.device | str,
                    model_vocab_size: int | None = None) -> None:
    """Raises ValueError on every rank when any rank's batch holds a token id outside
    [0, vocab_size), the tokenizer's ids: a corpus tokenized for another vocabulary. The message
    names the model's (padded) vocabulary too where it is larger."""
    local = max((int(mb[key].max()) for mb in microbatches for key in ("tokens", "labels")), default=-1)
    largest = torch.tensor([local], dtype=torch.int64, device=device)
    with reported("all-reduce of the largest token id", None):
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    if int(largest) >= vocab_size:
        padded = (f" (the model's vocabulary of {model_vocab_size} only pads it)"
                  if model_vocab_size is not None and model_vocab_size != vocab_size else "")
        raise ValueError(
            f"{what} holds token id {int(largest)}, outside the tokenizer's vocabulary of {vocab_size} "
            f"tokens{padded}: the "
            "corpus was tokenized with another tokenizer (--tokenizer / --load-hf must match --data-path)"
        )
