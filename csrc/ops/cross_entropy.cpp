// Vocabulary-parallel cross-entropy as an autograd node.
//
// Each rank holds logits x[..., V/tp] for vocabulary rows [rank * V/tp, (rank + 1) * V/tp).
// Forward: one pass per row gives the local max, sum of exp relative to it, sum of logits and
// the target logit (kernels/cross_entropy*); one MAX all-reduce of the maxima M, then one SUM
// all-reduce of the three rescaled sums S = sum exp(x - M), X = sum (x - M), T = x_t - M. With
// Megatron-core's smoothing convention (target 1 - a, every other class b = a / (V - 1)):
//
//   loss = sum_j q_j (lse - x_j) = log S - (1 - a - b) T - b X.
//
// Backward needs no communication: d loss / d x_j = (softmax_j - q_j) * grad, with softmax
// recomputed from the logits and the saved M and log S, so the node keeps O(tokens) extra memory.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "comm/process_group.h"
#include "kernels/cross_entropy.h"
#include "ops/cross_entropy.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr const char* kOp = "vocab_parallel_cross_entropy";

using ForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Every check depends only on shapes, dtypes and the targets, which all tensor-parallel ranks
// share, so a bad input raises the same error on every rank before any collective starts.
void check_inputs(const at::Tensor& logits, const at::Tensor& target, double label_smoothing,
                  int64_t world_size) {
  TORCH_CHECK_VALUE(logits.defined() && target.defined(), kOp, ": expected tensors, got an undefined one");
  TORCH_CHECK_VALUE(at::isFloatingType(logits.scalar_type()), kOp,
                    ": vocab_parallel_logits must be floating point, got dtype ", logits.scalar_type());
  TORCH_CHECK_VALUE(at::isIntegralType(target.scalar_type(), /*includeBool=*/false), kOp,
                    ": target must hold integer token ids, got dtype ", target.scalar_type());
  TORCH_CHECK_VALUE(logits.dim() >= 1, kOp, ": vocab_parallel_logits must have a vocabulary dim, got a scalar");
  TORCH_CHECK_VALUE(target.sizes() == logits.sizes().slice(0, logits.dim() - 1), kOp, ": target shape ",
                    target.sizes(), " must equal the logits shape ", logits.sizes(),
                    " without its last (vocabulary) dim");
  TORCH_CHECK_VALUE(target.device() == logits.device(), kOp, ": target is on ", target.device(),
                    " but vocab_parallel_logits are on ", logits.device());
  TORCH_CHECK_VALUE(logits.size(-1) > 0, kOp, ": the local vocabulary is empty (logits shape ",
                    logits.sizes(), ")");
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing < 1.0, kOp,
                    ": label_smoothing must be in [0, 1), got ", label_smoothing);
  TORCH_CHECK_VALUE(label_smoothing == 0.0 || logits.size(-1) * world_size > 1, kOp,
                    ": label_smoothing needs a vocabulary of at least 2 classes, got 1");
}

void check_target_range(const at::Tensor& target, int64_t vocab_size,
                        std::optional<int64_t> ignore_index) {
  auto invalid = (target < 0).logical_or_(target >= vocab_size);
  if (ignore_index.has_value()) invalid.logical_and_(target != *ignore_index);
  const int64_t count = invalid.sum().item<int64_t>();
  if (count == 0) return;
  const int64_t first_bad = target.masked_select(invalid)[0].item<int64_t>();
  TORCH_CHECK_VALUE(false, kOp, ": target id ", first_bad, " is outside the vocabulary [0, ", vocab_size,
                    ")", ignore_index ? " and is not ignore_index " + std::to_string(*ignore_index) : "",
                    " (", count, " such target", count == 1 ? "" : "s", ")");
}

at::Tensor row_stats(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                     std::optional<int64_t> ignore_index) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("megatron_ext::vocab_parallel_cross_entropy_row_stats", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                               std::optional<int64_t>)>();
  return op.call(logits, target, vocab_start, ignore_index);
}

// Forward below autograd: the loss and the row statistics the backward needs.
ForwardResult forward_impl(const at::Tensor& logits, const at::Tensor& target, double label_smoothing,
                           std::optional<int64_t> ignore_index, c10::string_view group_name) {
  const std::string group(group_name);
  const int64_t world = comm::group_size(group);
  check_inputs(logits, target, label_smoothing, world);
  const int64_t local_vocab = logits.size(-1);
  const int64_t vocab_size = local_vocab * world;
  const auto ids = target.to(at::kLong);
  check_target_range(ids, vocab_size, ignore_index);

  const auto stats = row_stats(logits, ids, comm::group_rank(group) * local_vocab, ignore_index);
  const auto local_max = stats.select(-1, kernels::kLocalMax);
  const bool communicate = world > 1 && ids.numel() > 0;
  const auto row_max = communicate ? comm::all_reduce(local_max, group, c10d::ReduceOp::MAX)
                                   : local_max.clone(at::MemoryFormat::Contiguous);
  const auto shift = local_max - row_max;  // <= 0: moves local sums onto the global max
  const auto holds = stats.select(-1, kernels::kHoldsTarget) > 0;
  auto sums = at::stack({stats.select(-1, kernels::kLocalSumExp) * shift.exp(),
                         stats.select(-1, kernels::kLocalSumShift) + shift * static_cast<double>(local_vocab),
                         at::where(holds, stats.select(-1, kernels::kTargetShift) + shift, 0.0)});
  if (communicate) sums = comm::all_reduce(sums, group);

  const double other = label_smoothing > 0.0 ? label_smoothing / static_cast<double>(vocab_size - 1) : 0.0;
  const double target_weight = 1.0 - label_smoothing - other;
  const auto log_sum_exp = sums[0].log();
  auto loss = log_sum_exp - sums[2] * target_weight;
  if (other != 0.0) loss = loss - sums[1] * other;
  if (ignore_index.has_value()) loss = loss.masked_fill(ids == *ignore_index, 0.0);
  return {loss, row_max, log_sum_exp};
}

using ForwardOp = c10::TypedOperatorHandle<ForwardResult(
    const at::Tensor&, const at::Tensor&, double, std::optional<int64_t>, c10::string_view)>;
using BackwardOp = c10::TypedOperatorHandle<at::Tensor(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
    std::optional<int64_t>, int64_t, int64_t)>;

const ForwardOp& forward_op() {
  static const ForwardOp op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("megatron_ext::vocab_parallel_cross_entropy_forward", "")
                                  .typed<ForwardResult(const at::Tensor&, const at::Tensor&, double,
                                                       std::optional<int64_t>, c10::string_view)>();
  return op;
}

const BackwardOp& backward_op() {
  static const BackwardOp op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("megatron_ext::vocab_parallel_cross_entropy_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double, std::optional<int64_t>, int64_t, int64_t)>();
  return op;
}

struct VocabParallelCrossEntropyFunction : public Function<VocabParallelCrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            double label_smoothing, std::optional<int64_t> ignore_index,
                            const std::string& group) {
    const int64_t local_vocab = logits.dim() > 0 ? logits.size(-1) : 0;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["ignore_index"] = ignore_index.has_value() ? c10::IValue(*ignore_index) : c10::IValue();
    ctx->saved_data["vocab_start"] = comm::group_rank(group) * local_vocab;
    ctx->saved_data["vocab_size"] = comm::group_size(group) * local_vocab;
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, row_max, log_sum_exp] = forward_op().call(logits, target, label_smoothing, ignore_index, group);
    ctx->save_for_backward({logits, target, row_max, log_sum_exp});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad_logits;
    if (grads[0].defined()) {
      const auto ignore = ctx->saved_data["ignore_index"];
      grad_logits = backward_op().call(
          grads[0], saved[0], saved[1].to(at::kLong), saved[2], saved[3],
          ctx->saved_data["label_smoothing"].toDouble(),
          ignore.isNone() ? std::nullopt : std::optional<int64_t>(ignore.toInt()),
          ctx->saved_data["vocab_start"].toInt(), ctx->saved_data["vocab_size"].toInt());
    }
    return {grad_logits, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor cross_entropy_autograd(const at::Tensor& logits, const at::Tensor& target, double label_smoothing,
                                  std::optional<int64_t> ignore_index, c10::string_view group) {
  return VocabParallelCrossEntropyFunction::apply(logits, target, label_smoothing, ignore_index,
                                                  std::string(group));
}

at::Tensor cross_entropy_no_autograd(const at::Tensor& logits, const at::Tensor& target, double label_smoothing,
                                     std::optional<int64_t> ignore_index, c10::string_view group) {
  return std::get<0>(forward_op().call(logits, target, label_smoothing, ignore_index, group));
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl("vocab_parallel_cross_entropy", &cross_entropy_no_autograd);
  m.impl("vocab_parallel_cross_entropy_forward", &forward_impl);
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) {
  m.impl("vocab_parallel_cross_entropy", &cross_entropy_autograd);
}

}  // namespace megatron_ext
