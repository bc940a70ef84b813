#pragma once
// The CPU loops of the gated delta rule (its arithmetic: kernels/gated_delta_rule.h), compiled
// once per instruction set (gated_delta_rule_kernels.cpp, see kernels/cpu_capability.h). Plain
// pointers at the interface, as kernels/cpu/llama_fusions_kernels.h; the loops take a range of
// tasks (a batch row's segment and head each), so the caller threads them.
#include <cstdint>

#include "kernels/cpu/llama_fusions_kernels.h"

namespace megatron_ext::kernels {

// q, k [B, T, H, K], v [B, T, H, V] in the tensors' dtype; g, beta [B, T, H] and the initial
// states [N, H, K, V] (null without) in the accumulation dtype; the segments [seg_start,
// seg_end) of every row (one, [0, T), without packed sequences, whose state rows are then the
// batch rows) and the index of each one's first chunk (chunk_states [B, H, chunks, K, V]).
struct GdrProblem {
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  const void* beta;
  const void* init;
  const int64_t* seg_start;
  const int64_t* seg_end;
  const int64_t* chunk_base;
  int64_t segments;
  bool packed;
  int64_t batch;
  int64_t length;
  int64_t heads;
  int64_t dk;
  int64_t dv;
  int64_t chunk;
  int64_t chunks;
  bool l2norm;
  double scale;
};

struct GatedDeltaRuleCpuKernels {
  // Tasks [begin, end) of the B x segments x H tasks ((b, s) x H + h): out [B, T, H, V],
  // final_state [N, H, K, V] and chunk_states (accumulation dtype).
  void (*forward)(FusionDtype dtype, const GdrProblem& p, int64_t begin, int64_t end, void* out,
                  void* final_state, void* chunk_states);
  // Tasks [begin, end): from grad_out (like out) and grad_final (like final_state; null for
  // zero), dq, dk, dv (the inputs' dtype), dg, dbeta and dinit (accumulation dtype; dinit null
  // when not wanted).
  void (*backward)(FusionDtype dtype, const GdrProblem& p, const void* grad_out,
                   const void* grad_final, const void* chunk_states, int64_t begin, int64_t end,
                   void* dq, void* dk, void* dv, void* dg, void* dbeta, void* dinit);
};

namespace DEFAULT {
extern const GatedDeltaRuleCpuKernels gated_delta_rule_cpu_kernels;
}
namespace AVX2 {
extern const GatedDeltaRuleCpuKernels gated_delta_rule_cpu_kernels;
}
namespace AVX512 {
extern const GatedDeltaRuleCpuKernels gated_delta_rule_cpu_kernels;
}

}  // namespace megatron_ext::kernels
