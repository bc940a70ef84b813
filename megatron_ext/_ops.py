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
        (*target.shape, 5), dtype=_cross_entropy_acc_dtype(vocab_parallel_logits), device=vocab_parallel_logits.device
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


# --- RMSNorm, rotary embedding and SwiGLU (ops/llama_fusions.cpp): the checks of ops/llama_fusions.h

_FUSION_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _fusion_acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_fusion_dtype(op: str, name: str, t: torch.Tensor) -> None:
    torch._check_value(
        t.dtype in _FUSION_DTYPES,
        lambda: f"{op}: {name} must be float64, float32, bfloat16 or float16, got {t.dtype}",
    )


def _check_like(op: str, name: str, other: torch.Tensor, input: torch.Tensor,
                input_name: str = "input") -> None:
    torch._check_value(
        other.dtype == input.dtype,
        lambda: f"{op}: {name} dtype {other.dtype} differs from the {input_name} dtype {input.dtype}",
    )
    torch._check_value(
        other.device == input.device,
        lambda: f"{op}: {name} is on {other.device} but the {input_name} is on {input.device}",
    )


def _check_rms_norm(op: str, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_fusion_dtype(op, "input", input)
    torch._check_value(input.dim() >= 1, lambda: f"{op}: input must have a last dim, got a scalar")
    torch._check_value(
        input.shape[-1] > 0,
        lambda: f"{op}: input must have a non-empty last (normalized) dim, got shape {list(input.shape)}",
    )
    torch._check_value(
        weight.dim() == 1 and weight.shape[0] == input.shape[-1],
        lambda: f"{op}: weight must have shape [{input.shape[-1]}] (the input's last dim), got "
        f"{list(weight.shape)}",
    )
    _check_like(op, "weight", weight, input)
    torch._check_value(eps >= 0, lambda: f"{op}: eps must be >= 0, got {eps}")


@torch.library.register_fake("megatron_ext::rms_norm")
def _(input, weight, eps):
    _check_rms_norm("rms_norm", input, weight, eps)
    return input.new_empty(input.shape)


@torch.library.register_fake("megatron_ext::rms_norm_forward")
def _(input, weight, eps):
    _check_rms_norm("rms_norm_forward", input, weight, eps)
    return input.new_empty(input.shape), input.new_empty(input.shape[:-1], dtype=_fusion_acc_dtype(input))


@torch.library.register_fake("megatron_ext::rms_norm_backward")
def _(grad_output, input, weight, rstd):
    op = "rms_norm_backward"
    _check_rms_norm(op, input, weight, 0.0)
    torch._check_value(
        grad_output.shape == input.shape,
        lambda: f"{op}: grad_output has shape {list(grad_output.shape)} but the input has shape "
        f"{list(input.shape)}",
    )
    _check_like(op, "grad_output", grad_output, input)
    torch._check_value(
        rstd.shape == input.shape[:-1] and rstd.dtype == _fusion_acc_dtype(input),
        lambda: f"{op}: rstd must be {_fusion_acc_dtype(input)} of shape {list(input.shape[:-1])}, got "
        f"{rstd.dtype} of shape {list(rstd.shape)}",
    )
    return input.new_empty(input.shape), weight.new_empty(weight.shape)


def _check_rotary_width(op: str, rot_dim, dim) -> None:
    torch._check_value(
        rot_dim > 0 and rot_dim % 2 == 0 and rot_dim <= dim,
        lambda: f"{op}: the rotary width (freqs' last dim) must be even and in (0, {dim}] (the head dim), "
        f"got {rot_dim}",
    )


def _check_rotary_input(op: str, name: str, t: torch.Tensor) -> None:
    _check_fusion_dtype(op, name, t)
    torch._check_value(t.dim() == 4, lambda: f"{op}: {name} must be [s, b, n, d], got shape {list(t.shape)}")


@torch.library.register_fake("megatron_ext::rotary_pos_emb")
def _(t, freqs, interleaved):
    op = "rotary_pos_emb"
    _check_rotary_input(op, "t", t)
    torch._check_value(
        freqs.dtype.is_floating_point, lambda: f"{op}: freqs must be a floating tensor, got {freqs.dtype}"
    )
    torch._check_value(
        freqs.dim() == 4 and freqs.shape[0] == t.shape[0] and freqs.shape[1] == 1 and freqs.shape[2] == 1,
        lambda: f"{op}: freqs must have shape [{t.shape[0]}, 1, 1, d_rot] (t is {list(t.shape)}), got "
        f"{list(freqs.shape)}",
    )
    _check_rotary_width(op, freqs.shape[3], t.shape[3])
    torch._check_value(
        freqs.device == t.device, lambda: f"{op}: freqs is on {freqs.device} but t is on {t.device}"
    )
    return t.new_empty(t.shape)


def _rotary_kernel_fake(op: str, input: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _check_rotary_input(op, "input", input)
    for name, table in (("cos", cos), ("sin", sin)):
        torch._check_value(
            table.dim() == 2 and table.shape[0] == input.shape[0],
            lambda: f"{op}: {name} must have shape [{input.shape[0]}, d_rot], got {list(table.shape)}",
        )
        _check_like(op, name, table, input)
    torch._check_value(
        cos.shape == sin.shape,
        lambda: f"{op}: cos has shape {list(cos.shape)} but sin has shape {list(sin.shape)}",
    )
    _check_rotary_width(op, cos.shape[1], input.shape[3])
    return input.new_empty(input.shape)


@torch.library.register_fake("megatron_ext::rotary_pos_emb_forward")
def _(t, cos, sin, interleaved):
    return _rotary_kernel_fake("rotary_pos_emb_forward", t, cos, sin)


@torch.library.register_fake("megatron_ext::rotary_pos_emb_backward")
def _(grad_output, cos, sin, interleaved):
    return _rotary_kernel_fake("rotary_pos_emb_backward", grad_output, cos, sin)


def _check_swiglu(op: str, input: torch.Tensor, bias) -> None:
    _check_fusion_dtype(op, "input", input)
    torch._check_value(input.dim() >= 1, lambda: f"{op}: input must have a last dim, got a scalar")
    torch._check_value(
        input.shape[-1] % 2 == 0,
        lambda: f"{op}: input's last dim must hold the two halves (gate, up), an even size, got shape "
        f"{list(input.shape)}",
    )
    if bias is not None:
        torch._check_value(
            bias.dim() == 1 and bias.shape[0] == input.shape[-1],
            lambda: f"{op}: bias must have shape [{input.shape[-1]}] (the input's last dim), got "
            f"{list(bias.shape)}",
        )
        _check_like(op, "bias", bias, input)


def _swiglu_out(input: torch.Tensor) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], input.shape[-1] // 2))


@torch.library.register_fake("megatron_ext::swiglu")
def _(input, bias):
    _check_swiglu("swiglu", input, bias)
    return _swiglu_out(input)


@torch.library.register_fake("megatron_ext::swiglu_forward")
def _(input, bias):
    _check_swiglu("swiglu_forward", input, bias)
    return _swiglu_out(input)


@torch.library.register_fake("megatron_ext::swiglu_backward")
def _(grad_output, input, bias):
    op = "swiglu_backward"
    _check_swiglu(op, input, bias)
    expected = (*input.shape[:-1], input.shape[-1] // 2)
    torch._check_value(
        tuple(grad_output.shape) == expected,
        lambda: f"{op}: grad_output must have shape {list(expected)}, got {list(grad_output.shape)}",
    )
    _check_like(op, "grad_output", grad_output, input)
    return input.new_empty(input.shape)
