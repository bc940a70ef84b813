// CPU kernels of the Mamba-2 SSD scan (the arithmetic: kernels/mamba_ssd.h), threaded with
// at::parallel_for over the (segment, head) pairs, each running its chunks in order (the backward
// in reverse order, from the saved chunk-boundary states). A chunk's inputs are brought into
// accumulation-dtype buffers and its products are matrix products of those buffers (ATen's CPU
// matrix multiply, BLAS, on views of them: one thread each, inside the parallel region); the
// elementwise parts (steps, decays, the segment-sum mask, their gradients) are the header's.
// The gradients of a task's scalars (A, D, dt_bias) are summed per task and then over the tasks
// in a fixed order, and those of B and C per head and then over the heads of a group, so the
// result does not depend on the number of threads.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/mamba_ssd.h"
#include "kernels/mamba_ssd_checks.h"

namespace megatron_ext {
namespace {

using kernels::SsdSegment;
using OptionalTensor = std::optional<at::Tensor>;

// The inputs: x, dt, B, C and z contiguous in their dtypes; A, D, dt_bias and the initial states
// contiguous in the accumulation dtype (undefined when not given).
struct SsdArgs {
  at::Tensor x, dt, B, C, z, A, D, dt_bias, init;
  std::vector<SsdSegment> segments;
  int64_t length, heads, headdim, groups, dstate, chunk, total_chunks, state_rows;
  bool softplus;
  double lo, hi;
};

at::Tensor acc_or_undefined(const OptionalTensor& t, at::ScalarType acc) {
  return has_tensor(t) ? t->to(acc).contiguous() : at::Tensor();
}

SsdArgs ssd_args(const char* op, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                 const at::Tensor& B, const at::Tensor& C, int64_t chunk_size,
                 const OptionalTensor& D, const OptionalTensor& z, const OptionalTensor& dt_bias,
                 const OptionalTensor& initial_states, const OptionalTensor& cu_seqlens,
                 bool dt_softplus, double dt_min, std::optional<double> dt_max) {
  check_mamba_chunk_scan_args(op, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
                              cu_seqlens, dt_min, dt_max);
  SsdArgs a;
  const auto acc = fusion_acc_type(x.scalar_type());
  a.x = x.contiguous();
  a.dt = dt.contiguous();
  a.B = B.contiguous();
  a.C = C.contiguous();
  a.z = has_tensor(z) ? z->contiguous() : at::Tensor();
  a.A = A.to(acc).contiguous();
  a.D = acc_or_undefined(D, acc);
  a.dt_bias = acc_or_undefined(dt_bias, acc);
  a.init = acc_or_undefined(initial_states, acc);
  a.segments = ssd_segments(op, x, cu_seqlens, chunk_size, &a.total_chunks);
  a.length = x.size(1);
  a.heads = x.size(2);
  a.headdim = x.size(3);
  a.groups = B.size(2);
  a.dstate = B.size(3);
  a.chunk = chunk_size;
  a.state_rows = ssd_state_rows(x, cu_seqlens);
  a.softplus = dt_softplus;
  a.lo = dt_min;
  a.hi = dt_max.value_or(INFINITY);
  return a;
}

// A strided view of t from element ``offset`` on, outside autograd.
at::Tensor view_of(const at::Tensor& t, int64_t offset, at::IntArrayRef sizes,
                   at::IntArrayRef strides) {
  auto* base = static_cast<char*>(const_cast<void*>(t.const_data_ptr()));
  return at::from_blob(base + offset * t.element_size(), sizes, strides, t.options());
}

// The buffers of one task, reused chunk after chunk: row-major matrices of at most ``l`` rows.
template <typename acc_t>
struct Buffers {
  at::TensorOptions opts;
  std::vector<acc_t> raw, step, cs, dcs, X, Xd, Bm, Cm, Z, Y, G, S, M, dY, dXd, dS, dB, dC, K, KN,
      state, dstate, dstate_in;
  Buffers(int64_t l, int64_t P, int64_t N, at::TensorOptions o)
      : opts(o),
        raw(l),
        step(l),
        cs(l),
        dcs(l),
        X(l * P),
        Xd(l * P),
        Bm(l * N),
        Cm(l * N),
        Z(l * P),
        Y(l * P),
        G(l * P),
        S(l * l),
        M(l * l),
        dY(l * P),
        dXd(l * P),
        dS(l * l),
        dB(l * N),
        dC(l * N),
        K(l * P),
        KN(l * N),
        state(P * N),
        dstate(P * N),
        dstate_in(P * N) {}
  at::Tensor mat(std::vector<acc_t>& v, int64_t rows, int64_t cols) {
    return at::from_blob(v.data(), {rows, cols}, opts);
  }
  at::Tensor vec(std::vector<acc_t>& v, int64_t n) { return at::from_blob(v.data(), {n}, opts); }
};

// What a task reads of a chunk: tokens [t0, t0 + T) of head h (group g) of batch row b.
struct ChunkAt {
  int64_t b, h, g, t0, T;
};

template <typename acc_t>
struct Scan {
  const SsdArgs& a;
  int64_t H, P, N, G, L;

  explicit Scan(const SsdArgs& args)
      : a(args), H(args.heads), P(args.headdim), N(args.dstate), G(args.groups), L(args.length) {}

  int64_t x_at(const ChunkAt& c) const { return ((c.b * L + c.t0) * H + c.h) * P; }
  int64_t bc_at(const ChunkAt& c) const { return ((c.b * L + c.t0) * G + c.g) * N; }
  at::Tensor x_view(const at::Tensor& t, const ChunkAt& c) const {
    return view_of(t, x_at(c), {c.T, P}, {H * P, 1});
  }
  at::Tensor bc_view(const at::Tensor& t, const ChunkAt& c) const {
    return view_of(t, bc_at(c), {c.T, N}, {G * N, 1});
  }
  at::Tensor dt_view(const at::Tensor& t, const ChunkAt& c) const {
    return view_of(t, (c.b * L + c.t0) * H + c.h, {c.T}, {H});
  }

  // Loads x, B, C (and z) of the chunk, the steps dt', their cumulative sums cs, Xd = dt' x, the
  // masked decays M[t, s] = exp(cs_t - cs_s) (s <= t, else 0) and S = C B^T.
  void load(Buffers<acc_t>& w, const ChunkAt& c) const {
    const int64_t T = c.T;
    w.mat(w.X, T, P).copy_(x_view(a.x, c));
    w.mat(w.Bm, T, N).copy_(bc_view(a.B, c));
    w.mat(w.Cm, T, N).copy_(bc_view(a.C, c));
    if (a.z.defined()) w.mat(w.Z, T, P).copy_(x_view(a.z, c));
    w.vec(w.raw, T).copy_(dt_view(a.dt, c));
    const acc_t A = a.A.const_data_ptr<acc_t>()[c.h];
    const acc_t bias = a.dt_bias.defined() ? a.dt_bias.const_data_ptr<acc_t>()[c.h] : acc_t(0);
    const acc_t lo = static_cast<acc_t>(a.lo), hi = static_cast<acc_t>(a.hi);
    acc_t run = 0;
    for (int64_t t = 0; t < T; ++t) {
      w.raw[t] += bias;
      w.step[t] = kernels::ssd_dt(w.raw[t], a.softplus, lo, hi);
      run += w.step[t] * A;
      w.cs[t] = run;
    }
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t p = 0; p < P; ++p) w.Xd[t * P + p] = w.step[t] * w.X[t * P + p];
    }
    w.mat(w.S, T, T).addmm_(w.mat(w.Cm, T, N), w.mat(w.Bm, T, N).t(), 0, 1);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t s = 0; s < T; ++s) {
        w.M[t * T + s] = s <= t ? kernels::ssd_decay(w.cs[t], w.cs[s]) : acc_t(0);
      }
    }
  }

  acc_t d_of(int64_t h, int64_t p) const {
    if (!a.D.defined()) return acc_t(0);
    return a.D.const_data_ptr<acc_t>()[a.D.dim() == 2 ? h * P + p : h];
  }

  // Y = (S o M) Xd + exp(cs) C S_in^T + D x, before the gate; w.S becomes S o M.
  void output(Buffers<acc_t>& w, const ChunkAt& c, const acc_t* state_in) {
    const int64_t T = c.T;
    for (int64_t i = 0; i < T * T; ++i) w.S[i] *= w.M[i];
    auto Y = w.mat(w.Y, T, P);
    Y.addmm_(w.mat(w.S, T, T), w.mat(w.Xd, T, P), 0, 1);
    for (int64_t t = 0; t < T; ++t) {
      const acc_t e = kernels::exp_acc_of(w.cs[t]);
      for (int64_t n = 0; n < N; ++n) w.KN[t * N + n] = e * w.Cm[t * N + n];
    }
    auto S_in = at::from_blob(const_cast<acc_t*>(state_in), {P, N}, w.opts);
    Y.addmm_(w.mat(w.KN, T, N), S_in.t(), 1, 1);
    if (a.D.defined()) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t p = 0; p < P; ++p) w.Y[t * P + p] += d_of(c.h, p) * w.X[t * P + p];
      }
    }
  }

  void forward_task(int64_t task, Buffers<acc_t>& w, at::Tensor& y, acc_t* final_states,
                    acc_t* chunk_states) {
    const SsdSegment& seg = a.segments[task / H];
    const int64_t h = task % H, g = h / (H / G), PN = P * N;
    acc_t* state = w.state.data();
    if (a.init.defined()) {
      const acc_t* init = a.init.const_data_ptr<acc_t>() + (seg.state * H + h) * PN;
      std::copy(init, init + PN, state);
    } else {
      std::fill(state, state + PN, acc_t(0));
    }
    const int64_t chunks = kernels::ssd_chunks(seg.end - seg.start, a.chunk);
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t t0 = seg.start + k * a.chunk;
      const ChunkAt c{seg.batch, h, g, t0, std::min(a.chunk, seg.end - t0)};
      const int64_t T = c.T;
      std::copy(state, state + PN, chunk_states + ((seg.chunk_base + k) * H + h) * PN);
      load(w, c);
      output(w, c, state);
      if (a.z.defined()) {
        for (int64_t i = 0; i < T * P; ++i) w.Y[i] = kernels::ssd_gate(w.Y[i], w.Z[i]);
      }
      x_view(y, c).copy_(w.mat(w.Y, T, P));
      // S_out = exp(cs_last) S_in + Xd^T (w o B), w_s = exp(cs_last - cs_s).
      const acc_t last = w.cs[T - 1];
      for (int64_t t = 0; t < T; ++t) {
        const acc_t decay = kernels::ssd_decay(last, w.cs[t]);
        for (int64_t n = 0; n < N; ++n) w.KN[t * N + n] = decay * w.Bm[t * N + n];
      }
      w.mat(w.state, P, N)
          .addmm_(w.mat(w.Xd, T, P).t(), w.mat(w.KN, T, N), kernels::exp_acc_of(last), 1);
    }
    std::copy(state, state + PN, final_states + (seg.state * H + h) * PN);
  }

  // Per task: dA, d(dt_bias) and dD (P values) partial sums.
  void backward_task(int64_t task, Buffers<acc_t>& w, const at::Tensor& gy, const acc_t* gfinal,
                     const acc_t* chunk_states, const at::Tensor& gx, const at::Tensor& gdt,
                     const at::Tensor& gBh, const at::Tensor& gCh, const at::Tensor& gz,
                     acc_t* ginit, acc_t* part) {
    const SsdSegment& seg = a.segments[task / H];
    const int64_t h = task % H, g = h / (H / G), PN = P * N;
    const acc_t A = a.A.const_data_ptr<acc_t>()[h];
    const acc_t lo = static_cast<acc_t>(a.lo), hi = static_cast<acc_t>(a.hi);
    acc_t* dstate = w.dstate.data();
    if (gfinal != nullptr) {
      const acc_t* src = gfinal + (seg.state * H + h) * PN;
      std::copy(src, src + PN, dstate);
    } else {
      std::fill(dstate, dstate + PN, acc_t(0));
    }
    acc_t sum_A = 0, sum_bias = 0;
    std::vector<acc_t> sum_D(P, acc_t(0));
    const int64_t chunks = kernels::ssd_chunks(seg.end - seg.start, a.chunk);
    for (int64_t k = chunks - 1; k >= 0; --k) {
      const int64_t t0 = seg.start + k * a.chunk;
      const ChunkAt c{seg.batch, h, g, t0, std::min(a.chunk, seg.end - t0)};
      const int64_t T = c.T;
      const acc_t* state_in = chunk_states + ((seg.chunk_base + k) * H + h) * PN;
      load(w, c);
      w.mat(w.G, T, P).copy_(x_view(gy, c));
      // Keep S = C B^T: dcs needs it; output() turns w.S into S o M, so work on a copy.
      std::copy(w.S.begin(), w.S.begin() + T * T, w.dS.begin());
      if (a.z.defined()) {
        output(w, c, state_in);
        for (int64_t i = 0; i < T * P; ++i) {
          w.K[i] = kernels::ssd_gate_grad_z(w.G[i], w.Y[i], w.Z[i]);
          w.dY[i] = kernels::ssd_gate(w.G[i], w.Z[i]);
        }
        x_view(gz, c).copy_(w.mat(w.K, T, P));
      } else {
        for (int64_t i = 0; i < T * T; ++i) w.S[i] *= w.M[i];
        std::copy(w.G.begin(), w.G.begin() + T * P, w.dY.begin());
      }
      // Now w.S = S o M (the masked scores) and w.dS = S.
      std::fill(w.dcs.begin(), w.dcs.begin() + T, acc_t(0));
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t p = 0; p < P; ++p) sum_D[p] += w.dY[t * P + p] * w.X[t * P + p];
      }
      auto dY = w.mat(w.dY, T, P);
      auto Xd = w.mat(w.Xd, T, P);
      w.mat(w.dXd, T, P).addmm_(w.mat(w.S, T, T).t(), dY, 0, 1);
      // dM = dY Xd^T into w.S (S o M is no longer needed), then dS = dM o M, dcs from dM o S o M.
      w.mat(w.S, T, T).addmm_(dY, Xd.t(), 0, 1);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t s = 0; s <= t; ++s) {
          const acc_t dS = w.S[t * T + s] * w.M[t * T + s];
          const acc_t q = dS * w.dS[t * T + s];
          w.dcs[t] += q;
          w.dcs[s] -= q;
          w.S[t * T + s] = dS;
        }
        for (int64_t s = t + 1; s < T; ++s) w.S[t * T + s] = acc_t(0);
      }
      auto dS = w.mat(w.S, T, T);
      auto Bm = w.mat(w.Bm, T, N);
      auto Cm = w.mat(w.Cm, T, N);
      w.mat(w.dC, T, N).addmm_(dS, Bm, 0, 1);
      w.mat(w.dB, T, N).addmm_(dS.t(), Cm, 0, 1);
      // The inter-chunk output exp(cs_t) C_t S_in^T.
      auto S_in = at::from_blob(const_cast<acc_t*>(state_in), {P, N}, w.opts);
      w.mat(w.KN, T, N).addmm_(dY, S_in, 0, 1);
      for (int64_t t = 0; t < T; ++t) {
        const acc_t e = kernels::exp_acc_of(w.cs[t]);
        acc_t dot = 0;
        for (int64_t n = 0; n < N; ++n) {
          const acc_t v = e * w.KN[t * N + n];
          dot += v * w.Cm[t * N + n];
          w.dC[t * N + n] += v;
        }
        w.dcs[t] += dot;
        for (int64_t p = 0; p < P; ++p) w.K[t * P + p] = e * w.dY[t * P + p];
      }
      auto dstate_in = w.mat(w.dstate_in, P, N);
      dstate_in.addmm_(w.mat(w.K, T, P).t(), Cm, 0, 1);
      // The state passed on: S_out = exp(cs_last) S_in + Xd^T (w o B).
      auto dS_out = w.mat(w.dstate, P, N);
      const acc_t last = w.cs[T - 1];
      w.mat(w.K, T, P).addmm_(Bm, dS_out.t(), 0, 1);
      w.mat(w.KN, T, N).addmm_(Xd, dS_out, 0, 1);
      for (int64_t s = 0; s < T; ++s) {
        const acc_t decay = kernels::ssd_decay(last, w.cs[s]);
        acc_t dw = 0;
        for (int64_t p = 0; p < P; ++p) {
          dw += w.Xd[s * P + p] * w.K[s * P + p];
          w.dXd[s * P + p] += decay * w.K[s * P + p];
        }
        for (int64_t n = 0; n < N; ++n) w.dB[s * N + n] += decay * w.KN[s * N + n];
        const acc_t q = dw * decay;
        w.dcs[T - 1] += q;
        w.dcs[s] -= q;
      }
      const acc_t e_last = kernels::exp_acc_of(last);
      acc_t carried = 0;
      for (int64_t i = 0; i < PN; ++i) {
        carried += w.dstate[i] * state_in[i];
        w.dstate_in[i] += e_last * w.dstate[i];
      }
      w.dcs[T - 1] += e_last * carried;
      // dx = D dY + dt' dXd; ddt' = sum_p dXd x + A sum_{t >= s} dcs_t.
      acc_t run = 0;
      for (int64_t t = T - 1; t >= 0; --t) {
        acc_t dstep = 0;
        for (int64_t p = 0; p < P; ++p) {
          dstep += w.dXd[t * P + p] * w.X[t * P + p];
          w.K[t * P + p] = d_of(h, p) * w.dY[t * P + p] + w.step[t] * w.dXd[t * P + p];
        }
        run += w.dcs[t];
        dstep += run * A;
        sum_A += run * w.step[t];
        w.raw[t] = kernels::ssd_dt_grad(dstep, w.raw[t], a.softplus, lo, hi);
        sum_bias += w.raw[t];
      }
      x_view(gx, c).copy_(w.mat(w.K, T, P));
      dt_view(gdt, c).copy_(w.vec(w.raw, T));
      view_of(gBh, ((c.b * L + t0) * H + h) * N, {T, N}, {H * N, 1}).copy_(w.mat(w.dB, T, N));
      view_of(gCh, ((c.b * L + t0) * H + h) * N, {T, N}, {H * N, 1}).copy_(w.mat(w.dC, T, N));
      std::swap(w.dstate, w.dstate_in);
    }
    if (ginit != nullptr) {
      std::copy(w.dstate.begin(), w.dstate.end(), ginit + (seg.state * H + h) * PN);
    }
    acc_t* out = part + task * (P + 2);
    out[0] = sum_A;
    out[1] = sum_bias;
    std::copy(sum_D.begin(), sum_D.end(), out + 2);
  }
};

int64_t longest(const SsdArgs& a) {
  int64_t n = 0;
  for (const auto& s : a.segments) n = std::max(n, std::min(a.chunk, s.end - s.start));
  return std::max<int64_t>(n, 1);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mamba_chunk_scan_forward_cpu(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, int64_t chunk_size, const OptionalTensor& D, const OptionalTensor& z,
    const OptionalTensor& dt_bias, const OptionalTensor& initial_states,
    const OptionalTensor& cu_seqlens, bool dt_softplus, double dt_min,
    std::optional<double> dt_max) {
  const auto a = ssd_args("mamba_chunk_scan_forward", x, dt, A, B, C, chunk_size, D, z, dt_bias,
                          initial_states, cu_seqlens, dt_softplus, dt_min, dt_max);
  const auto acc_opts = x.options().dtype(fusion_acc_type(x.scalar_type()));
  auto y = at::empty(a.x.sizes(), a.x.options());
  auto final_states = at::empty({a.state_rows, a.heads, a.headdim, a.dstate}, acc_opts);
  auto chunk_states = at::empty({a.total_chunks, a.heads, a.headdim, a.dstate}, acc_opts);
  const int64_t tasks = static_cast<int64_t>(a.segments.size()) * a.heads;
  const int64_t l = longest(a);
  auto run = [&](auto zero) {
    using acc_t = decltype(zero);
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      at::AutoDispatchBelowADInplaceOrView guard;
      Buffers<acc_t> w(l, a.headdim, a.dstate, acc_opts);
      Scan<acc_t> scan(a);
      for (int64_t task = begin; task < end; ++task) {
        scan.forward_task(task, w, y, final_states.mutable_data_ptr<acc_t>(),
                          chunk_states.mutable_data_ptr<acc_t>());
      }
    });
  };
  if (x.scalar_type() == at::kDouble) {
    run(double(0));
  } else {
    run(float(0));
  }
  return {y, final_states, chunk_states};
}

// The gradient of an optional input in its dtype, or an empty tensor of x's dtype without it.
at::Tensor like_or_empty(const OptionalTensor& t, const at::Tensor& grad, const at::Tensor& x) {
  return has_tensor(t) ? grad.to(t->scalar_type()) : at::empty({0}, x.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor, at::Tensor>
mamba_chunk_scan_backward_cpu(const at::Tensor& grad_y, const OptionalTensor& grad_final_states,
                              const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                              const at::Tensor& B, const at::Tensor& C, int64_t chunk_size,
                              const OptionalTensor& D, const OptionalTensor& z,
                              const OptionalTensor& dt_bias, const OptionalTensor& initial_states,
                              const OptionalTensor& cu_seqlens, bool dt_softplus, double dt_min,
                              std::optional<double> dt_max, const at::Tensor& chunk_states) {
  const char* op = "mamba_chunk_scan_backward";
  const auto a = ssd_args(op, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, cu_seqlens,
                          dt_softplus, dt_min, dt_max);
  check_mamba_chunk_scan_backward_args(op, grad_y, grad_final_states, x, a.state_rows,
                                       a.total_chunks, B.size(3), chunk_states);
  const auto acc = fusion_acc_type(x.scalar_type());
  const auto acc_opts = x.options().dtype(acc);
  const auto gy = grad_y.contiguous();
  const auto gfinal =
      has_tensor(grad_final_states) ? grad_final_states->to(acc).contiguous() : at::Tensor();
  const auto states = chunk_states.to(acc).contiguous();
  const int64_t H = a.heads, P = a.headdim, N = a.dstate;
  auto gx = at::empty(a.x.sizes(), a.x.options());
  auto gdt = at::empty(a.dt.sizes(), a.dt.options());
  auto gz = a.z.defined() ? at::empty(a.z.sizes(), a.z.options()) : at::empty({0}, a.x.options());
  auto gBh = at::empty({x.size(0), a.length, H, N}, acc_opts);
  auto gCh = at::empty({x.size(0), a.length, H, N}, acc_opts);
  auto ginit = at::zeros({a.state_rows, H, P, N}, acc_opts);
  const int64_t segments = static_cast<int64_t>(a.segments.size());
  auto part = at::empty({segments, H, P + 2}, acc_opts);
  const int64_t l = longest(a);
  auto run = [&](auto zero) {
    using acc_t = decltype(zero);
    at::parallel_for(0, segments * H, 1, [&](int64_t begin, int64_t end) {
      at::AutoDispatchBelowADInplaceOrView guard;
      Buffers<acc_t> w(l, P, N, acc_opts);
      Scan<acc_t> scan(a);
      for (int64_t task = begin; task < end; ++task) {
        scan.backward_task(task, w, gy, gfinal.defined() ? gfinal.const_data_ptr<acc_t>() : nullptr,
                           states.const_data_ptr<acc_t>(), gx, gdt, gBh, gCh, gz,
                           ginit.mutable_data_ptr<acc_t>(), part.mutable_data_ptr<acc_t>());
      }
    });
  };
  if (acc == at::kDouble) {
    run(double(0));
  } else {
    run(float(0));
  }
  const auto sums = part.sum(0);  // [H, P + 2], the tasks added in order
  const int64_t G = a.groups;
  auto reduce_heads = [&](const at::Tensor& per_head, const at::Tensor& like) {
    const auto grouped =
        H == G ? per_head : per_head.view({x.size(0), a.length, G, H / G, N}).sum(3);
    return grouped.to(like.scalar_type());
  };
  at::Tensor gD;
  if (has_tensor(D)) {
    const auto per_channel = sums.narrow(1, 2, P);
    gD = (D->dim() == 2 ? per_channel : per_channel.sum(1)).to(D->scalar_type());
  } else {
    gD = at::empty({0}, x.options());
  }
  return {gx,
          gdt,
          sums.select(1, 0).to(A.scalar_type()),
          reduce_heads(gBh, B),
          reduce_heads(gCh, C),
          gD,
          gz,
          like_or_empty(dt_bias, sums.select(1, 1), x),
          like_or_empty(initial_states, ginit, x)};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CPU, m) {
  m.impl("mamba_chunk_scan_forward", &mamba_chunk_scan_forward_cpu);
  m.impl("mamba_chunk_scan_backward", &mamba_chunk_scan_backward_cpu);
}

}  // namespace megatron_ext
