// CUDA kernels of the vocabulary-parallel cross-entropy: one block per row. Rows are read in
// 16-byte vectors from the first 16-byte boundary on (a scalar head and tail handle the rest), so
// each thread issues one 128-bit load per step whatever the dtype. The statistics kernel keeps a
// RowState per thread and merges them with one CUB block reduction; the gradient kernel
// recomputes the softmax from the saved row max and log-sum-exp. The arithmetic is the shared
// header's, the one the CPU kernels run.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <optional>

#include "kernels/cross_entropy.h"
#include "kernels/cross_entropy_checks.h"
#include "kernels/cuda_launch.cuh"

namespace megatron_ext {
namespace {

using namespace kernels;

// Elements before the first 16-byte boundary of ``p`` (at most n).
template <typename scalar_t>
__device__ __forceinline__ int64_t head_length(const scalar_t* p, int64_t n) {
  constexpr int64_t kSize = Pack<scalar_t>::kSize;
  const int64_t misaligned =
      static_cast<int64_t>((reinterpret_cast<uintptr_t>(p) % 16) / sizeof(scalar_t));
  const int64_t head = misaligned == 0 ? 0 : kSize - misaligned;
  return head < n ? head : n;
}

// Calls f(j, x_j) for every element of a row, this thread's share, reading 16-byte packs.
template <typename scalar_t, typename F>
__device__ __forceinline__ void for_each_in_row(const scalar_t* row, int64_t n, F&& f) {
  constexpr int64_t kSize = Pack<scalar_t>::kSize;
  const int64_t head = head_length(row, n);
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) f(j, row[j]);
  const int64_t packs = (n - head) / kSize;
  const auto* body = reinterpret_cast<const Pack<scalar_t>*>(row + head);
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<scalar_t> pack = body[p];
#pragma unroll
    for (int k = 0; k < kSize; ++k) f(head + p * kSize + k, pack.v[k]);
  }
  for (int64_t j = head + packs * kSize + threadIdx.x; j < n; j += blockDim.x) f(j, row[j]);
}

template <typename acc_t>
struct MergeRowStates {
  __device__ __forceinline__ RowState<acc_t> operator()(const RowState<acc_t>& a,
                                                        const RowState<acc_t>& b) const {
    return row_state_merge(a, b);
  }
};

template <typename scalar_t, typename acc_t>
__global__ void row_stats_kernel(const scalar_t* __restrict__ logits,
                                 const int64_t* __restrict__ target, int64_t vocab,
                                 int64_t vocab_start, bool has_ignore, int64_t ignore,
                                 acc_t* __restrict__ stats) {
  using BlockReduce = cub::BlockReduce<RowState<acc_t>, kThreads>;
  __shared__ typename BlockReduce::TempStorage storage;
  const int64_t row_index = blockIdx.x;
  const scalar_t* row = logits + row_index * vocab;
  RowState<acc_t> part = row_state_init<acc_t>();
  for_each_in_row(row, vocab, [&](int64_t, scalar_t x) {
    part = row_state_merge(part, row_state_of(static_cast<acc_t>(x)));
  });
  const RowState<acc_t> total = BlockReduce(storage).Reduce(part, MergeRowStates<acc_t>());
  if (threadIdx.x == 0) {
    const int64_t local =
        local_target_index(target[row_index], vocab_start, vocab, has_ignore, ignore);
    const acc_t target_logit = local >= 0 ? static_cast<acc_t>(row[local]) : acc_t(0);
    write_row_stats(total, local >= 0, target_logit, stats + row_index * kNumRowStats);
  }
}

// ``grad`` may be ``logits`` (in place): every element is read before it is written, by the same
// thread, and the target logit is read by thread 0 before the block synchronises.
template <typename scalar_t, typename acc_t>
__global__ void grad_kernel(const acc_t* __restrict__ grad_loss, const scalar_t* logits,
                            const int64_t* __restrict__ local_target,
                            const acc_t* __restrict__ row_max,
                            const acc_t* __restrict__ log_sum_exp, int64_t vocab,
                            acc_t target_weight, acc_t other_weight, scalar_t* grad) {
  const int64_t row_index = blockIdx.x;
  const scalar_t* row = logits + row_index * vocab;
  scalar_t* out = grad + row_index * vocab;
  const int64_t local = local_target[row_index];
  CUDA_KERNEL_ASSERT(local >= kIgnoredToken && local < vocab);
  if (local == kIgnoredToken) {
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) out[j] = scalar_t(0);
    return;
  }
  const acc_t g = grad_loss[row_index];
  const acc_t m = row_max[row_index];
  const acc_t l = log_sum_exp[row_index];
  __shared__ acc_t target_logit;
  if (threadIdx.x == 0 && local >= 0) target_logit = static_cast<acc_t>(row[local]);
  __syncthreads();
  for_each_in_row(row, vocab, [&](int64_t j, scalar_t x) {
    out[j] =
        static_cast<scalar_t>(softmax_minus_smoothed_one_hot<acc_t>(
                                  static_cast<acc_t>(x), m, l, false, target_weight, other_weight) *
                              g);
  });
  __syncthreads();
  if (threadIdx.x == 0 && local >= 0) {
    out[local] = static_cast<scalar_t>(softmax_minus_smoothed_one_hot<acc_t>(
                                           target_logit, m, l, true, target_weight, other_weight) *
                                       g);
  }
}

// One block per row: the int64 row count must fit the grid's x dimension.
unsigned int row_grid(int64_t rows, const char* op) {
  const int64_t limit = at::cuda::getCurrentDeviceProperties()->maxGridSize[0];
  TORCH_CHECK(rows <= limit, op, ": ", rows, " rows exceed the CUDA grid limit of ", limit,
              " blocks; split the tokens into chunks");
  return static_cast<unsigned int>(rows);
}

at::Tensor row_stats_cuda(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                          std::optional<int64_t> ignore_index) {
  constexpr const char* kName = "vocab_parallel_cross_entropy_row_stats";
  check_cross_entropy_kernel_args(logits, target, kName);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t vocab = logits.size(-1);
  const int64_t rows = target.numel();
  auto x = logits.contiguous();
  auto t = target.contiguous();
  auto sizes = target.sizes().vec();
  sizes.push_back(kNumRowStats);
  auto stats =
      at::empty(sizes, logits.options().dtype(cross_entropy_acc_type(logits.scalar_type())));
  if (rows == 0) return stats;
  const unsigned int grid = row_grid(rows, kName);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), kName, [&] {
    using acc_t = acc_type<scalar_t>;
    row_stats_kernel<scalar_t, acc_t><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(), t.const_data_ptr<int64_t>(), vocab, vocab_start,
        ignore_index.has_value(), ignore_index.value_or(0), stats.mutable_data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return stats;
}

void launch_backward(const CrossEntropyBackwardInputs& in, const at::Tensor& grad,
                     double label_smoothing) {
  if (in.rows == 0) return;
  const unsigned int grid = row_grid(in.rows, "vocab_parallel_cross_entropy_backward");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, in.logits.scalar_type(), "vocab_parallel_cross_entropy_backward",
      [&] {
        using acc_t = acc_type<scalar_t>;
        grad_kernel<scalar_t, acc_t><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
            in.grad_loss.const_data_ptr<acc_t>(), in.logits.const_data_ptr<scalar_t>(),
            in.local_target.const_data_ptr<int64_t>(), in.row_max.const_data_ptr<acc_t>(),
            in.log_sum_exp.const_data_ptr<acc_t>(), in.vocab,
            static_cast<acc_t>(1.0 - label_smoothing), static_cast<acc_t>(in.other_weight),
            grad.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

at::Tensor backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logits,
                         const at::Tensor& local_target, const at::Tensor& row_max,
                         const at::Tensor& log_sum_exp, double label_smoothing,
                         int64_t vocab_size) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto in = prepare_cross_entropy_backward(grad_loss, logits, local_target, row_max,
                                                 log_sum_exp, label_smoothing, vocab_size);
  auto grad = at::empty(in.logits.sizes(), in.logits.options());
  launch_backward(in, grad, label_smoothing);
  return grad;
}

void backward_inplace_cuda(const at::Tensor& grad_loss, const at::Tensor& logits,
                           const at::Tensor& local_target, const at::Tensor& row_max,
                           const at::Tensor& log_sum_exp, double label_smoothing,
                           int64_t vocab_size) {
  check_cross_entropy_inplace(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto in = prepare_cross_entropy_backward(grad_loss, logits, local_target, row_max,
                                                 log_sum_exp, label_smoothing, vocab_size);
  launch_backward(in, logits, label_smoothing);
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CUDA, m) {
  m.impl("vocab_parallel_cross_entropy_row_stats", &row_stats_cuda);
  m.impl("vocab_parallel_cross_entropy_backward", &backward_cuda);
  m.impl("vocab_parallel_cross_entropy_backward_", &backward_inplace_cuda);
}

}  // namespace megatron_ext
