#pragma once
// The CPU loops of RMSNorm, rotary embedding and SwiGLU (their arithmetic:
// kernels/llama_fusions.h), compiled once per instruction set (llama_fusions_kernels.cpp, see
// kernels/cpu_capability.h). Plain pointers at the interface, as
// kernels/cpu/cross_entropy_kernels.h. Every loop takes a range of rows, so the caller threads
// them; values of the accumulation type (float for 16-bit and float32 tensors, double for float64)
// are marked ``acc``.
#include <cstdint>

#include "kernels/llama_fusions.h"

namespace megatron_ext::kernels {

enum class FusionDtype { kFloat, kDouble, kBFloat16, kHalf };

// Calls fn<T>(...) for the element type T of ``dtype`` (inside a kernel-table function).
#define MEGATRON_EXT_FUSION_DISPATCH(dtype, fn, ...) \
  switch (dtype) {                                   \
    case FusionDtype::kFloat:                        \
      return fn<float>(__VA_ARGS__);                 \
    case FusionDtype::kDouble:                       \
      return fn<double>(__VA_ARGS__);                \
    case FusionDtype::kBFloat16:                     \
      return fn<c10::BFloat16>(__VA_ARGS__);         \
    case FusionDtype::kHalf:                         \
      return fn<c10::Half>(__VA_ARGS__);             \
  }

struct LlamaFusionCpuKernels {
  // Rows [begin, end) of x [rows, h]: y = (x rstd) w, and rstd per row (acc); w is acc.
  void (*rms_norm_forward)(FusionDtype dtype, const void* x, const void* weight, double eps,
                           int64_t h, int64_t begin, int64_t end, void* y, void* rstd);
  // Rows [begin, end): grad_x, and the rows' terms g (x rstd) added into grad_weight [h] (acc);
  // weight and rstd are acc.
  void (*rms_norm_backward)(FusionDtype dtype, const void* grad, const void* x, const void* weight,
                            const void* rstd, int64_t h, int64_t begin, int64_t end, void* grad_x,
                            void* grad_weight);
  // Heads [begin, end) of the rotary input (with ``backward``, of the output's gradient) laid out
  // as ``layout`` says, into out [heads, dim] (contiguous); cos and sin are [s, rot_dim] in the
  // input's dtype.
  void (*rotary)(FusionDtype dtype, const void* input, const void* cos, const void* sin,
                 const RotaryLayout& layout, bool backward, int64_t begin, int64_t end, void* out);
  // Rows [begin, end) of y [rows, 2f] plus bias [2f] (acc; null when there is none):
  // out [rows, f] = silu(gate) up, or the gated sigmoid unit ``params`` describes.
  void (*swiglu_forward)(FusionDtype dtype, const void* y, const void* bias, int64_t f,
                         const GluParams& params, int64_t begin, int64_t end, void* out);
  // Rows [begin, end): grad_y [rows, 2f] from grad [rows, f].
  void (*swiglu_backward)(FusionDtype dtype, const void* grad, const void* y, const void* bias,
                          int64_t f, const GluParams& params, int64_t begin, int64_t end,
                          void* grad_y);
};

namespace DEFAULT {
extern const LlamaFusionCpuKernels llama_fusion_cpu_kernels;
}
namespace AVX2 {
extern const LlamaFusionCpuKernels llama_fusion_cpu_kernels;
}
namespace AVX512 {
extern const LlamaFusionCpuKernels llama_fusion_cpu_kernels;
}

}  // namespace megatron_ext::kernels
