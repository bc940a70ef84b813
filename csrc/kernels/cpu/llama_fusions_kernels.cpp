// CPU loops of RMSNorm, rotary embedding and SwiGLU (and its gated-sigmoid variants). This file is
// compiled as is (baseline instruction set, namespace DEFAULT) and again by setup.py with
// CPU_CAPABILITY=AVX2 and AVX512 and the matching -m flags, as ATen compiles its kernels. Vector
// lanes run the arithmetic of kernels/llama_fusions.h operation for operation
// (at::vec::Vectorized), remainders run the header itself. A row is brought into the accumulation
// type once (16-bit values converted to float into a buffer the loop owns) and its results rounded
// back once.
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/cpu/llama_fusions_kernels.h"
#include "kernels/cpu/vec_convert.h"
#include "kernels/llama_fusions.h"

namespace megatron_ext::kernels::CPU_CAPABILITY {
namespace {

template <typename scalar_t>
constexpr bool kIsAcc = std::is_same_v<scalar_t, acc_type<scalar_t>>;

// Buffer room for one row of n values when scalar_t is not the accumulation type.
template <typename scalar_t>
std::vector<acc_type<scalar_t>> row_buffer(int64_t n) {
  return std::vector<acc_type<scalar_t>>(kIsAcc<scalar_t> ? 0 : n);
}

// n values in the accumulation type: ``row`` itself when it has that type, else its values
// converted into ``buffer``.
template <typename scalar_t>
const acc_type<scalar_t>* acc_row(const scalar_t* row, acc_type<scalar_t>* buffer, int64_t n) {
  if constexpr (kIsAcc<scalar_t>) {
    return row;
  } else {
    to_float(row, buffer, n);
    return buffer;
  }
}

// Where a row's results are computed: the output row when it has the accumulation type, else
// ``buffer``, which ``store_row`` then rounds into the output.
template <typename scalar_t>
acc_type<scalar_t>* acc_out(scalar_t* row, acc_type<scalar_t>* buffer) {
  if constexpr (kIsAcc<scalar_t>) {
    return row;
  } else {
    return buffer;
  }
}

template <typename scalar_t>
void store_row(const acc_type<scalar_t>* values, scalar_t* row, int64_t n) {
  if constexpr (!kIsAcc<scalar_t>) from_float(values, row, n);
}

template <typename acc_t>
acc_t horizontal_sum(const at::vec::Vectorized<acc_t>& v) {
  alignas(64) acc_t lanes[at::vec::Vectorized<acc_t>::size()];
  v.store(lanes);
  acc_t s = 0;
  for (const acc_t x : lanes) s += x;
  return s;
}

// ---- RMSNorm ---------------------------------------------------------------------------------

template <typename scalar_t>
void rms_norm_forward_rows(const void* x_ptr, const void* weight, double eps, int64_t h,
                           int64_t begin, int64_t end, void* y_ptr, void* rstd_ptr) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const int64_t hv = h - h % L;
  const auto* x = static_cast<const scalar_t*>(x_ptr);
  const auto* w = static_cast<const acc_t*>(weight);
  auto* y = static_cast<scalar_t*>(y_ptr);
  auto* rstd = static_cast<acc_t*>(rstd_ptr);
  const auto eps_acc = static_cast<acc_t>(eps);
  auto in_buffer = row_buffer<scalar_t>(h);
  auto out_buffer = row_buffer<scalar_t>(h);
  for (int64_t i = begin; i < end; ++i) {
    const acc_t* xr = acc_row(x + i * h, in_buffer.data(), h);
    Vec squares(0);
    for (int64_t j = 0; j < hv; j += L) {
      const Vec v = Vec::loadu(xr + j);
      squares = squares + v * v;
    }
    acc_t sum = horizontal_sum(squares);
    for (int64_t j = hv; j < h; ++j) sum += xr[j] * xr[j];
    const acc_t r = rms_norm_rstd(sum, h, eps_acc);
    rstd[i] = r;
    acc_t* yr = acc_out(y + i * h, out_buffer.data());
    const Vec vr(r);
    for (int64_t j = 0; j < hv; j += L) {
      ((Vec::loadu(xr + j) * vr) * Vec::loadu(w + j)).store(yr + j);
    }
    for (int64_t j = hv; j < h; ++j) yr[j] = rms_norm_out(xr[j], r, w[j]);
    store_row(yr, y + i * h, h);
  }
}

template <typename scalar_t>
void rms_norm_backward_rows(const void* grad_ptr, const void* x_ptr, const void* weight,
                            const void* rstd_ptr, int64_t h, int64_t begin, int64_t end,
                            void* grad_x_ptr, void* grad_weight_ptr) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const int64_t hv = h - h % L;
  const auto* g = static_cast<const scalar_t*>(grad_ptr);
  const auto* x = static_cast<const scalar_t*>(x_ptr);
  const auto* w = static_cast<const acc_t*>(weight);
  const auto* rstd = static_cast<const acc_t*>(rstd_ptr);
  auto* grad_x = static_cast<scalar_t*>(grad_x_ptr);
  auto* grad_w = static_cast<acc_t*>(grad_weight_ptr);
  auto g_buffer = row_buffer<scalar_t>(h);
  auto x_buffer = row_buffer<scalar_t>(h);
  auto out_buffer = row_buffer<scalar_t>(h);
  for (int64_t i = begin; i < end; ++i) {
    const acc_t* gr = acc_row(g + i * h, g_buffer.data(), h);
    const acc_t* xr = acc_row(x + i * h, x_buffer.data(), h);
    const acc_t r = rstd[i];
    Vec dot_lanes(0);
    for (int64_t j = 0; j < hv; j += L) {
      dot_lanes = dot_lanes + (Vec::loadu(gr + j) * Vec::loadu(w + j)) * Vec::loadu(xr + j);
    }
    acc_t dot = horizontal_sum(dot_lanes);
    for (int64_t j = hv; j < h; ++j) dot += (gr[j] * w[j]) * xr[j];
    const acc_t coef = rms_norm_grad_coef(r, dot, h);
    acc_t* out = acc_out(grad_x + i * h, out_buffer.data());
    const Vec vr(r), vcoef(coef);
    for (int64_t j = 0; j < hv; j += L) {
      const Vec gj = Vec::loadu(gr + j), xj = Vec::loadu(xr + j);
      ((gj * Vec::loadu(w + j)) * vr - xj * vcoef).store(out + j);
      (Vec::loadu(grad_w + j) + gj * (xj * vr)).store(grad_w + j);
    }
    for (int64_t j = hv; j < h; ++j) {
      out[j] = rms_norm_grad_input(gr[j], xr[j], w[j], r, coef);
      grad_w[j] += rms_norm_grad_weight_term(gr[j], xr[j], r);
    }
    store_row(out, grad_x + i * h, h);
  }
}

// ---- Rotary embedding --------------------------------------------------------------------------

// Lane ``lane`` of the rotated part of one head, by the header's arithmetic.
template <typename acc_t>
acc_t rotary_lane(const acc_t* t, const acc_t* c, const acc_t* s, int64_t rot, bool interleaved,
                  bool backward, int64_t lane) {
  const int64_t p = rotary_partner(lane, rot, interleaved);
  const bool negated = rotary_negated(lane, rot, interleaved);
  return backward ? rotary_backward(t[lane], t[p], c[lane], s[p], negated)
                  : rotary_forward(t[lane], t[p], c[lane], s[lane], negated);
}

// The rotated lanes of one head in halves: lane i < rot / 2 pairs with i + rot / 2.
template <typename acc_t>
void rotate_halves(const acc_t* t, const acc_t* c, const acc_t* s, int64_t rot, bool backward,
                   acc_t* out) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const int64_t half = rot / 2;
  const int64_t hv = half - half % L;
  for (int64_t i = 0; i < hv; i += L) {
    const Vec a = Vec::loadu(t + i), b = Vec::loadu(t + half + i);
    const Vec ca = Vec::loadu(c + i), cb = Vec::loadu(c + half + i);
    const Vec sa = Vec::loadu(s + i), sb = Vec::loadu(s + half + i);
    if (backward) {
      (a * ca + b * sb).store(out + i);
      (b * cb - a * sa).store(out + half + i);
    } else {
      (a * ca - b * sa).store(out + i);
      (b * cb + a * sb).store(out + half + i);
    }
  }
  for (int64_t i = hv; i < half; ++i) {
    out[i] = rotary_lane(t, c, s, rot, false, backward, i);
    out[half + i] = rotary_lane(t, c, s, rot, false, backward, half + i);
  }
}

// The rotated lanes of one head in interleaved pairs (2k, 2k + 1), split into even and odd lanes
// two vectors at a time.
template <typename acc_t>
void rotate_pairs(const acc_t* t, const acc_t* c, const acc_t* s, int64_t rot, bool backward,
                  acc_t* out) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const int64_t rv = rot - rot % (2 * L);
  for (int64_t j = 0; j < rv; j += 2 * L) {
    const auto [even, odd] = at::vec::deinterleave2(Vec::loadu(t + j), Vec::loadu(t + j + L));
    const auto [c_even, c_odd] = at::vec::deinterleave2(Vec::loadu(c + j), Vec::loadu(c + j + L));
    const auto [s_even, s_odd] = at::vec::deinterleave2(Vec::loadu(s + j), Vec::loadu(s + j + L));
    const auto [lo, hi] =
        backward ? at::vec::interleave2(even * c_even + odd * s_odd, odd * c_odd - even * s_even)
                 : at::vec::interleave2(even * c_even - odd * s_even, odd * c_odd + even * s_odd);
    lo.store(out + j);
    hi.store(out + j + L);
  }
  for (int64_t lane = rv; lane < rot; ++lane) {
    out[lane] = rotary_lane(t, c, s, rot, true, backward, lane);
  }
}

template <typename scalar_t>
void rotary_heads(const void* input, const void* cos_ptr, const void* sin_ptr,
                  const RotaryLayout& layout, bool backward, int64_t begin, int64_t end,
                  void* out_ptr) {
  using acc_t = acc_type<scalar_t>;
  const auto* in = static_cast<const scalar_t*>(input);
  const auto* cos = static_cast<const scalar_t*>(cos_ptr);
  const auto* sin = static_cast<const scalar_t*>(sin_ptr);
  auto* out = static_cast<scalar_t*>(out_ptr);
  const int64_t dim = layout.dim, rot = layout.rot_dim;
  auto in_buffer = row_buffer<scalar_t>(dim);
  auto out_buffer = row_buffer<scalar_t>(dim);
  auto cos_buffer = row_buffer<scalar_t>(rot);
  auto sin_buffer = row_buffer<scalar_t>(rot);
  int64_t position = -1;
  const acc_t *c = nullptr, *s = nullptr;
  for (int64_t head = begin; head < end; ++head) {
    // Heads of one position are consecutive: its cos and sin are converted once.
    if (rotary_position(layout, head) != position) {
      position = rotary_position(layout, head);
      c = acc_row(cos + position * rot, cos_buffer.data(), rot);
      s = acc_row(sin + position * rot, sin_buffer.data(), rot);
    }
    const acc_t* t = acc_row(in + rotary_head_offset(layout, head), in_buffer.data(), dim);
    acc_t* o = acc_out(out + head * dim, out_buffer.data());
    if (layout.interleaved) {
      rotate_pairs(t, c, s, rot, backward, o);
    } else {
      rotate_halves(t, c, s, rot, backward, o);
    }
    std::copy(t + rot, t + dim, o + rot);
    store_row(o, out + head * dim, dim);
  }
}

// ---- SwiGLU ------------------------------------------------------------------------------------

// Values of a row handled per block: the blocks' buffers stay in L1 however wide the row is.
constexpr int64_t kSwigluBlock = 1024;

// n values of ``row`` plus ``bias`` (when there is one) in the accumulation type.
template <typename scalar_t>
const acc_type<scalar_t>* biased_row(const scalar_t* row, const acc_type<scalar_t>* bias,
                                     acc_type<scalar_t>* buffer, int64_t n) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const acc_t* values = acc_row(row, buffer, n);
  if (bias == nullptr) return values;
  const int64_t nv = n - n % L;
  for (int64_t j = 0; j < nv; j += L) {
    (Vec::loadu(values + j) + Vec::loadu(bias + j)).store(buffer + j);
  }
  for (int64_t j = nv; j < n; ++j) buffer[j] = values[j] + bias[j];
  return buffer;
}

// Lanes [0, vector_lanes(f)) of a row of f gates take the vector exp, the rest the scalar one:
// torch's elementwise loops split each contiguous row the same way (two vectors a step), so the
// float and float64 results equal those of F.silu and its backward value for value.
template <typename acc_t>
int64_t vector_lanes(int64_t f) {
  constexpr int64_t step = 2 * at::vec::Vectorized<acc_t>::size();
  static_assert(kSwigluBlock % step == 0, "a block must end on a vector step");
  return f - f % step;
}

template <typename scalar_t>
void swiglu_forward_rows(const void* y_ptr, const void* bias_ptr, int64_t f, int64_t begin,
                         int64_t end, void* out_ptr) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const int64_t fv = vector_lanes<acc_t>(f);
  const auto* y = static_cast<const scalar_t*>(y_ptr);
  const auto* bias = static_cast<const acc_t*>(bias_ptr);
  auto* out = static_cast<scalar_t*>(out_ptr);
  alignas(64) acc_t gate_buffer[kSwigluBlock], up_buffer[kSwigluBlock], out_buffer[kSwigluBlock];
  const Vec one(1);
  for (int64_t i = begin; i < end; ++i) {
    for (int64_t c = 0; c < f; c += kSwigluBlock) {
      const int64_t n = std::min(kSwigluBlock, f - c);
      const scalar_t* row = y + i * 2 * f + c;
      const acc_t* gate = biased_row(row, bias ? bias + c : nullptr, gate_buffer, n);
      const acc_t* up = biased_row(row + f, bias ? bias + f + c : nullptr, up_buffer, n);
      acc_t* o = acc_out(out + i * f + c, out_buffer);
      const int64_t nv = std::clamp<int64_t>(fv - c, 0, n);
      for (int64_t j = 0; j < nv; j += L) {
        const Vec x = Vec::loadu(gate + j);
        ((x / (one + x.neg().exp())) * Vec::loadu(up + j)).store(o + j);
      }
      for (int64_t j = nv; j < n; ++j) o[j] = swiglu_out(gate[j], up[j]);
      store_row(o, out + i * f + c, n);
    }
  }
}

template <typename scalar_t>
void swiglu_backward_rows(const void* grad_ptr, const void* y_ptr, const void* bias_ptr, int64_t f,
                          int64_t begin, int64_t end, void* grad_y_ptr) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const int64_t fv = vector_lanes<acc_t>(f);
  const auto* grad = static_cast<const scalar_t*>(grad_ptr);
  const auto* y = static_cast<const scalar_t*>(y_ptr);
  const auto* bias = static_cast<const acc_t*>(bias_ptr);
  auto* grad_y = static_cast<scalar_t*>(grad_y_ptr);
  alignas(64) acc_t gate_buffer[kSwigluBlock], up_buffer[kSwigluBlock], grad_buffer[kSwigluBlock];
  alignas(64) acc_t gate_out_buffer[kSwigluBlock], up_out_buffer[kSwigluBlock];
  const Vec one(1);
  for (int64_t i = begin; i < end; ++i) {
    for (int64_t c = 0; c < f; c += kSwigluBlock) {
      const int64_t n = std::min(kSwigluBlock, f - c);
      const scalar_t* row = y + i * 2 * f + c;
      const acc_t* gate = biased_row(row, bias ? bias + c : nullptr, gate_buffer, n);
      const acc_t* up = biased_row(row + f, bias ? bias + f + c : nullptr, up_buffer, n);
      const acc_t* g = acc_row(grad + i * f + c, grad_buffer, n);
      scalar_t* grad_row = grad_y + i * 2 * f + c;
      acc_t* og = acc_out(grad_row, gate_out_buffer);
      acc_t* ou = acc_out(grad_row + f, up_out_buffer);
      const int64_t nv = std::clamp<int64_t>(fv - c, 0, n);
      for (int64_t j = 0; j < nv; j += L) {
        const Vec x = Vec::loadu(gate + j), gj = Vec::loadu(g + j);
        const Vec denom = one + x.neg().exp();
        const Vec sigmoid = one / denom;
        const Vec slope = at::vec::fmadd(x, one - sigmoid, one);  // fma_acc's lanes
        (((gj * Vec::loadu(up + j)) * sigmoid) * slope).store(og + j);
        (gj * (x / denom)).store(ou + j);
      }
      for (int64_t j = nv; j < n; ++j) {
        const SwigluGrads<acc_t> grads = swiglu_grads(g[j], gate[j], up[j]);
        og[j] = grads.gate;
        ou[j] = grads.up;
      }
      store_row(og, grad_row, n);
      store_row(ou, grad_row + f, n);
    }
  }
}

// ---- Gated sigmoid units (offset, clamp, quick GELU) -----------------------------------------

// The gate (clamped above) and the linear half (clamped both ways), when ``p`` clamps.
template <typename acc_t>
void clamp_halves(at::vec::Vectorized<acc_t>& g, at::vec::Vectorized<acc_t>& u,
                  const GluParams& p) {
  using Vec = at::vec::Vectorized<acc_t>;
  if (!p.clamped) return;
  const Vec hi(static_cast<acc_t>(p.clamp_value)), lo(static_cast<acc_t>(-p.clamp_value));
  g = at::vec::minimum(g, hi);
  u = at::vec::clamp(u, lo, hi);
}

template <typename scalar_t>
void glu_forward_rows(const void* y_ptr, const void* bias_ptr, int64_t f, const GluParams& p,
                      int64_t begin, int64_t end, void* out_ptr) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const auto* y = static_cast<const scalar_t*>(y_ptr);
  const auto* bias = static_cast<const acc_t*>(bias_ptr);
  auto* out = static_cast<scalar_t*>(out_ptr);
  alignas(64) acc_t gate_buffer[kSwigluBlock], up_buffer[kSwigluBlock], out_buffer[kSwigluBlock];
  const Vec one(1), alpha(static_cast<acc_t>(p.alpha)), offset(static_cast<acc_t>(p.linear_offset));
  for (int64_t i = begin; i < end; ++i) {
    for (int64_t c = 0; c < f; c += kSwigluBlock) {
      const int64_t n = std::min(kSwigluBlock, f - c);
      const scalar_t* row = y + i * 2 * f + c;
      const acc_t* gate = biased_row(row, bias ? bias + c : nullptr, gate_buffer, n);
      const acc_t* up = biased_row(row + f, bias ? bias + f + c : nullptr, up_buffer, n);
      acc_t* o = acc_out(out + i * f + c, out_buffer);
      const int64_t nv = n - n % L;
      for (int64_t j = 0; j < nv; j += L) {
        Vec g = Vec::loadu(gate + j), u = Vec::loadu(up + j);
        clamp_halves(g, u, p);
        const Vec s = one / (one + (alpha * g).neg().exp());
        ((g * s) * (u + offset)).store(o + j);
      }
      for (int64_t j = nv; j < n; ++j) o[j] = glu_out(gate[j], up[j], p);
      store_row(o, out + i * f + c, n);
    }
  }
}

template <typename scalar_t>
void glu_backward_rows(const void* grad_ptr, const void* y_ptr, const void* bias_ptr, int64_t f,
                       const GluParams& p, int64_t begin, int64_t end, void* grad_y_ptr) {
  using acc_t = acc_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const auto* grad = static_cast<const scalar_t*>(grad_ptr);
  const auto* y = static_cast<const scalar_t*>(y_ptr);
  const auto* bias = static_cast<const acc_t*>(bias_ptr);
  auto* grad_y = static_cast<scalar_t*>(grad_y_ptr);
  alignas(64) acc_t gate_buffer[kSwigluBlock], up_buffer[kSwigluBlock], grad_buffer[kSwigluBlock];
  alignas(64) acc_t gate_out_buffer[kSwigluBlock], up_out_buffer[kSwigluBlock];
  const Vec one(1), alpha(static_cast<acc_t>(p.alpha)), offset(static_cast<acc_t>(p.linear_offset));
  const Vec hi(static_cast<acc_t>(p.clamp_value)), lo(static_cast<acc_t>(-p.clamp_value));
  for (int64_t i = begin; i < end; ++i) {
    for (int64_t c = 0; c < f; c += kSwigluBlock) {
      const int64_t n = std::min(kSwigluBlock, f - c);
      const scalar_t* row = y + i * 2 * f + c;
      const acc_t* gate = biased_row(row, bias ? bias + c : nullptr, gate_buffer, n);
      const acc_t* up = biased_row(row + f, bias ? bias + f + c : nullptr, up_buffer, n);
      const acc_t* gr = acc_row(grad + i * f + c, grad_buffer, n);
      scalar_t* grad_row = grad_y + i * 2 * f + c;
      acc_t* og = acc_out(grad_row, gate_out_buffer);
      acc_t* ou = acc_out(grad_row + f, up_out_buffer);
      const int64_t nv = n - n % L;
      for (int64_t j = 0; j < nv; j += L) {
        Vec g = Vec::loadu(gate + j), u = Vec::loadu(up + j);
        const Vec gj = Vec::loadu(gr + j);
        // All bits set where the gradient passes the clamp (comparisons give such lane masks).
        const Vec gate_passes = g < hi, up_passes = (u > lo) & (u < hi);
        clamp_halves(g, u, p);
        const Vec s = one / (one + (alpha * g).neg().exp());
        const Vec slope = at::vec::fmadd(alpha * g, one - s, one);  // fma_acc's lanes
        Vec d_gate = ((gj * (u + offset)) * s) * slope;
        Vec d_up = gj * (g * s);
        if (p.clamped) {
          d_gate = d_gate & gate_passes;
          d_up = d_up & up_passes;
        }
        d_gate.store(og + j);
        d_up.store(ou + j);
      }
      for (int64_t j = nv; j < n; ++j) {
        const SwigluGrads<acc_t> grads = glu_grads(gr[j], gate[j], up[j], p);
        og[j] = grads.gate;
        ou[j] = grads.up;
      }
      store_row(og, grad_row, n);
      store_row(ou, grad_row + f, n);
    }
  }
}

// ---- dtype dispatch (MEGATRON_EXT_FUSION_DISPATCH: llama_fusions_kernels.h) --------------

void rms_norm_forward(FusionDtype dtype, const void* x, const void* weight, double eps, int64_t h,
                      int64_t begin, int64_t end, void* y, void* rstd) {
  MEGATRON_EXT_FUSION_DISPATCH(dtype, rms_norm_forward_rows, x, weight, eps, h, begin, end, y, rstd)
}

void rms_norm_backward(FusionDtype dtype, const void* grad, const void* x, const void* weight,
                       const void* rstd, int64_t h, int64_t begin, int64_t end, void* grad_x,
                       void* grad_weight) {
  MEGATRON_EXT_FUSION_DISPATCH(dtype, rms_norm_backward_rows, grad, x, weight, rstd, h, begin, end,
                               grad_x, grad_weight)
}

void rotary(FusionDtype dtype, const void* input, const void* cos, const void* sin,
            const RotaryLayout& layout, bool backward, int64_t begin, int64_t end, void* out) {
  MEGATRON_EXT_FUSION_DISPATCH(dtype, rotary_heads, input, cos, sin, layout, backward, begin, end,
                               out)
}

void swiglu_forward(FusionDtype dtype, const void* y, const void* bias, int64_t f,
                    const GluParams& params, int64_t begin, int64_t end, void* out) {
  if (is_plain_swiglu(params)) {
    MEGATRON_EXT_FUSION_DISPATCH(dtype, swiglu_forward_rows, y, bias, f, begin, end, out)
  }
  MEGATRON_EXT_FUSION_DISPATCH(dtype, glu_forward_rows, y, bias, f, params, begin, end, out)
}

void swiglu_backward(FusionDtype dtype, const void* grad, const void* y, const void* bias,
                     int64_t f, const GluParams& params, int64_t begin, int64_t end, void* grad_y) {
  if (is_plain_swiglu(params)) {
    MEGATRON_EXT_FUSION_DISPATCH(dtype, swiglu_backward_rows, grad, y, bias, f, begin, end, grad_y)
  }
  MEGATRON_EXT_FUSION_DISPATCH(dtype, glu_backward_rows, grad, y, bias, f, params, begin, end,
                               grad_y)
}

#undef MEGATRON_EXT_FUSION_DISPATCH

}  // namespace

const LlamaFusionCpuKernels llama_fusion_cpu_kernels{&rms_norm_forward, &rms_norm_backward, &rotary,
                                                     &swiglu_forward, &swiglu_backward};

}  // namespace megatron_ext::kernels::CPU_CAPABILITY
