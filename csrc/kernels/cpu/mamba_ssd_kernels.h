#pragma once
// The CPU loops of the Mamba-2 SSD scan (its arithmetic: kernels/mamba_ssd.h), compiled once per
// instruction set (mamba_ssd_kernels.cpp, see kernels/cpu_capability.h). Each call runs the
// (segment, head) tasks [begin, end) (task = segment * heads + head), so the caller threads them.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "kernels/mamba_ssd.h"

namespace megatron_ext::kernels {

// The inputs: x, dt, B, C and z contiguous in their dtypes; A, D, dt_bias and the initial states
// contiguous in the accumulation dtype (undefined when not given).
struct SsdArgs {
  at::Tensor x, dt, B, C, z, A, D, dt_bias, init;
  std::vector<SsdSegment> segments;
  int64_t length, heads, headdim, groups, dstate, chunk, total_chunks, state_rows;
  bool softplus;
  double lo, hi;
};

// The backward's tensors: grad_y (contiguous, x's dtype), the final states' gradient and the
// chunk-boundary states (accumulation dtype; gfinal undefined without), and the outputs: gx, gdt
// and gz in their inputs' dtypes, gBh and gCh [B, L, H, N] (per head), ginit [rows, H, P, N] and
// part [segments, H, P + 2] (per task: dA, d(dt_bias), dD per channel) in the accumulation dtype.
struct SsdGrads {
  at::Tensor gy, gfinal, states, gx, gdt, gBh, gCh, gz, ginit, part;
};

struct MambaSsdCpuKernels {
  // y (x's dtype), final_states and chunk_states (accumulation dtype).
  void (*forward)(const SsdArgs& a, int64_t begin, int64_t end, const at::Tensor& y,
                  const at::Tensor& final_states, const at::Tensor& chunk_states);
  void (*backward)(const SsdArgs& a, int64_t begin, int64_t end, const SsdGrads& g);
};

namespace DEFAULT {
extern const MambaSsdCpuKernels mamba_ssd_cpu_kernels;
}
namespace AVX2 {
extern const MambaSsdCpuKernels mamba_ssd_cpu_kernels;
}
namespace AVX512 {
extern const MambaSsdCpuKernels mamba_ssd_cpu_kernels;
}

}  // namespace megatron_ext::kernels
