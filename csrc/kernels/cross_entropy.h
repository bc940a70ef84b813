#pragma once
// Per-row arithmetic of the vocabulary-parallel cross-entropy, shared by the CPU loops and the
// CUDA kernels so that CPU tests exercise the arithmetic the GPU runs. ``acc_t`` is float for
// 16-bit and float32 logits, double for float64 ones.
#include <math.h>

#include <cstdint>
#include <limits>

#include "kernels/host_device.h"

namespace megatron_ext::kernels {

MEGATRON_EXT_HOST_DEVICE float exp_acc(float x) { return ::expf(x); }
MEGATRON_EXT_HOST_DEVICE double exp_acc(double x) { return ::exp(x); }
MEGATRON_EXT_HOST_DEVICE float log_acc(float x) { return ::logf(x); }
MEGATRON_EXT_HOST_DEVICE double log_acc(double x) { return ::log(x); }

// Columns of the per-row statistics one rank computes over its slice of the vocabulary.
enum RowStat : int64_t {
  kLocalMax = 0,        // max_j x_j
  kLocalSumExp = 1,     // sum_j exp(x_j - local max)
  kLocalSumShift = 2,   // sum_j (x_j - local max), for label smoothing
  kTargetShift = 3,     // x_target - local max when this rank holds the target, else 0
  kHoldsTarget = 4,     // 1 when this rank holds the (non-ignored) target, else 0
  kNumRowStats = 5,
};

// A running (max, sum of exp relative to max) pair: the online-softmax state.
template <typename acc_t>
struct MaxSumExp {
  acc_t max;
  acc_t sum_exp;
};

template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE MaxSumExp<acc_t> max_sum_exp_init() {
  return {-std::numeric_limits<acc_t>::infinity(), acc_t(0)};
}

// Merges two partial states; a side that has seen only -inf (or nothing) contributes nothing,
// which also keeps exp(-inf - -inf) = NaN out of the sum.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE MaxSumExp<acc_t> max_sum_exp_merge(MaxSumExp<acc_t> a, MaxSumExp<acc_t> b) {
  const acc_t m = a.max > b.max ? a.max : b.max;
  if (m == -std::numeric_limits<acc_t>::infinity()) return a;
  const acc_t sa = a.max == m ? a.sum_exp : a.sum_exp * exp_acc(a.max - m);
  const acc_t sb = b.max == m ? b.sum_exp : b.sum_exp * exp_acc(b.max - m);
  return {m, sa + sb};
}

// Adds one logit to the state; rescales the sum only when the max moves, so it costs one exp.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE void max_sum_exp_add(MaxSumExp<acc_t>& s, acc_t x) {
  if (x > s.max) {
    s.sum_exp = s.sum_exp * exp_acc(s.max - x) + acc_t(1);
    s.max = x;
  } else if (x != -std::numeric_limits<acc_t>::infinity()) {
    s.sum_exp += exp_acc(x - s.max);
  }
}

// The column of ``target`` in a rank holding vocabulary rows [vocab_start, vocab_start +
// local_vocab), or -1 when another rank holds it or the token is ignored.
MEGATRON_EXT_HOST_DEVICE int64_t local_target_index(int64_t target, int64_t vocab_start,
                                                    int64_t local_vocab, bool has_ignore_index,
                                                    int64_t ignore_index) {
  if (has_ignore_index && target == ignore_index) return -1;
  const int64_t local = target - vocab_start;
  return (local >= 0 && local < local_vocab) ? local : -1;
}

// Writes a row's statistics (RowStat order). The sum of logits is accumulated relative to the
// row's first logit, a shift known before the max is, so that large logits do not cancel.
template <typename scalar_t, typename acc_t>
MEGATRON_EXT_HOST_DEVICE void write_row_stats(const scalar_t* row, int64_t local_vocab,
                                              MaxSumExp<acc_t> state, acc_t sum_minus_first,
                                              int64_t local_target, acc_t* out) {
  const acc_t first = static_cast<acc_t>(row[0]);
  out[kLocalMax] = state.max;
  out[kLocalSumExp] = state.sum_exp;
  out[kLocalSumShift] = sum_minus_first + static_cast<acc_t>(local_vocab) * (first - state.max);
  const bool holds = local_target >= 0;
  out[kTargetShift] = holds ? static_cast<acc_t>(row[local_target]) - state.max : acc_t(0);
  out[kHoldsTarget] = holds ? acc_t(1) : acc_t(0);
}

// d loss / d x_j = softmax_j - q_j, with q the smoothed one-hot: ``target_weight`` (1 - a) at
// the target, ``other_weight`` (a / (V - 1)) elsewhere. The max is subtracted before log(sum_exp)
// rather than as one sum: x - max is exact for logits near the max, however large they are.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t softmax_minus_smoothed_one_hot(acc_t x, acc_t row_max,
                                                              acc_t log_sum_exp, bool is_target,
                                                              acc_t target_weight,
                                                              acc_t other_weight) {
  return exp_acc((x - row_max) - log_sum_exp) - (is_target ? target_weight : other_weight);
}

}  // namespace megatron_ext::kernels
