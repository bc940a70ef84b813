"""The output layer and the vocab-parallel cross-entropy fused, never holding the logits."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.tensor_parallel.utils import group_args

# Rows per chunk are chosen so that a chunk's logits take about this many bytes: two such
# buffers (the logits and their gradient) are alive at once.
DEFAULT_CHUNK_BYTES = 16 * 2**20


def default_chunk_size(local_vocab_size: int, dtype: torch.dtype) -> int:
    """Tokens per chunk for ``DEFAULT_CHUNK_BYTES`` of logits of ``local_vocab_size`` columns."""
    return max(1, DEFAULT_CHUNK_BYTES // (local_vocab_size * torch.finfo(dtype).bits // 8))


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int | None = None,
    chunk_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy of the logits ``hidden @ weight.T``, split along the vocabulary
    across ``tp_group``, computed in chunks of tokens without ever holding all the logits.

    Equal to ``vocab_parallel_cross_entropy(linear(copy_to_tensor_model_parallel_region(hidden),
    weight), target, label_smoothing, ignore_index=ignore_index)`` (the output layer of a GPT,
    ``ColumnParallelLinear`` without bias, followed by its loss), in value and in gradients.

    Args:
        hidden: ``[..., h]``, usually ``[s, b, h]``, the same on every rank of ``tp_group``.
        weight: ``[V/tp, h]``, this rank's rows of the output (or tied word-embedding) matrix:
            vocabulary ids ``[r*V/tp, (r+1)*V/tp)`` on rank ``r``.
        target: ``[...]`` (``hidden``'s shape without its last dim) integer ids in ``[0, V)``.
        label_smoothing, ignore_index: as in ``vocab_parallel_cross_entropy``.
        chunk_size: tokens per chunk; ``None`` picks about 16 MiB of logits per chunk. The peak
            extra memory is about two chunks of logits plus the gradients themselves.
        tp_group: the group the vocabulary is split over; ``None`` means the tensor-model-parallel
            group.

    Returns:
        The loss ``[...]`` in float32 (float64 for float64 inputs), the same on every rank.

    Forward: per chunk, the logits GEMM, the cross-entropy's per-row kernel, one MAX and one SUM
    all-reduce. Under autograd the forward also forms each chunk's ``softmax - q`` and accumulates
    the gradients for a unit loss gradient, so a backward whose loss gradient is the same for
    every token (a mean or sum of the losses) only rescales them; other rows' logits are
    recomputed in the backward. The hidden-state gradient is all-reduced over ``tp_group``.
    """
    for name, value in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"vocab_parallel_linear_cross_entropy: {name} must be a torch.Tensor, "
                            f"got {type(value).__name__}")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"vocab_parallel_linear_cross_entropy: ignore_index must be an int or None, "
                        f"got {ignore_index!r}")
    if chunk_size is None:
        chunk_size = default_chunk_size(max(1, weight.shape[0]) if weight.dim() > 0 else 1, hidden.dtype
                                        if hidden.is_floating_point() else torch.float32)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"vocab_parallel_linear_cross_entropy: chunk_size must be a positive int, "
                         f"got {chunk_size!r}")
    name, size, rank = group_args(tp_group)
    return torch.ops.megatron_ext.vocab_parallel_linear_cross_entropy(
        hidden, weight, target, float(label_smoothing), ignore_index, chunk_size, name, size, rank
    )
