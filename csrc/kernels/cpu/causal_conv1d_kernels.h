#pragma once
// The CPU loops of the causal convolution (its arithmetic: kernels/causal_conv1d.h), compiled once
// per instruction set (causal_conv1d_kernels.cpp, see kernels/cpu_capability.h). Plain pointers at
// the interface, as kernels/cpu/llama_fusions_kernels.h; every loop takes a range of rows or
// channels, so the caller threads them.
#include <cstdint>

#include "kernels/causal_conv1d.h"
#include "kernels/cpu/llama_fusions_kernels.h"

namespace megatron_ext::kernels {

// x [B, D, L] and initial_states [B or sequences, D, W - 1] (null without) in the tensors' dtype;
// weight [D, W] and bias [D] (null without) in the accumulation dtype; the segments of every row
// (one, [0, L), without packed sequences; then a row's initial states are those of its batch
// index, else of the segment's sequence).
struct ConvRows {
  const void* x;
  const void* init;
  const void* weight;
  const void* bias;
  const ConvSegment* segments;
  int64_t num_segments;
  bool packed;
  int64_t batch;
  int64_t channels;
  int64_t length;
  int64_t width;
  ConvActivation act;
};

struct CausalConvCpuKernels {
  // Rows [begin, end) of the B D rows (b, d): y [B, D, L].
  void (*forward)(FusionDtype dtype, const ConvRows& rows, int64_t begin, int64_t end, void* y);
  // Channels [begin, end), each over every batch row: grad_x [B, D, L], grad_init (like the
  // initial states; null without), grad_weight [D, W] and grad_bias [D] (accumulation dtype).
  void (*backward)(FusionDtype dtype, const ConvRows& rows, const void* grad, int64_t begin,
                   int64_t end, void* grad_x, void* grad_init, void* grad_weight, void* grad_bias);
};

namespace DEFAULT {
extern const CausalConvCpuKernels causal_conv_cpu_kernels;
}
namespace AVX2 {
extern const CausalConvCpuKernels causal_conv_cpu_kernels;
}
namespace AVX512 {
extern const CausalConvCpuKernels causal_conv_cpu_kernels;
}

}  // namespace megatron_ext::kernels
