#pragma once
// Per-row arithmetic of the vocabulary-parallel cross-entropy, shared by the CPU loops and the
// CUDA kernels so that CPU tests exercise the arithmetic the GPU runs, and the facts every part of
// the loss shares: the accumulation type, the columns of the row statistics and the encoding of
// the per-token local target. The ATen side (kernels/cross_entropy_checks.h) and the Python fakes
// (through megatron_ext._C) read them from here.
//
// Non-finite logits follow torch.nn.functional.cross_entropy: a NaN or +inf logit makes the row's
// loss and gradient NaN; -inf logits have probability 0, so a -inf target logit (or, with label
// smoothing, any -inf logit) gives loss +inf with a finite gradient.
#include <math.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/host_device.h"

namespace megatron_ext::kernels {

// The type statistics, losses and per-element gradients are computed in: float for 16-bit and
// float32 logits, double for float64 ones.
template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

MEGATRON_EXT_HOST_DEVICE float exp_acc(float x) { return ::expf(x); }
MEGATRON_EXT_HOST_DEVICE double exp_acc(double x) { return ::exp(x); }
MEGATRON_EXT_HOST_DEVICE float log_acc(float x) { return ::logf(x); }
MEGATRON_EXT_HOST_DEVICE double log_acc(double x) { return ::log(x); }

// Columns of the per-row statistics one rank computes over its slice of the vocabulary.
enum RowStat : int64_t {
  kLocalMax = 0,       // max_j x_j
  kLocalSumExp = 1,    // sum_j exp(x_j - local max)
  kLocalSumShift = 2,  // sum_j (x_j - local max), for label smoothing
  kTargetShift = 3,    // x_target - local max when this rank holds the target, else 0
  kHoldsTarget = 4,    // 1 when this rank holds the (non-ignored) target, else 0
  kNumRowStats = 5,
};

// The per-token local target the forward hands to the backward: the target's column in this
// rank's slice, or one of these.
constexpr int64_t kTargetElsewhere = -1;  // another rank holds the target
constexpr int64_t kIgnoredToken = -2;     // target == ignore_index: loss and gradient 0

// A running summary of part of a row: max, sum of exp relative to the max, sum of (x - max) and
// the element count. Sums relative to the max keep large logits from cancelling.
template <typename acc_t>
struct RowState {
  acc_t max;
  acc_t sum_exp;
  acc_t sum_shift;
  acc_t count;
};

template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE RowState<acc_t> row_state_init() {
  return {-std::numeric_limits<acc_t>::infinity(), acc_t(0), acc_t(0), acc_t(0)};
}

// The summary of one logit. A -inf logit has exp 0 and makes the shifted sum -inf.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE RowState<acc_t> row_state_of(acc_t x) {
  const bool minus_inf = x == -std::numeric_limits<acc_t>::infinity();
  return {x, minus_inf ? acc_t(0) : acc_t(1),
          minus_inf ? -std::numeric_limits<acc_t>::infinity() : acc_t(0), acc_t(1)};
}

// A part's shifted sum moved onto the max ``m`` of the merged parts.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t shifted_sum_onto(const RowState<acc_t>& a, acc_t m) {
  if (a.count == acc_t(0)) return acc_t(0);
  if (a.max == -std::numeric_limits<acc_t>::infinity())
    return -std::numeric_limits<acc_t>::infinity();
  return a.max == m ? a.sum_shift : a.sum_shift + a.count * (a.max - m);
}

// Merges two summaries. NaN maxima propagate into the sums (the comparison below is false for
// NaN, so the other side's max is taken and exp(NaN - m) poisons the sum).
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE RowState<acc_t> row_state_merge(const RowState<acc_t>& a,
                                                         const RowState<acc_t>& b) {
  if (a.count == acc_t(0)) return b;
  if (b.count == acc_t(0)) return a;
  const acc_t m = a.max > b.max ? a.max : b.max;
  const acc_t sa = a.max == m ? a.sum_exp : a.sum_exp * exp_acc(a.max - m);
  const acc_t sb = b.max == m ? b.sum_exp : b.sum_exp * exp_acc(b.max - m);
  return {m, sa + sb, shifted_sum_onto(a, m) + shifted_sum_onto(b, m), a.count + b.count};
}

// The local target of one token (kernels/cross_entropy_checks.h's ``local_target_columns`` is the
// same for a tensor of tokens): the column of ``target`` in a rank holding vocabulary rows
// [vocab_start, vocab_start + local_vocab), kIgnoredToken when it equals the ignore index,
// kTargetElsewhere when another rank holds it. Non-negative exactly when this rank holds the
// target of a token that counts.
MEGATRON_EXT_HOST_DEVICE int64_t local_target_index(int64_t target, int64_t vocab_start,
                                                    int64_t local_vocab, bool has_ignore_index,
                                                    int64_t ignore_index) {
  if (has_ignore_index && target == ignore_index) return kIgnoredToken;
  const int64_t local = target - vocab_start;
  return (local >= 0 && local < local_vocab) ? local : kTargetElsewhere;
}

// Writes a row's statistics (RowStat order) from its summary and its target logit.
template <typename acc_t>
MEGATRON_EXT_HOST_DEVICE void write_row_stats(const RowState<acc_t>& state, bool holds_target,
                                              acc_t target_logit, acc_t* out) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  out[kLocalMax] = state.max;
  // exp(x - max) is exp(inf - inf) = NaN for a +inf logit, as torch's log_softmax computes it.
  out[kLocalSumExp] = state.max == inf ? std::numeric_limits<acc_t>::quiet_NaN() : state.sum_exp;
  out[kLocalSumShift] = state.sum_shift;
  out[kTargetShift] =
      !holds_target ? acc_t(0) : (state.max == -inf ? -inf : target_logit - state.max);
  out[kHoldsTarget] = holds_target ? acc_t(1) : acc_t(0);
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
