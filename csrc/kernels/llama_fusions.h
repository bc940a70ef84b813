#pragma once
// Arithmetic of the Llama-family fusions (RMSNorm, rotary position embedding, SwiGLU and its
// clamped, offset, quick-GELU variants), shared by the CPU loops
// (kernels/cpu/llama_fusions_kernels.cpp) and the CUDA kernels (llama_fusions_cuda.cu), so that
// CPU tests exercise the arithmetic the GPU runs. ``acc_t`` is float for 16-bit and float32
// tensors, double for float64.
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

// ---- Gated sigmoid units: act(gate) * (up + linear_offset), act(x) = x sigmoid(alpha x) -------
// alpha 1 is SiLU (SwiGLU above), 1.702 the quick GELU of gpt-oss's experts. With a clamp value c
// the gate is first clamped to at most c and the linear half to [-c, c]; as torch's clamp (2.14),
// the gradient passes strictly within the bounds and is 0 at and beyond them.
struct GluParams {
  double alpha;
  double linear_offset;
  bool clamped;
  double clamp_value;
};

// Whether ``p`` is plain SwiGLU, which the SwiGLU arithmetic above computes.
MEGATRON_EXT_HOST_DEVICE bool is_plain_swiglu(const GluParams& p) {
  return p.alpha == 1.0 && p.linear_offset == 0.0 && !p.clamped;
}

template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t glu_gate_clamped(acc_t gate, const GluParams& p) {
  const acc_t c = static_cast<acc_t>(p.clamp_value);
  return p.clamped && gate > c ? c : gate;
}

template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t glu_up_clamped(acc_t up, const GluParams& p) {
  const acc_t c = static_cast<acc_t>(p.clamp_value);
  if (!p.clamped) return up;
  return up > c ? c : (up < -c ? -c : up);
}

// sigmoid(alpha x) = 1 / (1 + exp(-(alpha x))), the product rounded as torch's (alpha * x).
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t glu_sigmoid(acc_t x, const GluParams& p) {
  return acc_t(1) / (acc_t(1) + exp_acc_of(-mul_rounded(static_cast<acc_t>(p.alpha), x)));
}

// (g sigmoid(alpha g)) (u + offset) of the clamped halves.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t glu_out(acc_t gate, acc_t up, const GluParams& p) {
  const acc_t g = glu_gate_clamped(gate, p);
  const acc_t u = glu_up_clamped(up, p);
  return mul_rounded(mul_rounded(g, glu_sigmoid(g, p)), u + static_cast<acc_t>(p.linear_offset));
}

// d/dgate = grad (u + offset) s (1 + alpha g (1 - s)), d/dup = grad g s, each 0 where its clamp
// bound was reached.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE SwigluGrads<acc_t> glu_grads(acc_t grad, acc_t gate, acc_t up,
                                                      const GluParams& p) {
  const acc_t c = static_cast<acc_t>(p.clamp_value);
  const bool gate_passes = !p.clamped || gate < c;
  const bool up_passes = !p.clamped || (up > -c && up < c);
  const acc_t g = glu_gate_clamped(gate, p);
  const acc_t u = glu_up_clamped(up, p);
  const acc_t alpha = static_cast<acc_t>(p.alpha);
  const acc_t s = glu_sigmoid(g, p);
  const acc_t slope = fma_acc(mul_rounded(alpha, g), acc_t(1) - s, acc_t(1));
  const acc_t d_gate = mul_rounded(
      mul_rounded(mul_rounded(grad, u + static_cast<acc_t>(p.linear_offset)), s), slope);
  return {gate_passes ? d_gate : acc_t(0),
          up_passes ? mul_rounded(grad, mul_rounded(g, s)) : acc_t(0)};
}

}  // namespace megatron_ext::kernels
