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
//
// What the traced graph depends on is in the schemas: the public op and ``_forward`` take the
// group's size (checked against the group at run time), and everything that depends on the rank
// (the vocabulary slice a rank holds) is computed at run time inside ``_forward``, which hands the
// backward a per-token ``local_target`` column instead of a rank-dependent constant. A compiled
// graph is therefore valid on every rank and only at the group size it names.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "comm/functional.h"
#include "comm/process_group.h"
#include "kernels/cross_entropy.h"
#include "kernels/cross_entropy_checks.h"
#include "ops/dispatch.h"
#include "torch_compat.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr const char* kOp = "vocab_parallel_cross_entropy";
// Where its two all-reduces run, for a failure's message.
constexpr const char* kForwardMaxima =
    "the forward of vocab_parallel_cross_entropy (the row maxima)";
constexpr const char* kForwardSums = "the forward of vocab_parallel_cross_entropy (the row sums)";

using ForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Checks that depend only on shapes, dtypes and arguments all tensor-parallel ranks share, so a
// bad input raises the same error on every rank before any collective starts. What may differ
// between ranks (the local vocabulary size) is checked after the MAX all-reduce, which carries it.
void check_inputs(const at::Tensor& logits, const at::Tensor& target, double label_smoothing) {
  TORCH_CHECK_VALUE(logits.defined() && target.defined(), kOp,
                    ": expected tensors, got an undefined one");
  TORCH_CHECK_VALUE(at::isFloatingType(logits.scalar_type()), kOp,
                    ": vocab_parallel_logits must be floating point, got dtype ",
                    logits.scalar_type());
  TORCH_CHECK_VALUE(at::isIntegralType(target.scalar_type(), /*includeBool=*/false), kOp,
                    ": target must hold integer token ids, got dtype ", target.scalar_type());
  TORCH_CHECK_VALUE(logits.dim() >= 1, kOp,
                    ": vocab_parallel_logits must have a vocabulary dim, got a scalar");
  TORCH_CHECK_VALUE(target.sym_sizes() == logits.sym_sizes().slice(0, logits.dim() - 1), kOp,
                    ": target shape ", target.sym_sizes(), " must equal the logits shape ",
                    logits.sym_sizes(), " without its last (vocabulary) dim");
  TORCH_CHECK_VALUE(target.device() == logits.device(), kOp, ": target is on ", target.device(),
                    " but vocab_parallel_logits are on ", logits.device());
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing < 1.0, kOp,
                    ": label_smoothing must be in [0, 1), got ", label_smoothing);
}

void check_target_range(const at::Tensor& target, int64_t vocab_size,
                        std::optional<int64_t> ignore_index) {
  auto invalid = (target < 0).logical_or_(target >= vocab_size);
  if (ignore_index.has_value()) invalid.logical_and_(target != *ignore_index);
  const int64_t count = invalid.sum().item<int64_t>();
  if (count == 0) return;
  const int64_t first_bad = target.masked_select(invalid)[0].item<int64_t>();
  TORCH_CHECK_VALUE(false, kOp, ": target id ", first_bad, " is outside the vocabulary [0, ",
                    vocab_size, ")",
                    ignore_index ? " and is not ignore_index " + std::to_string(*ignore_index) : "",
                    " (", count, " such target", count == 1 ? "" : "s", ")");
}

at::Tensor row_stats(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                     std::optional<int64_t> ignore_index) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, std::optional<int64_t>)>(
          "vocab_parallel_cross_entropy_row_stats");
  return op.call(logits, target, vocab_start, ignore_index);
}

// The statistics of an empty vocabulary slice: it holds no logit and no target.
at::Tensor empty_slice_stats(const at::Tensor& logits, const at::Tensor& target) {
  auto sizes = target.sizes().vec();
  sizes.push_back(kernels::kNumRowStats);
  auto stats =
      at::zeros(sizes, logits.options().dtype(cross_entropy_acc_type(logits.scalar_type())));
  stats.select(-1, kernels::kLocalMax).fill_(-std::numeric_limits<double>::infinity());
  return stats;
}

// Forward below autograd: the loss, the row max and log-sum-exp the backward needs, and each
// token's target column in this rank's slice (kTargetElsewhere / kIgnoredToken otherwise).
ForwardResult forward_impl(const at::Tensor& logits, const at::Tensor& target,
                           double label_smoothing, std::optional<int64_t> ignore_index,
                           c10::string_view group_name, int64_t group_size) {
  const std::string group(group_name);
  const int64_t world = comm::group_size(group);
  TORCH_CHECK_VALUE(world == group_size, kOp, ": group_size ", group_size,
                    " does not match the size ", world, " of process group '", group, "'");
  check_inputs(logits, target, label_smoothing);
  const int64_t local_vocab = logits.size(-1);
  const auto ids = target.to(at::kLong);
  const int64_t vocab_start = comm::group_rank(group) * local_vocab;

  const auto stats = local_vocab > 0 ? row_stats(logits, ids, vocab_start, ignore_index)
                                     : empty_slice_stats(logits, ids);
  const auto local_max = stats.select(-1, kernels::kLocalMax);
  at::Tensor row_max;
  if (world > 1) {
    // The slice size rides along in the MAX all-reduce as (v, -v): both come back equal to the
    // local size on every rank only if every rank holds as many vocabulary rows.
    const auto slice = at::tensor(
        {static_cast<double>(local_vocab), -static_cast<double>(local_vocab)}, local_max.options());
    const auto maxima = at::cat({local_max.reshape(-1), slice});
    auto packed =
        comm::wait(comm::start_all_reduce(maxima, group, kForwardMaxima, c10d::ReduceOp::MAX));
    const int64_t rows = ids.numel();
    const auto largest = packed[rows].item<double>();
    const auto smallest = -packed[rows + 1].item<double>();
    TORCH_CHECK_VALUE(largest == smallest, kOp,
                      ": the tensor-parallel ranks hold vocabulary slices of different "
                      "sizes (from ",
                      static_cast<int64_t>(smallest), " to ", static_cast<int64_t>(largest),
                      "); each of the ", world, " ranks must hold vocab_size / ", world, " logits");
    row_max = packed.narrow(0, 0, rows).view(ids.sizes());
  } else {
    row_max = local_max.clone(at::MemoryFormat::Contiguous);
  }
  TORCH_CHECK_VALUE(local_vocab > 0, kOp, ": the local vocabulary is empty (logits shape ",
                    logits.sizes(), ")");
  const int64_t vocab_size = local_vocab * world;
  TORCH_CHECK_VALUE(label_smoothing == 0.0 || vocab_size > 1, kOp,
                    ": label_smoothing needs a vocabulary of at least 2 classes, got 1");
  check_target_range(ids, vocab_size, ignore_index);

  const auto shift = local_max - row_max;  // <= 0: moves local sums onto the global max
  const auto holds = stats.select(-1, kernels::kHoldsTarget) > 0;
  auto sums = at::stack(
      {stats.select(-1, kernels::kLocalSumExp) * shift.exp(),
       stats.select(-1, kernels::kLocalSumShift) + shift * static_cast<double>(local_vocab),
       at::where(holds, stats.select(-1, kernels::kTargetShift) + shift, 0.0)});
  if (world > 1) sums = comm::wait(comm::start_all_reduce(sums, group, kForwardSums));

  const double other =
      label_smoothing > 0.0 ? label_smoothing / static_cast<double>(vocab_size - 1) : 0.0;
  const double target_weight = 1.0 - label_smoothing - other;
  const auto log_sum_exp = sums[0].log();
  auto loss = log_sum_exp - sums[2] * target_weight;
  if (other != 0.0) loss = loss - sums[1] * other;

  const auto local_target = local_target_columns(ids, vocab_start, local_vocab, ignore_index);
  if (ignore_index.has_value()) {
    loss = loss.masked_fill(local_target == kernels::kIgnoredToken, 0.0);
  }
  return {loss, row_max, log_sum_exp, local_target};
}

using ForwardFn = ForwardResult(const at::Tensor&, const at::Tensor&, double,
                                std::optional<int64_t>, c10::string_view, int64_t);
using BackwardFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, double, int64_t);
using BackwardInplaceFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, double, int64_t);

constexpr const char* kNotTwiceDifferentiable =
    "vocab_parallel_cross_entropy is not twice differentiable: its backward ran with "
    "create_graph=True "
    "and the gradient of its gradient was requested";

struct VocabParallelCrossEntropyFunction : public Function<VocabParallelCrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, double label_smoothing,
                            std::optional<int64_t> ignore_index, const std::string& group,
                            int64_t group_size, bool overwrite_logits) {
    static const auto op = typed_op<ForwardFn>("vocab_parallel_cross_entropy_forward");
    const int64_t local_vocab = logits.dim() > 0 ? logits.size(-1) : 0;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["vocab_size"] = group_size * local_vocab;
    ctx->saved_data["overwrite_logits"] = overwrite_logits && logits.is_contiguous();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, row_max, log_sum_exp, local_target] =
        op.call(logits, target, label_smoothing, ignore_index, group, group_size);
    ctx->save_for_backward({logits, local_target, row_max, log_sum_exp});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BackwardFn>("vocab_parallel_cross_entropy_backward");
    static const auto inplace_op =
        typed_op<BackwardInplaceFn>("vocab_parallel_cross_entropy_backward_");
    const auto saved = ctx->get_saved_variables();
    const auto& logits = saved[0];
    at::Tensor grad_logits;
    if (grads[0].defined()) {
      const double label_smoothing = ctx->saved_data["label_smoothing"].toDouble();
      const int64_t vocab_size = ctx->saved_data["vocab_size"].toInt();
      const bool differentiable =
          at::GradMode::is_enabled() && (grads[0].requires_grad() || logits.requires_grad());
      {
        at::AutoDispatchBelowADInplaceOrView guard;
        if (ctx->saved_data["overwrite_logits"].toBool() && !differentiable) {
          // The caller asked for the gradient to replace the logits (read by nobody else): no
          // logits-sized buffer is allocated. Autograd's version check then catches any other
          // node that saved these logits.
          inplace_op.call(grads[0], logits, saved[1], saved[2], saved[3], label_smoothing,
                          vocab_size);
          torch::autograd::increment_version(logits);
          grad_logits = logits.detach();
        } else {
          grad_logits =
              op.call(grads[0], logits, saved[1], saved[2], saved[3], label_smoothing, vocab_size);
        }
      }
      if (differentiable) {
        // As torch.autograd.function.once_differentiable: the gradient is correct, and asking
        // for its own gradient raises instead of silently returning nothing.
        grad_logits = torch::autograd::wrap_outputs(
            {grads[0], logits}, {grad_logits}, [](torch::autograd::edge_list&& next_edges) {
              return make_autograd_node<torch::autograd::Error>(kNotTwiceDifferentiable,
                                                                std::move(next_edges));
            })[0];
      }
    }
    return {grad_logits,  at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor cross_entropy_autograd(const at::Tensor& logits, const at::Tensor& target,
                                  double label_smoothing, std::optional<int64_t> ignore_index,
                                  c10::string_view group, int64_t group_size,
                                  bool overwrite_logits) {
  // Checked here too, so a traced call (on fake tensors) raises the op's own errors.
  check_inputs(logits, target, label_smoothing);
  return VocabParallelCrossEntropyFunction::apply(logits, target, label_smoothing, ignore_index,
                                                  std::string(group), group_size, overwrite_logits);
}

at::Tensor cross_entropy_no_autograd(const at::Tensor& logits, const at::Tensor& target,
                                     double label_smoothing, std::optional<int64_t> ignore_index,
                                     c10::string_view group, int64_t group_size,
                                     bool /*overwrite_logits*/) {
  static const auto op = typed_op<ForwardFn>("vocab_parallel_cross_entropy_forward");
  return std::get<0>(op.call(logits, target, label_smoothing, ignore_index, group, group_size));
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
