// CPU loops of the causal convolution. This file is compiled as is (baseline instruction set,
// namespace DEFAULT) and again by setup.py with CPU_CAPABILITY=AVX2 and AVX512 and the matching -m
// flags, as ATen compiles its kernels. A segment of a row is brought into the accumulation type
// behind its W - 1 inputs of history, each tap is one pass over it (loops the compiler vectorises;
// products are never contracted, see setup.py), and the activation runs the header's operations a
// vector at a time (at::vec::Vectorized, torch's vector exp), its remainder the header itself.
// The weight and bias gradients of a channel are summed over its batch rows and time steps in a
// fixed order (kLanes partial sums, then over them), whatever the threading.
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/causal_conv1d.h"
#include "kernels/cpu/causal_conv1d_kernels.h"
#include "kernels/cpu/vec_convert.h"

namespace megatron_ext::kernels::CPU_CAPABILITY {
namespace {

constexpr int64_t kLanes = 8;

template <typename scalar_t>
constexpr bool kIsAcc = std::is_same_v<scalar_t, acc_type<scalar_t>>;

// n values converted to the accumulation type.
template <typename scalar_t>
void load_acc(const scalar_t* src, acc_type<scalar_t>* dst, int64_t n) {
  if constexpr (kIsAcc<scalar_t>) {
    std::copy(src, src + n, dst);
  } else {
    to_float(src, dst, n);
  }
}

template <typename scalar_t>
void store_rounded(const acc_type<scalar_t>* src, scalar_t* dst, int64_t n) {
  if constexpr (kIsAcc<scalar_t>) {
    std::copy(src, src + n, dst);
  } else {
    from_float(src, dst, n);
  }
}

// The segment's inputs behind their history: xe[j] is x at time start - (W - 1) + j.
template <typename scalar_t>
void fill_inputs(const scalar_t* x, const scalar_t* init, int64_t len, int64_t width,
                 acc_type<scalar_t>* xe) {
  using acc_t = acc_type<scalar_t>;
  if (init == nullptr) {
    std::fill(xe, xe + width - 1, acc_t(0));
  } else {
    load_acc(init, xe, width - 1);
  }
  load_acc(x, xe + width - 1, len);
}

// z[t] = bias + sum_k w[k] xe[t + k], taps in k order (kernels::conv_pre_activation's order).
template <typename acc_t>
void pre_activations(const acc_t* xe, const acc_t* w, acc_t bias, int64_t len, int64_t width,
                     acc_t* z) {
  std::fill(z, z + len, bias);
  for (int64_t k = 0; k < width; ++k) {
    const acc_t wk = w[k];
    const acc_t* xk = xe + k;
    for (int64_t t = 0; t < len; ++t) z[t] = conv_tap(z[t], wk, xk[t]);
  }
}

// z = act(z) in place: kernels::conv_activation's operations, a vector at a time.
template <typename acc_t>
void activate(acc_t* z, int64_t len, ConvActivation act) {
  if (act != ConvActivation::kSilu) return;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const Vec one(1);
  int64_t t = 0;
  for (; t + L <= len; t += L) {
    const Vec v = Vec::loadu(z + t);
    (v / (one + v.neg().exp())).store(z + t);
  }
  for (; t < len; ++t) z[t] = conv_activation(z[t], act);
}

// gz = g act'(z): kernels::conv_activation_grad's operations, a vector at a time.
template <typename acc_t>
void activation_grads(const acc_t* g, const acc_t* z, int64_t len, ConvActivation act, acc_t* gz) {
  if (act != ConvActivation::kSilu) {
    std::copy(g, g + len, gz);
    return;
  }
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const Vec one(1);
  int64_t t = 0;
  for (; t + L <= len; t += L) {
    const Vec v = Vec::loadu(z + t);
    const Vec s = one / (one + v.neg().exp());
    (Vec::loadu(g + t) * (s * (one + v * (one - s)))).store(gz + t);
  }
  for (; t < len; ++t) gz[t] = conv_activation_grad(g[t], z[t], act);
}

// sum_t a[t] b[t] in kLanes partial sums, then over them in order.
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

int64_t longest(const ConvRows& r) {
  int64_t n = 0;
  for (int64_t s = 0; s < r.num_segments; ++s) {
    n = std::max(n, r.segments[s].end - r.segments[s].start);
  }
  return n;
}

// The offset of the initial states of (row of batch b, segment seg, channel d).
int64_t init_offset(const ConvRows& r, const ConvSegment& seg, int64_t b, int64_t d) {
  return ((r.packed ? seg.state : b) * r.channels + d) * (r.width - 1);
}

template <typename scalar_t>
void forward_rows(const ConvRows& r, int64_t begin, int64_t end, void* y_ptr) {
  using acc_t = acc_type<scalar_t>;
  const auto* x = static_cast<const scalar_t*>(r.x);
  const auto* init = static_cast<const scalar_t*>(r.init);
  const auto* weight = static_cast<const acc_t*>(r.weight);
  const auto* bias = static_cast<const acc_t*>(r.bias);
  auto* y = static_cast<scalar_t*>(y_ptr);
  const int64_t W = r.width, D = r.channels, L = r.length;
  const int64_t span = longest(r);
  std::vector<acc_t> xe(span + W - 1), z(span);
  for (int64_t row = begin; row < end; ++row) {
    const int64_t b = row / D, d = row % D;
    for (int64_t s = 0; s < r.num_segments; ++s) {
      const ConvSegment& seg = r.segments[s];
      const int64_t len = seg.end - seg.start;
      fill_inputs(x + row * L + seg.start,
                  init == nullptr ? nullptr : init + init_offset(r, seg, b, d), len, W, xe.data());
      pre_activations(xe.data(), weight + d * W, bias == nullptr ? acc_t(0) : bias[d], len, W,
                      z.data());
      activate(z.data(), len, r.act);
      store_rounded(z.data(), y + row * L + seg.start, len);
    }
  }
}

template <typename scalar_t>
void backward_channels(const ConvRows& r, const void* grad_ptr, int64_t begin, int64_t end,
                       void* grad_x_ptr, void* grad_init_ptr, void* grad_w_ptr, void* grad_b_ptr) {
  using acc_t = acc_type<scalar_t>;
  const auto* x = static_cast<const scalar_t*>(r.x);
  const auto* init = static_cast<const scalar_t*>(r.init);
  const auto* weight = static_cast<const acc_t*>(r.weight);
  const auto* bias = static_cast<const acc_t*>(r.bias);
  const auto* grad = static_cast<const scalar_t*>(grad_ptr);
  auto* grad_x = static_cast<scalar_t*>(grad_x_ptr);
  auto* grad_init = static_cast<scalar_t*>(grad_init_ptr);
  auto* grad_w = static_cast<acc_t*>(grad_w_ptr);
  auto* grad_b = static_cast<acc_t*>(grad_b_ptr);
  const int64_t W = r.width, D = r.channels, L = r.length;
  const int64_t span = longest(r);
  // gz holds dL/dz behind and ahead of W - 1 zeros, so that every tap reads inside it.
  std::vector<acc_t> xe(span + W - 1), z(span), g(span), gz(span + 2 * (W - 1)), gxe(span + W - 1);
  acc_t* gzt = gz.data() + (W - 1);
  for (int64_t d = begin; d < end; ++d) {
    const acc_t* w = weight + d * W;
    const acc_t bias_d = bias == nullptr ? acc_t(0) : bias[d];
    acc_t sum_w[kMaxConvWidth] = {};
    acc_t sum_b = 0;
    for (int64_t b = 0; b < r.batch; ++b) {
      const int64_t row = b * D + d;
      for (int64_t s = 0; s < r.num_segments; ++s) {
        const ConvSegment& seg = r.segments[s];
        const int64_t len = seg.end - seg.start;
        const int64_t init_at = init_offset(r, seg, b, d);
        fill_inputs(x + row * L + seg.start, init == nullptr ? nullptr : init + init_at, len, W,
                    xe.data());
        pre_activations(xe.data(), w, bias_d, len, W, z.data());
        load_acc(grad + row * L + seg.start, g.data(), len);
        std::fill(gz.begin(), gz.begin() + (W - 1), acc_t(0));
        activation_grads(g.data(), z.data(), len, r.act, gzt);
        std::fill(gzt + len, gzt + len + (W - 1), acc_t(0));
        // gxe[i] = sum_k w[k] gz[i + W - 1 - k] (kernels::conv_input_grad's order).
        const int64_t inputs = len + W - 1;
        std::fill(gxe.begin(), gxe.begin() + inputs, acc_t(0));
        for (int64_t k = 0; k < W; ++k) {
          const acc_t wk = w[k];
          const acc_t* gk = gz.data() + (W - 1 - k);
          for (int64_t i = 0; i < inputs; ++i) gxe[i] = conv_tap(gxe[i], wk, gk[i]);
        }
        store_rounded(gxe.data() + (W - 1), grad_x + row * L + seg.start, len);
        if (grad_init != nullptr) store_rounded(gxe.data(), grad_init + init_at, W - 1);
        for (int64_t k = 0; k < W; ++k) sum_w[k] += lane_dot(gzt, xe.data() + k, len);
        sum_b += lane_sum(gzt, len);
      }
    }
    for (int64_t k = 0; k < W; ++k) grad_w[d * W + k] = sum_w[k];
    grad_b[d] = sum_b;
  }
}

void forward(FusionDtype dtype, const ConvRows& rows, int64_t begin, int64_t end, void* y) {
  MEGATRON_EXT_FUSION_DISPATCH(dtype, forward_rows, rows, begin, end, y)
}

void backward(FusionDtype dtype, const ConvRows& rows, const void* grad, int64_t begin, int64_t end,
              void* grad_x, void* grad_init, void* grad_weight, void* grad_bias) {
  MEGATRON_EXT_FUSION_DISPATCH(dtype, backward_channels, rows, grad, begin, end, grad_x, grad_init,
                               grad_weight, grad_bias)
}

}  // namespace

const CausalConvCpuKernels causal_conv_cpu_kernels{&forward, &backward};

}  // namespace megatron_ext::kernels::CPU_CAPABILITY
