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
            raise TypeError(
                f"vocab_parallel_cross_entropy: {name} must be a torch.Tensor, got {type(value).__name__}"
            )
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(
            f"vocab_parallel_cross_entropy: ignore_index must be an int or None, got {ignore_index!r}"
        )
    group_name, group_size, _ = group_args(tp_group)
    overwrite = bool(overwrite_logits) and not torch.compiler.is_compiling()
    return torch.ops.megatron_ext.vocab_parallel_cross_entropy(
        vocab_parallel_logits, target, float(label_smoothing), ignore_index, group_name, group_size, overwrite
    )


# Megatron-core's classes ----------------------------------------------------------------------------


class VocabParallelCrossEntropy:
    """The per-rank pieces of Megatron-core's vocabulary-parallel cross-entropy, which its fused
    cross-entropy (``megatron.core.fusions.fused_cross_entropy``) composes with its own
    all-reduces: local tensor math, no communication. Composed as there, they give the loss and
    gradient of :func:`vocab_parallel_cross_entropy` without label smoothing.

    As in Megatron-core, ``calculate_predicted_logits``, ``calculate_cross_entropy_loss`` and
    ``calculate_gradients`` work in place on the logits-sized tensor they are handed, so one buffer
    serves from the shifted logits to the gradient. Unlike there, ``calculate_logits_max`` always
    returns a copy of the logits (in float32, float64 kept), so the caller's logits are never
    modified.
    """

    @staticmethod
    def calculate_logits_max(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(logits, logits_max)``: a float32 copy of the logits (float64 logits stay
        float64) and their max along the last dim (to be MAX-all-reduced over the group)."""
        logits = vocab_parallel_logits
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
            raise ValueError(
                "VocabParallelCrossEntropy.calculate_logits_max: vocab_parallel_logits must be a floating "
                f"tensor, got {getattr(logits, 'dtype', type(logits).__name__)}"
            )
        logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32, copy=True)
        return logits, logits.amax(dim=-1)

    @staticmethod
    def calculate_predicted_logits(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        logits_max: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shifts the logits by ``logits_max`` and exponentiates them in place.

        Returns ``(target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits)``:
        whether each target lies outside ``[vocab_start_index, vocab_end_index)``, each target's
        local column flattened (0 where outside), the shifted target logit (0 where outside) and the
        local sum of the exponentials (both to be SUM-all-reduced), and the exponentials (the
        logits tensor itself).
        """
        op = "VocabParallelCrossEntropy.calculate_predicted_logits"
        if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
            raise ValueError(
                f"{op}: target shape {list(target.shape)} must equal the logits shape "
                f"{list(vocab_parallel_logits.shape)} without its last (vocabulary) dim"
            )
        if vocab_end_index - vocab_start_index != vocab_parallel_logits.shape[-1]:
            raise ValueError(
                f"{op}: the vocabulary range [{vocab_start_index}, {vocab_end_index}) must hold as many ids "
                f"as the logits' last dim ({vocab_parallel_logits.shape[-1]})"
            )
        # The C++ kernel of VocabParallelEmbedding's lookup: local column (0 outside) and the mask.
        masked_target, target_mask = torch.ops.megatron_ext.vocab_range_mask(
            target, vocab_start_index, vocab_end_index
        )
        vocab_parallel_logits.sub_(logits_max.unsqueeze(-1))
        predicted_logits = vocab_parallel_logits.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1)
        predicted_logits.masked_fill_(target_mask, 0.0)
        exp_logits = vocab_parallel_logits.exp_()
        sum_exp_logits = exp_logits.sum(dim=-1)
        return target_mask, masked_target.view(-1), predicted_logits, sum_exp_logits, exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(
        exp_logits: torch.Tensor, predicted_logits: torch.Tensor, sum_exp_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From the all-reduced sums: returns ``(softmax, loss)``, the softmax made by dividing
        ``exp_logits`` in place, ``loss = log(sum_exp_logits) - predicted_logits``."""
        loss = torch.log(sum_exp_logits) - predicted_logits
        return exp_logits.div_(sum_exp_logits.unsqueeze(-1)), loss

    @staticmethod
    def prepare_gradient_calculation_operands(
        softmax: torch.Tensor, target_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(grad_2d, arange_1d, softmax_update, grad_input)``: ``grad_input`` is
        ``softmax`` itself and ``grad_2d`` its ``[tokens, V/tp]`` view, ``arange_1d`` the token
        indices and ``softmax_update`` 1 for a target this rank holds, else 0 (float32)."""
        grad_2d = softmax.view(-1, softmax.shape[-1])
        arange_1d = torch.arange(grad_2d.shape[0], device=softmax.device)
        softmax_update = 1.0 - target_mask.reshape(-1).float()
        return grad_2d, arange_1d, softmax_update, softmax

    @staticmethod
    def calculate_gradients(
        grad_2d: torch.Tensor,
        arange_1d: torch.Tensor,
        masked_target_1d: torch.Tensor,
        softmax_update: torch.Tensor,
        grad_input: torch.Tensor,
        grad_output: torch.Tensor,
    ) -> torch.Tensor:
        """``(softmax - one_hot(target)) * grad_output``, written into ``grad_input`` (through its
        view ``grad_2d``) and returned."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        return grad_input.mul_(grad_output.unsqueeze(-1))


class _VocabParallelCrossEntropy:
    """Megatron-core's autograd function of the loss. Here the autograd node is the C++ op's
    (:func:`vocab_parallel_cross_entropy`), so this is a plain class whose ``apply`` takes
    Megatron-core's arguments (the group is the tensor-model-parallel group)."""

    @staticmethod
    def apply(
        vocab_parallel_logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
    ) -> torch.Tensor:
        return vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing)
