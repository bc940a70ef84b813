"""Fake (meta) kernels of the C++ ops, so shapes propagate under FakeTensor and torch.compile."""

import torch

from megatron_ext import _C  # noqa: F401  (registers the ops)


def _integer_ids(ids: torch.Tensor) -> bool:
    return not (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool)


# The communication regions' fakes sit beside their Python functions in tensor_parallel/mappings.py.


@torch.library.register_fake("megatron_ext::vocab_range_mask")
def _(ids, first, last):
    if not _integer_ids(ids):
        raise ValueError(f"vocab_range_mask: token ids must be an integer tensor, got {ids.dtype}")
    if not 0 <= first <= last:
        raise ValueError(f"vocab_range_mask: expected 0 <= first <= last, got [{first}, {last})")
    # The kernels write contiguous outputs whatever the ids' strides.
    return torch.empty(ids.shape, dtype=torch.long, device=ids.device), torch.empty(
        ids.shape, dtype=torch.bool, device=ids.device
    )


@torch.library.register_fake("megatron_ext::linear_with_grad_accumulation_and_async_allreduce")
def _(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, group_name,
      group_size):
    if weight.dim() != 2 or input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise ValueError(
            "linear_with_grad_accumulation_and_async_allreduce: the last dim of the input (shape "
            f"{tuple(input.shape)}) must equal the input size of the weight (shape {tuple(weight.shape)})"
        )
    shape = list(input.shape)
    if sequence_parallel:
        shape[0] *= group_size
    shape[-1] = weight.shape[0]
    return input.new_empty(shape)


def _cross_entropy_acc_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy")
def _(vocab_parallel_logits, target, label_smoothing, ignore_index, group_name):
    return target.new_empty(target.shape, dtype=_cross_entropy_acc_dtype(vocab_parallel_logits))


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy_forward")
def _(vocab_parallel_logits, target, label_smoothing, ignore_index, group_name):
    dtype = _cross_entropy_acc_dtype(vocab_parallel_logits)
    return tuple(target.new_empty(target.shape, dtype=dtype) for _ in range(3))


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy_row_stats")
def _(vocab_parallel_logits, target, vocab_start, ignore_index):
    return target.new_empty((*target.shape, 5), dtype=_cross_entropy_acc_dtype(vocab_parallel_logits))


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy_backward")
def _(grad_loss, vocab_parallel_logits, target, row_max, log_sum_exp, label_smoothing, ignore_index,
      vocab_start, vocab_size):
    return torch.empty_like(vocab_parallel_logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_ext::bias_gelu")
def _(input, bias, approximate_tanh):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_ext::bias_gelu_forward")
def _(input, bias, approximate_tanh):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_ext::bias_gelu_backward")
def _(grad_output, input, bias, approximate_tanh):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_ext::bias_dropout_add")
def _(input, bias, residual, prob, training):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_ext::bias_dropout_add_forward")
def _(input, bias, residual, prob, seed, offset):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_ext::dropout_backward")
def _(grad_output, prob, seed, offset):
    return torch.empty_like(grad_output, memory_format=torch.contiguous_format)

@torch.library.register_fake("megatron_ext::vocab_parallel_linear_cross_entropy")
def _(hidden, weight, target, label_smoothing, ignore_index, chunk_size, group_name, group_size, group_rank):
    return target.new_empty(target.shape, dtype=_cross_entropy_acc_dtype(hidden))


@torch.library.register_fake("megatron_ext::vocab_parallel_linear_cross_entropy_forward")
def _(hidden, weight, target, label_smoothing, ignore_index, chunk_size, hidden_grad, weight_grad, group_name,
      group_size, group_rank):
    acc = _cross_entropy_acc_dtype(hidden)
    rows = target.numel()
    loss = target.new_empty(target.shape, dtype=acc)
    stats = [target.new_empty((rows,), dtype=acc) for _ in range(2)]
    grad_hidden = hidden.new_empty((rows, hidden.shape[-1]) if hidden_grad else (0,))
    grad_weight = weight.new_empty(weight.shape if weight_grad else (0,), dtype=acc)
    return loss, *stats, grad_hidden, grad_weight


@torch.library.register_fake("megatron_ext::vocab_parallel_linear_cross_entropy_backward")
def _(grad_loss, hidden, weight, target, row_max, log_sum_exp, grad_hidden, grad_weight, label_smoothing,
      ignore_index, chunk_size, precomputed, vocab_start, vocab_size, group_name, group_size):
    return None
