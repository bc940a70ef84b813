#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/vocab_mask.h"
#include "kernels/vocab_mask_checks.h"

namespace megatron_ext {
namespace {

__global__ void vocab_mask_kernel(const int64_t* ids, int64_t n, int64_t first, int64_t last,
                                  int64_t* local, bool* outside) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    kernels::vocab_mask_one(ids[i], first, last, local + i, outside + i);
  }
}

std::tuple<at::Tensor, at::Tensor> vocab_range_mask_cuda(const at::Tensor& ids, int64_t first,
                                                         int64_t last) {
  check_vocab_range_mask_args(ids, first, last);
  const c10::cuda::CUDAGuard guard(ids.device());
  auto input = ids.contiguous().to(at::kLong);
  auto local = at::empty_like(input);
  auto outside = at::empty(input.sizes(), input.options().dtype(at::kBool));
  const int64_t n = input.numel();
  if (n == 0) return {local, outside};
  constexpr int threads = 256;
  const unsigned int blocks = grid_stride_blocks(n, threads, 65535);
  vocab_mask_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      input.const_data_ptr<int64_t>(), n, first, last, local.mutable_data_ptr<int64_t>(),
      outside.mutable_data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {local, outside};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CUDA, m) { m.impl("vocab_range_mask", &vocab_range_mask_cuda); }

}  // namespace megatron_ext
