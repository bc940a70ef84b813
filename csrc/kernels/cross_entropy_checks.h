#pragma once
// The ATen side of the cross-entropy's kernels, shared by its CPU and CUDA kernels and by the ops
// built on them (ops/cross_entropy.cpp, ops/linear_cross_entropy.cpp): the accumulation dtype and
// the per-token local target as tensors, from the definitions in kernels/cross_entropy.h, and the
// checks of the internal ops. The public op validates user input with friendlier messages before
// any kernel or collective runs; these guard direct calls of the internal ops.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include <optional>

#include "kernels/cross_entropy.h"

namespace megatron_ext {

inline void check_cross_entropy_kernel_args(const at::Tensor& logits, const at::Tensor& target,
                                            const char* op) {
  TORCH_CHECK_VALUE(logits.dim() >= 1 && logits.size(-1) > 0, op,
                    ": expected logits with a non-empty last (vocabulary) dim, got shape ",
                    logits.sizes());
  TORCH_CHECK_VALUE(at::isFloatingType(logits.scalar_type()), op,
                    ": expected floating-point logits, got ", logits.scalar_type());
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong, op, ": expected int64 target, got ",
                    target.scalar_type());
  TORCH_CHECK_VALUE(target.sizes() == logits.sizes().slice(0, logits.dim() - 1), op,
                    ": target shape ", target.sizes(), " must equal the logits shape ",
                    logits.sizes(), " without its last dim");
  TORCH_CHECK_VALUE(target.device() == logits.device(), op, ": target is on ", target.device(),
                    " but logits are on ", logits.device());
}

// The in-place backward writes the gradient over the logits, row by row.
inline void check_cross_entropy_inplace(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.is_contiguous(),
                    "vocab_parallel_cross_entropy_backward_: the logits the "
                    "gradient overwrites must be contiguous, got strides ",
                    logits.strides());
}

// The dtype of the row statistics and losses of ``logits`` floating-point logits: the kernels'
// kernels::acc_type.
inline at::ScalarType cross_entropy_acc_type(at::ScalarType logits) {
  return AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, logits, "cross_entropy_acc_type",
      [] { return c10::CppTypeToScalarType<kernels::acc_type<scalar_t>>::value; });
}

// Every token's local target (kernels::local_target_index) in a rank holding vocabulary rows
// [vocab_start, vocab_start + local_vocab), from int64 ``ids``.
inline at::Tensor local_target_columns(const at::Tensor& ids, int64_t vocab_start,
                                       int64_t local_vocab, std::optional<int64_t> ignore_index) {
  const auto column = ids.sub(vocab_start);
  const auto held = column.ge(0).logical_and_(column.lt(local_vocab));
  auto local = at::where(held, column, kernels::kTargetElsewhere);
  if (ignore_index.has_value()) local.masked_fill_(ids.eq(*ignore_index), kernels::kIgnoredToken);
  return local;
}

// The backward kernels' inputs, contiguous, statistics in the accumulation dtype.
struct CrossEntropyBackwardInputs {
  at::Tensor logits, local_target, grad_loss, row_max, log_sum_exp;
  int64_t vocab;        // this rank's vocabulary slice
  int64_t rows;         // tokens
  double other_weight;  // label_smoothing / (V - 1): what each non-target class gets
};

inline CrossEntropyBackwardInputs prepare_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& local_target,
    const at::Tensor& row_max, const at::Tensor& log_sum_exp, double label_smoothing,
    int64_t vocab_size) {
  check_cross_entropy_kernel_args(logits, local_target, "vocab_parallel_cross_entropy_backward");
  TORCH_CHECK_VALUE(vocab_size >= logits.size(-1),
                    "vocab_parallel_cross_entropy_backward: vocab_size ", vocab_size,
                    " is smaller than the local vocabulary ", logits.size(-1));
  const auto acc = cross_entropy_acc_type(logits.scalar_type());
  CrossEntropyBackwardInputs in{
      logits.contiguous(),
      local_target.contiguous(),
      grad_loss.to(acc).contiguous(),
      row_max.to(acc).contiguous(),
      log_sum_exp.to(acc).contiguous(),
      logits.size(-1),
      local_target.numel(),
      vocab_size > 1 ? label_smoothing / static_cast<double>(vocab_size - 1) : 0.0};
  TORCH_CHECK_VALUE(in.grad_loss.numel() == in.rows && in.row_max.numel() == in.rows &&
                        in.log_sum_exp.numel() == in.rows,
                    "vocab_parallel_cross_entropy_backward: expected one gradient, max and "
                    "log-sum-exp per token (",
                    in.rows, "), got ", in.grad_loss.numel(), ", ", in.row_max.numel(), ", ",
                    in.log_sum_exp.numel());
  TORCH_CHECK_VALUE(
      in.grad_loss.device() == in.logits.device() && in.row_max.device() == in.logits.device() &&
          in.log_sum_exp.device() == in.logits.device(),
      "vocab_parallel_cross_entropy_backward: every tensor must be on the logits' device ",
      in.logits.device());
  // The backward writes at each token's column: out-of-range columns are refused (on CPU here, one
  // pass over the tokens; the CUDA kernel asserts on the device rather than synchronise).
  if (in.local_target.is_cpu() && in.rows > 0) {
    const auto [lo, hi] = at::aminmax(in.local_target);
    const int64_t min = lo.item<int64_t>(), max = hi.item<int64_t>();
    TORCH_CHECK_VALUE(
        min >= kernels::kIgnoredToken && max < in.vocab,
        "vocab_parallel_cross_entropy_backward: local_target must hold columns in [0, ", in.vocab,
        "), ", kernels::kTargetElsewhere, " (another rank's) or ", kernels::kIgnoredToken,
        " (ignored), got values in [", min, ", ", max, "]");
  }
  return in;
}

}  // namespace megatron_ext
