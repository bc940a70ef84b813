// CUDA kernels of the Mamba-2 SSD scan, the arithmetic of kernels/mamba_ssd.h (the CPU loops run
// the same). Kept simple: a block per (segment, head) task runs its chunks in order (the backward
// in reverse order, from the saved chunk-boundary states), each chunk in phases separated by
// __syncthreads(), every phase a block-stride loop over its outputs, each output a plain sum in
// the accumulation dtype. A block's chunk scores C_t . B_s and their gradients live in a global
// scratch buffer of its own; the state (forward) and its gradient (backward) in global memory.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/cuda_launch.cuh"
#include "kernels/mamba_ssd.h"
#include "kernels/mamba_ssd_checks.h"

namespace megatron_ext {
namespace {

using namespace kernels;
using OptionalTensor = std::optional<at::Tensor>;

// The longest chunk a block takes: its per-token values are in shared memory.
constexpr int64_t kMaxSsdChunk = 1024;

// Sizes and pointers every kernel takes. x, B, C, z in the tensors' dtype; the rest in acc_t (dt
// already converted); D, z, dt_bias and init null without.
template <typename scalar_t, typename acc_t>
struct SsdCudaArgs {
  const scalar_t* x;
  const acc_t* dt;
  const acc_t* A;
  const scalar_t* B;
  const scalar_t* C;
  const acc_t* D;
  const scalar_t* z;
  const acc_t* dt_bias;
  const acc_t* init;
  const SsdSegment* segments;
  int64_t num_segments, length, heads, headdim, groups, dstate, chunk;
  bool d_per_channel, softplus;
  acc_t lo, hi;
};

template <typename scalar_t, typename acc_t>
struct SsdChunkView {
  const SsdCudaArgs<scalar_t, acc_t>& a;
  int64_t b, h, g, t0;
  __device__ int64_t tok(int64_t t) const { return a.length * b + t0 + t; }
  __device__ acc_t x(int64_t t, int64_t p) const {
    return static_cast<acc_t>(a.x[(tok(t) * a.heads + h) * a.headdim + p]);
  }
  __device__ acc_t z(int64_t t, int64_t p) const {
    return static_cast<acc_t>(a.z[(tok(t) * a.heads + h) * a.headdim + p]);
  }
  __device__ acc_t B(int64_t t, int64_t n) const {
    return static_cast<acc_t>(a.B[(tok(t) * a.groups + g) * a.dstate + n]);
  }
  __device__ acc_t C(int64_t t, int64_t n) const {
    return static_cast<acc_t>(a.C[(tok(t) * a.groups + g) * a.dstate + n]);
  }
  __device__ acc_t d(int64_t p) const {
    if (a.D == nullptr) return acc_t(0);
    return a.d_per_channel ? a.D[h * a.headdim + p] : a.D[h];
  }
};

// The steps dt' and their cumulative sums cs of a chunk (thread 0, in token order, as the CPU).
template <typename scalar_t, typename acc_t>
__device__ void ssd_chunk_steps(const SsdCudaArgs<scalar_t, acc_t>& a,
                                const SsdChunkView<scalar_t, acc_t>& c, int64_t T, acc_t* raw,
                                acc_t* step, acc_t* cs) {
  if (threadIdx.x == 0) {
    const acc_t A = a.A[c.h];
    const acc_t bias = a.dt_bias == nullptr ? acc_t(0) : a.dt_bias[c.h];
    acc_t run = 0;
    for (int64_t t = 0; t < T; ++t) {
      raw[t] = a.dt[c.tok(t) * a.heads + c.h] + bias;
      step[t] = ssd_dt(raw[t], a.softplus, a.lo, a.hi);
      run += step[t] * A;
      cs[t] = run;
    }
  }
  __syncthreads();
}

// scores[t * T + s] = C_t . B_s.
template <typename scalar_t, typename acc_t>
__device__ void ssd_chunk_scores(const SsdChunkView<scalar_t, acc_t>& c, int64_t T, int64_t N,
                                 acc_t* scores) {
  for (int64_t i = threadIdx.x; i < T * T; i += blockDim.x) {
    const int64_t t = i / T, s = i % T;
    acc_t dot = 0;
    for (int64_t n = 0; n < N; ++n) dot += c.C(t, n) * c.B(s, n);
    scores[i] = dot;
  }
  __syncthreads();
}

// The output before the gate: sum_{s <= t} exp(cs_t - cs_s) scores dt'_s x_s + exp(cs_t) C_t S_in
// + D x_t.
template <typename scalar_t, typename acc_t>
__device__ acc_t ssd_chunk_output(const SsdChunkView<scalar_t, acc_t>& c, int64_t T, int64_t N,
                                  const acc_t* step, const acc_t* cs, const acc_t* scores,
                                  const acc_t* state, int64_t t, int64_t p) {
  acc_t y = 0;
  for (int64_t s = 0; s <= t; ++s) {
    y += ssd_decay(cs[t], cs[s]) * scores[t * T + s] * step[s] * c.x(s, p);
  }
  acc_t off = 0;
  for (int64_t n = 0; n < N; ++n) off += state[p * N + n] * c.C(t, n);
  return y + ssd_decay(cs[t], acc_t(0)) * off + c.d(p) * c.x(t, p);
}

// Block per task (segment, head); ``state`` holds each task's running state (the final states
// tensor), ``scratch`` chunk * chunk values per block.
template <typename scalar_t, typename acc_t>
__global__ void ssd_forward_kernel(SsdCudaArgs<scalar_t, acc_t> a, scalar_t* __restrict__ y,
                                   acc_t* __restrict__ final_states,
                                   acc_t* __restrict__ chunk_states, acc_t* __restrict__ scratch) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  acc_t* raw = reinterpret_cast<acc_t*>(shared_bytes);
  acc_t* step = raw + a.chunk;
  acc_t* cs = step + a.chunk;
  acc_t* scores = scratch + blockIdx.x * a.chunk * a.chunk;
  const int64_t H = a.heads, P = a.headdim, N = a.dstate, PN = P * N;
  for (int64_t task = blockIdx.x; task < a.num_segments * H; task += gridDim.x) {
    const SsdSegment seg = a.segments[task / H];
    const int64_t h = task % H;
    acc_t* state = final_states + (seg.state * H + h) * PN;
    for (int64_t i = threadIdx.x; i < PN; i += blockDim.x) {
      state[i] = a.init == nullptr ? acc_t(0) : a.init[(seg.state * H + h) * PN + i];
    }
    __syncthreads();
    const int64_t chunks = ssd_chunks(seg.end - seg.start, a.chunk);
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t t0 = seg.start + k * a.chunk;
      const int64_t T = seg.end - t0 < a.chunk ? seg.end - t0 : a.chunk;
      const SsdChunkView<scalar_t, acc_t> c{a, seg.batch, h, h / (H / a.groups), t0};
      acc_t* saved = chunk_states + ((seg.chunk_base + k) * H + h) * PN;
      for (int64_t i = threadIdx.x; i < PN; i += blockDim.x) saved[i] = state[i];
      ssd_chunk_steps(a, c, T, raw, step, cs);
      ssd_chunk_scores(c, T, N, scores);
      for (int64_t i = threadIdx.x; i < T * P; i += blockDim.x) {
        const int64_t t = i / P, p = i % P;
        acc_t out = ssd_chunk_output(c, T, N, step, cs, scores, state, t, p);
        if (a.z != nullptr) out = ssd_gate(out, c.z(t, p));
        y[(c.tok(t) * H + h) * P + p] = static_cast<scalar_t>(out);
      }
      __syncthreads();
      const acc_t last = cs[T - 1];
      for (int64_t i = threadIdx.x; i < PN; i += blockDim.x) {
        const int64_t p = i / N, n = i % N;
        acc_t add = 0;
        for (int64_t s = 0; s < T; ++s) {
          add += ssd_decay(last, cs[s]) * step[s] * c.x(s, p) * c.B(s, n);
        }
        state[i] = ssd_decay(last, acc_t(0)) * state[i] + add;
      }
      __syncthreads();
    }
  }
}

// The backward's tensors: gy (x's dtype), gfinal (null without) and the saved states; outputs gx,
// gz (x's dtype), gdt, gBh, gCh [B, L, H, N], ginit, part [segments, H, P + 2] (acc_t); per block
// scratch: scores and their gradients (chunk * chunk each), dY, Xd, K (chunk * P each), and two
// state gradients (P * N each).
template <typename scalar_t, typename acc_t>
struct SsdCudaGrads {
  const scalar_t* gy;
  const acc_t* gfinal;
  const acc_t* states;
  scalar_t* gx;
  scalar_t* gz;
  acc_t* gdt;
  acc_t* gBh;
  acc_t* gCh;
  acc_t* ginit;
  acc_t* part;
  acc_t* scratch;
};

__host__ __device__ inline int64_t ssd_backward_scratch(int64_t chunk, int64_t P, int64_t N) {
  return 2 * chunk * chunk + 3 * chunk * P + 2 * P * N;
}

template <typename scalar_t, typename acc_t>
__global__ void ssd_backward_kernel(SsdCudaArgs<scalar_t, acc_t> a,
                                    SsdCudaGrads<scalar_t, acc_t> g) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int64_t l = a.chunk, H = a.heads, P = a.headdim, N = a.dstate, PN = P * N;
  acc_t* raw = reinterpret_cast<acc_t*>(shared_bytes);
  acc_t* step = raw + l;
  acc_t* cs = step + l;
  acc_t* dcs = cs + l;
  acc_t* per_token_A = dcs + l;
  acc_t* scores = g.scratch + blockIdx.x * ssd_backward_scratch(l, P, N);
  acc_t* dscores = scores + l * l;
  acc_t* dY = dscores + l * l;
  acc_t* Xd = dY + l * P;
  acc_t* K = Xd + l * P;
  acc_t* dstate = K + l * P;
  acc_t* dstate_next = dstate + PN;
  for (int64_t task = blockIdx.x; task < a.num_segments * H; task += gridDim.x) {
    const SsdSegment seg = a.segments[task / H];
    const int64_t h = task % H;
    const acc_t A = a.A[h];
    acc_t* part = g.part + task * (P + 2);
    for (int64_t i = threadIdx.x; i < PN; i += blockDim.x) {
      dstate[i] = g.gfinal == nullptr ? acc_t(0) : g.gfinal[(seg.state * H + h) * PN + i];
    }
    for (int64_t i = threadIdx.x; i < P + 2; i += blockDim.x) part[i] = 0;
    __syncthreads();
    const int64_t chunks = ssd_chunks(seg.end - seg.start, l);
    for (int64_t k = chunks - 1; k >= 0; --k) {
      const int64_t t0 = seg.start + k * l;
      const int64_t T = seg.end - t0 < l ? seg.end - t0 : l;
      const SsdChunkView<scalar_t, acc_t> c{a, seg.batch, h, h / (H / a.groups), t0};
      const acc_t* state_in = g.states + ((seg.chunk_base + k) * H + h) * PN;
      ssd_chunk_steps(a, c, T, raw, step, cs);
      ssd_chunk_scores(c, T, N, scores);
      const acc_t last = cs[T - 1];
      // dY (through the gate), Xd = dt' x, K = B dS_out^T.
      for (int64_t i = threadIdx.x; i < T * P; i += blockDim.x) {
        const int64_t t = i / P, p = i % P;
        const acc_t go = static_cast<acc_t>(g.gy[(c.tok(t) * H + h) * P + p]);
        if (a.z != nullptr) {
          const acc_t zv = c.z(t, p);
          const acc_t pre = ssd_chunk_output(c, T, N, step, cs, scores, state_in, t, p);
          g.gz[(c.tok(t) * H + h) * P + p] = static_cast<scalar_t>(ssd_gate_grad_z(go, pre, zv));
          dY[i] = ssd_gate(go, zv);
        } else {
          dY[i] = go;
        }
        Xd[i] = step[t] * c.x(t, p);
        acc_t kv = 0;
        for (int64_t n = 0; n < N; ++n) kv += c.B(t, n) * dstate[p * N + n];
        K[i] = kv;
      }
      __syncthreads();
      // dscores[t, s] = (dY_t . Xd_s) exp(cs_t - cs_s) for s <= t.
      for (int64_t i = threadIdx.x; i < T * T; i += blockDim.x) {
        const int64_t t = i / T, s = i % T;
        acc_t dm = 0;
        if (s <= t) {
          for (int64_t p = 0; p < P; ++p) dm += dY[t * P + p] * Xd[s * P + p];
          dm *= ssd_decay(cs[t], cs[s]);
        }
        dscores[i] = dm;
      }
      __syncthreads();
      // dcs[t]: the mask's, the inter-chunk output's and the passed state's parts.
      for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
        acc_t v = 0;
        for (int64_t s = 0; s <= t; ++s) v += dscores[t * T + s] * scores[t * T + s];
        for (int64_t u = t; u < T; ++u) v -= dscores[u * T + t] * scores[u * T + t];
        acc_t off = 0;
        for (int64_t p = 0; p < P; ++p) {
          acc_t cstate = 0;
          for (int64_t n = 0; n < N; ++n) cstate += state_in[p * N + n] * c.C(t, n);
          off += dY[t * P + p] * cstate;
        }
        v += ssd_decay(cs[t], acc_t(0)) * off;
        auto dw = [&](int64_t s) {
          acc_t sum = 0;
          for (int64_t p = 0; p < P; ++p) sum += Xd[s * P + p] * K[s * P + p];
          return sum * ssd_decay(last, cs[s]);
        };
        v -= dw(t);
        if (t == T - 1) {
          for (int64_t s = 0; s < T; ++s) v += dw(s);
          acc_t carried = 0;
          for (int64_t i = 0; i < PN; ++i) carried += dstate[i] * state_in[i];
          v += ssd_decay(last, acc_t(0)) * carried;
        }
        dcs[t] = v;
      }
      __syncthreads();
      if (threadIdx.x == 0) {  // da_t = sum_{u >= t} dcs_u
        acc_t run = 0;
        for (int64_t t = T - 1; t >= 0; --t) {
          run += dcs[t];
          dcs[t] = run;
        }
      }
      __syncthreads();
      // dXd, dx; K becomes dXd.
      for (int64_t i = threadIdx.x; i < T * P; i += blockDim.x) {
        const int64_t t = i / P, p = i % P;
        acc_t v = 0;
        for (int64_t u = t; u < T; ++u) {
          v += ssd_decay(cs[u], cs[t]) * scores[u * T + t] * dY[u * P + p];
        }
        const acc_t dxd = v + ssd_decay(last, cs[t]) * K[i];
        g.gx[(c.tok(t) * H + h) * P + p] = static_cast<scalar_t>(c.d(p) * dY[i] + step[t] * dxd);
        K[i] = dxd;
      }
      __syncthreads();
      for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
        acc_t dstep = 0;
        for (int64_t p = 0; p < P; ++p) dstep += K[t * P + p] * c.x(t, p);
        dstep += dcs[t] * A;
        per_token_A[t] = dcs[t] * step[t];
        raw[t] = ssd_dt_grad(dstep, raw[t], a.softplus, a.lo, a.hi);
        g.gdt[c.tok(t) * H + h] = raw[t];
      }
      for (int64_t p = threadIdx.x; p < P; p += blockDim.x) {
        acc_t sum = 0;
        for (int64_t t = 0; t < T; ++t) sum += dY[t * P + p] * c.x(t, p);
        part[2 + p] += sum;
      }
      // dB, dC (per head).
      for (int64_t i = threadIdx.x; i < T * N; i += blockDim.x) {
        const int64_t t = i / N, n = i % N;
        acc_t db = 0, dc = 0;
        for (int64_t u = t; u < T; ++u) db += dscores[u * T + t] * c.C(u, n);
        acc_t passed = 0, off = 0;
        for (int64_t p = 0; p < P; ++p) {
          passed += Xd[t * P + p] * dstate[p * N + n];
          off += dY[t * P + p] * state_in[p * N + n];
        }
        db += ssd_decay(last, cs[t]) * passed;
        for (int64_t s = 0; s <= t; ++s) dc += dscores[t * T + s] * c.B(s, n);
        dc += ssd_decay(cs[t], acc_t(0)) * off;
        g.gBh[(c.tok(t) * H + h) * N + n] = db;
        g.gCh[(c.tok(t) * H + h) * N + n] = dc;
      }
      // The state gradient passed to the chunk before.
      for (int64_t i = threadIdx.x; i < PN; i += blockDim.x) {
        const int64_t p = i / N, n = i % N;
        acc_t v = 0;
        for (int64_t t = 0; t < T; ++t) v += ssd_decay(cs[t], acc_t(0)) * dY[t * P + p] * c.C(t, n);
        dstate_next[i] = v + ssd_decay(last, acc_t(0)) * dstate[i];
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        for (int64_t t = 0; t < T; ++t) {
          part[0] += per_token_A[t];
          part[1] += raw[t];
        }
      }
      acc_t* swap = dstate;
      dstate = dstate_next;
      dstate_next = swap;
      __syncthreads();
    }
    if (g.ginit != nullptr) {
      for (int64_t i = threadIdx.x; i < PN; i += blockDim.x) {
        g.ginit[(seg.state * H + h) * PN + i] = dstate[i];
      }
    }
    __syncthreads();
  }
}

// The kernels' inputs: x, B, C, z contiguous; dt, A, D, dt_bias, initial states contiguous in the
// accumulation dtype; the segments on the device.
struct SsdCudaTensors {
  at::Tensor x, dt, A, B, C, D, z, dt_bias, init, segments;
  std::vector<SsdSegment> host_segments;
  int64_t total_chunks, state_rows, chunk;
};

at::Tensor ssd_acc_contiguous(const OptionalTensor& t, at::ScalarType acc) {
  return has_tensor(t) ? t->to(acc).contiguous() : at::Tensor();
}

SsdCudaTensors ssd_cuda_tensors(const char* op, const at::Tensor& x, const at::Tensor& dt,
                                const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                                int64_t chunk_size, const OptionalTensor& D,
                                const OptionalTensor& z, const OptionalTensor& dt_bias,
                                const OptionalTensor& initial_states,
                                const OptionalTensor& cu_seqlens, double dt_min,
                                std::optional<double> dt_max) {
  check_mamba_chunk_scan_args(op, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
                              cu_seqlens, dt_min, dt_max);
  SsdCudaTensors t;
  const auto acc = fusion_acc_type(x.scalar_type());
  t.x = x.contiguous();
  t.dt = dt.to(acc).contiguous();
  t.A = A.to(acc).contiguous();
  t.B = B.contiguous();
  t.C = C.contiguous();
  t.D = ssd_acc_contiguous(D, acc);
  t.z = has_tensor(z) ? z->contiguous() : at::Tensor();
  t.dt_bias = ssd_acc_contiguous(dt_bias, acc);
  t.init = ssd_acc_contiguous(initial_states, acc);
  t.host_segments = ssd_segments(op, x, cu_seqlens, chunk_size, &t.total_chunks);
  t.state_rows = ssd_state_rows(x, cu_seqlens);
  int64_t longest = 1;
  for (const auto& s : t.host_segments) {
    longest = std::max(longest, std::min(chunk_size, s.end - s.start));
  }
  t.chunk = longest;
  TORCH_CHECK_VALUE(t.chunk <= kMaxSsdChunk, op, ": on CUDA a chunk holds at most ", kMaxSsdChunk,
                    " tokens, got chunk_size ", chunk_size);
  const auto bytes = static_cast<int64_t>(t.host_segments.size() * sizeof(SsdSegment));
  auto host =
      at::empty({std::max<int64_t>(bytes, 1)}, x.options().dtype(at::kByte).device(at::kCPU));
  if (bytes > 0) std::memcpy(host.mutable_data_ptr(), t.host_segments.data(), bytes);
  t.segments = host.to(x.device());
  return t;
}

template <typename scalar_t, typename acc_t>
SsdCudaArgs<scalar_t, acc_t> ssd_cuda_args(const SsdCudaTensors& t, bool softplus, double lo,
                                           double hi) {
  auto ptr = [](const at::Tensor& v) {
    return v.defined() ? v.const_data_ptr<acc_t>() : static_cast<const acc_t*>(nullptr);
  };
  return {t.x.const_data_ptr<scalar_t>(),
          ptr(t.dt),
          ptr(t.A),
          t.B.const_data_ptr<scalar_t>(),
          t.C.const_data_ptr<scalar_t>(),
          ptr(t.D),
          t.z.defined() ? t.z.const_data_ptr<scalar_t>() : nullptr,
          ptr(t.dt_bias),
          ptr(t.init),
          reinterpret_cast<const SsdSegment*>(t.segments.const_data_ptr()),
          static_cast<int64_t>(t.host_segments.size()),
          t.x.size(1),
          t.x.size(2),
          t.x.size(3),
          t.B.size(2),
          t.B.size(3),
          t.chunk,
          t.D.defined() && t.D.dim() == 2,
          softplus,
          static_cast<acc_t>(lo),
          static_cast<acc_t>(hi)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mamba_chunk_scan_forward_cuda(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, int64_t chunk_size, const OptionalTensor& D, const OptionalTensor& z,
    const OptionalTensor& dt_bias, const OptionalTensor& initial_states,
    const OptionalTensor& cu_seqlens, bool dt_softplus, double dt_min,
    std::optional<double> dt_max) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto t = ssd_cuda_tensors("mamba_chunk_scan_forward", x, dt, A, B, C, chunk_size, D, z,
                                  dt_bias, initial_states, cu_seqlens, dt_min, dt_max);
  const auto acc_opts = x.options().dtype(fusion_acc_type(x.scalar_type()));
  const int64_t H = x.size(2), P = x.size(3), N = B.size(3);
  auto y = at::empty(t.x.sizes(), t.x.options());
  auto final_states = at::empty({t.state_rows, H, P, N}, acc_opts);
  auto chunk_states = at::empty({t.total_chunks, H, P, N}, acc_opts);
  const int64_t tasks = static_cast<int64_t>(t.host_segments.size()) * H;
  if (tasks == 0 || P == 0 || N == 0) return {y, final_states.zero_(), chunk_states};
  const auto blocks = row_blocks(tasks);
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, t.x.scalar_type(), "mamba_chunk_scan_forward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        auto scratch = at::empty({static_cast<int64_t>(blocks) * t.chunk * t.chunk}, acc_opts);
        const size_t shared = 3 * t.chunk * sizeof(acc_t);
        ssd_forward_kernel<scalar_t, acc_t><<<blocks, kThreads, shared, stream>>>(
            ssd_cuda_args<scalar_t, acc_t>(t, dt_softplus, dt_min, dt_max.value_or(INFINITY)),
            y.mutable_data_ptr<scalar_t>(), final_states.mutable_data_ptr<acc_t>(),
            chunk_states.mutable_data_ptr<acc_t>(), scratch.mutable_data_ptr<acc_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return {y, final_states, chunk_states};
}

SsdGradients mamba_chunk_scan_backward_cuda(
    const at::Tensor& grad_y, const OptionalTensor& grad_final_states, const at::Tensor& x,
    const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
    int64_t chunk_size, const OptionalTensor& D, const OptionalTensor& z,
    const OptionalTensor& dt_bias, const OptionalTensor& initial_states,
    const OptionalTensor& cu_seqlens, bool dt_softplus, double dt_min, std::optional<double> dt_max,
    const at::Tensor& chunk_states) {
  const char* op = "mamba_chunk_scan_backward";
  const c10::cuda::CUDAGuard guard(x.device());
  const auto t = ssd_cuda_tensors(op, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
                                  cu_seqlens, dt_min, dt_max);
  check_mamba_chunk_scan_backward_args(op, grad_y, grad_final_states, x, t.state_rows,
                                       t.total_chunks, B.size(3), chunk_states);
  const auto acc = fusion_acc_type(x.scalar_type());
  const auto acc_opts = x.options().dtype(acc);
  const int64_t H = x.size(2), P = x.size(3), N = B.size(3);
  const auto gy = grad_y.contiguous();
  const auto gfinal = ssd_acc_contiguous(grad_final_states, acc);
  const auto states = chunk_states.to(acc).contiguous();
  auto gx = at::zeros(t.x.sizes(), t.x.options());
  auto gz = t.z.defined() ? at::zeros(t.z.sizes(), t.z.options()) : at::empty({0}, t.x.options());
  auto gdt = at::zeros(t.dt.sizes(), acc_opts);
  auto gBh = at::zeros({x.size(0), x.size(1), H, N}, acc_opts);
  auto gCh = at::zeros({x.size(0), x.size(1), H, N}, acc_opts);
  auto ginit = at::zeros({t.state_rows, H, P, N}, acc_opts);
  const int64_t segments = static_cast<int64_t>(t.host_segments.size());
  auto part = at::zeros({segments, H, P + 2}, acc_opts);
  const int64_t tasks = segments * H;
  if (tasks > 0 && P > 0 && N > 0) {
    const auto blocks = row_blocks(tasks);
    const auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, t.x.scalar_type(), "mamba_chunk_scan_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          auto scratch = at::empty(
              {static_cast<int64_t>(blocks) * ssd_backward_scratch(t.chunk, P, N)}, acc_opts);
          const SsdCudaGrads<scalar_t, acc_t> g{
              gy.const_data_ptr<scalar_t>(),
              gfinal.defined() ? gfinal.const_data_ptr<acc_t>() : nullptr,
              states.const_data_ptr<acc_t>(),
              gx.mutable_data_ptr<scalar_t>(),
              t.z.defined() ? gz.mutable_data_ptr<scalar_t>() : nullptr,
              gdt.mutable_data_ptr<acc_t>(),
              gBh.mutable_data_ptr<acc_t>(),
              gCh.mutable_data_ptr<acc_t>(),
              ginit.mutable_data_ptr<acc_t>(),
              part.mutable_data_ptr<acc_t>(),
              scratch.mutable_data_ptr<acc_t>()};
          const size_t shared = 5 * t.chunk * sizeof(acc_t);
          ssd_backward_kernel<scalar_t, acc_t><<<blocks, kThreads, shared, stream>>>(
              ssd_cuda_args<scalar_t, acc_t>(t, dt_softplus, dt_min, dt_max.value_or(INFINITY)), g);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }
  return ssd_gradients(x, dt, gx, gdt, gz, A, B, C, D, dt_bias, initial_states, gBh, gCh, ginit,
                       part);
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CUDA, m) {
  m.impl("mamba_chunk_scan_forward", &mamba_chunk_scan_forward_cuda);
  m.impl("mamba_chunk_scan_backward", &mamba_chunk_scan_backward_cuda);
}

}  // namespace megatron_ext
