#pragma once
// Arithmetic of the Mamba-2 state-space-duality (SSD) scan, shared by the CPU kernels
// (kernels/mamba_ssd_cpu.cpp) and the CUDA kernels (mamba_ssd_cuda.cu).
//
// Per head h (group g = h / (H / G)) of a segment (a batch row, or a packed sequence):
//   dt'_t = clamp(softplus(dt_t + dt_bias_h) or dt_t + dt_bias_h, dt_min, dt_max)
//   S_t   = exp(dt'_t A_h) S_{t-1} + dt'_t x_t B_t^T          (the state, [P, N])
//   y_t   = (S_t C_t + D x_t) * silu(z_t)                     (the gate only with z)
// computed chunk by chunk: with cs_t the cumulative sum of dt'_s A_h inside a chunk and S_in the
// state entering it,
//   y_t   = sum_{s <= t} exp(cs_t - cs_s) (C_t . B_s) dt'_s x_s + exp(cs_t) S_in C_t + D x_t
//   S_out = exp(cs_last) S_in + sum_s exp(cs_last - cs_s) dt'_s x_s B_s^T
// Every exponent is <= 0 (A < 0, dt' >= 0 with the default limits), so no factor exceeds 1.
// ``acc_t`` is float for 16-bit and float32 tensors, double for float64.
#include <math.h>

#include <cstdint>

#include "kernels/causal_conv1d.h"
#include "kernels/host_device.h"
#include "kernels/llama_fusions.h"

namespace megatron_ext::kernels {

MEGATRON_EXT_HOST_DEVICE float log1p_acc_of(float x) { return ::log1pf(x); }
MEGATRON_EXT_HOST_DEVICE double log1p_acc_of(double x) { return ::log1p(x); }

// torch.nn.functional.softplus with its default threshold: v itself above 20.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t ssd_softplus(acc_t v) {
  return v > acc_t(20) ? v : log1p_acc_of(exp_acc_of(v));
}

// The step of one token from v = dt + dt_bias.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t ssd_dt(acc_t v, bool softplus, acc_t lo, acc_t hi) {
  const acc_t d = softplus ? ssd_softplus(v) : v;
  return d < lo ? lo : (d > hi ? hi : d);
}

// dL/dv from dL/ddt': zero where the limits clamp (as mamba-ssm's kernels and torch.clamp's
// gradient: a value equal to a limit passes), times softplus'(v) = sigmoid(v) below the threshold.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t ssd_dt_grad(acc_t g, acc_t v, bool softplus, acc_t lo, acc_t hi) {
  const acc_t d = softplus ? ssd_softplus(v) : v;
  if (d < lo || d > hi) return acc_t(0);
  return softplus && v <= acc_t(20) ? g * conv_sigmoid(v) : g;
}

// The smallest exponent of a decay kept: below it, a decay is zero. Subnormal numbers never enter
// the products (x86 CPUs take about a hundred times longer over them), and a dropped term is below
// 1e-27 (float) or 1e-277 (double) of the state it decays, far below the dtype's rounding.
MEGATRON_EXT_HOST_DEVICE float ssd_min_exponent(float) { return -64.0f; }
MEGATRON_EXT_HOST_DEVICE double ssd_min_exponent(double) { return -640.0; }

// exp(cs_t - cs_s): the decay from token s to token t >= s of a chunk (cs_s = 0: from its start).
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t ssd_decay(acc_t cs_t, acc_t cs_s) {
  const acc_t e = cs_t - cs_s;
  return e < ssd_min_exponent(e) ? acc_t(0) : exp_acc_of(e);
}

// y * silu(z), and its gradients: d/dy = g silu(z), d/dz = g y silu'(z).
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t ssd_gate(acc_t y, acc_t z) {
  return y * conv_activation(z, ConvActivation::kSilu);
}

template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t ssd_gate_grad_z(acc_t g, acc_t y, acc_t z) {
  return conv_activation_grad(g * y, z, ConvActivation::kSilu);
}

// A segment of the scan: tokens [start, end) of batch row ``batch``, its initial and final states
// in row ``state`` of the state tensors, its chunks from ``chunk_base`` on in the saved
// chunk-boundary states (chunks restart at each segment's start).
struct SsdSegment {
  int64_t batch;
  int64_t start;
  int64_t end;
  int64_t state;
  int64_t chunk_base;
};

MEGATRON_EXT_HOST_DEVICE int64_t ssd_chunks(int64_t length, int64_t chunk) {
  return (length + chunk - 1) / chunk;
}

}  // namespace megatron_ext::kernels
