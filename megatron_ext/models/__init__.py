"""Models built from the parallel transformer."""

from megatron_ext.models.gpt import GPTModel

__all__ = ["GPTModel"]
