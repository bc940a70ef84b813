// Vocabulary-parallel output layer + cross-entropy that never holds the [tokens, V/tp] logits.
//
// Each rank holds the weight rows W [V/tp, h] of vocabulary ids [rank * V/tp, (rank + 1) * V/tp)
// and the full hidden states H [tokens, h] (replicated over the group, as the input of a
// column-parallel layer). Tokens are processed in chunks of ``chunk_size`` rows; a chunk's logits
// L = H_c W^T live only while that chunk is processed. The loss of a chunk is the cross-entropy
// op's forward over L (its per-row kernel, one MAX and one SUM all-reduce), so the math is the
// unfused loss's.
//
// Gradients. With P = softmax(L) - q (the cross-entropy's backward kernel for a unit loss
// gradient; zero rows for ignored tokens) and g the incoming loss gradient:
//
//   grad_H = diag(g) P W            (then all-reduced over the group in place: H is replicated)
//   grad_W = P^T diag(g) H
//
// When the forward runs under autograd it already holds each chunk's P, so it accumulates the
// unit-gradient results D = P W and A = P^T H there, which costs two GEMMs per chunk and no
// recomputation. The backward then needs, for any g:
//
//   grad_H = diag(g) D                                          (exact: a row scaling)
//   grad_W = c A + sum over rows i with g_i != c of (g_i - c) P_i^T h_i,   c = g of one row
//
// The sum recomputes the logits of only the rows whose gradient differs from c: none for a mean
// or sum of the losses (the usual case, three GEMMs in all, as the unfused layer), the masked-out
// rows for a loss mask, every row for an arbitrary g. A second backward through a retained graph
// (whose unit-gradient buffers were consumed by the first) recomputes every chunk.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "comm/functional.h"
#include "comm/process_group.h"
#include "kernels/cross_entropy_checks.h"
#include "ops/dispatch.h"
#include "ops/weight_grad.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr const char* kOp = "vocab_parallel_linear_cross_entropy";
constexpr const char* kHiddenGrad =
    "the backward of vocab_parallel_linear_cross_entropy (the hidden-state gradient)";

using ForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The signatures of the ops this op is built from: the cross-entropy's forward and backward
// (ops/cross_entropy.cpp, kernels/cross_entropy*).
using CeForwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, double, std::optional<int64_t>, c10::string_view,
    int64_t);
using CeBackwardFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, int64_t);

std::tuple<at::Tensor, at::Tensor, at::Tensor> ce_forward(const at::Tensor& logits,
                                                          const at::Tensor& target,
                                                          double label_smoothing,
                                                          std::optional<int64_t> ignore_index,
                                                          const std::string& group) {
  static const auto op = typed_op<CeForwardFn>("vocab_parallel_cross_entropy_forward");
  const auto out =
      op.call(logits, target, label_smoothing, ignore_index, group, comm::group_size(group));
  return {std::get<0>(out), std::get<1>(out), std::get<2>(out)};
}

// (softmax(logits) - q) * grad_loss per row, in the logits' dtype; zero rows for ignored tokens.
at::Tensor ce_backward(const at::Tensor& grad_loss, const at::Tensor& logits,
                       const at::Tensor& target, const at::Tensor& row_max,
                       const at::Tensor& log_sum_exp, double label_smoothing,
                       std::optional<int64_t> ignore_index, int64_t vocab_start,
                       int64_t vocab_size) {
  static const auto op = typed_op<CeBackwardFn>("vocab_parallel_cross_entropy_backward");
  // The cross-entropy's backward takes each token's local target, as its forward returns it.
  const auto local_target =
      local_target_columns(target.to(at::kLong), vocab_start, logits.size(-1), ignore_index);
  return op.call(grad_loss, logits, local_target, row_max, log_sum_exp, label_smoothing,
                 vocab_size);
}

// Every check depends only on shapes, dtypes and arguments that all ranks share, so bad input
// raises the same error on every rank before any collective starts. Target ids out of range are
// checked by the cross-entropy's forward, on every rank alike. Metadata only: the autograd kernel
// runs it on fake tensors too.
void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                  int64_t chunk_size) {
  TORCH_CHECK_VALUE(hidden.defined() && weight.defined() && target.defined(), kOp,
                    ": expected tensors, got an undefined one");
  TORCH_CHECK_VALUE(at::isFloatingType(hidden.scalar_type()), kOp,
                    ": hidden must be floating point, got dtype ", hidden.scalar_type());
  TORCH_CHECK_VALUE(weight.scalar_type() == hidden.scalar_type(), kOp, ": weight has dtype ",
                    weight.scalar_type(), " but hidden has dtype ", hidden.scalar_type());
  TORCH_CHECK_VALUE(
      weight.dim() == 2 && weight.size(0) > 0, kOp,
      ": weight must be 2-D [vocab / tp, hidden] with a non-empty vocabulary slice, got shape ",
      weight.sizes());
  TORCH_CHECK_VALUE(hidden.dim() >= 1 && hidden.size(-1) == weight.size(1), kOp,
                    ": the last dim of hidden (shape ", hidden.sizes(),
                    ") must equal the hidden size of the weight (shape ", weight.sizes(), ")");
  TORCH_CHECK_VALUE(target.sizes() == hidden.sizes().slice(0, hidden.dim() - 1), kOp,
                    ": target shape ", target.sizes(), " must equal the hidden shape ",
                    hidden.sizes(), " without its last dim");
  TORCH_CHECK_VALUE(at::isIntegralType(target.scalar_type(), /*includeBool=*/false), kOp,
                    ": target must hold integer token ids, got dtype ", target.scalar_type());
  TORCH_CHECK_VALUE(weight.device() == hidden.device() && target.device() == hidden.device(), kOp,
                    ": hidden, weight and target must be on one device, got ", hidden.device(),
                    ", ", weight.device(), " and ", target.device());
  TORCH_CHECK_VALUE(chunk_size > 0, kOp, ": chunk_size must be positive, got ", chunk_size);
}

void check_group(const std::string& group, int64_t group_size, int64_t group_rank) {
  const int64_t size = comm::group_size(group);
  const int64_t rank = comm::group_rank(group);
  TORCH_CHECK_VALUE(group_size == size && group_rank == rank, kOp, ": group_size ", group_size,
                    " and group_rank ", group_rank, " do not match process group '", group,
                    "' (size ", size, ", this rank ", rank, ")");
}

// grad += a^T b, accumulated in grad's dtype (float for 16-bit inputs). On CUDA that is the
// linear layers' mixed-dtype GEMM; the CPU has none, and rounding the one 16-bit product beats
// widening copies of both chunks.
void add_transposed_product(at::Tensor& grad, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == grad.scalar_type() || grad.is_cuda()) {
    accumulate_weight_grad_(grad, a, b);
  } else {
    grad.add_(at::mm(a.t(), b));
  }
}

// Forward below autograd: the loss, the row statistics the backward needs and, when asked, the
// gradients of the hidden states and of the weight for a unit loss gradient (before the
// all-reduce over the group; empty when not asked).
ForwardResult forward_impl(const at::Tensor& hidden, const at::Tensor& weight,
                           const at::Tensor& target, double label_smoothing,
                           std::optional<int64_t> ignore_index, int64_t chunk_size,
                           bool hidden_grad, bool weight_grad, c10::string_view group_name,
                           int64_t group_size, int64_t group_rank) {
  const std::string group(group_name);
  check_inputs(hidden, weight, target, chunk_size);
  check_group(group, group_size, group_rank);
  const int64_t local_vocab = weight.size(0);
  const auto h = hidden.reshape({-1, hidden.size(-1)}).contiguous();
  const auto ids = target.reshape({-1}).to(at::kLong).contiguous();
  const int64_t rows = ids.numel();
  const auto acc = cross_entropy_acc_type(hidden.scalar_type());
  auto loss = at::empty({rows}, hidden.options().dtype(acc));
  auto row_max = at::empty_like(loss);
  auto log_sum_exp = at::empty_like(loss);
  auto grad_hidden = hidden_grad ? at::empty_like(h) : at::empty({0}, h.options());
  auto grad_weight = weight_grad ? at::zeros(weight.sizes(), weight.options().dtype(acc))
                                 : at::empty({0}, weight.options().dtype(acc));
  const bool grads = hidden_grad || weight_grad;
  const auto ones = grads ? at::ones({std::min(chunk_size, rows)}, loss.options()) : at::Tensor();
  for (int64_t start = 0; start < rows; start += chunk_size) {
    const int64_t n = std::min(chunk_size, rows - start);
    const auto h_chunk = h.narrow(0, start, n);
    const auto t_chunk = ids.narrow(0, start, n);
    auto logits = at::mm(h_chunk, weight.t());
    auto [l, m, lse] = ce_forward(logits, t_chunk, label_smoothing, ignore_index, group);
    loss.narrow(0, start, n).copy_(l);
    row_max.narrow(0, start, n).copy_(m);
    log_sum_exp.narrow(0, start, n).copy_(lse);
    if (!grads) continue;
    const auto p = ce_backward(ones.narrow(0, 0, n), logits, t_chunk, m, lse, label_smoothing,
                               ignore_index, group_rank * local_vocab, group_size * local_vocab);
    logits.reset();  // at most two chunk-sized buffers are alive at once
    if (hidden_grad) {
      auto out = grad_hidden.narrow(0, start, n);
      at::mm_out(out, p, weight);
    }
    if (weight_grad) add_transposed_product(grad_weight, p, h_chunk);
  }
  return {loss.view(target.sizes()), row_max, log_sum_exp, grad_hidden, grad_weight};
}

// Backward below autograd. On entry ``grad_hidden`` [tokens, h] and ``grad_weight`` [V/tp, h]
// hold the forward's unit-gradient results when ``precomputed``, else zeros; an empty one is not
// wanted. On exit they hold the gradients for ``grad_loss``, ``grad_hidden`` summed over the group
// in place (the hidden states are replicated: the conjugate of copy_to's identity). As in the
// column-parallel linear, that all-reduce runs while the weight gradient is computed.
void backward_impl(const at::Tensor& grad_loss, const at::Tensor& hidden, const at::Tensor& weight,
                   const at::Tensor& target, const at::Tensor& row_max,
                   const at::Tensor& log_sum_exp, at::Tensor& grad_hidden, at::Tensor& grad_weight,
                   double label_smoothing, std::optional<int64_t> ignore_index, int64_t chunk_size,
                   bool precomputed, int64_t vocab_start, int64_t vocab_size,
                   c10::string_view group_name, int64_t group_size) {
  TORCH_CHECK_VALUE(chunk_size > 0, kOp, "_backward: chunk_size must be positive, got ",
                    chunk_size);
  const auto h = hidden.reshape({-1, hidden.size(-1)});
  const auto ids = target.reshape({-1}).to(at::kLong);
  const int64_t rows = ids.numel();
  const bool want_hidden = grad_hidden.numel() > 0;
  const bool want_weight = grad_weight.numel() > 0;
  TORCH_CHECK_VALUE(!want_hidden || grad_hidden.sizes() == h.sizes(), kOp,
                    "_backward: grad_hidden has shape ", grad_hidden.sizes(), ", expected ",
                    h.sizes());
  TORCH_CHECK_VALUE(!want_weight || grad_weight.sizes() == weight.sizes(), kOp,
                    "_backward: grad_weight has shape ", grad_weight.sizes(), ", expected ",
                    weight.sizes());
  const auto acc = cross_entropy_acc_type(hidden.scalar_type());
  auto g = grad_loss.reshape({-1}).to(acc);
  TORCH_CHECK_VALUE(g.numel() == rows, kOp, "_backward: expected one loss gradient per token (",
                    rows, "), got ", g.numel());
  // Ignored tokens get no gradient whatever g holds there (as in the unfused loss).
  if (ignore_index.has_value()) g = g.masked_fill(ids == *ignore_index, 0.0);

  const std::string group(group_name);
  const bool reduce_hidden = want_hidden && group_size > 1 && rows > 0;
  std::optional<comm::Pending> hidden_sum;
  at::Tensor delta = g;       // what each row's P still has to be multiplied by and added
  at::Tensor recompute_rows;  // undefined: every row
  int64_t count = rows;
  if (precomputed) {
    count = 0;
    if (want_hidden) {
      grad_hidden.mul_(g.unsqueeze(1));
      if (reduce_hidden)
        hidden_sum = comm::start_all_reduce_inplace(grad_hidden, group, kHiddenGrad);
    }
    const auto active =
        ignore_index.has_value() ? ids != *ignore_index : at::ones_like(ids, at::kBool);
    const auto first = active.nonzero();
    // With every token ignored the gradients are zero already.
    if (want_weight && first.size(0) > 0) {
      const auto c = g.index_select(0, first[0]);
      grad_weight.mul_(c);
      delta = g - c;
      recompute_rows = (delta != 0).logical_and_(active).nonzero().squeeze(1);
      count = recompute_rows.numel();
    }
  }
  const bool all_rows = !recompute_rows.defined();
  for (int64_t start = 0; start < count; start += chunk_size) {
    const int64_t n = std::min(chunk_size, count - start);
    at::Tensor h_chunk, t_chunk, g_chunk, m_chunk, l_chunk;
    if (all_rows) {
      h_chunk = h.narrow(0, start, n);
      t_chunk = ids.narrow(0, start, n);
      g_chunk = delta.narrow(0, start, n);
      m_chunk = row_max.narrow(0, start, n);
      l_chunk = log_sum_exp.narrow(0, start, n);
    } else {
      const auto index = recompute_rows.narrow(0, start, n);
      h_chunk = h.index_select(0, index);
      t_chunk = ids.index_select(0, index);
      g_chunk = delta.index_select(0, index);
      m_chunk = row_max.index_select(0, index);
      l_chunk = log_sum_exp.index_select(0, index);
    }
    auto logits = at::mm(h_chunk, weight.t());
    const auto p = ce_backward(g_chunk, logits, t_chunk, m_chunk, l_chunk, label_smoothing,
                               ignore_index, vocab_start, vocab_size);
    logits.reset();
    if (want_weight) add_transposed_product(grad_weight, p, h_chunk);
    // Only a full recompute owes the hidden gradient: a precomputed one is exact already.
    if (want_hidden && !precomputed) {
      auto out = grad_hidden.narrow(0, start, n);
      at::mm_out(out, p, weight);
    }
  }
  if (reduce_hidden && !precomputed) {
    hidden_sum = comm::start_all_reduce_inplace(grad_hidden, group, kHiddenGrad);
  }
  if (hidden_sum) comm::wait(std::move(*hidden_sum));
}

using ForwardFn = ForwardResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                std::optional<int64_t>, int64_t, bool, bool, c10::string_view,
                                int64_t, int64_t);
using BackwardFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, double,
                        std::optional<int64_t>, int64_t, bool, int64_t, int64_t, c10::string_view,
                        int64_t);

struct LinearCrossEntropyFunction : public Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& target,
                            double label_smoothing, std::optional<int64_t> ignore_index,
                            int64_t chunk_size, const std::string& group, int64_t group_size,
                            int64_t group_rank) {
    static const auto op = typed_op<ForwardFn>("vocab_parallel_linear_cross_entropy_forward");
    const bool hidden_grad = hidden.requires_grad();
    const bool weight_grad = weight.requires_grad();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, row_max, log_sum_exp, grad_hidden, grad_weight] =
        op.call(hidden, weight, target, label_smoothing, ignore_index, chunk_size, hidden_grad,
                weight_grad, group, group_size, group_rank);
    ctx->save_for_backward({hidden, weight, target, row_max, log_sum_exp});
    // Kept out of save_for_backward: the backward turns them into the gradients in place and
    // hands them on, so the buffers must not stay referenced here afterwards.
    ctx->saved_data["grad_hidden"] = grad_hidden;
    ctx->saved_data["grad_weight"] = grad_weight;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["ignore_index"] =
        ignore_index.has_value() ? c10::IValue(*ignore_index) : c10::IValue();
    ctx->saved_data["chunk_size"] = chunk_size;
    ctx->saved_data["group"] = group;
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["vocab_start"] = group_rank * weight.size(0);
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BackwardFn>("vocab_parallel_linear_cross_entropy_backward");
    variable_list result(9);
    if (!grads[0].defined()) return result;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& weight = saved[1];
    const bool want_hidden = ctx->needs_input_grad(0);
    const bool want_weight = ctx->needs_input_grad(1);
    const bool precomputed = ctx->saved_data.count("grad_hidden") > 0;
    const auto acc = cross_entropy_acc_type(hidden.scalar_type());
    at::Tensor grad_hidden, grad_weight;
    if (precomputed) {
      grad_hidden = ctx->saved_data["grad_hidden"].toTensor();
      grad_weight = ctx->saved_data["grad_weight"].toTensor();
      ctx->saved_data.erase("grad_hidden");
      ctx->saved_data.erase("grad_weight");
    }
    if (!precomputed || !want_hidden) {
      grad_hidden = want_hidden ? at::zeros({hidden.numel() / hidden.size(-1), hidden.size(-1)},
                                            hidden.options())
                                : at::empty({0}, hidden.options());
    }
    if (!precomputed || !want_weight) {
      grad_weight = want_weight ? at::zeros(weight.sizes(), weight.options().dtype(acc))
                                : at::empty({0}, weight.options().dtype(acc));
    }
    const auto ignore = ctx->saved_data["ignore_index"];
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op.call(grads[0], hidden, weight, saved[2], saved[3], saved[4], grad_hidden, grad_weight,
              ctx->saved_data["label_smoothing"].toDouble(),
              ignore.isNone() ? std::nullopt : std::optional<int64_t>(ignore.toInt()),
              ctx->saved_data["chunk_size"].toInt(), precomputed,
              ctx->saved_data["vocab_start"].toInt(),
              ctx->saved_data["group_size"].toInt() * weight.size(0),
              ctx->saved_data["group"].toStringRef(), ctx->saved_data["group_size"].toInt());
    }
    if (want_hidden) result[0] = grad_hidden.view(hidden.sizes());
    if (want_weight) result[1] = grad_weight.to(weight.scalar_type());
    return result;
  }
};

at::Tensor linear_cross_entropy_autograd(const at::Tensor& hidden, const at::Tensor& weight,
                                         const at::Tensor& target, double label_smoothing,
                                         std::optional<int64_t> ignore_index, int64_t chunk_size,
                                         c10::string_view group, int64_t group_size,
                                         int64_t group_rank) {
  check_inputs(hidden, weight, target, chunk_size);
  return LinearCrossEntropyFunction::apply(hidden, weight, target, label_smoothing, ignore_index,
                                           chunk_size, std::string(group), group_size, group_rank);
}

at::Tensor linear_cross_entropy_no_autograd(const at::Tensor& hidden, const at::Tensor& weight,
                                            const at::Tensor& target, double label_smoothing,
                                            std::optional<int64_t> ignore_index, int64_t chunk_size,
                                            c10::string_view group, int64_t group_size,
                                            int64_t group_rank) {
  return std::get<0>(forward_impl(hidden, weight, target, label_smoothing, ignore_index, chunk_size,
                                  false, false, group, group_size, group_rank));
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl("vocab_parallel_linear_cross_entropy", &linear_cross_entropy_no_autograd);
  m.impl("vocab_parallel_linear_cross_entropy_forward", &forward_impl);
  m.impl("vocab_parallel_linear_cross_entropy_backward", &backward_impl);
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) {
  m.impl("vocab_parallel_linear_cross_entropy", &linear_cross_entropy_autograd);
}

}  // namespace megatron_ext
