#pragma once
// Arithmetic of the Llama-family fusions (RMSNorm, rotary position embedding, SwiGLU), shared by
// the CPU loops (kernels/cpu/llama_fusions_kernels.cpp) and the CUDA kernels
// (llama_fusions_cuda.cu), so that CPU tests exercise the arithmetic the GPU runs. ``acc_t`` is
// float for 16-bit and float32 tensors, double for float64.
//
// Each expression is evaluated in the order, and with the roundings, of the torch ops it replaces
// (torch.nn.functional.rms_norm; Megatron-core's rotary chain of muls, an add and a cat;
// F.silu(gate) * up and its autograd), so that float64 and float32 results can equal them: a
// product that torch rounds as an op of its own is rounded here too (``mul_rounded``; the CPU
// build never contracts, see setup.py, and nvcc would), and the one fused multiply-add torch's
// compiled SiLU gradient holds on CPUs with FMA and on GPUs is written out (``fma_acc``).
#include <math.h>

#include <cstdint>

#include "kernels/host_device.h"

namespace megatron_ext::kernels {

MEGATRON_EXT_HOST_DEVICE float exp_acc_of(float x) { return ::expf(x); }
MEGATRON_EXT_HOST_DEVICE double exp_acc_of(double x) { return ::exp(x); }

// a * b rounded before anything consumes it.
MEGATRON_EXT_HOST_DEVICE float mul_rounded(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MEGATRON_EXT_HOST_DEVICE double mul_rounded(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// a * b + c rounded once where the hardware fuses it (GPUs, CPUs built with FMA), as the compilers
// of torch's own kernels contract it there; rounded twice elsewhere.
MEGATRON_EXT_HOST_DEVICE float fma_acc(float a, float b, float c) {
#if defined(__CUDA_ARCH__) || defined(__FMA__)
  return ::fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
MEGATRON_EXT_HOST_DEVICE double fma_acc(double a, double b, double c) {
#if defined(__CUDA_ARCH__) || defined(__FMA__)
  return ::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// 1 / sqrt(x): the GPU's rsqrt, the correctly rounded quotient of the square root on CPUs (torch's
// CPU rsqrt).
MEGATRON_EXT_HOST_DEVICE float rsqrt_acc(float x) {
#ifdef __CUDA_ARCH__
  return ::rsqrtf(x);
#else
  return 1.0f / ::sqrtf(x);
#endif
}
MEGATRON_EXT_HOST_DEVICE double rsqrt_acc(double x) {
#ifdef __CUDA_ARCH__
  return ::rsqrt(x);
#else
  return 1.0 / ::sqrt(x);
#endif
}

// ---- RMSNorm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) over the last dim of size h ----

// rstd from the row's sum of squares: the mean is the sum divided by h, as torch computes it.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t rms_norm_rstd(acc_t sum_squares, int64_t h, acc_t eps) {
  return rsqrt_acc(sum_squares / static_cast<acc_t>(h) + eps);
}

// (x * rstd) * w, each product rounded.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t rms_norm_out(acc_t x, acc_t rstd, acc_t w) {
  return mul_rounded(mul_rounded(x, rstd), w);
}

// The row's share of the input gradient through rstd: with dot = sum_k g_k w_k x_k,
// d rstd / d x_j = -rstd^3 x_j / h, so every x_j is scaled by rstd^3 dot / h.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t rms_norm_grad_coef(acc_t rstd, acc_t dot, int64_t h) {
  return rstd * rstd * rstd * dot / static_cast<acc_t>(h);
}

// dL/dx_j = (g_j w_j) rstd - x_j coef.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t rms_norm_grad_input(acc_t g, acc_t x, acc_t w, acc_t rstd,
                                                   acc_t coef) {
  return mul_rounded(mul_rounded(g, w), rstd) - mul_rounded(x, coef);
}

// The row's term of dL/dw_j: g_j (x_j rstd).
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t rms_norm_grad_weight_term(acc_t g, acc_t x, acc_t rstd) {
  return mul_rounded(g, mul_rounded(x, rstd));
}

// ---- Rotary position embedding over [s, b, n, d] -------------------------------------------
// out = t * cos + rotate_half(t) * sin on the first ``rot_dim`` lanes of each head, the rest
// copied. rotate_half pairs lane i with partner p(i): i +- rot_dim / 2 (halves), or i ^ 1
// (interleaved pairs); the first half (even lanes) takes its partner negated.

// Where the heads of a rotary input lie: head r = (i, j, k) of [s, b, n] is
// (r / (b n), (r / n) % b, r % n); its ``dim`` lanes are contiguous.
struct RotaryLayout {
  int64_t batch;
  int64_t heads;
  int64_t dim;
  int64_t rot_dim;
  int64_t stride_s;
  int64_t stride_b;
  int64_t stride_n;
  bool interleaved;
};

MEGATRON_EXT_HOST_DEVICE int64_t rotary_head_offset(const RotaryLayout& l, int64_t head) {
  const int64_t n = head % l.heads;
  const int64_t b = (head / l.heads) % l.batch;
  const int64_t s = head / (l.heads * l.batch);
  return s * l.stride_s + b * l.stride_b + n * l.stride_n;
}

MEGATRON_EXT_HOST_DEVICE int64_t rotary_position(const RotaryLayout& l, int64_t head) {
  return head / (l.heads * l.batch);
}

MEGATRON_EXT_HOST_DEVICE int64_t rotary_partner(int64_t lane, int64_t rot_dim, bool interleaved) {
  if (interleaved) return lane ^ 1;
  const int64_t half = rot_dim / 2;
  return lane < half ? lane + half : lane - half;
}

// Whether rotate_half negates the partner of ``lane``.
MEGATRON_EXT_HOST_DEVICE bool rotary_negated(int64_t lane, int64_t rot_dim, bool interleaved) {
  return interleaved ? (lane & 1) == 0 : lane < rot_dim / 2;
}

// t_i cos_i + rotate_half(t)_i sin_i: (t_i cos_i) -/+ (t_p sin_i).
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t rotary_forward(acc_t t, acc_t t_partner, acc_t cos_i, acc_t sin_i,
                                              bool negated) {
  const acc_t direct = mul_rounded(t, cos_i);
  const acc_t rotated = mul_rounded(t_partner, sin_i);
  return negated ? direct - rotated : direct + rotated;
}

// The transpose, for the gradient: g_i cos_i + rotate_half^T(g sin)_i, where rotate_half^T
// gives the partner's value with the opposite sign: (g_i cos_i) +/- (g_p sin_p).
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t rotary_backward(acc_t g, acc_t g_partner, acc_t cos_i,
                                               acc_t sin_partner, bool negated) {
  const acc_t direct = mul_rounded(g, cos_i);
  const acc_t rotated = mul_rounded(g_partner, sin_partner);
  return negated ? direct + rotated : direct - rotated;
}

// ---- SwiGLU: out = silu(gate) * up, (gate, up) the halves of the last dim -------------------

// silu(x) = x / (1 + exp(-x)), as torch's kernels.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t silu_of(acc_t x) {
  return x / (acc_t(1) + exp_acc_of(-x));
}

template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t swiglu_out(acc_t gate, acc_t up) {
  return mul_rounded(silu_of(gate), up);
}

template <typename acc_t>
struct SwigluGrads {
  acc_t gate;
  acc_t up;
};

// The gradients of silu(gate) * up as autograd forms them: up gets grad * silu(gate); silu's
// input gets silu_backward(grad * up, gate) = ((grad up) s) (1 + gate (1 - s)),
// s = 1 / (1 + exp(-gate)).
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE SwigluGrads<acc_t> swiglu_grads(acc_t grad, acc_t gate, acc_t up) {
  const acc_t denom = acc_t(1) + exp_acc_of(-gate);
  const acc_t sigmoid = acc_t(1) / denom;
  const acc_t grad_silu = mul_rounded(grad, up);
  const acc_t slope = fma_acc(gate, acc_t(1) - sigmoid, acc_t(1));
  return {mul_rounded(mul_rounded(grad_silu, sigmoid), slope), mul_rounded(grad, gate / denom)};
}

}  // namespace megatron_ext::kernels
