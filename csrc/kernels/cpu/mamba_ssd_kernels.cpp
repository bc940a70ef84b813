// CPU loops of the Mamba-2 SSD scan. This file is compiled as is (baseline instruction set,
// namespace DEFAULT) and again by setup.py with CPU_CAPABILITY=AVX2 and AVX512 and the matching -m
// flags, as ATen compiles its kernels. A task (segment, head) runs its chunks in order (the
// backward in reverse order, from the saved chunk-boundary states). A chunk's inputs are brought
// into accumulation-dtype buffers and its products are matrix products of those buffers (ATen's
// CPU matrix multiply, BLAS, on views of them: one thread each, inside the caller's parallel
// region); the elementwise parts (steps, decays, the segment-sum mask, their gradients) are the
// header's, the mask's exponentials a vector at a time (at::vec::Vectorized, torch's vector exp).
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <vector>

#include "kernels/cpu/mamba_ssd_kernels.h"
#include "kernels/mamba_ssd.h"

namespace megatron_ext::kernels::CPU_CAPABILITY {
namespace {

// A strided view of t from element ``offset`` on, outside autograd.
at::Tensor view_of(const at::Tensor& t, int64_t offset, at::IntArrayRef sizes,
                   at::IntArrayRef strides) {
  auto* base = static_cast<char*>(const_cast<void*>(t.const_data_ptr()));
  return at::from_blob(base + offset * t.element_size(), sizes, strides, t.options());
}

// row[s] = kernels::ssd_decay(cs[t], cs[s]) for s <= t (a vector at a time), 0 after t.
template <typename acc_t>
void decay_row(const acc_t* cs, int64_t t, int64_t T, acc_t* row) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t V = Vec::size();
  const Vec top(cs[t]);
  const Vec floor(kernels::ssd_min_exponent(acc_t(0)));
  const Vec zero(acc_t(0));
  int64_t s = 0;
  for (; s + V <= t + 1; s += V) {
    const Vec e = top - Vec::loadu(cs + s);
    Vec::blendv(e.exp(), zero, e < floor).store(row + s);
  }
  for (; s <= t; ++s) row[s] = kernels::ssd_decay(cs[t], cs[s]);
  std::fill(row + t + 1, row + T, acc_t(0));
}

// The buffers of one task, reused chunk after chunk: row-major matrices of at most ``l`` rows.
template <typename acc_t>
struct Buffers {
  at::TensorOptions opts;
  std::vector<acc_t> raw, step, cs, dcs, q, col, X, Xd, Bm, Cm, Z, Y, G, S, M, dY, dXd, dS, dB, dC,
      K, KN, state, dstate, dstate_in;
  Buffers(int64_t l, int64_t P, int64_t N, at::TensorOptions o)
      : opts(o),
        raw(l),
        step(l),
        cs(l),
        dcs(l),
        q(l),
        col(l),
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
  // A chunk's rows of t (x-like: [T, P]; B-like: [T, N]; dt-like: [T, 1]) into / out of a
  // contiguous buffer; in place when t is in the accumulation dtype, else by ATen's conversion.
  struct Rows {
    int64_t offset, cols, stride;
  };
  Rows x_rows(const ChunkAt& c) const { return {x_at(c), P, H * P}; }
  Rows bc_rows(const ChunkAt& c) const { return {bc_at(c), N, G * N}; }
  Rows dt_rows(const ChunkAt& c) const { return {(c.b * L + c.t0) * H + c.h, 1, H}; }
  Rows head_rows(const ChunkAt& c) const { return {((c.b * L + c.t0) * H + c.h) * N, N, H * N}; }

  static void gather(const at::Tensor& t, const Rows& r, int64_t T, acc_t* dst,
                     const at::TensorOptions& opts) {
    if (t.scalar_type() == c10::CppTypeToScalarType<acc_t>::value) {
      const acc_t* src = t.const_data_ptr<acc_t>() + r.offset;
      for (int64_t i = 0; i < T; ++i) {
        std::copy(src + i * r.stride, src + i * r.stride + r.cols, dst + i * r.cols);
      }
    } else {
      at::from_blob(dst, {T, r.cols}, opts).copy_(view_of(t, r.offset, {T, r.cols}, {r.stride, 1}));
    }
  }

  static void scatter(const acc_t* src, int64_t T, const at::Tensor& t, const Rows& r,
                      const at::TensorOptions& opts) {
    if (t.scalar_type() == c10::CppTypeToScalarType<acc_t>::value) {
      acc_t* dst = static_cast<acc_t*>(const_cast<void*>(t.const_data_ptr())) + r.offset;
      for (int64_t i = 0; i < T; ++i) {
        std::copy(src + i * r.cols, src + (i + 1) * r.cols, dst + i * r.stride);
      }
    } else {
      view_of(t, r.offset, {T, r.cols}, {r.stride, 1})
          .copy_(at::from_blob(const_cast<acc_t*>(src), {T, r.cols}, opts));
    }
  }

  // Loads x, B, C (and z) of the chunk, the steps dt', their cumulative sums cs, Xd = dt' x, the
  // masked decays M[t, s] = exp(cs_t - cs_s) (s <= t, else 0) and S = C B^T.
  void load(Buffers<acc_t>& w, const ChunkAt& c) const {
    const int64_t T = c.T;
    gather(a.x, x_rows(c), T, w.X.data(), w.opts);
    gather(a.B, bc_rows(c), T, w.Bm.data(), w.opts);
    gather(a.C, bc_rows(c), T, w.Cm.data(), w.opts);
    if (a.z.defined()) gather(a.z, x_rows(c), T, w.Z.data(), w.opts);
    gather(a.dt, dt_rows(c), T, w.raw.data(), w.opts);
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
    for (int64_t t = 0; t < T; ++t) decay_row(w.cs.data(), t, T, w.M.data() + t * T);
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
      const acc_t e = kernels::ssd_decay(w.cs[t], acc_t(0));
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
      scatter(w.Y.data(), T, y, x_rows(c), w.opts);
      // S_out = exp(cs_last) S_in + Xd^T (w o B), w_s = exp(cs_last - cs_s).
      const acc_t last = w.cs[T - 1];
      for (int64_t t = 0; t < T; ++t) {
        const acc_t decay = kernels::ssd_decay(last, w.cs[t]);
        for (int64_t n = 0; n < N; ++n) w.KN[t * N + n] = decay * w.Bm[t * N + n];
      }
      w.mat(w.state, P, N)
          .addmm_(w.mat(w.Xd, T, P).t(), w.mat(w.KN, T, N), kernels::ssd_decay(last, acc_t(0)), 1);
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
      gather(gy, x_rows(c), T, w.G.data(), w.opts);
      // Keep S = C B^T: dcs needs it; output() turns w.S into S o M, so work on a copy.
      std::copy(w.S.begin(), w.S.begin() + T * T, w.dS.begin());
      if (a.z.defined()) {
        output(w, c, state_in);
        for (int64_t i = 0; i < T * P; ++i) {
          w.K[i] = kernels::ssd_gate_grad_z(w.G[i], w.Y[i], w.Z[i]);
          w.dY[i] = kernels::ssd_gate(w.G[i], w.Z[i]);
        }
        scatter(w.K.data(), T, gz, x_rows(c), w.opts);
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
      // q = dS o S: its row sums add to dcs, its column sums come off it.
      std::fill(w.col.begin(), w.col.begin() + T, acc_t(0));
      for (int64_t t = 0; t < T; ++t) {
        acc_t* row = w.S.data() + t * T;
        const acc_t* mask = w.M.data() + t * T;
        const acc_t* scores = w.dS.data() + t * T;
        acc_t* q = w.q.data();
        acc_t* col = w.col.data();
        for (int64_t s = 0; s <= t; ++s) {
          row[s] *= mask[s];
          q[s] = row[s] * scores[s];
          col[s] += q[s];
        }
        acc_t sum = 0;
        for (int64_t s = 0; s <= t; ++s) sum += q[s];
        w.dcs[t] += sum;
        std::fill(row + t + 1, row + T, acc_t(0));
      }
      for (int64_t s = 0; s < T; ++s) w.dcs[s] -= w.col[s];
      auto dS = w.mat(w.S, T, T);
      auto Bm = w.mat(w.Bm, T, N);
      auto Cm = w.mat(w.Cm, T, N);
      w.mat(w.dC, T, N).addmm_(dS, Bm, 0, 1);
      w.mat(w.dB, T, N).addmm_(dS.t(), Cm, 0, 1);
      // The inter-chunk output exp(cs_t) C_t S_in^T.
      auto S_in = at::from_blob(const_cast<acc_t*>(state_in), {P, N}, w.opts);
      w.mat(w.KN, T, N).addmm_(dY, S_in, 0, 1);
      for (int64_t t = 0; t < T; ++t) {
        const acc_t e = kernels::ssd_decay(w.cs[t], acc_t(0));
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
      const acc_t e_last = kernels::ssd_decay(last, acc_t(0));
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
      scatter(w.K.data(), T, gx, x_rows(c), w.opts);
      scatter(w.raw.data(), T, gdt, dt_rows(c), w.opts);
      scatter(w.dB.data(), T, gBh, head_rows(c), w.opts);
      scatter(w.dC.data(), T, gCh, head_rows(c), w.opts);
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

// The tasks [begin, end), each with the buffers of the longest chunk.
int64_t longest(const SsdArgs& a) {
  int64_t n = 0;
  for (const auto& s : a.segments) n = std::max(n, std::min(a.chunk, s.end - s.start));
  return std::max<int64_t>(n, 1);
}

at::TensorOptions acc_options(const SsdArgs& a) {
  return a.x.options().dtype(a.x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}

template <typename acc_t>
void forward_range(const SsdArgs& a, int64_t begin, int64_t end, const at::Tensor& y,
                   const at::Tensor& final_states, const at::Tensor& chunk_states) {
  Buffers<acc_t> w(longest(a), a.headdim, a.dstate, acc_options(a));
  Scan<acc_t> scan(a);
  at::Tensor out = y;
  for (int64_t task = begin; task < end; ++task) {
    scan.forward_task(task, w, out, static_cast<acc_t*>(final_states.data_ptr()),
                      static_cast<acc_t*>(chunk_states.data_ptr()));
  }
}

template <typename acc_t>
void backward_range(const SsdArgs& a, int64_t begin, int64_t end, const SsdGrads& g) {
  Buffers<acc_t> w(longest(a), a.headdim, a.dstate, acc_options(a));
  Scan<acc_t> scan(a);
  for (int64_t task = begin; task < end; ++task) {
    scan.backward_task(
        task, w, g.gy, g.gfinal.defined() ? g.gfinal.const_data_ptr<acc_t>() : nullptr,
        g.states.const_data_ptr<acc_t>(), g.gx, g.gdt, g.gBh, g.gCh, g.gz,
        static_cast<acc_t*>(g.ginit.data_ptr()), static_cast<acc_t*>(g.part.data_ptr()));
  }
}

void forward(const SsdArgs& a, int64_t begin, int64_t end, const at::Tensor& y,
             const at::Tensor& final_states, const at::Tensor& chunk_states) {
  if (a.x.scalar_type() == at::kDouble) {
    forward_range<double>(a, begin, end, y, final_states, chunk_states);
  } else {
    forward_range<float>(a, begin, end, y, final_states, chunk_states);
  }
}

void backward(const SsdArgs& a, int64_t begin, int64_t end, const SsdGrads& g) {
  if (a.x.scalar_type() == at::kDouble) {
    backward_range<double>(a, begin, end, g);
  } else {
    backward_range<float>(a, begin, end, g);
  }
}

}  // namespace

const MambaSsdCpuKernels mamba_ssd_cpu_kernels{&forward, &backward};

}  // namespace megatron_ext::kernels::CPU_CAPABILITY
