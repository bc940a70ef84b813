// CPU kernels of the causal convolution (kernels/causal_conv1d.h holds the arithmetic): a segment
// of a row is copied into a float32 (float64) buffer behind its W - 1 inputs of history, and each
// tap is one pass over the segment, a loop the compiler vectorises. The forward threads over the
// (batch, channel) rows; the backward over channels, each summing its weight and bias gradients
// over the batch and the time steps in a fixed order (8 lanes, then over the lanes), so the result
// does not depend on the number of threads.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
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

namespace megatron_ext {
namespace {

using kernels::ConvActivation;

constexpr int64_t kLanes = 8;

// The rows' segments: [start, end) and the row of initial_states of each.
std::vector<kernels::ConvSegment> conv_segments(const char* op,
                                                const std::optional<at::Tensor>& cu_seqlens,
                                                int64_t length) {
  if (!has_tensor(cu_seqlens)) return {{0, length, 0}};
  const auto offsets = conv_offsets(op, *cu_seqlens, length);
  std::vector<kernels::ConvSegment> segments;
  for (size_t s = 0; s + 1 < offsets.size(); ++s) {
    segments.push_back({offsets[s], offsets[s + 1], static_cast<int64_t>(s)});
  }
  return segments;
}

int64_t longest(const std::vector<kernels::ConvSegment>& segments) {
  int64_t n = 0;
  for (const auto& s : segments) n = std::max(n, s.end - s.start);
  return n;
}

// The segment's inputs behind their history: xe[j] is x at time start - (W - 1) + j.
template <typename scalar_t, typename acc_t>
void fill_inputs(const scalar_t* x, const scalar_t* init, int64_t len, int64_t width, acc_t* xe) {
  for (int64_t j = 0; j < width - 1; ++j) {
    xe[j] = init == nullptr ? acc_t(0) : static_cast<acc_t>(init[j]);
  }
  for (int64_t t = 0; t < len; ++t) xe[width - 1 + t] = static_cast<acc_t>(x[t]);
}

// z[t] = bias + sum_k w[k] xe[t + k], taps in k order (kernels::conv_pre_activation's order).
template <typename acc_t>
void pre_activations(const acc_t* xe, const acc_t* w, acc_t bias, int64_t len, int64_t width,
                     acc_t* z) {
  for (int64_t t = 0; t < len; ++t) z[t] = bias;
  for (int64_t k = 0; k < width; ++k) {
    const acc_t wk = w[k];
    const acc_t* xk = xe + k;
    for (int64_t t = 0; t < len; ++t) z[t] = kernels::conv_tap(z[t], wk, xk[t]);
  }
}

// sum_t a[t] b[t] in kLanes lanes, then over the lanes in order.
template <typename acc_t>
acc_t lane_dot(const acc_t* a, const acc_t* b, int64_t n) {
  acc_t lanes[kLanes] = {};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[t + l] * b[t + l];
  }
  for (int64_t l = 0; t + l < n; ++l) lanes[l] += a[t + l] * b[t + l];
  acc_t sum = 0;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

template <typename acc_t>
acc_t lane_sum(const acc_t* a, int64_t n) {
  acc_t lanes[kLanes] = {};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[t + l];
  }
  for (int64_t l = 0; t + l < n; ++l) lanes[l] += a[t + l];
  acc_t sum = 0;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

at::Tensor to_acc(const at::Tensor& t) {
  return t.to(fusion_acc_type(t.scalar_type())).contiguous();
}

// The inputs of both kernels, contiguous, weight and bias in the accumulation dtype.
struct ConvInputs {
  at::Tensor x, w, b, init;
  int64_t batch, channels, length, width;
  ConvActivation act;
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
  in.batch = x.size(0);
  in.channels = x.size(1);
  in.length = x.size(2);
  in.width = weight.size(1);
  in.act = conv_activation_of(op, activation);
  return in;
}

at::Tensor causal_conv1d_forward_cpu(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     const std::optional<at::Tensor>& cu_seqlens,
                                     const std::optional<at::Tensor>& initial_states,
                                     c10::string_view activation) {
  const char* op = "causal_conv1d_forward";
  const auto in = conv_inputs(op, x, weight, bias, cu_seqlens, initial_states, activation);
  const auto segments = conv_segments(op, cu_seqlens, in.length);
  auto y = at::empty(in.x.sizes(), in.x.options());
  const int64_t rows = in.batch * in.channels;
  if (y.numel() == 0) return y;
  const int64_t W = in.width, D = in.channels, L = in.length;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, in.x.scalar_type(), "causal_conv1d_forward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* xp = in.x.const_data_ptr<scalar_t>();
        const scalar_t* ip = in.init.defined() ? in.init.const_data_ptr<scalar_t>() : nullptr;
        const acc_t* wp = in.w.const_data_ptr<acc_t>();
        const acc_t* bp = in.b.defined() ? in.b.const_data_ptr<acc_t>() : nullptr;
        scalar_t* yp = y.mutable_data_ptr<scalar_t>();
        const int64_t span = longest(segments);
        at::parallel_for(
            0, rows, std::max<int64_t>(1, 16384 / L), [&](int64_t first, int64_t last) {
              std::vector<acc_t> xe(span + W - 1), z(span);
              for (int64_t row = first; row < last; ++row) {
                const int64_t b = row / D, d = row % D;
                const acc_t* w = wp + d * W;
                const acc_t bias_d = bp == nullptr ? acc_t(0) : bp[d];
                for (const auto& seg : segments) {
                  const int64_t len = seg.end - seg.start;
                  const int64_t state = segments.size() == 1 ? b : seg.state;
                  const scalar_t* init = ip == nullptr ? nullptr : ip + (state * D + d) * (W - 1);
                  fill_inputs(xp + row * L + seg.start, init, len, W, xe.data());
                  pre_activations(xe.data(), w, bias_d, len, W, z.data());
                  scalar_t* out = yp + row * L + seg.start;
                  for (int64_t t = 0; t < len; ++t) {
                    out[t] = static_cast<scalar_t>(kernels::conv_activation(z[t], in.act));
                  }
                }
              }
            });
      });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_conv1d_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& initial_states, c10::string_view activation) {
  const char* op = "causal_conv1d_backward";
  const auto in = conv_inputs(op, x, weight, bias, cu_seqlens, initial_states, activation);
  check_causal_conv1d_backward_args(grad_output, x);
  const auto segments = conv_segments(op, cu_seqlens, in.length);
  const auto g = grad_output.contiguous();
  const int64_t W = in.width, D = in.channels, L = in.length, B = in.batch;
  auto grad_x = at::empty(in.x.sizes(), in.x.options());
  auto grad_init = in.init.defined() ? at::empty(in.init.sizes(), in.init.options())
                                     : at::empty({0}, in.x.options());
  auto grad_w = at::empty(in.w.sizes(), in.w.options());
  auto grad_b = at::empty({D}, in.w.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, in.x.scalar_type(), "causal_conv1d_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* xp = in.x.const_data_ptr<scalar_t>();
        const scalar_t* gp = g.const_data_ptr<scalar_t>();
        const scalar_t* ip = in.init.defined() ? in.init.const_data_ptr<scalar_t>() : nullptr;
        const acc_t* wp = in.w.const_data_ptr<acc_t>();
        const acc_t* bp = in.b.defined() ? in.b.const_data_ptr<acc_t>() : nullptr;
        scalar_t* gxp = grad_x.mutable_data_ptr<scalar_t>();
        scalar_t* gip = ip == nullptr ? nullptr : grad_init.mutable_data_ptr<scalar_t>();
        acc_t* gwp = grad_w.mutable_data_ptr<acc_t>();
        acc_t* gbp = grad_b.mutable_data_ptr<acc_t>();
        const int64_t span = longest(segments);
        at::parallel_for(
            0, D, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, B * L)),
            [&](int64_t first, int64_t last) {
              // gz holds dL/dz behind and ahead of W - 1 zeros, so that every tap reads inside it.
              std::vector<acc_t> xe(span + W - 1), z(std::max<int64_t>(span, 1)),
                  gz(span + 2 * (W - 1)), gxe(span + W - 1);
              for (int64_t d = first; d < last; ++d) {
                const acc_t* w = wp + d * W;
                const acc_t bias_d = bp == nullptr ? acc_t(0) : bp[d];
                acc_t sum_w[kernels::kMaxConvWidth] = {};
                acc_t sum_b = 0;
                for (int64_t b = 0; b < B; ++b) {
                  const int64_t row = b * D + d;
                  for (const auto& seg : segments) {
                    const int64_t len = seg.end - seg.start;
                    const int64_t state = segments.size() == 1 ? b : seg.state;
                    const int64_t init_at = (state * D + d) * (W - 1);
                    fill_inputs(xp + row * L + seg.start, ip == nullptr ? nullptr : ip + init_at,
                                len, W, xe.data());
                    pre_activations(xe.data(), w, bias_d, len, W, z.data());
                    const scalar_t* grad = gp + row * L + seg.start;
                    acc_t* gzt = gz.data() + (W - 1);
                    std::fill(gz.begin(), gz.begin() + (W - 1), acc_t(0));
                    std::fill(gzt + len, gzt + len + (W - 1), acc_t(0));
                    for (int64_t t = 0; t < len; ++t) {
                      gzt[t] =
                          kernels::conv_activation_grad(static_cast<acc_t>(grad[t]), z[t], in.act);
                    }
                    // gxe[i] = sum_k w[k] gz[i + W - 1 - k] (kernels::conv_input_grad's order).
                    const int64_t inputs = len + W - 1;
                    std::fill(gxe.begin(), gxe.begin() + inputs, acc_t(0));
                    for (int64_t k = 0; k < W; ++k) {
                      const acc_t wk = w[k];
                      const acc_t* gk = gz.data() + (W - 1 - k);
                      for (int64_t i = 0; i < inputs; ++i)
                        gxe[i] = kernels::conv_tap(gxe[i], wk, gk[i]);
                    }
                    scalar_t* gx = gxp + row * L + seg.start;
                    for (int64_t t = 0; t < len; ++t) gx[t] = static_cast<scalar_t>(gxe[W - 1 + t]);
                    if (gip != nullptr) {
                      for (int64_t j = 0; j < W - 1; ++j)
                        gip[init_at + j] = static_cast<scalar_t>(gxe[j]);
                    }
                    for (int64_t k = 0; k < W; ++k) sum_w[k] += lane_dot(gzt, xe.data() + k, len);
                    sum_b += lane_sum(gzt, len);
                  }
                }
                for (int64_t k = 0; k < W; ++k) gwp[d * W + k] = sum_w[k];
                gbp[d] = sum_b;
              }
            });
      });
  return {grad_x, grad_w.to(weight.scalar_type()), grad_b.to(x.scalar_type()), grad_init};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CPU, m) {
  m.impl("causal_conv1d_forward", &causal_conv1d_forward_cpu);
  m.impl("causal_conv1d_backward", &causal_conv1d_backward_cpu);
}

}  // namespace megatron_ext
