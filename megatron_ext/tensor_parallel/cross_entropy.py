"""Cross-entropy over logits whose vocabulary dim is split across the tensor-parallel group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.tensor_parallel.utils import group_args


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    ignore_index: int | None = None,
    *,
    overwrite_logits: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy of logits split along the vocabulary across ``tp_group``.

    Args:
        vocab_parallel_logits: ``[..., V/tp]``, usually ``[s, b, V/tp]``; rank ``r`` holds the
            logits of vocabulary ids ``[r*V/tp, (r+1)*V/tp)`` (``VocabUtility``). Not modified.
        target: ``[...]`` integer ids in the global vocabulary ``[0, V)``, the same on every rank.
        label_smoothing: ``a`` in Megatron-core's convention: the target gets probability
            ``1 - a`` and every other class ``a / (V - 1)`` of the global vocabulary, at every
            TP size (equal to ``torch.nn.functional.cross_entropy``'s ``label_smoothing`` of
            ``a * V / (V - 1)``).
        tp_group: the group the vocabulary is split over; ``None`` means the tensor-model-parallel
            group.
        ignore_index: tokens whose target equals it get loss 0 and gradient 0.
        overwrite_logits: for logits nobody reads after this loss (as ``GPTModel``'s own): the
            backward writes the gradient over ``vocab_parallel_logits`` instead of allocating a
            logits-sized buffer, as megatron-core's in-place backward does, so the loss adds no
            logits-sized memory. The forward still leaves the logits intact. Eager mode only:
            under ``torch.compile`` the flag is ignored. Another autograd node that saved the
            same logits then fails autograd's version check instead of reading the gradient.

    Returns:
        The loss ``[...]`` in float32 (float64 for float64 logits), the same on every rank.

    Forward: ``loss = logsumexp(x) - sum_j q_j x_j`` with ``q`` the smoothed one-hot, from
    per-row statistics of one pass over the local logits, one MAX and one SUM all-reduce.
    Backward (no communication): ``grad_x = (softmax(x) - q) * grad_loss`` in the logits' dtype,
    the softmax recomputed from the logits and the saved row max and log-sum-exp. Not twice
    differentiable: a gradient of the gradient raises RuntimeError.

    Non-finite logits give what ``torch.nn.functional.cross_entropy`` gives: NaN for a row with a
    NaN or +inf logit, +inf for a -inf target logit (and, with label smoothing, any -inf logit).

    Raises ValueError, on every rank before any communication, for a target outside ``[0, V)``
    (other than ``ignore_index``), a target shape other than the logits shape without its last
    dim, a non-integer target, non-floating logits, ``label_smoothing`` outside ``[0, 1)`` or
    vocabulary slices of different sizes on different ranks.
    """
    for name, value in (("vocab_parallel_logits", vocab_parallel_logits), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"vocab_parallel_cross_entropy: {name} must be a torch.Tensor, got {type(value).__name__}")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"vocab_parallel_cross_entropy: ignore_index must be an int or None, got {ignore_index!r}")
    group_name, group_size, _ = group_args(tp_group)
    overwrite = bool(overwrite_logits) and not torch.compiler.is_compiling()
    return torch.ops.megatron_ext.vocab_parallel_cross_entropy(
        vocab_parallel_logits, target, float(label_smoothing), ignore_index, group_name, group_size, overwrite
    )
