// CUDA kernels of the token permutation for the experts: blocks stride over the permuted rows,
// a block's threads over a row's columns. The row arithmetic is kernels/moe_permute.h's, the one
// the CPU kernels run. Rows are added into their tokens with atomic adds in the accumulation
// dtype (float for 16-bit types), so the order of a token's k terms may vary from run to run, as
// with ATen's scatter_add on CUDA. An index outside the tokens stops the kernel with a device
// assertion.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <optional>

#include "kernels/moe_permute.h"
#include "kernels/moe_permute_checks.h"
#include "kernels/cuda_launch.cuh"

namespace megatron_ext {
namespace {

using namespace kernels;

template <typename scalar_t, typename acc_t>
__global__ void gather_rows_kernel(const scalar_t* src, const int64_t* index, const scalar_t* scale,
                                   int64_t m, int64_t n, int64_t cols, scalar_t* out) {
  for (int64_t i = blockIdx.x; i < m; i += gridDim.x) {
    const int64_t token = index[i];
    CUDA_KERNEL_ASSERT(token >= 0 && token < n);
    const acc_t factor = scale != nullptr ? static_cast<acc_t>(scale[i]) : acc_t(1);
    kernels::moe_gather_row<scalar_t, acc_t>(src + token * cols, out + i * cols, factor,
                                             static_cast<int64_t>(threadIdx.x), cols,
                                             static_cast<int64_t>(blockDim.x));
  }
}

template <typename scalar_t, typename acc_t>
__global__ void scatter_add_rows_kernel(const scalar_t* src, const int64_t* index,
                                        const scalar_t* scale, int64_t m, int64_t n, int64_t cols,
                                        acc_t* acc) {
  for (int64_t i = blockIdx.x; i < m; i += gridDim.x) {
    const int64_t token = index[i];
    CUDA_KERNEL_ASSERT(token >= 0 && token < n);
    const acc_t factor = scale != nullptr ? static_cast<acc_t>(scale[i]) : acc_t(1);
    for (int64_t h = threadIdx.x; h < cols; h += blockDim.x) {
      gpuAtomicAdd(acc + token * cols + h,
                   kernels::moe_scatter_term<scalar_t, acc_t>(src + i * cols, factor, h));
    }
  }
}

template <typename scalar_t, typename acc_t>
__global__ void gathered_row_dot_kernel(const scalar_t* grad, const int64_t* index,
                                        const scalar_t* rows, int64_t m, int64_t n, int64_t cols,
                                        scalar_t* out) {
  using BlockReduce = cub::BlockReduce<acc_t, kThreads>;
  __shared__ typename BlockReduce::TempStorage temp;
  for (int64_t i = blockIdx.x; i < m; i += gridDim.x) {
    const int64_t token = index[i];
    CUDA_KERNEL_ASSERT(token >= 0 && token < n);
    const acc_t part = kernels::moe_row_dot<scalar_t, acc_t>(
        grad + token * cols, rows + i * cols, static_cast<int64_t>(threadIdx.x), cols,
        static_cast<int64_t>(blockDim.x));
    const acc_t total = BlockReduce(temp).Sum(part);
    if (threadIdx.x == 0) out[i] = static_cast<scalar_t>(total);
    __syncthreads();  // temp is reused by the next row
  }
}

std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->contiguous();
}

at::Tensor gather_rows_cuda(const at::Tensor& input, const at::Tensor& index,
                            const std::optional<at::Tensor>& scale) {
  constexpr const char* kName = "moe_gather_rows";
  check_moe_rows(kName, input, index, scale, index.numel());
  const c10::cuda::CUDAGuard guard(input.device());
  const auto src = input.contiguous();
  const auto idx = index.contiguous();
  const auto s = contiguous(scale);
  const int64_t cols = src.size(1);
  const int64_t m = idx.numel();
  auto out = at::empty({m, cols}, src.options());
  if (m == 0 || cols == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), kName, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    gather_rows_kernel<scalar_t, acc_t>
        <<<row_blocks(m), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
            src.const_data_ptr<scalar_t>(), idx.const_data_ptr<int64_t>(),
            s.has_value() ? s->const_data_ptr<scalar_t>() : nullptr, m, src.size(0), cols,
            out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor scatter_add_rows_cuda(const at::Tensor& input, const at::Tensor& index,
                                 const std::optional<at::Tensor>& scale, int64_t num_rows) {
  constexpr const char* kName = "moe_scatter_add_rows";
  check_moe_rows(kName, input, index, scale, input.size(0));
  check_moe_num_rows(kName, num_rows);
  const c10::cuda::CUDAGuard guard(input.device());
  const auto src = input.contiguous();
  const auto idx = index.contiguous();
  const auto s = contiguous(scale);
  const int64_t cols = src.size(1);
  const int64_t m = idx.numel();
  auto acc = at::zeros({num_rows, cols}, src.options().dtype(at::toOpMathType(src.scalar_type())));
  if (m > 0 && cols > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), kName, [&] {
      using acc_t = at::opmath_type<scalar_t>;
      scatter_add_rows_kernel<scalar_t, acc_t>
          <<<row_blocks(m), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
              src.const_data_ptr<scalar_t>(), idx.const_data_ptr<int64_t>(),
              s.has_value() ? s->const_data_ptr<scalar_t>() : nullptr, m, num_rows, cols,
              acc.mutable_data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return acc.to(src.scalar_type());
}

at::Tensor gathered_row_dot_cuda(const at::Tensor& grad, const at::Tensor& index,
                                 const at::Tensor& input) {
  constexpr const char* kName = "moe_gathered_row_dot";
  check_moe_rows(kName, input, index, std::nullopt, input.size(0));
  check_moe_rows(kName, grad, index, std::nullopt, index.numel());
  TORCH_CHECK_VALUE(grad.size(1) == input.size(1) && grad.scalar_type() == input.scalar_type(),
                    kName, ": the gradient (", grad.scalar_type(), ", shape ", grad.sizes(),
                    ") and the rows (", input.scalar_type(), ", shape ", input.sizes(),
                    ") must agree in dtype and hidden size");
  const c10::cuda::CUDAGuard guard(input.device());
  const auto g = grad.contiguous();
  const auto src = input.contiguous();
  const auto idx = index.contiguous();
  const int64_t cols = src.size(1);
  const int64_t m = idx.numel();
  auto out = at::zeros({m}, src.options());
  if (m == 0 || cols == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), kName, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    gathered_row_dot_kernel<scalar_t, acc_t>
        <<<row_blocks(m), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
            g.const_data_ptr<scalar_t>(), idx.const_data_ptr<int64_t>(),
            src.const_data_ptr<scalar_t>(), m, g.size(0), cols, out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CUDA, m) {
  m.impl("moe_gather_rows", &gather_rows_cuda);
  m.impl("moe_scatter_add_rows", &scatter_add_rows_cuda);
  m.impl("moe_gathered_row_dot", &gathered_row_dot_cuda);
}

}  // namespace megatron_ext
