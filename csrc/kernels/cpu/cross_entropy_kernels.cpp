// CPU row loops of the vocabulary-parallel cross-entropy. This file is compiled as is (baseline
// instruction set, namespace DEFAULT) and again by setup.py with CPU_CAPABILITY=AVX2 and AVX512
// and the matching -m flags, as ATen compiles its kernels. at::vec::Vectorized gives lane-wise
// partial maxima and sums (which the compiler may not form itself, floating-point adds not being
// associative) and a vectorised exp. 16-bit rows are converted to float a block at a time.
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "kernels/cpu/cross_entropy_kernels.h"
#include "kernels/cpu/vec_convert.h"
#include "kernels/cross_entropy.h"

namespace megatron_ext::kernels::CPU_CAPABILITY {
namespace {

// Elements per block: small enough that the passes over a block after the first re-read it from
// L1, so a row is streamed from memory once.
constexpr int64_t kBlock = 2048;

template <typename acc_t>
acc_t max_propagating_nan(acc_t a, acc_t b) {
  return (a != a || b != b) ? std::numeric_limits<acc_t>::quiet_NaN() : (a > b ? a : b);
}

template <typename acc_t>
acc_t horizontal_sum(const at::vec::Vectorized<acc_t>& v) {
  alignas(64) acc_t lanes[at::vec::Vectorized<acc_t>::size()];
  v.store(lanes);
  acc_t s = 0;
  for (const acc_t x : lanes) s += x;
  return s;
}

// Summary (max, sum exp, sum shift, count) of n > 0 contiguous values.
template <typename acc_t>
RowState<acc_t> block_state(const acc_t* p, int64_t n) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const int64_t nv = n - n % L;
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  acc_t m = -inf;
  if (nv > 0) {
    Vec vm = Vec::loadu(p);
    for (int64_t j = L; j < nv; j += L) vm = at::vec::maximum(vm, Vec::loadu(p + j));
    alignas(64) acc_t lanes[L];
    vm.store(lanes);
    for (const acc_t x : lanes) m = max_propagating_nan(m, x);
  }
  for (int64_t j = nv; j < n; ++j) m = max_propagating_nan(m, p[j]);
  const auto count = static_cast<acc_t>(n);
  if (m == -inf) return {m, acc_t(0), -inf, count};
  if (m != m) return {m, m, m, count};
  Vec sum_exp(0), sum_shift(0);
  const Vec vmax(m);
  for (int64_t j = 0; j < nv; j += L) {
    const Vec d = Vec::loadu(p + j) - vmax;
    sum_exp = sum_exp + d.exp();
    sum_shift = sum_shift + d;
  }
  acc_t se = horizontal_sum(sum_exp), ss = horizontal_sum(sum_shift);
  for (int64_t j = nv; j < n; ++j) {
    se += exp_acc(p[j] - m);
    ss += p[j] - m;
  }
  return {m, se, ss, count};
}

template <typename scalar_t>
void row_stats_rows(const void* logits, const int64_t* target, int64_t begin, int64_t end,
                    int64_t vocab, int64_t vocab_start, bool has_ignore, int64_t ignore,
                    void* stats) {
  using acc_t = acc_type<scalar_t>;
  const auto* x = static_cast<const scalar_t*>(logits);
  auto* out = static_cast<acc_t*>(stats);
  alignas(64) float buffer[std::is_same_v<scalar_t, acc_t> ? 1 : kBlock];
  for (int64_t i = begin; i < end; ++i) {
    const scalar_t* row = x + i * vocab;
    RowState<acc_t> state = row_state_init<acc_t>();
    for (int64_t b = 0; b < vocab; b += kBlock) {
      const int64_t len = std::min(kBlock, vocab - b);
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        state = row_state_merge(state, block_state<acc_t>(row + b, len));
      } else {
        to_float(row + b, buffer, len);
        state = row_state_merge(state, block_state<float>(buffer, len));
      }
    }
    const int64_t local = local_target_index(target[i], vocab_start, vocab, has_ignore, ignore);
    const acc_t target_logit = local >= 0 ? static_cast<acc_t>(row[local]) : acc_t(0);
    write_row_stats(state, local >= 0, target_logit, out + i * kNumRowStats);
  }
}

// out = (exp((x - max) - lse) - other_weight) * g over n floats (float or double).
template <typename acc_t>
void grad_block(const acc_t* x, acc_t* out, int64_t n, acc_t row_max, acc_t lse, acc_t other,
                acc_t g) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  const int64_t nv = n - n % L;
  const Vec vmax(row_max), vlse(lse), vother(other), vg(g);
  for (int64_t j = 0; j < nv; j += L) {
    const Vec y = (((Vec::loadu(x + j) - vmax) - vlse).exp() - vother) * vg;
    y.store(out + j);
  }
  for (int64_t j = nv; j < n; ++j) out[j] = (exp_acc((x[j] - row_max) - lse) - other) * g;
}

template <typename scalar_t>
void backward_rows(const void* logits, void* grad, const int64_t* local_target,
                   const void* grad_loss, const void* row_max, const void* log_sum_exp,
                   int64_t begin, int64_t end, int64_t vocab, double target_weight,
                   double other_weight) {
  using acc_t = acc_type<scalar_t>;
  const auto* x = static_cast<const scalar_t*>(logits);
  auto* y = static_cast<scalar_t*>(grad);
  const auto* gp = static_cast<const acc_t*>(grad_loss);
  const auto* mp = static_cast<const acc_t*>(row_max);
  const auto* lp = static_cast<const acc_t*>(log_sum_exp);
  const auto tw = static_cast<acc_t>(target_weight);
  const auto ow = static_cast<acc_t>(other_weight);
  alignas(64) float buffer[std::is_same_v<scalar_t, acc_t> ? 1 : kBlock];
  for (int64_t i = begin; i < end; ++i) {
    const scalar_t* row = x + i * vocab;
    scalar_t* out = y + i * vocab;
    const int64_t local = local_target[i];
    if (local == kIgnoredToken) {
      std::fill(out, out + vocab, scalar_t(0));
      continue;
    }
    // Read before the row is overwritten: ``grad`` may be ``logits``.
    const acc_t target_logit = local >= 0 ? static_cast<acc_t>(row[local]) : acc_t(0);
    for (int64_t b = 0; b < vocab; b += kBlock) {
      const int64_t len = std::min(kBlock, vocab - b);
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        grad_block<acc_t>(row + b, out + b, len, mp[i], lp[i], ow, gp[i]);
      } else {
        to_float(row + b, buffer, len);
        grad_block<float>(buffer, buffer, len, mp[i], lp[i], ow, gp[i]);
        from_float(buffer, out + b, len);
      }
    }
    if (local >= 0) {
      out[local] = static_cast<scalar_t>(
          softmax_minus_smoothed_one_hot<acc_t>(target_logit, mp[i], lp[i], true, tw, ow) * gp[i]);
    }
  }
}

void row_stats(CeDtype dtype, const void* logits, const int64_t* target, int64_t begin, int64_t end,
               int64_t vocab, int64_t vocab_start, bool has_ignore, int64_t ignore, void* stats) {
  switch (dtype) {
    case CeDtype::kFloat:
      return row_stats_rows<float>(logits, target, begin, end, vocab, vocab_start, has_ignore,
                                   ignore, stats);
    case CeDtype::kDouble:
      return row_stats_rows<double>(logits, target, begin, end, vocab, vocab_start, has_ignore,
                                    ignore, stats);
    case CeDtype::kBFloat16:
      return row_stats_rows<c10::BFloat16>(logits, target, begin, end, vocab, vocab_start,
                                           has_ignore, ignore, stats);
    case CeDtype::kHalf:
      return row_stats_rows<c10::Half>(logits, target, begin, end, vocab, vocab_start, has_ignore,
                                       ignore, stats);
  }
}

void backward(CeDtype dtype, const void* logits, void* grad, const int64_t* local_target,
              const void* grad_loss, const void* row_max, const void* log_sum_exp, int64_t begin,
              int64_t end, int64_t vocab, double target_weight, double other_weight) {
  switch (dtype) {
    case CeDtype::kFloat:
      return backward_rows<float>(logits, grad, local_target, grad_loss, row_max, log_sum_exp,
                                  begin, end, vocab, target_weight, other_weight);
    case CeDtype::kDouble:
      return backward_rows<double>(logits, grad, local_target, grad_loss, row_max, log_sum_exp,
                                   begin, end, vocab, target_weight, other_weight);
    case CeDtype::kBFloat16:
      return backward_rows<c10::BFloat16>(logits, grad, local_target, grad_loss, row_max,
                                          log_sum_exp, begin, end, vocab, target_weight,
                                          other_weight);
    case CeDtype::kHalf:
      return backward_rows<c10::Half>(logits, grad, local_target, grad_loss, row_max, log_sum_exp,
                                      begin, end, vocab, target_weight, other_weight);
  }
}

}  // namespace

const CrossEntropyCpuKernels cross_entropy_cpu_kernels{&row_stats, &backward};

}  // namespace megatron_ext::kernels::CPU_CAPABILITY
