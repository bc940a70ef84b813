#pragma once
// Argument checks of the causal convolution ops, shared by the CPU and CUDA kernels and the
// autograd node: shapes and dtypes (meta-safe), and the values of cu_seqlens (read on the host).
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <optional>
#include <vector>

#include "kernels/causal_conv1d.h"
#include "kernels/llama_fusions_checks.h"

namespace megatron_ext {

inline kernels::ConvActivation conv_activation_of(const char* op, c10::string_view name) {
  if (name == "silu" || name == "swish") return kernels::ConvActivation::kSilu;
  TORCH_CHECK_VALUE(name == "none" || name == "identity", op,
                    ": activation must be 'silu', 'swish', 'none' or 'identity', got '", name, "'");
  return kernels::ConvActivation::kNone;
}

// The number of rows of initial_states: the batch, or the packed sequences.
inline int64_t conv_state_rows(const at::Tensor& x, const std::optional<at::Tensor>& cu_seqlens) {
  return has_tensor(cu_seqlens) ? cu_seqlens->size(0) - 1 : x.size(0);
}

inline void check_causal_conv1d_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     const std::optional<at::Tensor>& cu_seqlens,
                                     const std::optional<at::Tensor>& initial_states,
                                     c10::string_view activation) {
  check_fusion_dtype(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() == 3, op, ": x must be [batch, channels, length], got shape ",
                    x.sizes());
  const int64_t channels = x.size(1);
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) == channels, op,
                    ": weight must be [channels, width] with channels = ", channels,
                    " (x's dim 1), got shape ", weight.sizes());
  const int64_t width = weight.size(1);
  TORCH_CHECK_VALUE(width >= 1 && width <= kernels::kMaxConvWidth, op,
                    ": the kernel width (weight's dim 1) must be in [1, ", kernels::kMaxConvWidth,
                    "], got ", width);
  check_like(op, "weight", weight, x, "x");
  if (has_tensor(bias)) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == channels, op, ": bias must be [",
                      channels, "] (x's channels), got shape ", bias->sizes());
    check_like(op, "bias", *bias, x, "x");
  }
  if (has_tensor(cu_seqlens)) {
    const auto dtype = cu_seqlens->scalar_type();
    TORCH_CHECK_VALUE(dtype == at::kInt || dtype == at::kLong, op,
                      ": cu_seqlens must be int32 or int64, got ", dtype);
    TORCH_CHECK_VALUE(cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 2, op,
                      ": cu_seqlens must be [sequences + 1] with at least one sequence, got shape ",
                      cu_seqlens->sizes());
    TORCH_CHECK_VALUE(x.size(0) == 1, op,
                      ": packed sequences (cu_seqlens) take x of batch size 1, got shape ",
                      x.sizes());
    TORCH_CHECK_VALUE(cu_seqlens->device() == x.device(), op, ": cu_seqlens is on ",
                      cu_seqlens->device(), " but x is on ", x.device());
  }
  if (has_tensor(initial_states)) {
    const int64_t rows = conv_state_rows(x, cu_seqlens);
    TORCH_CHECK_VALUE(initial_states->dim() == 3 && initial_states->size(0) == rows &&
                          initial_states->size(1) == channels &&
                          initial_states->size(2) == width - 1,
                      op, ": initial_states must be [", rows, ", ", channels, ", ", width - 1,
                      "] (", has_tensor(cu_seqlens) ? "sequences" : "batch",
                      ", channels, width - 1), got shape ", initial_states->sizes());
    check_like(op, "initial_states", *initial_states, x, "x");
  }
  conv_activation_of(op, activation);
}

inline void check_causal_conv1d_backward_args(const at::Tensor& grad_output, const at::Tensor& x) {
  const char* op = "causal_conv1d_backward";
  TORCH_CHECK_VALUE(grad_output.sizes() == x.sizes(), op, ": grad_output has shape ",
                    grad_output.sizes(), " but x has shape ", x.sizes());
  check_like(op, "grad_output", grad_output, x, "x");
}

// cu_seqlens as int64 offsets on the host, checked: 0 first, the length of x last, nondecreasing
// (equal neighbours are empty sequences).
inline std::vector<int64_t> conv_offsets(const char* op, const at::Tensor& cu_seqlens,
                                         int64_t length) {
  const auto host = cu_seqlens.to(at::kCPU).to(at::kLong).contiguous();
  const int64_t* p = host.const_data_ptr<int64_t>();
  std::vector<int64_t> offsets(p, p + host.numel());
  TORCH_CHECK_VALUE(offsets.front() == 0, op, ": cu_seqlens must start at 0, got ",
                    offsets.front());
  TORCH_CHECK_VALUE(offsets.back() == length, op, ": cu_seqlens must end at x's length ", length,
                    ", got ", offsets.back());
  for (size_t s = 1; s < offsets.size(); ++s) {
    TORCH_CHECK_VALUE(offsets[s] >= offsets[s - 1], op, ": cu_seqlens must be nondecreasing, got ",
                      offsets[s - 1], " then ", offsets[s], " at index ", s);
  }
  return offsets;
}

}  // namespace megatron_ext
