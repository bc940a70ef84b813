#pragma once
// Arithmetic of the gated delta rule (the linear attention of Gated DeltaNet layers), shared by
// the CPU loops (kernels/cpu/gated_delta_rule_kernels.cpp) and the CUDA kernels
// (gated_delta_rule_cuda.cu), so that CPU tests exercise the arithmetic the GPU runs.
//
// Per batch row b and head h, with the [K, V] state S, q_t scaled by ``scale`` (after the optional
// L2 normalisation of q_t and k_t over K), decay e^{g_t} and rate beta_t:
//   S_t = e^{g_t} S_{t-1} + k_t u_t^T,  u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),  o_t = S_t^T
//   q_t.
// A segment (the row, or a packed sequence) is cut into chunks of ``chunk`` tokens, run in order.
// In a chunk of c tokens entering with state S0, gam = the cumulative sum of g in the chunk and
// G_ij = e^{gam_i - gam_j}:
//   A = strictly lower (beta_i G_ij k_i.k_j),  (I + A) U = diag(beta) V - diag(beta e^gam) K S0
//   (the UT transform of the chunk, applied by forward substitution),
//   O = diag(e^gam) Q S0 + P U,  P = lower with diagonal (G_ij q_i.k_j),
//   S_c = e^{gam_last} S0 + sum_i e^{gam_last - gam_i} k_i u_i^T.
// The backward walks a segment's chunks in reverse from their saved entering states, carrying the
// state's gradient; the gradient of U goes through T^T = (I + A)^{-T} by back substitution.
//
// The functions run on a ``Team`` of threads: ``rank`` and ``size``, and ``sync()`` between
// phases (one thread on the CPU; a block on the GPU). Rows of each phase are split over the team
// (the substitutions over columns), inner loops run over contiguous rows, so that the CPU
// compiler vectorises them. ``acc_t`` is float for 16-bit and float32 tensors, double for float64.
#include <math.h>

#include <cstdint>

#include "kernels/host_device.h"
#include "kernels/llama_fusions.h"

namespace megatron_ext::kernels {
// Internal linkage: the CPU loops are compiled once per instruction set, and these functions are
// too large to be inlined, so the linker would otherwise keep one copy (the baseline's) for all.
namespace {

// fla's and transformers' l2norm: x / sqrt(sum x^2 + eps).
constexpr double kGdrL2NormEps = 1e-6;

struct GdrSerialTeam {
  int64_t rank = 0;
  int64_t size = 1;
  MEGATRON_EXT_HOST_DEVICE void sync() const {}
};

// The problem: q, k [B, T, H, K], v [B, T, H, V] (scalar_t); g, beta [B, T, H] (acc_t); the
// initial states [N, H, K, V] (acc_t, null without; N = B, or the packed sequences); the
// segments [seg_start, seg_end) of every row and the index of each one's first chunk among a row's
// ``chunks`` chunks (chunk_states are [B, H, chunks, K, V]).
template <typename scalar_t, typename acc_t>
struct GdrArgs {
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
  const acc_t* g;
  const acc_t* beta;
  const acc_t* init;
  const int64_t* seg_start;
  const int64_t* seg_end;
  const int64_t* chunk_base;
  int64_t segments;
  bool packed;
  int64_t batch;
  int64_t length;
  int64_t heads;
  int64_t dk;
  int64_t dv;
  int64_t chunk;
  int64_t chunks;
  bool l2norm;
  acc_t scale;
};

// One team's buffers (acc_t), carved from gdr_work_size(...) elements: the chunk's q (normalised,
// unscaled), k (normalised) and its transpose, beta e^gam k, e^{gam_last - gam} k, scale e^gam q,
// v, U and its transpose, e^gam scale Q S0, k_i.k_j, A, P, the decays G, the per-token rates and
// decays; the state (or its gradient) and, for the backward, the transposes of the entering state
// and of the state's gradient, the output's gradient, the gradient of U and its image under T^T,
// the gradients of P and A, and per-token sums.
template <typename acc_t>
struct GdrWork {
  acc_t *q, *k, *kt, *kb, *kl, *qg, *dkb, *dq, *dkn;
  acc_t *v, *u, *ut, *qs, *dout, *du, *y;
  acc_t *kk, *a, *p, *dec, *dp, *da, *hm;
  acc_t *beta, *gam, *eg, *egl, *rq, *rk, *dgam, *dbeta, *h;
  acc_t *state, *st, *dst, *ds;
  acc_t* red;
};

MEGATRON_EXT_HOST_DEVICE int64_t gdr_work_size(int64_t c, int64_t dk, int64_t dv) {
  return 9 * c * dk + 7 * c * dv + 7 * c * c + 9 * c + 4 * dk * dv + dk;
}

template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE GdrWork<acc_t> gdr_work_at(acc_t* base, int64_t c, int64_t dk,
                                                    int64_t dv) {
  GdrWork<acc_t> w;
  acc_t* p = base;
  acc_t** by_k[] = {&w.q, &w.k, &w.kt, &w.kb, &w.kl, &w.qg, &w.dkb, &w.dq, &w.dkn};
  acc_t** by_v[] = {&w.v, &w.u, &w.ut, &w.qs, &w.dout, &w.du, &w.y};
  acc_t** by_c2[] = {&w.kk, &w.a, &w.p, &w.dec, &w.dp, &w.da, &w.hm};
  acc_t** by_c[] = {&w.beta, &w.gam, &w.eg, &w.egl, &w.rq, &w.rk, &w.dgam, &w.dbeta, &w.h};
  acc_t** by_kv[] = {&w.state, &w.st, &w.dst, &w.ds};
  for (acc_t** r : by_k) *r = p, p += c * dk;
  for (acc_t** r : by_v) *r = p, p += c * dv;
  for (acc_t** r : by_c2) *r = p, p += c * c;
  for (acc_t** r : by_c) *r = p, p += c;
  for (acc_t** r : by_kv) *r = p, p += dk * dv;
  w.red = p;
  return w;
}

// x . y over n.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t gdr_dot(const acc_t* x, const acc_t* y, int64_t n) {
  acc_t s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}

// out += c x over n.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE void gdr_axpy(acc_t* out, acc_t c, const acc_t* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fma_acc(c, x[i], out[i]);
}

// out[:n] += alpha sum_{r < count} coef[r cs] rows[r rs : r rs + n]: the step of every product of
// the chunk (a row of the result gathers rows of the right-hand factor), four rows per pass over
// out, in loops the CPU compiler vectorises; fused multiply-adds where the hardware has them (the
// products here need not round as torch's ops would).
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE void gdr_gather(acc_t* out, int64_t n, acc_t alpha, const acc_t* coef,
                                         int64_t cs, const acc_t* rows, int64_t rs, int64_t count) {
  int64_t r = 0;
  for (; r + 4 <= count; r += 4) {
    const acc_t c0 = alpha * coef[r * cs], c1 = alpha * coef[(r + 1) * cs];
    const acc_t c2 = alpha * coef[(r + 2) * cs], c3 = alpha * coef[(r + 3) * cs];
    const acc_t* x0 = rows + r * rs;
    const acc_t* x1 = x0 + rs;
    const acc_t* x2 = x1 + rs;
    const acc_t* x3 = x2 + rs;
    for (int64_t i = 0; i < n; ++i) {
      out[i] =
          fma_acc(c3, x3[i], fma_acc(c2, x2[i], fma_acc(c1, x1[i], fma_acc(c0, x0[i], out[i]))));
    }
  }
  for (; r < count; ++r) gdr_axpy(out, alpha * coef[r * cs], rows + r * rs, n);
}

// The chunk of c tokens at t0 of row b, head h, into the team's buffers: q, k (L2-normalised when
// asked, their inverse norms in rq, rk), v, beta, the cumulative decays gam and e^gam,
// e^{gam_last - gam}, k's transpose, beta e^gam k, and the chunk's k.k, G, A and P.
template <typename scalar_t, typename acc_t, typename Team>
MEGATRON_EXT_HOST_DEVICE void gdr_load_chunk(const Team& team, const GdrArgs<scalar_t, acc_t>& a,
                                             const GdrWork<acc_t>& w, int64_t b, int64_t h,
                                             int64_t t0, int64_t c) {
  const int64_t H = a.heads, K = a.dk, V = a.dv, C = a.chunk;
  for (int64_t i = team.rank; i < c; i += team.size) {
    const int64_t tok = (b * a.length + t0 + i) * H + h;
    const scalar_t* qi = a.q + tok * K;
    const scalar_t* ki = a.k + tok * K;
    acc_t sq = 0, sk = 0;
    for (int64_t p = 0; p < K; ++p) {
      const acc_t x = static_cast<acc_t>(qi[p]);
      const acc_t z = static_cast<acc_t>(ki[p]);
      w.q[i * K + p] = x;
      w.k[i * K + p] = z;
      sq += x * x;
      sk += z * z;
    }
    acc_t rq = 1, rk = 1;
    if (a.l2norm) {
      rq = rsqrt_acc(sq + acc_t(kGdrL2NormEps));
      rk = rsqrt_acc(sk + acc_t(kGdrL2NormEps));
      for (int64_t p = 0; p < K; ++p) {
        w.q[i * K + p] *= rq;
        w.k[i * K + p] *= rk;
      }
    }
    w.rq[i] = rq;
    w.rk[i] = rk;
    const scalar_t* vi = a.v + tok * V;
    for (int64_t j = 0; j < V; ++j) w.v[i * V + j] = static_cast<acc_t>(vi[j]);
    w.beta[i] = a.beta[tok];
    w.gam[i] = a.g[tok];
  }
  team.sync();
  if (team.rank == 0) {
    for (int64_t i = 1; i < c; ++i) w.gam[i] += w.gam[i - 1];
  }
  team.sync();
  const acc_t last = w.gam[c - 1];
  for (int64_t i = team.rank; i < c; i += team.size) {
    w.eg[i] = exp_acc_of(w.gam[i]);
    w.egl[i] = exp_acc_of(last - w.gam[i]);
    const acc_t bk = w.beta[i] * w.eg[i], qe = a.scale * w.eg[i];
    for (int64_t p = 0; p < K; ++p) {
      w.kb[i * K + p] = bk * w.k[i * K + p];
      w.kl[i * K + p] = w.egl[i] * w.k[i * K + p];
      w.qg[i * K + p] = qe * w.q[i * K + p];
    }
  }
  for (int64_t p = team.rank; p < K; p += team.size) {
    for (int64_t i = 0; i < c; ++i) w.kt[p * C + i] = w.k[i * K + p];
  }
  team.sync();
  for (int64_t i = team.rank; i < c; i += team.size) {
    acc_t* kk = w.kk + i * C;
    acc_t* pp = w.p + i * C;
    for (int64_t j = 0; j < C; ++j) kk[j] = pp[j] = 0;
    gdr_gather(kk, i + 1, acc_t(1), w.k + i * K, 1, w.kt, C, K);
    gdr_gather(pp, i + 1, acc_t(1), w.q + i * K, 1, w.kt, C, K);
    acc_t* ai = w.a + i * C;
    for (int64_t j = 0; j < C; ++j) ai[j] = 0;
    for (int64_t j = 0; j <= i; ++j) {
      const acc_t decay = exp_acc_of(w.gam[i] - w.gam[j]);
      w.dec[i * C + j] = decay;
      if (j < i) ai[j] = w.beta[i] * decay * kk[j];
      pp[j] *= a.scale * decay;
    }
  }
  team.sync();
}

// qs = diag(e^gam) scale Q S0 and the right-hand side of the UT system, diag(beta) V - diag(beta
// e^gam) K S0, into u; then U by forward substitution (columns split over the team).
template <typename acc_t, typename Team>
MEGATRON_EXT_HOST_DEVICE void gdr_chunk_values(const Team& team, const GdrWork<acc_t>& w, int64_t c,
                                               int64_t C, int64_t K, int64_t V) {
  for (int64_t i = team.rank; i < c; i += team.size) {
    acc_t* qs = w.qs + i * V;
    acc_t* u = w.u + i * V;
    for (int64_t j = 0; j < V; ++j) {
      qs[j] = 0;
      u[j] = 0;
    }
    gdr_gather(qs, V, acc_t(1), w.qg + i * K, 1, w.state, V, K);
    gdr_gather(u, V, acc_t(-1), w.kb + i * K, 1, w.state, V, K);
    gdr_axpy(u, w.beta[i], w.v + i * V, V);
  }
  team.sync();
  const int64_t per = (V + team.size - 1) / team.size;
  const int64_t c0 = team.rank * per < V ? team.rank * per : V;
  const int64_t c1 = c0 + per < V ? c0 + per : V;
  for (int64_t i = 1; i < c; ++i) {
    gdr_gather(w.u + i * V + c0, c1 - c0, acc_t(-1), w.a + i * C, 1, w.u + c0, V, i);
  }
  team.sync();
}

// One chunk forward: the entering state saved to ``saved`` [K, V], the outputs written, the state
// advanced to the chunk's end.
template <typename scalar_t, typename acc_t, typename Team>
MEGATRON_EXT_HOST_DEVICE void gdr_forward_chunk(const Team& team, const GdrArgs<scalar_t, acc_t>& a,
                                                const GdrWork<acc_t>& w, int64_t b, int64_t h,
                                                int64_t t0, int64_t c, acc_t* saved,
                                                scalar_t* out) {
  const int64_t H = a.heads, K = a.dk, V = a.dv, C = a.chunk;
  for (int64_t e = team.rank; e < K * V; e += team.size) saved[e] = w.state[e];
  gdr_load_chunk(team, a, w, b, h, t0, c);
  gdr_chunk_values(team, w, c, C, K, V);
  for (int64_t i = team.rank; i < c; i += team.size) {
    // o_i = qs_i + sum_{j <= i} P_ij u_j, formed in qs's row.
    acc_t* qs = w.qs + i * V;
    gdr_gather(qs, V, acc_t(1), w.p + i * C, 1, w.u, V, i + 1);
    scalar_t* oi = out + ((b * a.length + t0 + i) * H + h) * V;
    for (int64_t j = 0; j < V; ++j) oi[j] = static_cast<scalar_t>(qs[j]);
  }
  const acc_t decay = exp_acc_of(w.gam[c - 1]);
  for (int64_t p = team.rank; p < K; p += team.size) {
    acc_t* sp = w.state + p * V;
    for (int64_t j = 0; j < V; ++j) sp[j] *= decay;
    gdr_gather(sp, V, acc_t(1), w.kl + p, K, w.u, V, c);
  }
  team.sync();
}

// The state row (initial_state / final_state) of segment s of batch row b, head h.
template <typename scalar_t, typename acc_t>
MEGATRON_EXT_HOST_DEVICE int64_t gdr_state_offset(const GdrArgs<scalar_t, acc_t>& a, int64_t b,
                                                  int64_t s, int64_t h) {
  return ((a.packed ? s : b) * a.heads + h) * a.dk * a.dv;
}

template <typename scalar_t, typename acc_t>
MEGATRON_EXT_HOST_DEVICE int64_t gdr_chunk_offset(const GdrArgs<scalar_t, acc_t>& a, int64_t b,
                                                  int64_t h, int64_t chunk) {
  return ((b * a.heads + h) * a.chunks + chunk) * a.dk * a.dv;
}

// Segment s of row b, head h, forward: outputs, the state entering each chunk (chunk_states) and
// the final state.
template <typename scalar_t, typename acc_t, typename Team>
MEGATRON_EXT_HOST_DEVICE void gdr_forward_segment(const Team& team,
                                                  const GdrArgs<scalar_t, acc_t>& a,
                                                  const GdrWork<acc_t>& w, int64_t b, int64_t s,
                                                  int64_t h, scalar_t* out, acc_t* final_state,
                                                  acc_t* chunk_states) {
  const int64_t KV = a.dk * a.dv;
  const int64_t so = gdr_state_offset(a, b, s, h);
  for (int64_t e = team.rank; e < KV; e += team.size) {
    w.state[e] = a.init == nullptr ? acc_t(0) : a.init[so + e];
  }
  team.sync();
  const int64_t start = a.seg_start[s], end = a.seg_end[s];
  int64_t chunk = a.chunk_base[s];
  for (int64_t t0 = start; t0 < end; t0 += a.chunk, ++chunk) {
    const int64_t c = end - t0 < a.chunk ? end - t0 : a.chunk;
    gdr_forward_chunk(team, a, w, b, h, t0, c, chunk_states + gdr_chunk_offset(a, b, h, chunk),
                      out);
  }
  for (int64_t e = team.rank; e < KV; e += team.size) final_state[so + e] = w.state[e];
  team.sync();
}

// The gradient of an L2-normalised row y = x r, r = (x.x + eps)^{-1/2}: r (dy - (y.dy) y), or dy.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE void gdr_l2norm_grad(acc_t* dy, const acc_t* y, acc_t r, int64_t n,
                                              bool l2norm) {
  if (!l2norm) return;
  const acc_t yd = gdr_dot(y, dy, n);
  for (int64_t p = 0; p < n; ++p) dy[p] = r * (dy[p] - yd * y[p]);
}

// Pointers to the gradients: of the output (in), and of q, k, v (scalar_t), g and beta (acc_t).
template <typename scalar_t, typename acc_t>
struct GdrGrads {
  const scalar_t* dout;
  scalar_t* dq;
  scalar_t* dk;
  scalar_t* dv;
  acc_t* dg;
  acc_t* dbeta;
};

// One chunk backward, entering state read from ``saved``; w.state holds the gradient of the
// chunk's end state on entry and of its entering state on exit.
template <typename scalar_t, typename acc_t, typename Team>
MEGATRON_EXT_HOST_DEVICE void gdr_backward_chunk(const Team& team,
                                                 const GdrArgs<scalar_t, acc_t>& a,
                                                 const GdrWork<acc_t>& w,
                                                 const GdrGrads<scalar_t, acc_t>& gr, int64_t b,
                                                 int64_t h, int64_t t0, int64_t c,
                                                 const acc_t* saved, acc_t* grad_state) {
  const int64_t H = a.heads, K = a.dk, V = a.dv, C = a.chunk;
  // w.state <- S0 for the shared chunk functions; grad_state is the state's gradient dS.
  for (int64_t p = team.rank; p < K; p += team.size) {
    for (int64_t j = 0; j < V; ++j) {
      const acc_t s0 = saved[p * V + j];
      w.state[p * V + j] = s0;
      w.st[j * K + p] = s0;
      w.dst[j * K + p] = grad_state[p * V + j];
    }
  }
  for (int64_t i = team.rank; i < c; i += team.size) {
    const scalar_t* di = gr.dout + ((b * a.length + t0 + i) * H + h) * V;
    for (int64_t j = 0; j < V; ++j) w.dout[i * V + j] = static_cast<acc_t>(di[j]);
  }
  gdr_load_chunk(team, a, w, b, h, t0, c);  // syncs before its first use of the team's rows
  gdr_chunk_values(team, w, c, C, K, V);
  // U's transpose; dU = P^T dO + diag(e^{gam_last - gam}) K dS.
  for (int64_t j = team.rank; j < V; j += team.size) {
    for (int64_t i = 0; i < c; ++i) w.ut[j * C + i] = w.u[i * V + j];
  }
  for (int64_t i = team.rank; i < c; i += team.size) {
    acc_t* du = w.du + i * V;
    for (int64_t j = 0; j < V; ++j) du[j] = 0;
    gdr_gather(du, V, acc_t(1), w.kl + i * K, 1, grad_state, V, K);
    gdr_gather(du, V, acc_t(1), w.p + i * C + i, C, w.dout + i * V, V, c - i);
    for (int64_t j = 0; j < V; ++j) w.y[i * V + j] = du[j];
  }
  team.sync();
  // Y = (I + A)^{-T} dU by back substitution, columns split over the team.
  {
    const int64_t per = (V + team.size - 1) / team.size;
    const int64_t c0 = team.rank * per < V ? team.rank * per : V;
    const int64_t c1 = c0 + per < V ? c0 + per : V;
    for (int64_t i = c - 2; i >= 0; --i) {
      gdr_gather(w.y + i * V + c0, c1 - c0, acc_t(-1), w.a + (i + 1) * C + i, C,
                 w.y + (i + 1) * V + c0, V, c - 1 - i);
    }
  }
  team.sync();
  // Per row i: dP_ij = dO_i.u_j (j <= i), dA_ij = -Y_i.u_j (j < i); hm = dP P + dA A (their share
  // of gam's gradient: row sums minus column sums); dp <- dP scale G, da <- beta_i dA G; dKb = -Y
  // S0^T.
  for (int64_t i = team.rank; i < c; i += team.size) {
    acc_t* dp = w.dp + i * C;
    acc_t* da = w.da + i * C;
    acc_t* hm = w.hm + i * C;
    for (int64_t j = 0; j < C; ++j) dp[j] = da[j] = hm[j] = 0;
    gdr_gather(dp, i + 1, acc_t(1), w.dout + i * V, 1, w.ut, C, V);
    gdr_gather(da, i + 1, acc_t(-1), w.y + i * V, 1, w.ut, C, V);
    da[i] = 0;
    acc_t rows = 0, dbeta = 0;
    for (int64_t j = 0; j <= i; ++j) {
      const acc_t decay = w.dec[i * C + j];
      hm[j] = dp[j] * w.p[i * C + j] + da[j] * w.a[i * C + j];
      rows += hm[j];
      dp[j] *= a.scale * decay;
      da[j] *= decay;
      dbeta += da[j] * w.kk[i * C + j];
      da[j] *= w.beta[i];
    }
    acc_t* dkb = w.dkb + i * K;
    for (int64_t p = 0; p < K; ++p) dkb[p] = 0;
    gdr_gather(dkb, K, acc_t(-1), w.y + i * V, 1, w.st, K, V);
    const acc_t kdk = gdr_dot(dkb, w.k + i * K, K);
    w.dbeta[i] = dbeta + gdr_dot(w.v + i * V, w.y + i * V, V) + w.eg[i] * kdk;
    w.dgam[i] = rows + gdr_dot(w.dout + i * V, w.qs + i * V, V) + w.beta[i] * w.eg[i] * kdk;
  }
  team.sync();
  for (int64_t i = team.rank; i < c; i += team.size) {
    const int64_t tok = (b * a.length + t0 + i) * H + h;
    const acc_t* ki = w.k + i * K;
    // dq_i = scale e^gam_i S0 dO_i + sum_{j <= i} dp_ij k_j, through the normalisation.
    acc_t* dq = w.dq + i * K;
    for (int64_t p = 0; p < K; ++p) dq[p] = 0;
    gdr_gather(dq, K, a.scale * w.eg[i], w.dout + i * V, 1, w.st, K, V);
    gdr_gather(dq, K, acc_t(1), w.dp + i * C, 1, w.k, K, i + 1);
    gdr_l2norm_grad(dq, w.q + i * K, w.rq[i], K, a.l2norm);
    for (int64_t p = 0; p < K; ++p) gr.dq[tok * K + p] = static_cast<scalar_t>(dq[p]);
    // dk_i: the final state's e^{gam_last - gam_i} dS u_i first (its dot with k_i is gam's share
    // h_i), then beta_i e^gam_i dKb_i, A's and P's terms, through the normalisation.
    acc_t* dk = w.dkn + i * K;
    for (int64_t p = 0; p < K; ++p) dk[p] = 0;
    gdr_gather(dk, K, w.egl[i], w.u + i * V, 1, w.dst, K, V);
    const acc_t hi = gdr_dot(ki, dk, K);
    gdr_axpy(dk, w.beta[i] * w.eg[i], w.dkb + i * K, K);
    gdr_gather(dk, K, acc_t(1), w.da + i * C, 1, w.k, K, i);
    gdr_gather(dk, K, acc_t(1), w.da + (i + 1) * C + i, C, w.k + (i + 1) * K, K, c - 1 - i);
    gdr_gather(dk, K, acc_t(1), w.dp + i * C + i, C, w.q + i * K, K, c - i);
    gdr_l2norm_grad(dk, ki, w.rk[i], K, a.l2norm);
    for (int64_t p = 0; p < K; ++p) gr.dk[tok * K + p] = static_cast<scalar_t>(dk[p]);
    for (int64_t j = 0; j < V; ++j) {
      gr.dv[tok * V + j] = static_cast<scalar_t>(w.beta[i] * w.y[i * V + j]);
    }
    acc_t cols = 0;
    for (int64_t r = i; r < c; ++r) cols += w.hm[r * C + i];
    w.dgam[i] -= cols + hi;
    w.h[i] = hi;
  }
  for (int64_t p = team.rank; p < K; p += team.size) {
    w.red[p] = gdr_dot(w.state + p * V, grad_state + p * V, V);
  }
  team.sync();
  const acc_t decay = exp_acc_of(w.gam[c - 1]);
  if (team.rank == 0) {
    // e^{gam_last} S0 and the sum of the h_j reach gam_last; g's gradient is the reverse
    // cumulative sum of gam's.
    acc_t last = 0;
    for (int64_t p = 0; p < K; ++p) last += w.red[p];
    last *= decay;
    for (int64_t i = 0; i < c; ++i) last += w.h[i];
    w.dgam[c - 1] += last;
    acc_t run = 0;
    for (int64_t i = c - 1; i >= 0; --i) {
      run += w.dgam[i];
      const int64_t tok = (b * a.length + t0 + i) * H + h;
      gr.dg[tok] = run;
      gr.dbeta[tok] = w.dbeta[i];
    }
  }
  // dS0 = e^{gam_last} dS + scale sum_i e^gam_i q_i dO_i^T - sum_i kb_i Y_i^T, row by row in place.
  for (int64_t p = team.rank; p < K; p += team.size) {
    acc_t* dsp = grad_state + p * V;
    for (int64_t j = 0; j < V; ++j) dsp[j] *= decay;
    gdr_gather(dsp, V, acc_t(1), w.qg + p, K, w.dout, V, c);
    gdr_gather(dsp, V, acc_t(-1), w.kb + p, K, w.y, V, c);
  }
  team.sync();
}

// Segment s of row b, head h, backward: its chunks in reverse from their saved entering states,
// the state's gradient starting from the final state's (zero without; grad_final null) and
// ending as the initial state's (written unless grad_init is null).
template <typename scalar_t, typename acc_t, typename Team>
MEGATRON_EXT_HOST_DEVICE void gdr_backward_segment(const Team& team,
                                                   const GdrArgs<scalar_t, acc_t>& a,
                                                   const GdrWork<acc_t>& w,
                                                   const GdrGrads<scalar_t, acc_t>& gr, int64_t b,
                                                   int64_t s, int64_t h, const acc_t* grad_final,
                                                   const acc_t* chunk_states, acc_t* grad_init) {
  const int64_t KV = a.dk * a.dv;
  const int64_t so = gdr_state_offset(a, b, s, h);
  for (int64_t e = team.rank; e < KV; e += team.size) {
    w.ds[e] = grad_final == nullptr ? acc_t(0) : grad_final[so + e];
  }
  team.sync();
  const int64_t start = a.seg_start[s], end = a.seg_end[s];
  const int64_t n = (end - start + a.chunk - 1) / a.chunk;
  for (int64_t i = n - 1; i >= 0; --i) {
    const int64_t t0 = start + i * a.chunk;
    const int64_t c = end - t0 < a.chunk ? end - t0 : a.chunk;
    gdr_backward_chunk(team, a, w, gr, b, h, t0, c,
                       chunk_states + gdr_chunk_offset(a, b, h, a.chunk_base[s] + i), w.ds);
  }
  if (grad_init != nullptr) {
    for (int64_t e = team.rank; e < KV; e += team.size) grad_init[so + e] = w.ds[e];
  }
  team.sync();
}

}  // namespace
}  // namespace megatron_ext::kernels
