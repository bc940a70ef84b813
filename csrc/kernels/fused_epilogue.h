#pragma once
// Per-element arithmetic of the transformer layer's fused epilogues (bias + GeLU, bias + dropout +
// residual add), shared by the CPU loops and the CUDA kernels so that CPU tests exercise the
// arithmetic the GPU runs. ``acc_t`` is float for 16-bit and float32 tensors, double for float64.
//
// The dropout mask is a counter-based stream (Philox-4x32-10) keyed by a seed and an offset drawn
// from the device's default generator: element i keeps or drops by the bits of counter
// (offset + i / 4), so the CPU and CUDA kernels drop the same elements for the same (seed,
// offset), and backward regenerates the mask instead of storing it.
#include <math.h>

#include <cstdint>

#include "kernels/host_device.h"

namespace megatron_ext::kernels {

MEGATRON_EXT_HOST_DEVICE float erf_acc(float x) { return ::erff(x); }
MEGATRON_EXT_HOST_DEVICE double erf_acc(double x) { return ::erf(x); }
MEGATRON_EXT_HOST_DEVICE float tanh_acc(float x) { return ::tanhf(x); }
MEGATRON_EXT_HOST_DEVICE double tanh_acc(double x) { return ::tanh(x); }
MEGATRON_EXT_HOST_DEVICE float exp_of(float x) { return ::expf(x); }
MEGATRON_EXT_HOST_DEVICE double exp_of(double x) { return ::exp(x); }

// GeLU(x) = x * Phi(x) (``tanh_form`` false), or torch's approximate="tanh" form:
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t gelu(acc_t x, bool tanh_form) {
  if (tanh_form) {
    const acc_t k = acc_t(0.7978845608028654);  // sqrt(2 / pi)
    const acc_t inner = k * (x + acc_t(0.044715) * x * x * x);
    return acc_t(0.5) * x * (acc_t(1) + tanh_acc(inner));
  }
  return acc_t(0.5) * x * (acc_t(1) + erf_acc(x * acc_t(0.7071067811865476)));
}

// d GeLU(x) / dx in the same form.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t gelu_grad(acc_t x, bool tanh_form) {
  if (tanh_form) {
    const acc_t k = acc_t(0.7978845608028654);
    const acc_t c = acc_t(0.044715);
    const acc_t x2 = x * x;
    const acc_t t = tanh_acc(k * (x + c * x2 * x));
    const acc_t d_inner = k * (acc_t(1) + acc_t(3) * c * x2);
    return acc_t(0.5) * (acc_t(1) + t) + acc_t(0.5) * x * (acc_t(1) - t * t) * d_inner;
  }
  const acc_t cdf = acc_t(0.5) * (acc_t(1) + erf_acc(x * acc_t(0.7071067811865476)));
  const acc_t pdf = exp_of(acc_t(-0.5) * x * x) * acc_t(0.3989422804014327);  // 1 / sqrt(2 pi)
  return cdf + x * pdf;
}

// Four 32-bit words of the Philox-4x32-10 stream at ``counter`` under ``seed``.
struct Philox4 {
  uint32_t v[4];
};

MEGATRON_EXT_HOST_DEVICE Philox4 philox4x32_10(uint64_t seed, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// Elements share one Philox call per group of this many.
constexpr int64_t kDropoutGroup = 4;

// Whether element ``lane`` of a group is kept: a 24-bit uniform in [0, 1) below keep_prob.
MEGATRON_EXT_HOST_DEVICE bool dropout_keep(const Philox4& bits, int64_t lane, float keep_prob) {
  const float u = static_cast<float>(bits.v[lane] >> 8) * (1.0f / 16777216.0f);
  return u < keep_prob;
}

// residual + dropout(x + bias): the kept value scaled by 1 / keep_prob, the dropped one 0.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t bias_dropout_add(acc_t x, acc_t bias, acc_t residual, bool keep,
                                                acc_t scale) {
  return residual + (keep ? (x + bias) * scale : acc_t(0));
}

// The gradient reaching x (and the bias) through the dropout.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t dropout_grad(acc_t grad, bool keep, acc_t scale) {
  return keep ? grad * scale : acc_t(0);
}

}  // namespace megatron_ext::kernels
