// CUDA kernels of the causal convolution, the arithmetic of kernels/causal_conv1d.h (the CPU twins
// run the same). The forward and the input gradients are grid-stride loops over the elements, a
// thread per output (the gradient of an input recomputes the W pre-activations it feeds); the
// weight and bias gradients take a block per channel, each thread summing its share of the
// (batch, time) steps, then a CUB block reduction per tap.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <optional>
#include <tuple>

#include "kernels/causal_conv1d.h"
#include "kernels/causal_conv1d_checks.h"
#include "kernels/cuda_launch.cuh"

namespace megatron_ext {
namespace {

using namespace kernels;

// Sizes and pointers every kernel takes; ``cu`` (int64 offsets) is null without packed sequences.
template <typename scalar_t, typename acc_t>
struct ConvArgs {
  const scalar_t* x;
  const scalar_t* init;
  const acc_t* w;
  const acc_t* bias;
  const int64_t* cu;
  int64_t segments;
  int64_t channels;
  int64_t length;
  int64_t width;
  ConvActivation act;
};

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ const scalar_t* init_row(const ConvArgs<scalar_t, acc_t>& a,
                                                    int64_t state, int64_t d) {
  return a.init == nullptr ? nullptr : a.init + (state * a.channels + d) * (a.width - 1);
}

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t bias_of(const ConvArgs<scalar_t, acc_t>& a, int64_t d) {
  return a.bias == nullptr ? acc_t(0) : a.bias[d];
}

template <typename scalar_t, typename acc_t>
__global__ void causal_conv1d_forward_kernel(ConvArgs<scalar_t, acc_t> a, int64_t n,
                                             scalar_t* __restrict__ y) {
  for (int64_t e = global_thread(); e < n; e += grid_threads()) {
    const int64_t row = e / a.length, t = e % a.length;
    const int64_t b = row / a.channels, d = row % a.channels;
    const ConvSegment seg = conv_segment(a.cu, a.segments, a.length, b, t);
    const acc_t z = conv_pre_activation<scalar_t, acc_t>(
        a.x + row * a.length, init_row(a, seg.state, d), a.w + d * a.width, bias_of(a, d),
        seg.start, t, a.width);
    y[e] = static_cast<scalar_t>(conv_activation(z, a.act));
  }
}

template <typename scalar_t, typename acc_t>
__global__ void causal_conv1d_grad_input_kernel(ConvArgs<scalar_t, acc_t> a,
                                                const scalar_t* __restrict__ g, int64_t n,
                                                scalar_t* __restrict__ grad_x) {
  for (int64_t e = global_thread(); e < n; e += grid_threads()) {
    const int64_t row = e / a.length, t = e % a.length;
    const int64_t b = row / a.channels, d = row % a.channels;
    const ConvSegment seg = conv_segment(a.cu, a.segments, a.length, b, t);
    grad_x[e] = static_cast<scalar_t>(conv_input_grad<scalar_t, acc_t>(
        g + row * a.length, a.x + row * a.length, init_row(a, seg.state, d), a.w + d * a.width,
        bias_of(a, d), seg.start, seg.end, t, a.width, a.act));
  }
}

// Element (state, d, j) of initial_states: the input at time start - (W - 1) + j of the segment
// (the batch row ``state``, or the packed sequence ``state`` of row 0).
template <typename scalar_t, typename acc_t>
__global__ void causal_conv1d_grad_state_kernel(ConvArgs<scalar_t, acc_t> a,
                                                const scalar_t* __restrict__ g, int64_t n,
                                                scalar_t* __restrict__ grad_init) {
  const int64_t history = a.width - 1;
  for (int64_t e = global_thread(); e < n; e += grid_threads()) {
    const int64_t j = e % history, d = (e / history) % a.channels,
                  state = e / (history * a.channels);
    const int64_t b = a.cu == nullptr ? state : 0;
    const int64_t start = a.cu == nullptr ? 0 : a.cu[state];
    const int64_t end = a.cu == nullptr ? a.length : a.cu[state + 1];
    const int64_t row = b * a.channels + d;
    grad_init[e] = static_cast<scalar_t>(conv_input_grad<scalar_t, acc_t>(
        g + row * a.length, a.x + row * a.length, init_row(a, state, d), a.w + d * a.width,
        bias_of(a, d), start, end, start - history + j, a.width, a.act));
  }
}

// Block per channel d: grad_w[d, k] = sum_{b, t} dL/dz[b, d, t] x[b, d, t - (W - 1) + k] and
// grad_b[d] = sum_{b, t} dL/dz[b, d, t].
template <typename scalar_t, typename acc_t>
__global__ void causal_conv1d_grad_weight_kernel(ConvArgs<scalar_t, acc_t> a,
                                                 const scalar_t* __restrict__ g, int64_t batch,
                                                 acc_t* __restrict__ grad_w,
                                                 acc_t* __restrict__ grad_b) {
  using BlockReduce = cub::BlockReduce<acc_t, kThreads>;
  __shared__ typename BlockReduce::TempStorage storage;
  const int64_t steps = batch * a.length;
  for (int64_t d = blockIdx.x; d < a.channels; d += gridDim.x) {
    acc_t sums[kMaxConvWidth + 1] = {};
    const acc_t* w = a.w + d * a.width;
    for (int64_t i = threadIdx.x; i < steps; i += blockDim.x) {
      const int64_t b = i / a.length, t = i % a.length;
      const int64_t row = b * a.channels + d;
      const ConvSegment seg = conv_segment(a.cu, a.segments, a.length, b, t);
      const scalar_t* xr = a.x + row * a.length;
      const scalar_t* ir = init_row(a, seg.state, d);
      const acc_t gz = conv_pre_activation_grad<scalar_t, acc_t>(
          g + row * a.length, xr, ir, w, bias_of(a, d), seg.start, t, a.width, a.act);
#pragma unroll
      for (int k = 0; k < kMaxConvWidth; ++k) {
        if (k < a.width) {
          sums[k] += gz * conv_input_at<scalar_t, acc_t>(xr, ir, seg.start, t - (a.width - 1) + k,
                                                         a.width);
        }
      }
      sums[kMaxConvWidth] += gz;
    }
#pragma unroll
    for (int k = 0; k <= kMaxConvWidth; ++k) {
      if (k < a.width || k == kMaxConvWidth) {
        const acc_t total = BlockReduce(storage).Sum(sums[k]);
        if (threadIdx.x == 0) {
          if (k == kMaxConvWidth) {
            grad_b[d] = total;
          } else {
            grad_w[d * a.width + k] = total;
          }
        }
        __syncthreads();
      }
    }
  }
}

// The kernels' arguments; ``offsets`` keeps the int64 copy of cu_seqlens alive.
struct ConvTensors {
  at::Tensor x, w, b, init, offsets;
  ConvActivation act;
};

ConvTensors conv_tensors(const char* op, const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& cu_seqlens,
                         const std::optional<at::Tensor>& initial_states,
                         c10::string_view activation) {
  check_causal_conv1d_args(op, x, weight, bias, cu_seqlens, initial_states, activation);
  ConvTensors t;
  const auto acc = fusion_acc_type(x.scalar_type());
  t.x = x.contiguous();
  t.w = weight.to(acc).contiguous();
  t.b = has_tensor(bias) ? bias->to(acc).contiguous() : at::Tensor();
  t.init = has_tensor(initial_states) ? initial_states->contiguous() : at::Tensor();
  if (has_tensor(cu_seqlens)) {
    conv_offsets(op, *cu_seqlens, x.size(2));  // checked on the host, as the CPU kernel checks
    t.offsets = cu_seqlens->to(at::kLong).contiguous();
  }
  t.act = conv_activation_of(op, activation);
  return t;
}

template <typename scalar_t, typename acc_t>
ConvArgs<scalar_t, acc_t> conv_args(const ConvTensors& t) {
  return {t.x.const_data_ptr<scalar_t>(),
          t.init.defined() ? t.init.const_data_ptr<scalar_t>() : nullptr,
          t.w.const_data_ptr<acc_t>(),
          t.b.defined() ? t.b.const_data_ptr<acc_t>() : nullptr,
          t.offsets.defined() ? t.offsets.const_data_ptr<int64_t>() : nullptr,
          t.offsets.defined() ? t.offsets.numel() - 1 : 1,
          t.x.size(1),
          t.x.size(2),
          t.w.size(1),
          t.act};
}

at::Tensor causal_conv1d_forward_cuda(const at::Tensor& x, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias,
                                      const std::optional<at::Tensor>& cu_seqlens,
                                      const std::optional<at::Tensor>& initial_states,
                                      c10::string_view activation) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto t = conv_tensors("causal_conv1d_forward", x, weight, bias, cu_seqlens, initial_states,
                              activation);
  auto y = at::empty(t.x.sizes(), t.x.options());
  const int64_t n = y.numel();
  if (n == 0) return y;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, t.x.scalar_type(), "causal_conv1d_forward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        causal_conv1d_forward_kernel<scalar_t, acc_t><<<blocks_for(n), kThreads, 0, stream>>>(
            conv_args<scalar_t, acc_t>(t), n, y.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_conv1d_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& initial_states, c10::string_view activation) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto t = conv_tensors("causal_conv1d_backward", x, weight, bias, cu_seqlens, initial_states,
                              activation);
  check_causal_conv1d_backward_args(grad_output, x);
  const auto g = grad_output.contiguous();
  auto grad_x = at::empty(t.x.sizes(), t.x.options());
  auto grad_init = t.init.defined() ? at::empty(t.init.sizes(), t.init.options())
                                    : at::empty({0}, t.x.options());
  auto grad_w = at::empty(t.w.sizes(), t.w.options());
  auto grad_b = at::empty({t.x.size(1)}, t.w.options());
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, t.x.scalar_type(), "causal_conv1d_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const auto args = conv_args<scalar_t, acc_t>(t);
        const scalar_t* gp = g.const_data_ptr<scalar_t>();
        const int64_t n = grad_x.numel();
        if (n > 0) {
          causal_conv1d_grad_input_kernel<scalar_t, acc_t><<<blocks_for(n), kThreads, 0, stream>>>(
              args, gp, n, grad_x.mutable_data_ptr<scalar_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        const int64_t states = grad_init.numel();
        if (states > 0) {
          causal_conv1d_grad_state_kernel<scalar_t, acc_t>
              <<<blocks_for(states), kThreads, 0, stream>>>(args, gp, states,
                                                            grad_init.mutable_data_ptr<scalar_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        if (t.x.size(1) > 0) {
          causal_conv1d_grad_weight_kernel<scalar_t, acc_t>
              <<<row_blocks(t.x.size(1)), kThreads, 0, stream>>>(args, gp, t.x.size(0),
                                                                 grad_w.mutable_data_ptr<acc_t>(),
                                                                 grad_b.mutable_data_ptr<acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
  return {grad_x, grad_w.to(weight.scalar_type()), grad_b.to(x.scalar_type()), grad_init};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CUDA, m) {
  m.impl("causal_conv1d_forward", &causal_conv1d_forward_cuda);
  m.impl("causal_conv1d_backward", &causal_conv1d_backward_cuda);
}

}  // namespace megatron_ext
