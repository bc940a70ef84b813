"""Megatron's datasets: tokenized corpora in ``.bin``/``.idx`` files, GPT samples over them,
weighted blends and train/valid/test splits, with Megatron-core's names, file formats and index
cache (``megatron.core.datasets``); packed supervised fine-tuning rows; and
``python -m megatron_ext.datasets.preprocess``, which tokenizes JSONL or text into a corpus.
Knows no model: it sits beside tensor_parallel."""

from megatron_ext.datasets.blended_dataset import BlendedDataset
from megatron_ext.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron_ext.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_ext.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron_ext.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from megatron_ext.datasets.megatron_dataset import MegatronDataset
from megatron_ext.datasets.sft_dataset import SFTDataset, SFTDatasetConfig, SFTLowLevelDataset
from megatron_ext.datasets.tokenizer import HuggingFaceTokenizer, NullTokenizer
from megatron_ext.datasets.utils import Split, get_blend_from_list

__all__ = [
    "BlendedDataset",
    "BlendedMegatronDatasetBuilder",
    "BlendedMegatronDatasetConfig",
    "DType",
    "GPTDataset",
    "GPTDatasetConfig",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronDataset",
    "MockGPTDataset",
    "SFTDataset",
    "SFTDatasetConfig",
    "SFTLowLevelDataset",
    "Split",
    "get_blend_from_list",
]
