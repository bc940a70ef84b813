"""Fake (meta) kernels of the C++ ops, so shapes propagate under FakeTensor and torch.compile."""

import torch

from megatron_ext import _C  # registers the ops


# Fakes compute what the real op returns (shapes, strides, dtypes, devices) from the schema's
# arguments; a condition their results rest on is a ``torch._check``. The C++ ops are the one
# source of argument errors: their autograd kernels check before dispatching, also on fake tensors.
# The communication regions' fakes sit beside their Python functions in tensor_parallel/mappings.py.


@torch.library.register_fake("megatron_ext::vocab_range_mask")
def _(ids, first, last):
    # The kernels write contiguous outputs whatever the ids' strides.
    return torch.empty(ids.shape, dtype=torch.long, device=ids.device), torch.empty(
        ids.shape, dtype=torch.bool, device=ids.device
    )


@torch.library.register_fake("megatron_ext::linear_with_grad_accumulation_and_async_allreduce")
def _(input, weight, bias, main_grad, wgrad_placeholder, allreduce_dgrad, sequence_parallel, group_name,
      group_size):
    torch._check(weight.dim() == 2 and input.dim() >= 1 and input.shape[-1] == weight.shape[1],
                 lambda: "the input's last dim must equal the weight's input size")
    shape = list(input.shape)
    if sequence_parallel:
        shape[0] *= group_size
    shape[-1] = weight.shape[0]
    return input.new_empty(shape)


def _per_token(logits: torch.Tensor, target: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of ``target``'s shape, one value per row of ``logits`` (the cross-entropy's
    accumulation dtype unless ``dtype`` is given)."""
    torch._check(logits.dim() >= 1 and tuple(target.shape) == tuple(logits.shape[:-1]),
                 lambda: "one target per row of logits")
    dtype = dtype or _C.cross_entropy_acc_dtype(logits.dtype)
    return torch.empty(target.shape, dtype=dtype, device=logits.device)


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy")
def _(
    vocab_parallel_logits,
    target,
    label_smoothing,
    ignore_index,
    group_name,
    group_size,
    overwrite_logits=False,
):
    return _per_token(vocab_parallel_logits, target)


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy_forward")
def _(vocab_parallel_logits, target, label_smoothing, ignore_index, group_name, group_size):
    loss, row_max, log_sum_exp = (_per_token(vocab_parallel_logits, target) for _ in range(3))
    return loss, row_max, log_sum_exp, _per_token(vocab_parallel_logits, target, torch.int64)


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy_row_stats")
def _(vocab_parallel_logits, target, vocab_start, ignore_index):
    stats = _per_token(vocab_parallel_logits, target)
    return stats.new_empty((*target.shape, _C.CROSS_ENTROPY_ROW_STATS))


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy_backward")
def _(grad_loss, vocab_parallel_logits, local_target, row_max, log_sum_exp, label_smoothing, vocab_size):
    _per_token(vocab_parallel_logits, local_target)
    return torch.empty_like(vocab_parallel_logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_ext::vocab_parallel_cross_entropy_backward_")
def _(grad_loss, vocab_parallel_logits, local_target, row_max, log_sum_exp, label_smoothing, vocab_size):
    _per_token(vocab_parallel_logits, local_target)


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


def _check_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> None:
    torch._check(weight.dim() == 2 and hidden.dim() >= 1 and hidden.shape[-1] == weight.shape[1]
                 and tuple(target.shape) == tuple(hidden.shape[:-1]),
                 lambda: "hidden [..., h], weight [vocab / tp, h] and target [...]")


@torch.library.register_fake("megatron_ext::vocab_parallel_linear_cross_entropy")
def _(hidden, weight, target, label_smoothing, ignore_index, chunk_size, group_name, group_size, group_rank):
    _check_linear_cross_entropy(hidden, weight, target)
    return target.new_empty(target.shape, dtype=_C.cross_entropy_acc_dtype(hidden.dtype))


@torch.library.register_fake("megatron_ext::vocab_parallel_linear_cross_entropy_forward")
def _(hidden, weight, target, label_smoothing, ignore_index, chunk_size, hidden_grad, weight_grad, group_name,
      group_size, group_rank):
    _check_linear_cross_entropy(hidden, weight, target)
    acc = _C.cross_entropy_acc_dtype(hidden.dtype)
    rows = target.numel()
    loss = target.new_empty(target.shape, dtype=acc)
    stats = [target.new_empty((rows,), dtype=acc) for _ in range(2)]
    grad_hidden = hidden.new_empty((rows, hidden.shape[-1]) if hidden_grad else (0,))
    grad_weight = weight.new_empty(weight.shape if weight_grad else (0,), dtype=acc)
    return loss, *stats, grad_hidden, grad_weight


@torch.library.register_fake("megatron_ext::vocab_parallel_linear_cross_entropy_backward")
def _(grad_loss, hidden, weight, target, row_max, log_sum_exp, grad_hidden, grad_weight, label_smoothing,
      ignore_index, chunk_size, precomputed, vocab_start, vocab_size, group_name, group_size):
    _check_linear_cross_entropy(hidden, weight, target)


# --- RMSNorm, rotary embedding and SwiGLU (ops/llama_fusions.cpp) ----------------------------------


def _rms_norm_acc_dtype(input: torch.Tensor) -> torch.dtype:
    return torch.float64 if input.dtype == torch.float64 else torch.float32


@torch.library.register_fake("megatron_ext::rms_norm")
def _(input, weight, eps):
    return input.new_empty(input.shape)


@torch.library.register_fake("megatron_ext::rms_norm_forward")
def _(input, weight, eps):
    return input.new_empty(input.shape), input.new_empty(input.shape[:-1], dtype=_rms_norm_acc_dtype(input))


@torch.library.register_fake("megatron_ext::rms_norm_backward")
def _(grad_output, input, weight, rstd):
    return input.new_empty(input.shape), weight.new_empty(weight.shape)


@torch.library.register_fake("megatron_ext::rotary_pos_emb")
def _(t, freqs, interleaved):
    return t.new_empty(t.shape)


@torch.library.register_fake("megatron_ext::rotary_pos_emb_forward")
def _(t, cos, sin, interleaved):
    return t.new_empty(t.shape)


@torch.library.register_fake("megatron_ext::rotary_pos_emb_backward")
def _(grad_output, cos, sin, interleaved):
    return grad_output.new_empty(grad_output.shape)


def _swiglu_out(input: torch.Tensor) -> torch.Tensor:
    torch._check(input.dim() >= 1 and input.shape[-1] % 2 == 0, lambda: "the last dim holds (gate, up)")
    return input.new_empty((*input.shape[:-1], input.shape[-1] // 2))


@torch.library.register_fake("megatron_ext::swiglu")
def _(input, bias, alpha=1.0, linear_offset=0.0, clamp_value=None):
    return _swiglu_out(input)


@torch.library.register_fake("megatron_ext::swiglu_forward")
def _(input, bias, alpha=1.0, linear_offset=0.0, clamp_value=None):
    return _swiglu_out(input)


@torch.library.register_fake("megatron_ext::swiglu_backward")
def _(grad_output, input, bias, alpha=1.0, linear_offset=0.0, clamp_value=None):
    return input.new_empty(input.shape)


# --- Causal convolution of Mamba-2 / Gated DeltaNet (ops/causal_conv1d.cpp) ------------------------


@torch.library.register_fake("megatron_ext::causal_conv1d")
def _(x, weight, bias=None, cu_seqlens=None, initial_states=None, activation="none"):
    return x.new_empty(x.shape)


@torch.library.register_fake("megatron_ext::causal_conv1d_forward")
def _(x, weight, bias, cu_seqlens, initial_states, activation):
    return x.new_empty(x.shape)


@torch.library.register_fake("megatron_ext::causal_conv1d_backward")
def _(grad_output, x, weight, bias, cu_seqlens, initial_states, activation):
    states = x.new_empty((0,)) if initial_states is None else initial_states.new_empty(initial_states.shape)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), x.new_empty((x.shape[1],)), states


# --- Gated delta rule of Gated DeltaNet (ops/gated_delta_rule.cpp) ---------------------------------


def _gdr_acc_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _gdr_state_shape(q, v, cu_seqlens) -> tuple[int, ...]:
    rows = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (rows, q.shape[2], q.shape[3], v.shape[3])


@torch.library.register_fake("megatron_ext::chunk_gated_delta_rule")
def _(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
      use_qk_l2norm=False, chunk_size=64):
    shape = _gdr_state_shape(q, v, cu_seqlens) if output_final_state else (0,)
    return v.new_empty(v.shape), q.new_empty(shape, dtype=_gdr_acc_dtype(q))


@torch.library.register_fake("megatron_ext::gated_delta_rule_forward")
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size):
    # kernels/gated_delta_rule_checks.h gdr_chunk_slots: ceil(T / chunk) + sequences - 1.
    segments = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    slots = (q.shape[1] + chunk_size - 1) // chunk_size + segments - 1
    acc = _gdr_acc_dtype(q)
    return (v.new_empty(v.shape), q.new_empty(_gdr_state_shape(q, v, cu_seqlens), dtype=acc),
            q.new_empty((q.shape[0], q.shape[2], slots, q.shape[3], v.shape[3]), dtype=acc))


@torch.library.register_fake("megatron_ext::gated_delta_rule_backward")
def _(grad_output, grad_final_state, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_states,
      use_qk_l2norm, chunk_size):
    state = q.new_empty((0,), dtype=_gdr_acc_dtype(q)) if initial_state is None else initial_state.new_empty(
        initial_state.shape)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), state)
# --- Mamba-2 SSD scan (ops/mamba_ssd.cpp) --------------------------------------------------------


def _ssd_state_shape(x, initial_states, cu_seqlens):
    rows = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (rows, x.shape[2], x.shape[3])


def _ssd_acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.register_fake("megatron_ext::mamba_chunk_scan")
def _(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, cu_seqlens=None,
      dt_softplus=False, dt_min=0.0, dt_max=None):
    states = (*_ssd_state_shape(x, initial_states, cu_seqlens), B.shape[3])
    return x.new_empty(x.shape), x.new_empty(states, dtype=_ssd_acc_dtype(x))


@torch.library.register_fake("megatron_ext::mamba_chunk_scan_forward")
def _(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, cu_seqlens, dt_softplus, dt_min, dt_max):
    # The number of chunks depends on the packed sequences' lengths: data-dependent with cu_seqlens.
    if cu_seqlens is None:
        chunks = x.shape[0] * ((x.shape[1] + chunk_size - 1) // chunk_size)
    else:
        chunks = torch.library.get_ctx().new_dynamic_size()
    acc = _ssd_acc_dtype(x)
    states = (*_ssd_state_shape(x, initial_states, cu_seqlens), B.shape[3])
    return (x.new_empty(x.shape), x.new_empty(states, dtype=acc),
            x.new_empty((chunks, x.shape[2], x.shape[3], B.shape[3]), dtype=acc))


@torch.library.register_fake("megatron_ext::mamba_chunk_scan_backward")
def _(grad_y, grad_final_states, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, cu_seqlens,
      dt_softplus, dt_min, dt_max, chunk_states):
    def like(t):
        return x.new_empty((0,)) if t is None else t.new_empty(t.shape)

    return (x.new_empty(x.shape), dt.new_empty(dt.shape), A.new_empty(A.shape), B.new_empty(B.shape),
            C.new_empty(C.shape), like(D), like(z), like(dt_bias), like(initial_states))


# --- Context-parallel attention (ops/context_parallel_attention.cpp) -------------------------------


def _attention_acc_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


@torch.library.register_fake("megatron_ext::context_parallel_attention")
def _(query, key, value, group_name, group_size, group_rank, is_causal=True, cp_comm_type="p2p", scale=None,
      window=None, sinks=None, cu_seqlens=None):
    return query.new_empty((*query.shape[:3], value.shape[3]))


@torch.library.register_fake("megatron_ext::context_parallel_attention_forward")
def _(query, key, value, group_name, group_size, group_rank, is_causal, cp_comm_type, scale, window=None,
      sinks=None, cu_seqlens=None):
    b, heads, s, _ = query.shape
    if cp_comm_type == "a2a" and group_size > 1:  # the log-sum-exp of heads / cp over the whole sequence
        heads, s = heads // group_size, s * group_size
    out = query.new_empty((*query.shape[:3], value.shape[3]))
    return out, query.new_empty((b, heads, s), dtype=_attention_acc_dtype(query))


@torch.library.register_fake("megatron_ext::context_parallel_attention_backward")
def _(grad_out, query, key, value, out, log_sum_exp, group_name, group_size, group_rank, is_causal,
      cp_comm_type, scale, window=None, sinks=None, cu_seqlens=None):
    grad_sinks = sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty(
        (0,), dtype=_attention_acc_dtype(query))
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), grad_sinks


# --- The experts' token permutation and grouped GEMM (ops/moe.cpp) ------------------------------


@torch.library.register_fake("megatron_ext::moe_sort_by_expert")
def _(routing_map, capacity):
    torch._check(routing_map.dim() == 2, lambda: "routing_map [num_tokens, num_experts]")
    num_tokens, num_experts = routing_map.shape
    if capacity is None:  # one row per routed (token, expert) pair: known when the map is
        rows = torch.library.get_ctx().new_dynamic_size()
    else:
        rows = num_experts * min(capacity, num_tokens)
    return (torch.empty((rows,), dtype=torch.long, device=routing_map.device),
            torch.empty((rows,), dtype=torch.long, device=routing_map.device))


def _gathered_rows(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    torch._check(input.dim() == 2 and indices.dim() == 1, lambda: "rows [n, hidden] and indices [m]")
    return input.new_empty((indices.shape[0], input.shape[1]))


def _scattered_rows(input: torch.Tensor, indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    torch._check(input.dim() == 2 and indices.shape == (input.shape[0],), lambda: "one index per row")
    return input.new_empty((num_rows, input.shape[1]))


@torch.library.register_fake("megatron_ext::moe_permute")
def _(tokens, sorted_indices, probs):
    return _gathered_rows(tokens, sorted_indices)


@torch.library.register_fake("megatron_ext::moe_gather_rows")
def _(input, indices, scale):
    return _gathered_rows(input, indices)


@torch.library.register_fake("megatron_ext::moe_unpermute")
def _(permuted_tokens, sorted_indices, probs, num_tokens):
    return _scattered_rows(permuted_tokens, sorted_indices, num_tokens)


@torch.library.register_fake("megatron_ext::moe_scatter_add_rows")
def _(input, indices, scale, num_rows):
    return _scattered_rows(input, indices, num_rows)


@torch.library.register_fake("megatron_ext::moe_gathered_row_dot")
def _(grad, indices, input):
    torch._check(input.dim() == 2 and indices.shape == (input.shape[0],), lambda: "one index per row")
    return input.new_empty((input.shape[0],))


@torch.library.register_fake("megatron_ext::grouped_gemm")
def _(a, b, batch_sizes, trans_b):
    torch._check(a.dim() == 2 and b.dim() == 3, lambda: "a [tokens, k] and b [experts, k, n]")
    return a.new_empty((a.shape[0], b.shape[1] if trans_b else b.shape[2]))


@torch.library.register_fake("megatron_ext::grouped_gemm_backward")
def _(grad, a, b, batch_sizes, trans_b):
    return a.new_empty(a.shape), b.new_empty(b.shape)
