// CUDA kernels of RMSNorm, rotary embedding and SwiGLU (and its gated sigmoid variants), the
// arithmetic of kernels/llama_fusions.h (the CPU twins run the same). RMSNorm takes one block per
// row (a CUB block reduction for the row's sum) and sums its weight gradient over blocks of rows
// into a buffer, a group of columns per thread, then over the blocks; rotary embedding and SwiGLU
// are one grid-stride pass over the output, 16 bytes of elements per step where the widths and
// alignments allow (an element per step otherwise).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cub/block/block_reduce.cuh>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <type_traits>

#include "kernels/llama_fusions.h"
#include "kernels/llama_fusions_checks.h"
#include "kernels/cuda_launch.cuh"

namespace megatron_ext {
namespace {

using namespace kernels;

// ---- RMSNorm ---------------------------------------------------------------------------------

// The kernels read and write V consecutive elements per access: a 16-byte pack where the row
// width and the pointers allow (rms_norm_lanes), one element otherwise. Thread t of a block takes
// the lane groups t, t + blockDim.x, ... of a row.

template <typename scalar_t, typename acc_t, int V>
__global__ void rms_norm_forward_kernel(const scalar_t* __restrict__ x,
                                        const scalar_t* __restrict__ w, int64_t rows, int64_t h,
                                        acc_t eps, scalar_t* __restrict__ y,
                                        acc_t* __restrict__ rstd) {
  using L = Lanes<scalar_t, V>;
  using BlockReduce = cub::BlockReduce<acc_t, kThreads>;
  __shared__ typename BlockReduce::TempStorage storage;
  __shared__ acc_t row_rstd;
  const int64_t groups = h / V;
  const L* wl = reinterpret_cast<const L*>(w);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const L* xr = reinterpret_cast<const L*>(x + row * h);
    L* yr = reinterpret_cast<L*>(y + row * h);
    acc_t squares = 0;
    for (int64_t j = threadIdx.x; j < groups; j += blockDim.x) {
      const L xv = xr[j];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const acc_t v = static_cast<acc_t>(xv.v[k]);
        squares += v * v;
      }
    }
    const acc_t sum = BlockReduce(storage).Sum(squares);
    if (threadIdx.x == 0) {
      row_rstd = rms_norm_rstd(sum, h, eps);
      rstd[row] = row_rstd;
    }
    __syncthreads();
    const acc_t r = row_rstd;
    for (int64_t j = threadIdx.x; j < groups; j += blockDim.x) {
      const L xv = xr[j], wv = wl[j];
      L yv;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        yv.v[k] = static_cast<scalar_t>(
            rms_norm_out(static_cast<acc_t>(xv.v[k]), r, static_cast<acc_t>(wv.v[k])));
      }
      yr[j] = yv;
    }
    __syncthreads();  // storage and row_rstd are reused by the next row
  }
}

template <typename scalar_t, typename acc_t, int V>
__global__ void rms_norm_backward_kernel(const scalar_t* __restrict__ grad,
                                         const scalar_t* __restrict__ x,
                                         const scalar_t* __restrict__ w,
                                         const acc_t* __restrict__ rstd, int64_t rows, int64_t h,
                                         scalar_t* __restrict__ grad_x) {
  using L = Lanes<scalar_t, V>;
  using BlockReduce = cub::BlockReduce<acc_t, kThreads>;
  __shared__ typename BlockReduce::TempStorage storage;
  __shared__ acc_t row_coef;
  const int64_t groups = h / V;
  const L* wl = reinterpret_cast<const L*>(w);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const L* gr = reinterpret_cast<const L*>(grad + row * h);
    const L* xr = reinterpret_cast<const L*>(x + row * h);
    L* dr = reinterpret_cast<L*>(grad_x + row * h);
    const acc_t r = rstd[row];
    acc_t dot = 0;
    for (int64_t j = threadIdx.x; j < groups; j += blockDim.x) {
      const L gv = gr[j], xv = xr[j], wv = wl[j];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        dot += (static_cast<acc_t>(gv.v[k]) * static_cast<acc_t>(wv.v[k])) *
               static_cast<acc_t>(xv.v[k]);
      }
    }
    const acc_t total = BlockReduce(storage).Sum(dot);
    if (threadIdx.x == 0) row_coef = rms_norm_grad_coef(r, total, h);
    __syncthreads();
    const acc_t coef = row_coef;
    for (int64_t j = threadIdx.x; j < groups; j += blockDim.x) {
      const L gv = gr[j], xv = xr[j], wv = wl[j];
      L dv;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        dv.v[k] = static_cast<scalar_t>(rms_norm_grad_input(static_cast<acc_t>(gv.v[k]),
                                                            static_cast<acc_t>(xv.v[k]),
                                                            static_cast<acc_t>(wv.v[k]), r, coef));
      }
      dr[j] = dv;
    }
    __syncthreads();
  }
}

// partial[chunk, j] = sum over the chunk's rows of g (x rstd), one group of V columns per thread:
// a warp reads consecutive columns of a row.
template <typename scalar_t, typename acc_t, int V>
__global__ void rms_norm_weight_grad_kernel(const scalar_t* __restrict__ grad,
                                            const scalar_t* __restrict__ x,
                                            const acc_t* __restrict__ rstd, int64_t rows, int64_t h,
                                            int64_t rows_per_chunk, acc_t* __restrict__ partial) {
  using L = Lanes<scalar_t, V>;
  const int64_t groups = h / V;
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= groups) return;
  const int64_t first = blockIdx.y * rows_per_chunk;
  const int64_t last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  const L* gl = reinterpret_cast<const L*>(grad);
  const L* xl = reinterpret_cast<const L*>(x);
  acc_t sum[V] = {};
  for (int64_t row = first; row < last; ++row) {
    const L gv = gl[row * groups + j], xv = xl[row * groups + j];
    const acc_t r = rstd[row];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      sum[k] +=
          rms_norm_grad_weight_term(static_cast<acc_t>(gv.v[k]), static_cast<acc_t>(xv.v[k]), r);
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) partial[blockIdx.y * h + j * V + k] = sum[k];
}

// Calls launch(std::integral_constant<int, V>) with the widest V the row width and the pointers
// allow: a 16-byte pack, or one element.
template <typename scalar_t, typename Launch>
void with_rms_norm_lanes(int64_t h, std::initializer_list<const void*> pointers, Launch&& launch) {
  if (packs_fit<scalar_t>(h, pointers)) {
    launch(std::integral_constant<int, Pack<scalar_t>::kSize>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& input,
                                                         const at::Tensor& weight, double eps) {
  check_rms_norm_args("rms_norm_forward", input, weight, eps);
  const c10::cuda::CUDAGuard guard(input.device());
  const auto x = input.contiguous();
  const auto w = weight.contiguous();
  const int64_t h = x.size(-1);
  const int64_t rows = x.numel() / h;
  auto y = at::empty(x.sizes(), x.options());
  auto rstd = at::empty(x.sizes().slice(0, x.dim() - 1),
                        x.options().dtype(fusion_acc_type(x.scalar_type())));
  if (rows == 0) return {y, rstd};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_forward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const scalar_t* wp = w.const_data_ptr<scalar_t>();
        scalar_t* yp = y.mutable_data_ptr<scalar_t>();
        with_rms_norm_lanes<scalar_t>(h, {xp, wp, yp}, [&](auto lanes) {
          rms_norm_forward_kernel<scalar_t, acc_t, decltype(lanes)::value>
              <<<row_blocks(rows), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
                  xp, wp, rows, h, static_cast<acc_t>(eps), yp, rstd.mutable_data_ptr<acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_output,
                                                          const at::Tensor& input,
                                                          const at::Tensor& weight,
                                                          const at::Tensor& rstd) {
  check_rms_norm_backward_args(grad_output, input, weight, rstd);
  const c10::cuda::CUDAGuard guard(input.device());
  const auto g = grad_output.contiguous();
  const auto x = input.contiguous();
  const auto w = weight.contiguous();
  const auto r = rstd.contiguous();
  const int64_t h = x.size(-1);
  const int64_t rows = x.numel() / h;
  auto grad_x = at::empty(x.sizes(), x.options());
  if (rows == 0) return {grad_x, at::zeros_like(weight)};
  at::Tensor partial;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* gp = g.const_data_ptr<scalar_t>();
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const scalar_t* wp = w.const_data_ptr<scalar_t>();
        scalar_t* dp = grad_x.mutable_data_ptr<scalar_t>();
        with_rms_norm_lanes<scalar_t>(h, {gp, xp, wp, dp}, [&](auto lanes) {
          constexpr int V = decltype(lanes)::value;
          rms_norm_backward_kernel<scalar_t, acc_t, V><<<row_blocks(rows), kThreads, 0, stream>>>(
              gp, xp, wp, r.const_data_ptr<acc_t>(), rows, h, dp);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          // Enough chunks of rows that the weight-gradient grid fills the device about four
          // times over.
          const int64_t column_blocks = (h / V + kThreads - 1) / kThreads;
          const int64_t chunks = std::max<int64_t>(
              1,
              std::min<int64_t>(rows, (multiprocessors() * 4 + column_blocks - 1) / column_blocks));
          const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
          partial = at::empty({(rows + rows_per_chunk - 1) / rows_per_chunk, h},
                              x.options().dtype(fusion_acc_type(x.scalar_type())));
          const dim3 grid(static_cast<unsigned>(column_blocks),
                          static_cast<unsigned>(partial.size(0)));
          rms_norm_weight_grad_kernel<scalar_t, acc_t, V>
              <<<grid, kThreads, 0, stream>>>(gp, xp, r.const_data_ptr<acc_t>(), rows, h,
                                              rows_per_chunk, partial.mutable_data_ptr<acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  // The chunks' sums are added in the accumulation type, then rounded to the weight's dtype.
  return {grad_x, partial.sum(0).to(weight.scalar_type())};
}

// ---- rotary embedding ------------------------------------------------------------------------

template <typename scalar_t, typename acc_t>
__global__ void rotary_kernel(const scalar_t* __restrict__ input, const scalar_t* __restrict__ cos,
                              const scalar_t* __restrict__ sin, RotaryLayout layout, int64_t n,
                              bool backward, scalar_t* __restrict__ out) {
  const int64_t dim = layout.dim, rot = layout.rot_dim;
  for (int64_t e = global_thread(); e < n; e += grid_threads()) {
    const int64_t head = e / dim, lane = e % dim;
    const scalar_t* t = input + rotary_head_offset(layout, head);
    if (lane >= rot) {
      out[e] = t[lane];
      continue;
    }
    const scalar_t* c = cos + rotary_position(layout, head) * rot;
    const scalar_t* s = sin + rotary_position(layout, head) * rot;
    const int64_t p = rotary_partner(lane, rot, layout.interleaved);
    const bool negated = rotary_negated(lane, rot, layout.interleaved);
    const acc_t value =
        backward
            ? rotary_backward(static_cast<acc_t>(t[lane]), static_cast<acc_t>(t[p]),
                              static_cast<acc_t>(c[lane]), static_cast<acc_t>(s[p]), negated)
            : rotary_forward(static_cast<acc_t>(t[lane]), static_cast<acc_t>(t[p]),
                             static_cast<acc_t>(c[lane]), static_cast<acc_t>(s[lane]), negated);
    out[e] = static_cast<scalar_t>(value);
  }
}

// The packed kernel's work items per head: with pack size k, a pair of packs (lanes i and
// i + rot/2) or one pack of interleaved pairs per rotation item, then one pack per copied item.
__host__ __device__ __forceinline__ int64_t rotary_rotation_items(const RotaryLayout& l,
                                                                  int64_t k) {
  return l.interleaved ? l.rot_dim / k : l.rot_dim / (2 * k);
}

__host__ __device__ __forceinline__ int64_t rotary_pack_items(const RotaryLayout& l, int64_t k) {
  return rotary_rotation_items(l, k) + (l.dim - l.rot_dim) / k;
}

// The same arithmetic as rotary_kernel over 16-byte packs: each item reads its lanes and their
// partners once and writes both, and splits its index into head and lane once per pack.
template <typename scalar_t, typename acc_t>
__global__ void rotary_pack_kernel(const scalar_t* __restrict__ input,
                                   const scalar_t* __restrict__ cos,
                                   const scalar_t* __restrict__ sin, RotaryLayout layout,
                                   int64_t items, bool backward, scalar_t* __restrict__ out) {
  constexpr int k = Pack<scalar_t>::kSize;
  const int64_t per_head = rotary_pack_items(layout, k);
  const int64_t rotations = rotary_rotation_items(layout, k);
  const int64_t dim = layout.dim, rot = layout.rot_dim;
  for (int64_t e = global_thread(); e < items; e += grid_threads()) {
    const int64_t head = e / per_head, item = e - head * per_head;
    const scalar_t* t = input + rotary_head_offset(layout, head);
    scalar_t* o = out + head * dim;
    if (item >= rotations) {
      const int64_t lane = rot + (item - rotations) * k;
      *as_packs(o + lane) = *as_packs(t + lane);
      continue;
    }
    const scalar_t* c = cos + rotary_position(layout, head) * rot;
    const scalar_t* s = sin + rotary_position(layout, head) * rot;
    if (layout.interleaved) {
      // Lanes 2j and 2j + 1 of the pack are partners; the even lane takes its partner negated.
      const int64_t lane = item * k;
      const Pack<scalar_t> tv = *as_packs(t + lane), cv = *as_packs(c + lane),
                           sv = *as_packs(s + lane);
      Pack<scalar_t> ov;
#pragma unroll
      for (int j = 0; j < k; ++j) {
        const int p = j ^ 1;
        const bool negated = (j & 1) == 0;
        const acc_t a = static_cast<acc_t>(tv.v[j]), b = static_cast<acc_t>(tv.v[p]);
        ov.v[j] =
            static_cast<scalar_t>(backward ? rotary_backward(a, b, static_cast<acc_t>(cv.v[j]),
                                                             static_cast<acc_t>(sv.v[p]), negated)
                                           : rotary_forward(a, b, static_cast<acc_t>(cv.v[j]),
                                                            static_cast<acc_t>(sv.v[j]), negated));
      }
      *as_packs(o + lane) = ov;
      continue;
    }
    // Lane i of the first half (negated partner) and lane i + rot/2 of the second.
    const int64_t lo = item * k, hi = lo + rot / 2;
    const Pack<scalar_t> t_lo = *as_packs(t + lo), t_hi = *as_packs(t + hi);
    const Pack<scalar_t> c_lo = *as_packs(c + lo), c_hi = *as_packs(c + hi);
    const Pack<scalar_t> s_lo = *as_packs(s + lo), s_hi = *as_packs(s + hi);
    Pack<scalar_t> o_lo, o_hi;
#pragma unroll
    for (int j = 0; j < k; ++j) {
      const acc_t a = static_cast<acc_t>(t_lo.v[j]), b = static_cast<acc_t>(t_hi.v[j]);
      const acc_t ca = static_cast<acc_t>(c_lo.v[j]), cb = static_cast<acc_t>(c_hi.v[j]);
      const acc_t sa = static_cast<acc_t>(s_lo.v[j]), sb = static_cast<acc_t>(s_hi.v[j]);
      o_lo.v[j] = static_cast<scalar_t>(backward ? rotary_backward(a, b, ca, sb, true)
                                                 : rotary_forward(a, b, ca, sa, true));
      o_hi.v[j] = static_cast<scalar_t>(backward ? rotary_backward(b, a, cb, sa, false)
                                                 : rotary_forward(b, a, cb, sb, false));
    }
    *as_packs(o + lo) = o_lo;
    *as_packs(o + hi) = o_hi;
  }
}

at::Tensor rotary_cuda(const char* op, const at::Tensor& input, const at::Tensor& cos,
                       const at::Tensor& sin, bool interleaved, bool backward) {
  check_rotary_kernel_args(op, input, cos, sin);
  const c10::cuda::CUDAGuard guard(input.device());
  const auto t = input.stride(3) == 1 ? input : input.contiguous();
  const auto c = cos.contiguous();
  const auto s = sin.contiguous();
  auto out = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = out.numel();
  if (n == 0) return out;
  const RotaryLayout layout{t.size(1),   t.size(2),   t.size(3),   c.size(1),
                            t.stride(0), t.stride(1), t.stride(2), interleaved};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "rotary_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* tp = t.const_data_ptr<scalar_t>();
    const scalar_t* cp = c.const_data_ptr<scalar_t>();
    const scalar_t* sp = s.const_data_ptr<scalar_t>();
    scalar_t* outp = out.mutable_data_ptr<scalar_t>();
    const auto stream = at::cuda::getCurrentCUDAStream();
    constexpr int64_t k = Pack<scalar_t>::kSize;
    // Packs fit when every head, every row of cos and sin and each rotated group (a half, or
    // the whole rotated part when interleaved) starts on a 16-byte boundary.
    const int64_t group = interleaved ? layout.rot_dim : layout.rot_dim / 2;
    if (packs_fit<scalar_t>(layout.dim, {tp, cp, sp, outp}) && group % k == 0 &&
        layout.stride_s % k == 0 && layout.stride_b % k == 0 && layout.stride_n % k == 0) {
      const int64_t items = n / layout.dim * rotary_pack_items(layout, k);
      rotary_pack_kernel<scalar_t, acc_t>
          <<<blocks_for(items), kThreads, 0, stream>>>(tp, cp, sp, layout, items, backward, outp);
    } else {
      rotary_kernel<scalar_t, acc_t>
          <<<blocks_for(n), kThreads, 0, stream>>>(tp, cp, sp, layout, n, backward, outp);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor rotary_forward_cuda(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin,
                               bool interleaved) {
  return rotary_cuda("rotary_pos_emb_forward", t, cos, sin, interleaved, false);
}

at::Tensor rotary_backward_cuda(const at::Tensor& grad_output, const at::Tensor& cos,
                                const at::Tensor& sin, bool interleaved) {
  return rotary_cuda("rotary_pos_emb_backward", grad_output, cos, sin, interleaved, true);
}

// ---- SwiGLU (and the gated sigmoid units of GluParams) -----------------------------------------
// kPlain: plain SwiGLU's arithmetic (swiglu_out / swiglu_grads); else glu_out / glu_grads of ``p``.

template <bool kPlain, typename acc_t>
__device__ __forceinline__ acc_t unit_out(acc_t gate, acc_t up, const GluParams& p) {
  if constexpr (kPlain) {
    return swiglu_out(gate, up);
  } else {
    return glu_out(gate, up, p);
  }
}

template <bool kPlain, typename acc_t>
__device__ __forceinline__ SwigluGrads<acc_t> unit_grads(acc_t grad, acc_t gate, acc_t up,
                                                         const GluParams& p) {
  if constexpr (kPlain) {
    return swiglu_grads(grad, gate, up);
  } else {
    return glu_grads(grad, gate, up, p);
  }
}

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t biased(const scalar_t* y, const scalar_t* bias, int64_t row,
                                        int64_t col, int64_t width) {
  const acc_t v = static_cast<acc_t>(y[row * width + col]);
  return bias ? v + static_cast<acc_t>(bias[col]) : v;
}

template <bool kPlain, typename scalar_t, typename acc_t>
__global__ void swiglu_forward_kernel(const scalar_t* __restrict__ y,
                                      const scalar_t* __restrict__ bias, int64_t n, int64_t f,
                                      GluParams p, scalar_t* __restrict__ out) {
  for (int64_t e = global_thread(); e < n; e += grid_threads()) {
    const int64_t row = e / f, j = e % f;
    const acc_t gate = biased<scalar_t, acc_t>(y, bias, row, j, 2 * f);
    const acc_t up = biased<scalar_t, acc_t>(y, bias, row, f + j, 2 * f);
    out[e] = static_cast<scalar_t>(unit_out<kPlain>(gate, up, p));
  }
}

template <bool kPlain, typename scalar_t, typename acc_t>
__global__ void swiglu_backward_kernel(const scalar_t* __restrict__ grad,
                                       const scalar_t* __restrict__ y,
                                       const scalar_t* __restrict__ bias, int64_t n, int64_t f,
                                       GluParams p, scalar_t* __restrict__ grad_y) {
  for (int64_t e = global_thread(); e < n; e += grid_threads()) {
    const int64_t row = e / f, j = e % f;
    const acc_t gate = biased<scalar_t, acc_t>(y, bias, row, j, 2 * f);
    const acc_t up = biased<scalar_t, acc_t>(y, bias, row, f + j, 2 * f);
    const SwigluGrads<acc_t> grads = unit_grads<kPlain>(static_cast<acc_t>(grad[e]), gate, up, p);
    grad_y[row * 2 * f + j] = static_cast<scalar_t>(grads.gate);
    grad_y[row * 2 * f + f + j] = static_cast<scalar_t>(grads.up);
  }
}

// The same arithmetic over 16-byte packs, for halves a whole number of packs wide and 16-byte
// aligned tensors. gate_up_packs brings output pack e's gate and up values (their biases added)
// into the accumulation type and returns the gate pack's offset in y (up's is f further).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ int64_t gate_up_packs(const scalar_t* y, const scalar_t* bias, int64_t e,
                                                 int64_t f, acc_t* gate, acc_t* up) {
  constexpr int k = Pack<scalar_t>::kSize;
  const int64_t row = e / (f / k), col = e * k - row * f;
  const int64_t at = row * 2 * f + col;
  const Pack<scalar_t> g = *as_packs(y + at), u = *as_packs(y + at + f);
#pragma unroll
  for (int j = 0; j < k; ++j) {
    gate[j] = static_cast<acc_t>(g.v[j]);
    up[j] = static_cast<acc_t>(u.v[j]);
  }
  if (bias) {
    const Pack<scalar_t> bg = *as_packs(bias + col), bu = *as_packs(bias + f + col);
#pragma unroll
    for (int j = 0; j < k; ++j) {
      gate[j] += static_cast<acc_t>(bg.v[j]);
      up[j] += static_cast<acc_t>(bu.v[j]);
    }
  }
  return at;
}

template <bool kPlain, typename scalar_t, typename acc_t>
__global__ void swiglu_forward_pack_kernel(const scalar_t* __restrict__ y,
                                           const scalar_t* __restrict__ bias, int64_t items,
                                           int64_t f, GluParams p, scalar_t* __restrict__ out) {
  constexpr int k = Pack<scalar_t>::kSize;
  for (int64_t e = global_thread(); e < items; e += grid_threads()) {
    acc_t gate[k], up[k];
    gate_up_packs(y, bias, e, f, gate, up);
    Pack<scalar_t> o;
#pragma unroll
    for (int j = 0; j < k; ++j) o.v[j] = static_cast<scalar_t>(unit_out<kPlain>(gate[j], up[j], p));
    as_packs(out)[e] = o;
  }
}

template <bool kPlain, typename scalar_t, typename acc_t>
__global__ void swiglu_backward_pack_kernel(const scalar_t* __restrict__ grad,
                                            const scalar_t* __restrict__ y,
                                            const scalar_t* __restrict__ bias, int64_t items,
                                            int64_t f, GluParams p, scalar_t* __restrict__ grad_y) {
  constexpr int k = Pack<scalar_t>::kSize;
  for (int64_t e = global_thread(); e < items; e += grid_threads()) {
    acc_t gate[k], up[k];
    const int64_t at = gate_up_packs(y, bias, e, f, gate, up);
    const Pack<scalar_t> g = as_packs(grad)[e];
    Pack<scalar_t> d_gate, d_up;
#pragma unroll
    for (int j = 0; j < k; ++j) {
      const SwigluGrads<acc_t> grads =
          unit_grads<kPlain>(static_cast<acc_t>(g.v[j]), gate[j], up[j], p);
      d_gate.v[j] = static_cast<scalar_t>(grads.gate);
      d_up.v[j] = static_cast<scalar_t>(grads.up);
    }
    *as_packs(grad_y + at) = d_gate;
    *as_packs(grad_y + at + f) = d_up;
  }
}

template <bool kPlain, typename scalar_t>
void launch_swiglu_forward(const scalar_t* yp, const scalar_t* bp, int64_t n, int64_t f,
                           const GluParams& p, scalar_t* op) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (packs_fit<scalar_t>(f, {yp, bp, op})) {
    const int64_t items = n / Pack<scalar_t>::kSize;
    swiglu_forward_pack_kernel<kPlain, scalar_t, acc_t>
        <<<blocks_for(items), kThreads, 0, stream>>>(yp, bp, items, f, p, op);
  } else {
    swiglu_forward_kernel<kPlain, scalar_t, acc_t>
        <<<blocks_for(n), kThreads, 0, stream>>>(yp, bp, n, f, p, op);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kPlain, typename scalar_t>
void launch_swiglu_backward(const scalar_t* gp, const scalar_t* yp, const scalar_t* bp, int64_t n,
                            int64_t f, const GluParams& p, scalar_t* op) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (packs_fit<scalar_t>(f, {gp, yp, bp, op})) {
    const int64_t items = n / Pack<scalar_t>::kSize;
    swiglu_backward_pack_kernel<kPlain, scalar_t, acc_t>
        <<<blocks_for(items), kThreads, 0, stream>>>(gp, yp, bp, items, f, p, op);
  } else {
    swiglu_backward_kernel<kPlain, scalar_t, acc_t>
        <<<blocks_for(n), kThreads, 0, stream>>>(gp, yp, bp, n, f, p, op);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor swiglu_forward_cuda(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                               double alpha, double linear_offset,
                               std::optional<double> clamp_value) {
  check_swiglu_args("swiglu_forward", input, bias);
  const GluParams params = glu_params("swiglu_forward", alpha, linear_offset, clamp_value);
  const c10::cuda::CUDAGuard guard(input.device());
  const auto y = input.contiguous();
  const auto b = has_tensor(bias) ? bias->contiguous() : at::Tensor();
  const int64_t f = y.size(-1) / 2;
  auto sizes = y.sizes().vec();
  sizes.back() = f;
  auto out = at::empty(sizes, y.options());
  const int64_t n = out.numel();
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, y.scalar_type(), "swiglu_forward_cuda", [&] {
        const scalar_t* yp = y.const_data_ptr<scalar_t>();
        const scalar_t* bp = b.defined() ? b.const_data_ptr<scalar_t>() : nullptr;
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        if (is_plain_swiglu(params)) {
          launch_swiglu_forward<true>(yp, bp, n, f, params, op);
        } else {
          launch_swiglu_forward<false>(yp, bp, n, f, params, op);
        }
      });
  return out;
}

at::Tensor swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                const std::optional<at::Tensor>& bias, double alpha,
                                double linear_offset, std::optional<double> clamp_value) {
  check_swiglu_backward_args(grad_output, input, bias);
  const GluParams params = glu_params("swiglu_backward", alpha, linear_offset, clamp_value);
  const c10::cuda::CUDAGuard guard(input.device());
  const auto g = grad_output.contiguous();
  const auto y = input.contiguous();
  const auto b = has_tensor(bias) ? bias->contiguous() : at::Tensor();
  auto grad_y = at::empty(y.sizes(), y.options());
  const int64_t n = g.numel();
  if (n == 0) return grad_y;
  const int64_t f = y.size(-1) / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, y.scalar_type(), "swiglu_backward_cuda", [&] {
        const scalar_t* gp = g.const_data_ptr<scalar_t>();
        const scalar_t* yp = y.const_data_ptr<scalar_t>();
        const scalar_t* bp = b.defined() ? b.const_data_ptr<scalar_t>() : nullptr;
        scalar_t* op = grad_y.mutable_data_ptr<scalar_t>();
        if (is_plain_swiglu(params)) {
          launch_swiglu_backward<true>(gp, yp, bp, n, f, params, op);
        } else {
          launch_swiglu_backward<false>(gp, yp, bp, n, f, params, op);
        }
      });
  return grad_y;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CUDA, m) {
  m.impl("rms_norm_forward", &rms_norm_forward_cuda);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
  m.impl("rotary_pos_emb_forward", &rotary_forward_cuda);
  m.impl("rotary_pos_emb_backward", &rotary_backward_cuda);
  m.impl("swiglu_forward", &swiglu_forward_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
}

}  // namespace megatron_ext
