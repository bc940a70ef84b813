// CPU kernels of the vocabulary-parallel cross-entropy: per-row statistics and the gradient.
// Rows are spread over threads with at::parallel_for. float32/float64 rows go through
// at::vec::Vectorized, whose lane-wise partial sums and maxima the compiler would not form on
// its own (it may not reorder floating-point adds); 16-bit rows convert element by element to
// float and take the scalar online update of the shared header.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "kernels/cross_entropy.h"
#include "ops/cross_entropy.h"

namespace megatron_ext {
namespace {

using namespace kernels;

// Elements per block: small enough that the exp pass re-reads the block from L1 after the max
// pass, so the row is streamed from memory once.
constexpr int64_t kBlock = 2048;

int64_t row_grain(int64_t row_length) { return std::max<int64_t>(1, 32768 / row_length); }

template <typename scalar_t, typename acc_t>
void row_stats_one(const scalar_t* row, int64_t n, int64_t local_target, acc_t* out) {
  MaxSumExp<acc_t> state = max_sum_exp_init<acc_t>();
  const acc_t first = static_cast<acc_t>(row[0]);
  acc_t sum_minus_first = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    using Vec = at::vec::Vectorized<acc_t>;
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t len = std::min(kBlock, n - b);
      const acc_t* p = row + b;
      const acc_t block_max = at::vec::reduce_all<acc_t>(
          [](Vec x, Vec y) { return at::vec::maximum(x, y); }, p, len);
      sum_minus_first += at::vec::map_reduce_all<acc_t>(
          [first](Vec x) { return x - Vec(first); }, [](Vec x, Vec y) { return x + y; }, p, len);
      if (block_max == -std::numeric_limits<acc_t>::infinity()) continue;
      const acc_t block_sum = at::vec::map_reduce_all<acc_t>(
          [block_max](Vec x) { return (x - Vec(block_max)).exp(); },
          [](Vec x, Vec y) { return x + y; }, p, len);
      state = max_sum_exp_merge(state, MaxSumExp<acc_t>{block_max, block_sum});
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const acc_t x = static_cast<acc_t>(row[j]);
      max_sum_exp_add(state, x);
      sum_minus_first += x - first;
    }
  }
  write_row_stats(row, n, state, sum_minus_first, local_target, out);
}

at::Tensor row_stats_cpu(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                         std::optional<int64_t> ignore_index) {
  check_cross_entropy_kernel_args(logits, target, "vocab_parallel_cross_entropy_row_stats");
  const int64_t vocab = logits.size(-1);
  const int64_t rows = target.numel();
  auto x = logits.contiguous();
  auto t = target.contiguous();
  auto sizes = target.sizes().vec();
  sizes.push_back(kNumRowStats);
  auto stats = at::empty(sizes, logits.options().dtype(cross_entropy_acc_type(logits.scalar_type())));
  const bool has_ignore = ignore_index.has_value();
  const int64_t ignore = ignore_index.value_or(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "vocab_parallel_cross_entropy_row_stats", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const int64_t* tp = t.const_data_ptr<int64_t>();
        acc_t* sp = stats.mutable_data_ptr<acc_t>();
        at::parallel_for(0, rows, row_grain(vocab), [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const int64_t local = local_target_index(tp[i], vocab_start, vocab, has_ignore, ignore);
            row_stats_one<scalar_t, acc_t>(xp + i * vocab, vocab, local, sp + i * kNumRowStats);
          }
        });
      });
  return stats;
}

template <typename scalar_t, typename acc_t>
void grad_row(const scalar_t* x, scalar_t* out, int64_t n, int64_t local_target, acc_t g,
              acc_t row_max, acc_t log_sum_exp, acc_t target_weight, acc_t other_weight) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    using Vec = at::vec::Vectorized<acc_t>;
    at::vec::map<acc_t>(
        [=](Vec v) {
          return (((v - Vec(row_max)) - Vec(log_sum_exp)).exp() - Vec(other_weight)) * Vec(g);
        },
        out, x, n);
    if (local_target >= 0) {
      out[local_target] = softmax_minus_smoothed_one_hot<acc_t>(
                              x[local_target], row_max, log_sum_exp, true, target_weight,
                              other_weight) *
                          g;
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      out[j] = static_cast<scalar_t>(
          softmax_minus_smoothed_one_hot<acc_t>(static_cast<acc_t>(x[j]), row_max, log_sum_exp,
                                                j == local_target, target_weight, other_weight) *
          g);
    }
  }
}

at::Tensor backward_cpu(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                        const at::Tensor& row_max, const at::Tensor& log_sum_exp,
                        double label_smoothing, std::optional<int64_t> ignore_index,
                        int64_t vocab_start, int64_t vocab_size) {
  const auto in = prepare_cross_entropy_backward(grad_loss, logits, target, row_max, log_sum_exp,
                                                 label_smoothing, vocab_size);
  const int64_t vocab = in.vocab;
  const int64_t rows = in.rows;
  const auto& x = in.logits;
  const auto& t = in.target;
  const auto& g = in.grad_loss;
  const auto& m = in.row_max;
  const auto& l = in.log_sum_exp;
  auto grad = at::empty(x.sizes(), x.options());
  const bool has_ignore = ignore_index.has_value();
  const int64_t ignore = ignore_index.value_or(0);
  const double other = in.other_weight;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "vocab_parallel_cross_entropy_backward", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const int64_t* tp = t.const_data_ptr<int64_t>();
        const acc_t* gp = g.const_data_ptr<acc_t>();
        const acc_t* mp = m.const_data_ptr<acc_t>();
        const acc_t* lp = l.const_data_ptr<acc_t>();
        scalar_t* op = grad.mutable_data_ptr<scalar_t>();
        const auto target_weight = static_cast<acc_t>(1.0 - label_smoothing);
        const auto other_weight = static_cast<acc_t>(other);
        at::parallel_for(0, rows, row_grain(vocab), [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            scalar_t* out = op + i * vocab;
            if (has_ignore && tp[i] == ignore) {
              std::fill(out, out + vocab, scalar_t(0));
              continue;
            }
            const int64_t local = local_target_index(tp[i], vocab_start, vocab, false, 0);
            grad_row<scalar_t, acc_t>(xp + i * vocab, out, vocab, local, gp[i], mp[i], lp[i],
                                      target_weight, other_weight);
          }
        });
      });
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CPU, m) {
  m.impl("vocab_parallel_cross_entropy_row_stats", &row_stats_cpu);
  m.impl("vocab_parallel_cross_entropy_backward", &backward_cpu);
}

}  // namespace megatron_ext
