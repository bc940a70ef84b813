#pragma once
// Argument checks and launch facts of the fused epilogue ops, shared by the CPU and CUDA kernels.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "kernels/fused_epilogue.h"

namespace megatron_ext {

inline void check_bias_gelu_args(const char* op, const at::Tensor& input, const at::Tensor& bias) {
  TORCH_CHECK_VALUE(at::isFloatingType(input.scalar_type()), op,
                    ": input must be a floating tensor, got ", input.scalar_type());
  TORCH_CHECK_VALUE(input.dim() >= 1, op, ": input must have at least one dim, got a scalar");
  TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == input.size(-1), op,
                    ": bias must have shape [", input.size(-1), "] (the input's last dim), got ",
                    bias.sizes());
  TORCH_CHECK_VALUE(bias.scalar_type() == input.scalar_type(), op, ": bias dtype ",
                    bias.scalar_type(), " differs from the input dtype ", input.scalar_type());
  TORCH_CHECK_VALUE(bias.device() == input.device(), op, ": bias is on ", bias.device(),
                    " but the input is on ", input.device());
}

inline void check_same_tensor_layout(const char* op, const char* name, const at::Tensor& other,
                                     const at::Tensor& input) {
  TORCH_CHECK_VALUE(other.sizes() == input.sizes(), op, ": ", name, " has shape ", other.sizes(),
                    " but the input has shape ", input.sizes());
  TORCH_CHECK_VALUE(other.scalar_type() == input.scalar_type(), op, ": ", name, " dtype ",
                    other.scalar_type(), " differs from the input dtype ", input.scalar_type());
  TORCH_CHECK_VALUE(other.device() == input.device(), op, ": ", name, " is on ", other.device(),
                    " but the input is on ", input.device());
}

inline void check_dropout_prob(const char* op, double prob) {
  TORCH_CHECK_VALUE(prob >= 0.0 && prob <= 1.0, op, ": dropout probability must be in [0, 1], got ",
                    prob);
}

inline void check_bias_dropout_add_args(const char* op, const at::Tensor& input,
                                        const std::optional<at::Tensor>& bias,
                                        const at::Tensor& residual, double prob) {
  TORCH_CHECK_VALUE(at::isFloatingType(input.scalar_type()), op,
                    ": input must be a floating tensor, got ", input.scalar_type());
  TORCH_CHECK_VALUE(input.dim() >= 1, op, ": input must have at least one dim, got a scalar");
  if (bias.has_value() && bias->defined()) check_bias_gelu_args(op, input, *bias);
  check_same_tensor_layout(op, "residual", residual, input);
  check_dropout_prob(op, prob);
}

// 1 / keep probability, or 0 when every element is dropped (so no inf * 0 appears).
template <typename acc_t>
acc_t dropout_scale(double prob) {
  return prob < 1.0 ? static_cast<acc_t>(1.0 / (1.0 - prob)) : acc_t(0);
}

inline int64_t dropout_groups(int64_t numel) {
  return (numel + kernels::kDropoutGroup - 1) / kernels::kDropoutGroup;
}

}  // namespace megatron_ext
