// CUDA kernels of the vocabulary-parallel cross-entropy: one block per row. The statistics
// kernel keeps an online (max, sum-exp) state and a shifted sum per thread and merges them with
// one CUB block reduction; the gradient kernel recomputes the softmax from the saved row max and
// log-sum-exp. The arithmetic is the shared header's, the one the CPU kernels run.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <optional>

#include "kernels/cross_entropy.h"
#include "ops/cross_entropy.h"

namespace megatron_ext {
namespace {

using namespace kernels;

constexpr int kThreads = 256;

template <typename acc_t>
struct PartialRow {
  MaxSumExp<acc_t> softmax;
  acc_t sum_minus_first;
};

template <typename acc_t>
struct MergePartialRows {
  __device__ __forceinline__ PartialRow<acc_t> operator()(const PartialRow<acc_t>& a,
                                                          const PartialRow<acc_t>& b) const {
    return {max_sum_exp_merge(a.softmax, b.softmax), a.sum_minus_first + b.sum_minus_first};
  }
};

template <typename scalar_t, typename acc_t>
__global__ void row_stats_kernel(const scalar_t* __restrict__ logits, const int64_t* __restrict__ target,
                                 int64_t vocab, int64_t vocab_start, bool has_ignore, int64_t ignore,
                                 acc_t* __restrict__ stats) {
  using BlockReduce = cub::BlockReduce<PartialRow<acc_t>, kThreads>;
  __shared__ typename BlockReduce::TempStorage storage;
  const int64_t row_index = blockIdx.x;
  const scalar_t* row = logits + row_index * vocab;
  const acc_t first = static_cast<acc_t>(row[0]);
  PartialRow<acc_t> part{max_sum_exp_init<acc_t>(), acc_t(0)};
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    const acc_t x = static_cast<acc_t>(row[j]);
    max_sum_exp_add(part.softmax, x);
    part.sum_minus_first += x - first;
  }
  const PartialRow<acc_t> total = BlockReduce(storage).Reduce(part, MergePartialRows<acc_t>());
  if (threadIdx.x == 0) {
    const int64_t local = local_target_index(target[row_index], vocab_start, vocab, has_ignore, ignore);
    write_row_stats(row, vocab, total.softmax, total.sum_minus_first, local,
                    stats + row_index * kNumRowStats);
  }
}

template <typename scalar_t, typename acc_t>
__global__ void grad_kernel(const acc_t* __restrict__ grad_loss, const scalar_t* __restrict__ logits,
                            const int64_t* __restrict__ target, const acc_t* __restrict__ row_max,
                            const acc_t* __restrict__ log_sum_exp, int64_t vocab, int64_t vocab_start,
                            bool has_ignore, int64_t ignore, acc_t target_weight, acc_t other_weight,
                            scalar_t* __restrict__ grad) {
  const int64_t row_index = blockIdx.x;
  const scalar_t* row = logits + row_index * vocab;
  scalar_t* out = grad + row_index * vocab;
  const int64_t t = target[row_index];
  if (has_ignore && t == ignore) {
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) out[j] = scalar_t(0);
    return;
  }
  const int64_t local = local_target_index(t, vocab_start, vocab, false, 0);
  const acc_t g = grad_loss[row_index];
  const acc_t m = row_max[row_index];
  const acc_t l = log_sum_exp[row_index];
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    out[j] = static_cast<scalar_t>(
        softmax_minus_smoothed_one_hot<acc_t>(static_cast<acc_t>(row[j]), m, l, j == local,
                                              target_weight, other_weight) *
        g);
  }
}

at::Tensor row_stats_cuda(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                          std::optional<int64_t> ignore_index) {
  check_cross_entropy_kernel_args(logits, target, "vocab_parallel_cross_entropy_row_stats");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t vocab = logits.size(-1);
  const int64_t rows = target.numel();
  auto x = logits.contiguous();
  auto t = target.contiguous();
  auto sizes = target.sizes().vec();
  sizes.push_back(kNumRowStats);
  auto stats = at::empty(sizes, logits.options().dtype(cross_entropy_acc_type(logits.scalar_type())));
  if (rows == 0) return stats;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "vocab_parallel_cross_entropy_row_stats_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        row_stats_kernel<scalar_t, acc_t><<<rows, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
            x.const_data_ptr<scalar_t>(), t.const_data_ptr<int64_t>(), vocab, vocab_start,
            ignore_index.has_value(), ignore_index.value_or(0), stats.mutable_data_ptr<acc_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return stats;
}

at::Tensor backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                         const at::Tensor& row_max, const at::Tensor& log_sum_exp, double label_smoothing,
                         std::optional<int64_t> ignore_index, int64_t vocab_start, int64_t vocab_size) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto in = prepare_cross_entropy_backward(grad_loss, logits, target, row_max, log_sum_exp,
                                                 label_smoothing, vocab_size);
  const int64_t vocab = in.vocab;
  const int64_t rows = in.rows;
  const auto& x = in.logits;
  const auto& t = in.target;
  const auto& g = in.grad_loss;
  const auto& m = in.row_max;
  const auto& l = in.log_sum_exp;
  auto grad = at::empty(x.sizes(), x.options());
  if (rows == 0) return grad;
  const double other = in.other_weight;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "vocab_parallel_cross_entropy_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        grad_kernel<scalar_t, acc_t><<<rows, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
            g.const_data_ptr<acc_t>(), x.const_data_ptr<scalar_t>(), t.const_data_ptr<int64_t>(),
            m.const_data_ptr<acc_t>(), l.const_data_ptr<acc_t>(), vocab, vocab_start,
            ignore_index.has_value(), ignore_index.value_or(0),
            static_cast<acc_t>(1.0 - label_smoothing), static_cast<acc_t>(other),
            grad.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CUDA, m) {
  m.impl("vocab_parallel_cross_entropy_row_stats", &row_stats_cuda);
  m.impl("vocab_parallel_cross_entropy_backward", &backward_cuda);
}

}  // namespace megatron_ext
