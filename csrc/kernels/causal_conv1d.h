#pragma once
// Arithmetic of the short depthwise causal convolution of Mamba-2 and Gated DeltaNet layers,
// shared by the CPU loops (kernels/causal_conv1d_cpu.cpp) and the CUDA kernels
// (causal_conv1d_cuda.cu), so that CPU tests exercise the arithmetic the GPU runs.
//
// Row (b, d) of x [B, D, L] is cut into segments (the packed sequences of cu_seqlens, or one
// segment [0, L)); in a segment starting at ``start``,
//   z[t] = bias[d] + sum_{k < W} w[d, k] * x[t - (W - 1) + k],   y[t] = act(z[t]),
// the taps added in k order, each product rounded before its sum (on every device: the CPU build
// never contracts, and mul_rounded keeps nvcc from it), where x at t' < start is the segment's
// initial state: initial_states[n, d, W - 1 + t' - start] (n the batch row, or the sequence of a
// packed row), or zero without initial states. ``acc_t`` is float for 16-bit and float32 tensors,
// double for float64; the weight and the bias are given in acc_t.
#include <cstdint>

#include "kernels/host_device.h"
#include "kernels/llama_fusions.h"

namespace megatron_ext::kernels {

// The widest kernel the ops take (Mamba-2 and Gated DeltaNet use 4); the CUDA weight-gradient
// kernel keeps one sum per tap in registers.
constexpr int64_t kMaxConvWidth = 8;

enum class ConvActivation : int { kNone = 0, kSilu = 1 };

// acc + w x with the product rounded.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t conv_tap(acc_t acc, acc_t w, acc_t x) {
  return acc + mul_rounded(w, x);
}

template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t conv_sigmoid(acc_t z) {
  return acc_t(1) / (acc_t(1) + exp_acc_of(-z));
}

// silu(z) = z / (1 + exp(-z)), as torch's F.silu computes it.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t conv_activation(acc_t z, ConvActivation act) {
  return act == ConvActivation::kSilu ? z / (acc_t(1) + exp_acc_of(-z)) : z;
}

// g * act'(z); silu'(z) = s (1 + z (1 - s)) with s = sigmoid(z).
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t conv_activation_grad(acc_t g, acc_t z, ConvActivation act) {
  if (act != ConvActivation::kSilu) return g;
  const acc_t s = conv_sigmoid(z);
  return g * (s * (acc_t(1) + z * (acc_t(1) - s)));
}

// The segment of a row that holds time t: [start, end) and the row of initial_states it starts
// from. Without cu_seqlens (cu == nullptr) it is the whole row of batch b. With them, the last
// sequence s with cu[s] <= t, so that empty sequences (equal offsets) are skipped.
struct ConvSegment {
  int64_t start;
  int64_t end;
  int64_t state;
};

MEGATRON_EXT_HOST_DEVICE ConvSegment conv_segment(const int64_t* cu, int64_t segments,
                                                  int64_t length, int64_t b, int64_t t) {
  if (cu == nullptr) return {0, length, b};
  int64_t lo = 0, hi = segments - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return {cu[lo], cu[lo + 1], lo};
}

// x at time tt of a row (x_row points at time 0), in a segment starting at ``start``: before it,
// the segment's initial state (init_row: its W - 1 values) or zero.
template <typename scalar_t, typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t conv_input_at(const scalar_t* x_row, const scalar_t* init_row,
                                             int64_t start, int64_t tt, int64_t width) {
  if (tt >= start) return static_cast<acc_t>(x_row[tt]);
  if (init_row == nullptr) return acc_t(0);
  return static_cast<acc_t>(init_row[width - 1 + tt - start]);
}

// z[t], the convolution before the activation.
template <typename scalar_t, typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t conv_pre_activation(const scalar_t* x_row, const scalar_t* init_row,
                                                   const acc_t* w, acc_t bias, int64_t start,
                                                   int64_t t, int64_t width) {
  acc_t z = bias;
  for (int64_t k = 0; k < width; ++k) {
    z = conv_tap(
        z, w[k],
        conv_input_at<scalar_t, acc_t>(x_row, init_row, start, t - (width - 1) + k, width));
  }
  return z;
}

// dL/dz[t] = g[t] act'(z[t]), z recomputed.
template <typename scalar_t, typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t conv_pre_activation_grad(const scalar_t* g_row,
                                                        const scalar_t* x_row,
                                                        const scalar_t* init_row, const acc_t* w,
                                                        acc_t bias, int64_t start, int64_t t,
                                                        int64_t width, ConvActivation act) {
  const acc_t z = conv_pre_activation<scalar_t, acc_t>(x_row, init_row, w, bias, start, t, width);
  return conv_activation_grad(static_cast<acc_t>(g_row[t]), z, act);
}

// The gradient of the input at time pos of a segment [start, end), pos >= start - (W - 1) (before
// start: the initial state's): sum_k w[k] dL/dz[pos + W - 1 - k] over the outputs in the segment,
// added in k order from zero.
template <typename scalar_t, typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t conv_input_grad(const scalar_t* g_row, const scalar_t* x_row,
                                               const scalar_t* init_row, const acc_t* w, acc_t bias,
                                               int64_t start, int64_t end, int64_t pos,
                                               int64_t width, ConvActivation act) {
  acc_t acc = 0;
  for (int64_t k = 0; k < width; ++k) {
    const int64_t t = pos + width - 1 - k;
    if (t >= start && t < end) {
      acc = conv_tap(acc, w[k],
                     conv_pre_activation_grad<scalar_t, acc_t>(g_row, x_row, init_row, w, bias,
                                                               start, t, width, act));
    }
  }
  return acc;
}

}  // namespace megatron_ext::kernels
