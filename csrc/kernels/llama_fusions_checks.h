#pragma once
// Argument checks and launch facts of the RMSNorm, rotary embedding and SwiGLU ops, shared by the
// CPU and CUDA kernels and the autograd nodes.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>

#include "kernels/llama_fusions.h"

namespace megatron_ext {

// The accumulation dtype: float64 for float64 tensors, float32 for the others.
inline at::ScalarType fusion_acc_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_fusion_dtype(const char* op, const char* name, const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK_VALUE(
      dtype == at::kDouble || dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
      op, ": ", name, " must be float64, float32, bfloat16 or float16, got ", dtype);
}

inline void check_like(const char* op, const char* name, const at::Tensor& other,
                       const at::Tensor& input, const char* input_name) {
  TORCH_CHECK_VALUE(other.scalar_type() == input.scalar_type(), op, ": ", name, " dtype ",
                    other.scalar_type(), " differs from the ", input_name, " dtype ",
                    input.scalar_type());
  TORCH_CHECK_VALUE(other.device() == input.device(), op, ": ", name, " is on ", other.device(),
                    " but the ", input_name, " is on ", input.device());
}

// ---- RMSNorm ---------------------------------------------------------------------------------

inline void check_rms_norm_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                                double eps) {
  check_fusion_dtype(op, "input", input);
  TORCH_CHECK_VALUE(input.dim() >= 1 && input.size(-1) > 0, op,
                    ": input must have a non-empty last (normalized) dim, got shape ",
                    input.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == input.size(-1), op,
                    ": weight must have shape [", input.size(-1), "] (the input's last dim), got ",
                    weight.sizes());
  check_like(op, "weight", weight, input, "input");
  TORCH_CHECK_VALUE(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
}

inline void check_rms_norm_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                         const at::Tensor& weight, const at::Tensor& rstd) {
  const char* op = "rms_norm_backward";
  check_rms_norm_args(op, input, weight, 0.0);
  TORCH_CHECK_VALUE(grad_output.sizes() == input.sizes(), op, ": grad_output has shape ",
                    grad_output.sizes(), " but the input has shape ", input.sizes());
  check_like(op, "grad_output", grad_output, input, "input");
  TORCH_CHECK_VALUE(rstd.sizes() == input.sizes().slice(0, input.dim() - 1), op,
                    ": rstd must have the input's shape without its last dim (",
                    input.sizes().slice(0, input.dim() - 1), "), got ", rstd.sizes());
  TORCH_CHECK_VALUE(rstd.scalar_type() == fusion_acc_type(input.scalar_type()), op,
                    ": rstd must be ", fusion_acc_type(input.scalar_type()), ", got ",
                    rstd.scalar_type());
  TORCH_CHECK_VALUE(rstd.device() == input.device(), op, ": rstd is on ", rstd.device(),
                    " but the input is on ", input.device());
}

// ---- rotary embedding ------------------------------------------------------------------------

inline void check_rotary_input(const char* op, const char* name, const at::Tensor& t) {
  check_fusion_dtype(op, name, t);
  TORCH_CHECK_VALUE(t.dim() == 4, op, ": ", name, " must be [s, b, n, d], got shape ", t.sizes());
}

// The rotated width d_rot: even, in (0, d].
inline void check_rotary_width(const char* op, int64_t rot_dim, int64_t dim) {
  TORCH_CHECK_VALUE(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= dim, op,
                    ": the rotary width (freqs' last dim) must be even and in (0, ", dim,
                    "] (the head dim), got ", rot_dim);
}

// The public op: t [s, b, n, d], freqs [s, 1, 1, d_rot] angles in any floating dtype.
inline void check_rotary_freqs(const char* op, const at::Tensor& t, const at::Tensor& freqs) {
  check_rotary_input(op, "t", t);
  TORCH_CHECK_VALUE(at::isFloatingType(freqs.scalar_type()), op,
                    ": freqs must be a floating tensor, got ", freqs.scalar_type());
  TORCH_CHECK_VALUE(
      freqs.dim() == 4 && freqs.size(0) == t.size(0) && freqs.size(1) == 1 && freqs.size(2) == 1,
      op, ": freqs must have shape [", t.size(0), ", 1, 1, d_rot] (t is ", t.sizes(), "), got ",
      freqs.sizes());
  check_rotary_width(op, freqs.size(3), t.size(3));
  TORCH_CHECK_VALUE(freqs.device() == t.device(), op, ": freqs is on ", freqs.device(),
                    " but t is on ", t.device());
}

// The kernels: input [s, b, n, d], cos and sin [s, d_rot] in the input's dtype.
inline void check_rotary_kernel_args(const char* op, const at::Tensor& input, const at::Tensor& cos,
                                     const at::Tensor& sin) {
  check_rotary_input(op, "input", input);
  const auto check_table = [&](const char* name, const at::Tensor& table) {
    TORCH_CHECK_VALUE(table.dim() == 2 && table.size(0) == input.size(0), op, ": ", name,
                      " must have shape [", input.size(0), ", d_rot], got ", table.sizes());
    check_like(op, name, table, input, "input");
  };
  check_table("cos", cos);
  check_table("sin", sin);
  TORCH_CHECK_VALUE(cos.sizes() == sin.sizes(), op, ": cos has shape ", cos.sizes(),
                    " but sin has shape ", sin.sizes());
  check_rotary_width(op, cos.size(1), input.size(3));
}

// ---- SwiGLU ----------------------------------------------------------------------------------

inline void check_swiglu_args(const char* op, const at::Tensor& input,
                              const std::optional<at::Tensor>& bias) {
  check_fusion_dtype(op, "input", input);
  TORCH_CHECK_VALUE(input.dim() >= 1 && input.size(-1) % 2 == 0, op,
                    ": input's last dim must hold the two halves (gate, up), an even size, got "
                    "shape ",
                    input.sizes());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == input.size(-1), op,
                      ": bias must have shape [", input.size(-1), "] (the input's last dim), got ",
                      bias->sizes());
    check_like(op, "bias", *bias, input, "input");
  }
}

inline void check_swiglu_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                       const std::optional<at::Tensor>& bias) {
  const char* op = "swiglu_backward";
  check_swiglu_args(op, input, bias);
  auto expected = input.sizes().vec();
  expected.back() /= 2;
  TORCH_CHECK_VALUE(grad_output.sizes() == at::IntArrayRef(expected), op,
                    ": grad_output must have shape ", at::IntArrayRef(expected), ", got ",
                    grad_output.sizes());
  check_like(op, "grad_output", grad_output, input, "input");
}

inline bool has_tensor(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The gated sigmoid unit's settings: a finite alpha and offset, a clamp value positive and finite
// (or none).
inline kernels::GluParams glu_params(const char* op, double alpha, double linear_offset,
                                     std::optional<double> clamp_value) {
  TORCH_CHECK_VALUE(std::isfinite(alpha), op, ": alpha must be finite, got ", alpha);
  TORCH_CHECK_VALUE(std::isfinite(linear_offset), op, ": linear_offset must be finite, got ",
                    linear_offset);
  if (clamp_value.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*clamp_value) && *clamp_value > 0, op,
                      ": clamp_value must be positive and finite (or None), got ", *clamp_value);
  }
  return {alpha, linear_offset, clamp_value.has_value(), clamp_value.value_or(0.0)};
}

}  // namespace megatron_ext
