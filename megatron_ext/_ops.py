"""Fake (meta) kernels of the C++ ops, so shapes propagate under FakeTensor and torch.compile."""

import torch

from megatron_ext import _C  # registers the ops


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
    return _C.cross_entropy_acc_dtype(logits.dtype)  # kernels/cross_entropy.h's acc_type


_CE = "vocab_parallel_cross_entropy"


def _check_cross_entropy_args(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> None:
    """The checks of the real op (ops/cross_entropy.cpp, check_inputs), with its messages."""
    if not logits.dtype.is_floating_point:
        raise ValueError(f"{_CE}: vocab_parallel_logits must be floating point, got dtype {logits.dtype}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise ValueError(f"{_CE}: target must hold integer token ids, got dtype {target.dtype}")
    if logits.dim() < 1:
        raise ValueError(f"{_CE}: vocab_parallel_logits must have a vocabulary dim, got a scalar")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{_CE}: target shape {list(target.shape)} must equal the logits shape {list(logits.shape)} "
            "without its last (vocabulary) dim"
        )
    if target.device != logits.device:
        raise ValueError(f"{_CE}: target is on {target.device} but vocab_parallel_logits are on {logits.device}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"{_CE}: label_smoothing must be in [0, 1), got {label_smoothing}")


def _check_cross_entropy_kernel_args(logits: torch.Tensor, target: torch.Tensor, op: str) -> None:
    """The checks of the kernel ops (kernels/cross_entropy_checks.h)."""
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{op}: expected logits with a non-empty last (vocabulary) dim, got shape {list(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"{op}: expected floating-point logits, got {logits.dtype}")
    if target.dtype != torch.int64:
        raise ValueError(f"{op}: expected int64 target, got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{op}: target shape {list(target.shape)} must equal the logits shape {list(logits.shape)}")
    if target.device != logits.device:
        raise ValueError(f"{op}: target is on {target.device} but logits are on {logits.device}")


def _per_token(logits: torch.Tensor, target: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(target.shape, dtype=dtype, device=logits.device)


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy")
def _(vocab_parallel_logits, target, label_smoothing, ignore_index, group_name, group_size, overwrite_logits=False):
    _check_cross_entropy_args(vocab_parallel_logits, target, label_smoothing)
    return _per_token(vocab_parallel_logits, target, _cross_entropy_acc_dtype(vocab_parallel_logits))


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy_forward")
def _(vocab_parallel_logits, target, label_smoothing, ignore_index, group_name, group_size):
    _check_cross_entropy_args(vocab_parallel_logits, target, label_smoothing)
    acc = _cross_entropy_acc_dtype(vocab_parallel_logits)
    loss, row_max, log_sum_exp = (_per_token(vocab_parallel_logits, target, acc) for _ in range(3))
    return loss, row_max, log_sum_exp, _per_token(vocab_parallel_logits, target, torch.int64)


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy_row_stats")
def _(vocab_parallel_logits, target, vocab_start, ignore_index):
    _check_cross_entropy_kernel_args(vocab_parallel_logits, target, "vocab_parallel_cross_entropy_row_stats")
    return torch.empty(
        (*target.shape, _C.CROSS_ENTROPY_ROW_STATS), dtype=_cross_entropy_acc_dtype(vocab_parallel_logits),
        device=vocab_parallel_logits.device,
    )


def _check_cross_entropy_backward(grad_loss, logits, local_target, row_max, log_sum_exp, vocab_size) -> None:
    op = "vocab_parallel_cross_entropy_backward"
    _check_cross_entropy_kernel_args(logits, local_target, op)
    if vocab_size < logits.shape[-1]:
        raise ValueError(f"{op}: vocab_size {vocab_size} is smaller than the local vocabulary {logits.shape[-1]}")
    rows = local_target.numel()
    if grad_loss.numel() != rows or row_max.numel() != rows or log_sum_exp.numel() != rows:
        raise ValueError(
            f"{op}: expected one gradient, max and log-sum-exp per token ({rows}), got {grad_loss.numel()}, "
            f"{row_max.numel()}, {log_sum_exp.numel()}"
        )
    if any(t.device != logits.device for t in (grad_loss, row_max, log_sum_exp)):
        raise ValueError(f"{op}: every tensor must be on the logits' device {logits.device}")


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy_backward")
def _(grad_loss, vocab_parallel_logits, local_target, row_max, log_sum_exp, label_smoothing, vocab_size):
    _check_cross_entropy_backward(grad_loss, vocab_parallel_logits, local_target, row_max, log_sum_exp, vocab_size)
    return torch.empty_like(vocab_parallel_logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy_backward_")
def _(grad_loss, vocab_parallel_logits, local_target, row_max, log_sum_exp, label_smoothing, vocab_size):
    if not vocab_parallel_logits.is_contiguous():
        raise ValueError(
            "vocab_parallel_cross_entropy_backward_: the logits the gradient overwrites must be contiguous, "
            f"got strides {list(vocab_parallel_logits.stride())}"
        )
    _check_cross_entropy_backward(grad_loss, vocab_parallel_logits, local_target, row_max, log_sum_exp, vocab_size)


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
