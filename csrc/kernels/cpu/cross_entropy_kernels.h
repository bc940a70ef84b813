#pragma once
// The cross-entropy's CPU row loops, compiled once per instruction set (cross_entropy_kernels.cpp,
// see kernels/cpu_capability.h). The interface is plain pointers so that the per-ISA objects share
// no inline ATen code with the rest of the library beyond at::vec, which lives in a per-ISA
// namespace itself.
#include <cstdint>

namespace megatron_ext::kernels {

enum class CeDtype { kFloat, kDouble, kBFloat16, kHalf };

struct CrossEntropyCpuKernels {
  // Statistics (RowStat order, accumulation dtype) of rows [begin, end) of ``logits`` [rows,
  // vocab].
  void (*row_stats)(CeDtype dtype, const void* logits, const int64_t* target, int64_t begin,
                    int64_t end, int64_t vocab, int64_t vocab_start, bool has_ignore,
                    int64_t ignore, void* stats);
  // Gradient of rows [begin, end) into ``grad``, which may be ``logits`` itself (in place).
  // ``local_target`` holds a column, kTargetElsewhere or kIgnoredToken per row; ``grad_loss``,
  // ``row_max`` and ``log_sum_exp`` are in the accumulation dtype.
  void (*backward)(CeDtype dtype, const void* logits, void* grad, const int64_t* local_target,
                   const void* grad_loss, const void* row_max, const void* log_sum_exp,
                   int64_t begin, int64_t end, int64_t vocab, double target_weight,
                   double other_weight);
};

namespace DEFAULT {
extern const CrossEntropyCpuKernels cross_entropy_cpu_kernels;
}
namespace AVX2 {
extern const CrossEntropyCpuKernels cross_entropy_cpu_kernels;
}
namespace AVX512 {
extern const CrossEntropyCpuKernels cross_entropy_cpu_kernels;
}

}  // namespace megatron_ext::kernels
