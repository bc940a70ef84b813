#pragma once
// Checks shared by the CPU and CUDA kernels of the cross-entropy's internal ops. The public op
// validates user input with friendlier messages before any kernel or collective runs
// (ops/cross_entropy.cpp); these guard direct calls of the internal ops.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

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

// The dtype statistics and losses are accumulated in: float for 16-bit and float32 logits.
inline at::ScalarType cross_entropy_acc_type(at::ScalarType logits) {
  return logits == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace megatron_ext
