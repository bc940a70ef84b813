#pragma once
// The element type of the CPU fused kernels for an ATen dtype, and a tensor's contiguous copy in
// its accumulation dtype (float64 for float64, float32 for the others): shared by the RMSNorm,
// rotary, SwiGLU and causal convolution ops.
#include <ATen/core/Tensor.h>

#include "kernels/cpu/llama_fusions_kernels.h"
#include "kernels/llama_fusions_checks.h"

namespace megatron_ext {

inline kernels::FusionDtype fusion_dtype(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return kernels::FusionDtype::kDouble;
    case at::kBFloat16:
      return kernels::FusionDtype::kBFloat16;
    case at::kHalf:
      return kernels::FusionDtype::kHalf;
    default:  // checked by the callers
      return kernels::FusionDtype::kFloat;
  }
}

inline at::Tensor to_acc(const at::Tensor& t) {
  return t.to(fusion_acc_type(t.scalar_type())).contiguous();
}

}  // namespace megatron_ext
