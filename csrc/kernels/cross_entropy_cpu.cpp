// CPU implementations of the cross-entropy's kernel ops: argument checks, threading over rows
// with at::parallel_for, and the run-time choice of the instruction-set variant of the row loops
// (kernels/cpu/cross_entropy_kernels.cpp).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "kernels/cpu/cross_entropy_kernels.h"
#include "kernels/cpu_capability.h"
#include "kernels/cross_entropy.h"
#include "kernels/cross_entropy_checks.h"

namespace megatron_ext {
namespace {

using namespace kernels;

int64_t row_grain(int64_t row_length) { return std::max<int64_t>(1, 32768 / row_length); }

const CrossEntropyCpuKernels& cpu_kernels() {
  switch (cpu_capability()) {
#ifdef MEGATRON_EXT_CPU_AVX512
    case CpuCapability::kAvx512:
      return AVX512::cross_entropy_cpu_kernels;
#endif
#ifdef MEGATRON_EXT_CPU_AVX2
    case CpuCapability::kAvx2:
      return AVX2::cross_entropy_cpu_kernels;
#endif
    default:
      return DEFAULT::cross_entropy_cpu_kernels;
  }
}

CeDtype ce_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return CeDtype::kFloat;
    case at::kDouble:
      return CeDtype::kDouble;
    case at::kBFloat16:
      return CeDtype::kBFloat16;
    case at::kHalf:
      return CeDtype::kHalf;
    default:
      TORCH_CHECK_VALUE(false, "vocab_parallel_cross_entropy: unsupported logits dtype ", t,
                        "; expected float64, float32, bfloat16 or float16");
  }
}

at::Tensor row_stats_cpu(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                         std::optional<int64_t> ignore_index) {
  check_cross_entropy_kernel_args(logits, target, "vocab_parallel_cross_entropy_row_stats");
  const int64_t vocab = logits.size(-1);
  const int64_t rows = target.numel();
  auto x = logits.contiguous();
  auto t = target.contiguous();
  auto sizes = target.sizes().vec();
  sizes.push_back(kNumRowStats);
  auto stats =
      at::empty(sizes, logits.options().dtype(cross_entropy_acc_type(logits.scalar_type())));
  const auto dtype = ce_dtype(x.scalar_type());
  const auto& k = cpu_kernels();
  const void* xp = x.const_data_ptr();
  const int64_t* tp = t.const_data_ptr<int64_t>();
  void* sp = stats.mutable_data_ptr();
  const bool has_ignore = ignore_index.has_value();
  const int64_t ignore = ignore_index.value_or(0);
  at::parallel_for(0, rows, row_grain(vocab), [&](int64_t begin, int64_t end) {
    k.row_stats(dtype, xp, tp, begin, end, vocab, vocab_start, has_ignore, ignore, sp);
  });
  return stats;
}

void backward_into(const CrossEntropyBackwardInputs& in, const at::Tensor& grad,
                   double label_smoothing) {
  const auto dtype = ce_dtype(in.logits.scalar_type());
  const auto& k = cpu_kernels();
  const void* xp = in.logits.const_data_ptr();
  void* yp = grad.data_ptr();
  const int64_t* tp = in.local_target.const_data_ptr<int64_t>();
  const void* gp = in.grad_loss.const_data_ptr();
  const void* mp = in.row_max.const_data_ptr();
  const void* lp = in.log_sum_exp.const_data_ptr();
  at::parallel_for(0, in.rows, row_grain(in.vocab), [&](int64_t begin, int64_t end) {
    k.backward(dtype, xp, yp, tp, gp, mp, lp, begin, end, in.vocab, 1.0 - label_smoothing,
               in.other_weight);
  });
}

at::Tensor backward_cpu(const at::Tensor& grad_loss, const at::Tensor& logits,
                        const at::Tensor& local_target, const at::Tensor& row_max,
                        const at::Tensor& log_sum_exp, double label_smoothing, int64_t vocab_size) {
  const auto in = prepare_cross_entropy_backward(grad_loss, logits, local_target, row_max,
                                                 log_sum_exp, label_smoothing, vocab_size);
  auto grad = at::empty(in.logits.sizes(), in.logits.options());
  backward_into(in, grad, label_smoothing);
  return grad;
}

void backward_inplace_cpu(const at::Tensor& grad_loss, const at::Tensor& logits,
                          const at::Tensor& local_target, const at::Tensor& row_max,
                          const at::Tensor& log_sum_exp, double label_smoothing,
                          int64_t vocab_size) {
  check_cross_entropy_inplace(logits);
  const auto in = prepare_cross_entropy_backward(grad_loss, logits, local_target, row_max,
                                                 log_sum_exp, label_smoothing, vocab_size);
  backward_into(in, logits, label_smoothing);
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CPU, m) {
  m.impl("vocab_parallel_cross_entropy_row_stats", &row_stats_cpu);
  m.impl("vocab_parallel_cross_entropy_backward", &backward_cpu);
  m.impl("vocab_parallel_cross_entropy_backward_", &backward_inplace_cpu);
}

}  // namespace megatron_ext
