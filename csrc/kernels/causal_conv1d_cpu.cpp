// CPU implementations of the causal convolution kernel ops: argument checks, the segments of the
// rows, threading with at::parallel_for (the forward over the (batch, channel) rows, the backward
// over channels, each summing its weight and bias gradients itself), and the run-time choice of
// the instruction-set variant of the loops (kernels/cpu/causal_conv1d_kernels.cpp).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/causal_conv1d.h"
#include "kernels/causal_conv1d_checks.h"
#include "kernels/cpu/causal_conv1d_kernels.h"
#include "kernels/cpu/fusion_dtype.h"
#include "kernels/cpu_capability.h"

namespace megatron_ext {
namespace {

using kernels::ConvSegment;
using kernels::FusionDtype;

// About this many elements per task.
constexpr int64_t kGrain = 16384;

const kernels::CausalConvCpuKernels& cpu_kernels() {
  switch (kernels::cpu_capability()) {
#ifdef MEGATRON_EXT_CPU_AVX512
    case kernels::CpuCapability::kAvx512:
      return kernels::AVX512::causal_conv_cpu_kernels;
#endif
#ifdef MEGATRON_EXT_CPU_AVX2
    case kernels::CpuCapability::kAvx2:
      return kernels::AVX2::causal_conv_cpu_kernels;
#endif
    default:
      return kernels::DEFAULT::causal_conv_cpu_kernels;
  }
}

// The inputs of both kernels: contiguous, the weight and the bias in the accumulation dtype, and
// the rows' segments (one without packed sequences).
struct ConvInputs {
  at::Tensor x, w, b, init;
  std::vector<ConvSegment> segments;
  kernels::ConvRows rows;
};

ConvInputs conv_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& cu_seqlens,
                       const std::optional<at::Tensor>& initial_states,
                       c10::string_view activation) {
  check_causal_conv1d_args(op, x, weight, bias, cu_seqlens, initial_states, activation);
  ConvInputs in;
  in.x = x.contiguous();
  in.w = to_acc(weight);
  in.b = has_tensor(bias) ? to_acc(*bias) : at::Tensor();
  in.init = has_tensor(initial_states) ? initial_states->contiguous() : at::Tensor();
  const bool packed = has_tensor(cu_seqlens);
  if (packed) {
    const auto offsets = conv_offsets(op, *cu_seqlens, x.size(2));
    for (size_t s = 0; s + 1 < offsets.size(); ++s) {
      in.segments.push_back({offsets[s], offsets[s + 1], static_cast<int64_t>(s)});
    }
  } else {
    in.segments.push_back({0, x.size(2), 0});
  }
  in.rows = {in.x.const_data_ptr(),
             in.init.defined() ? in.init.const_data_ptr() : nullptr,
             in.w.const_data_ptr(),
             in.b.defined() ? in.b.const_data_ptr() : nullptr,
             in.segments.data(),
             static_cast<int64_t>(in.segments.size()),
             packed,
             x.size(0),
             x.size(1),
             x.size(2),
             weight.size(1),
             conv_activation_of(op, activation)};
  return in;
}

at::Tensor causal_conv1d_forward_cpu(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     const std::optional<at::Tensor>& cu_seqlens,
                                     const std::optional<at::Tensor>& initial_states,
                                     c10::string_view activation) {
  const auto in =
      conv_inputs("causal_conv1d_forward", x, weight, bias, cu_seqlens, initial_states, activation);
  auto y = at::empty(in.x.sizes(), in.x.options());
  if (y.numel() == 0) return y;
  const auto& k = cpu_kernels();
  const auto dtype = fusion_dtype(in.x.scalar_type());
  const int64_t rows = in.rows.batch * in.rows.channels;
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / in.rows.length),
                   [&](int64_t begin, int64_t end) {
                     k.forward(dtype, in.rows, begin, end, y.mutable_data_ptr());
                   });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_conv1d_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& initial_states, c10::string_view activation) {
  const auto in = conv_inputs("causal_conv1d_backward", x, weight, bias, cu_seqlens, initial_states,
                              activation);
  check_causal_conv1d_backward_args(grad_output, x);
  const auto g = grad_output.contiguous();
  auto grad_x = at::empty(in.x.sizes(), in.x.options());
  auto grad_init = in.init.defined() ? at::empty(in.init.sizes(), in.init.options())
                                     : at::empty({0}, in.x.options());
  auto grad_w = at::empty(in.w.sizes(), in.w.options());
  auto grad_b = at::empty({in.rows.channels}, in.w.options());
  const auto& k = cpu_kernels();
  const auto dtype = fusion_dtype(in.x.scalar_type());
  const int64_t steps = std::max<int64_t>(1, in.rows.batch * in.rows.length);
  at::parallel_for(
      0, in.rows.channels, std::max<int64_t>(1, kGrain / steps), [&](int64_t begin, int64_t end) {
        k.backward(dtype, in.rows, g.const_data_ptr(), begin, end, grad_x.mutable_data_ptr(),
                   in.init.defined() ? grad_init.mutable_data_ptr() : nullptr,
                   grad_w.mutable_data_ptr(), grad_b.mutable_data_ptr());
      });
  return {grad_x, grad_w.to(weight.scalar_type()), grad_b.to(x.scalar_type()), grad_init};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CPU, m) {
  m.impl("causal_conv1d_forward", &causal_conv1d_forward_cpu);
  m.impl("causal_conv1d_backward", &causal_conv1d_backward_cpu);
}

}  // namespace megatron_ext
