// CUDA kernels of the fused epilogues: one grid-stride pass over the elements, the arithmetic of
// kernels/fused_epilogue.h (the CPU twins run the same). The dropout kernels handle one Philox
// group (four elements) per thread step.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "kernels/fused_epilogue.h"
#include "kernels/cuda_launch.cuh"
#include "kernels/fused_epilogue_checks.h"

namespace megatron_ext {
namespace {

using namespace kernels;

// The bias column of element i (i % h) along a grid-stride loop whose index advances by `step`:
// one 64-bit division per thread instead of one per element (the division, emulated in software,
// cost more than the arithmetic it indexes).
struct Column {
  int64_t col, step, h;
  __device__ Column(int64_t first, int64_t stride, int64_t width)
      : col(first % width), step(stride % width), h(width) {}
  __device__ __forceinline__ void advance() {
    col += step;
    if (col >= h) col -= h;
  }
};

template <typename scalar_t, typename acc_t>
__global__ void bias_gelu_forward_kernel(const scalar_t* __restrict__ x,
                                         const scalar_t* __restrict__ bias, int64_t n, int64_t h,
                                         bool tanh_form, scalar_t* __restrict__ out) {
  Column c(global_thread(), grid_threads(), h);
  for (int64_t i = global_thread(); i < n; i += grid_threads(), c.advance()) {
    const acc_t v = static_cast<acc_t>(x[i]) + static_cast<acc_t>(bias[c.col]);
    out[i] = static_cast<scalar_t>(gelu<acc_t>(v, tanh_form));
  }
}

template <typename scalar_t, typename acc_t>
__global__ void bias_gelu_backward_kernel(const scalar_t* __restrict__ grad,
                                          const scalar_t* __restrict__ x,
                                          const scalar_t* __restrict__ bias, int64_t n, int64_t h,
                                          bool tanh_form, scalar_t* __restrict__ out) {
  Column c(global_thread(), grid_threads(), h);
  for (int64_t i = global_thread(); i < n; i += grid_threads(), c.advance()) {
    const acc_t v = static_cast<acc_t>(x[i]) + static_cast<acc_t>(bias[c.col]);
    out[i] = static_cast<scalar_t>(static_cast<acc_t>(grad[i]) * gelu_grad<acc_t>(v, tanh_form));
  }
}

// The same arithmetic over 16-byte packs, for rows whose width is a multiple of a pack and
// 16-byte aligned tensors (n and h counted in packs).
template <typename scalar_t, typename acc_t>
__global__ void bias_gelu_forward_pack_kernel(const Pack<scalar_t>* __restrict__ x,
                                              const Pack<scalar_t>* __restrict__ bias, int64_t n,
                                              int64_t h, bool tanh_form,
                                              Pack<scalar_t>* __restrict__ out) {
  Column c(global_thread(), grid_threads(), h);
  for (int64_t i = global_thread(); i < n; i += grid_threads(), c.advance()) {
    const Pack<scalar_t> xs = x[i];
    const Pack<scalar_t> bs = bias[c.col];
    Pack<scalar_t> o;
#pragma unroll
    for (int k = 0; k < Pack<scalar_t>::kSize; ++k) {
      const acc_t v = static_cast<acc_t>(xs.v[k]) + static_cast<acc_t>(bs.v[k]);
      o.v[k] = static_cast<scalar_t>(gelu<acc_t>(v, tanh_form));
    }
    out[i] = o;
  }
}

template <typename scalar_t, typename acc_t>
__global__ void bias_gelu_backward_pack_kernel(const Pack<scalar_t>* __restrict__ grad,
                                               const Pack<scalar_t>* __restrict__ x,
                                               const Pack<scalar_t>* __restrict__ bias, int64_t n,
                                               int64_t h, bool tanh_form,
                                               Pack<scalar_t>* __restrict__ out) {
  Column c(global_thread(), grid_threads(), h);
  for (int64_t i = global_thread(); i < n; i += grid_threads(), c.advance()) {
    const Pack<scalar_t> gs = grad[i];
    const Pack<scalar_t> xs = x[i];
    const Pack<scalar_t> bs = bias[c.col];
    Pack<scalar_t> o;
#pragma unroll
    for (int k = 0; k < Pack<scalar_t>::kSize; ++k) {
      const acc_t v = static_cast<acc_t>(xs.v[k]) + static_cast<acc_t>(bs.v[k]);
      o.v[k] = static_cast<scalar_t>(static_cast<acc_t>(gs.v[k]) * gelu_grad<acc_t>(v, tanh_form));
    }
    out[i] = o;
  }
}

template <typename scalar_t, typename acc_t>
__global__ void bias_dropout_add_kernel(const scalar_t* __restrict__ x,
                                        const scalar_t* __restrict__ bias,
                                        const scalar_t* __restrict__ residual, int64_t n, int64_t h,
                                        float keep_prob, acc_t scale, uint64_t seed,
                                        uint64_t offset, scalar_t* __restrict__ out) {
  const int64_t groups = (n + kDropoutGroup - 1) / kDropoutGroup;
  Column c(global_thread() * kDropoutGroup, grid_threads() * kDropoutGroup, h);
  for (int64_t group = global_thread(); group < groups; group += grid_threads(), c.advance()) {
    const Philox4 bits = philox4x32_10(seed, offset + static_cast<uint64_t>(group));
    int64_t col = c.col;
#pragma unroll
    for (int64_t lane = 0; lane < kDropoutGroup; ++lane, col = col + 1 == h ? 0 : col + 1) {
      const int64_t i = group * kDropoutGroup + lane;
      if (i < n) {
        const acc_t b = bias ? static_cast<acc_t>(bias[col]) : acc_t(0);
        out[i] = static_cast<scalar_t>(
            bias_dropout_add<acc_t>(static_cast<acc_t>(x[i]), b, static_cast<acc_t>(residual[i]),
                                    dropout_keep(bits, lane, keep_prob), scale));
      }
    }
  }
}

template <typename scalar_t, typename acc_t>
__global__ void dropout_backward_kernel(const scalar_t* __restrict__ grad, int64_t n,
                                        float keep_prob, acc_t scale, uint64_t seed,
                                        uint64_t offset, scalar_t* __restrict__ out) {
  const int64_t groups = (n + kDropoutGroup - 1) / kDropoutGroup;
  for (int64_t group = global_thread(); group < groups; group += grid_threads()) {
    const Philox4 bits = philox4x32_10(seed, offset + static_cast<uint64_t>(group));
#pragma unroll
    for (int64_t lane = 0; lane < kDropoutGroup; ++lane) {
      const int64_t i = group * kDropoutGroup + lane;
      if (i < n) {
        out[i] = static_cast<scalar_t>(dropout_grad<acc_t>(
            static_cast<acc_t>(grad[i]), dropout_keep(bits, lane, keep_prob), scale));
      }
    }
  }
}

at::Tensor bias_gelu_forward_cuda(const at::Tensor& input, const at::Tensor& bias, bool tanh_form) {
  check_bias_gelu_args("bias_gelu_forward", input, bias);
  const c10::cuda::CUDAGuard guard(input.device());
  const auto x = input.contiguous();
  const auto b = bias.contiguous();
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_forward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const scalar_t* bp = b.const_data_ptr<scalar_t>();
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        const int64_t h = x.size(-1);
        const auto stream = at::cuda::getCurrentCUDAStream();
        if (packs_fit<scalar_t>(h, {xp, bp, op})) {
          constexpr int64_t k = Pack<scalar_t>::kSize;
          bias_gelu_forward_pack_kernel<scalar_t, acc_t>
              <<<blocks_for(n / k), kThreads, 0, stream>>>(as_packs(xp), as_packs(bp), n / k, h / k,
                                                           tanh_form, as_packs(op));
        } else {
          bias_gelu_forward_kernel<scalar_t, acc_t>
              <<<blocks_for(n), kThreads, 0, stream>>>(xp, bp, n, h, tanh_form, op);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

at::Tensor bias_gelu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                   const at::Tensor& bias, bool tanh_form) {
  check_bias_gelu_args("bias_gelu_backward", input, bias);
  check_same_tensor_layout("bias_gelu_backward", "grad_output", grad_output, input);
  const c10::cuda::CUDAGuard guard(input.device());
  const auto g = grad_output.contiguous();
  const auto x = input.contiguous();
  const auto b = bias.contiguous();
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* gp = g.const_data_ptr<scalar_t>();
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const scalar_t* bp = b.const_data_ptr<scalar_t>();
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        const int64_t h = x.size(-1);
        const auto stream = at::cuda::getCurrentCUDAStream();
        if (packs_fit<scalar_t>(h, {gp, xp, bp, op})) {
          constexpr int64_t k = Pack<scalar_t>::kSize;
          bias_gelu_backward_pack_kernel<scalar_t, acc_t>
              <<<blocks_for(n / k), kThreads, 0, stream>>>(as_packs(gp), as_packs(xp), as_packs(bp),
                                                           n / k, h / k, tanh_form, as_packs(op));
        } else {
          bias_gelu_backward_kernel<scalar_t, acc_t>
              <<<blocks_for(n), kThreads, 0, stream>>>(gp, xp, bp, n, h, tanh_form, op);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

at::Tensor bias_dropout_add_forward_cuda(const at::Tensor& input,
                                         const std::optional<at::Tensor>& bias,
                                         const at::Tensor& residual, double prob, int64_t seed,
                                         int64_t offset) {
  check_bias_dropout_add_args("bias_dropout_add_forward", input, bias, residual, prob);
  const c10::cuda::CUDAGuard guard(input.device());
  const bool has_bias = bias.has_value() && bias->defined();
  const auto x = input.contiguous();
  const auto r = residual.contiguous();
  const auto b = has_bias ? bias->contiguous() : at::Tensor();
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;
  const float keep_prob = static_cast<float>(1.0 - prob);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "bias_dropout_add_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        bias_dropout_add_kernel<scalar_t, acc_t>
            <<<blocks_for(dropout_groups(n)), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
                x.const_data_ptr<scalar_t>(), has_bias ? b.const_data_ptr<scalar_t>() : nullptr,
                r.const_data_ptr<scalar_t>(), n, x.size(-1), keep_prob, dropout_scale<acc_t>(prob),
                static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                out.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

at::Tensor dropout_backward_cuda(const at::Tensor& grad_output, double prob, int64_t seed,
                                 int64_t offset) {
  TORCH_CHECK_VALUE(at::isFloatingType(grad_output.scalar_type()),
                    "dropout_backward: grad_output must be a floating tensor, got ",
                    grad_output.scalar_type());
  check_dropout_prob("dropout_backward", prob);
  const c10::cuda::CUDAGuard guard(grad_output.device());
  const auto g = grad_output.contiguous();
  auto out = at::empty_like(g);
  const int64_t n = g.numel();
  if (n == 0) return out;
  const float keep_prob = static_cast<float>(1.0 - prob);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, g.scalar_type(), "dropout_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        dropout_backward_kernel<scalar_t, acc_t>
            <<<blocks_for(dropout_groups(n)), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
                g.const_data_ptr<scalar_t>(), n, keep_prob, dropout_scale<acc_t>(prob),
                static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                out.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CUDA, m) {
  m.impl("bias_gelu_forward", &bias_gelu_forward_cuda);
  m.impl("bias_gelu_backward", &bias_gelu_backward_cuda);
  m.impl("bias_dropout_add_forward", &bias_dropout_add_forward_cuda);
  m.impl("dropout_backward", &dropout_backward_cuda);
}

}  // namespace megatron_ext
