// The token permutation and the grouped GEMM of the experts.
//
// ``moe_sort_by_expert`` lists, expert after expert, the tokens the routing map sends to each (in
// token order; with a capacity, each expert's first ``capacity`` tokens padded with the tokens it
// was not sent, in token order), and the expert of each listed row. ``moe_permute`` gathers those
// rows (each scaled by a probability when given) and ``moe_unpermute`` adds them back into their
// tokens; each is the other's gradient. Both are C++ autograd nodes over the CPU and CUDA kernels
// of kernels/moe_permute*; a backward that is itself differentiated (create_graph=True) computes
// the probabilities' gradient with differentiable ATen ops.
//
// ``grouped_gemm`` multiplies each expert's rows of ``a`` by its matrix of ``b``: a loop of GEMMs,
// forward and backward (``grouped_gemm_backward``), on any device ATen's matmul runs on.
//
// ``moe_aux_loss_scaler`` returns ``output`` (a view carrying its node) and gives ``aux_loss`` the
// gradient ``scale`` in the backward, so that an auxiliary loss joins the backward of the main loss
// without being added to it. ``scale`` is read when the backward runs: the schedules set it in
// place after the forward (Megatron-core's ``MoEAuxLossAutoScaler.set_loss_scale``).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels/moe_permute_checks.h"
#include "ops/dispatch.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

using GatherFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using ScatterFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                             int64_t);
using RowDotFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& index,
                       const std::optional<at::Tensor>& scale) {
  static const auto op = typed_op<GatherFn>("moe_gather_rows");
  return op.call(x, index, scale);
}

at::Tensor scatter_add_rows(const at::Tensor& x, const at::Tensor& index,
                            const std::optional<at::Tensor>& scale, int64_t num_rows) {
  static const auto op = typed_op<ScatterFn>("moe_scatter_add_rows");
  return op.call(x, index, scale, num_rows);
}

at::Tensor gathered_row_dot(const at::Tensor& grad, const at::Tensor& index, const at::Tensor& x) {
  static const auto op = typed_op<RowDotFn>("moe_gathered_row_dot");
  return op.call(grad, index, x);
}

at::Tensor permute_op(const at::Tensor& tokens, const at::Tensor& index,
                      const std::optional<at::Tensor>& probs) {
  static const auto op = typed_op<GatherFn>("moe_permute");
  return op.call(tokens, index, probs);
}

at::Tensor unpermute_op(const at::Tensor& rows, const at::Tensor& index,
                        const std::optional<at::Tensor>& probs, int64_t num_tokens) {
  static const auto op = typed_op<ScatterFn>("moe_unpermute");
  return op.call(rows, index, probs, num_tokens);
}

std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// sum_h a[index[i], h] * b[i, h] per row i: the probabilities' gradient.
at::Tensor probs_grad(const at::Tensor& a, const at::Tensor& index, const at::Tensor& b) {
  if (at::GradMode::is_enabled()) return (a.index_select(0, index) * b).sum(-1);
  return gathered_row_dot(a, index, b);
}

void check_probs_dtype(const char* op, const at::Tensor& x,
                       const std::optional<at::Tensor>& probs) {
  TORCH_CHECK_VALUE(x.defined(), op, ": expected a tensor, got an undefined tensor");
  if (probs.has_value()) {
    TORCH_CHECK_VALUE(probs->scalar_type() == x.scalar_type(), op, ": the probabilities are ",
                      probs->scalar_type(), ", the tokens ", x.scalar_type(),
                      "; cast them to one dtype");
  }
}

// tokens [n, h], sorted_indices [m], probs [m] -> [m, h]: row i is tokens[sorted_indices[i]] *
// probs[i].
struct PermuteFunction : public Function<PermuteFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& tokens, const at::Tensor& index,
                            const std::optional<at::Tensor>& probs) {
    // The tokens only for the probabilities' gradient.
    ctx->save_for_backward(
        {probs.has_value() ? tokens : at::Tensor(), index, probs.value_or(at::Tensor())});
    ctx->saved_data["num_tokens"] = tokens.size(0);
    at::AutoDispatchBelowADInplaceOrView guard;
    return gather_rows(tokens, index, probs);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(3);
    if (!grads[0].defined()) return result;
    const auto saved = ctx->get_saved_variables();
    const auto& tokens = saved[0];
    const auto& index = saved[1];
    if (ctx->needs_input_grad(0)) {
      result[0] = unpermute_op(grads[0], index, optional_of(saved[2]),
                               ctx->saved_data["num_tokens"].toInt());
    }
    if (saved[2].defined() && ctx->needs_input_grad(2)) {
      result[2] = probs_grad(tokens, index, grads[0]);
    }
    return result;
  }
};

// rows [m, h], sorted_indices [m], probs [m] -> [num_tokens, h]: token t is the sum of
// rows[i] * probs[i] over the i with sorted_indices[i] == t.
struct UnpermuteFunction : public Function<UnpermuteFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows, const at::Tensor& index,
                            const std::optional<at::Tensor>& probs, int64_t num_tokens) {
    // The rows only for the probabilities' gradient.
    ctx->save_for_backward(
        {probs.has_value() ? rows : at::Tensor(), index, probs.value_or(at::Tensor())});
    at::AutoDispatchBelowADInplaceOrView guard;
    return scatter_add_rows(rows, index, probs, num_tokens);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(4);
    if (!grads[0].defined()) return result;
    const auto saved = ctx->get_saved_variables();
    const auto& rows = saved[0];
    const auto& index = saved[1];
    if (ctx->needs_input_grad(0)) result[0] = permute_op(grads[0], index, optional_of(saved[2]));
    if (saved[2].defined() && ctx->needs_input_grad(2)) {
      result[2] = probs_grad(grads[0], index, rows);
    }
    return result;
  }
};

at::Tensor permute_autograd(const at::Tensor& tokens, const at::Tensor& index,
                            const std::optional<at::Tensor>& probs) {
  check_probs_dtype("moe_permute", tokens, probs);
  return PermuteFunction::apply(tokens, index, probs);
}

at::Tensor permute_no_autograd(const at::Tensor& tokens, const at::Tensor& index,
                               const std::optional<at::Tensor>& probs) {
  check_probs_dtype("moe_permute", tokens, probs);
  return gather_rows(tokens, index, probs);
}

at::Tensor unpermute_autograd(const at::Tensor& rows, const at::Tensor& index,
                              const std::optional<at::Tensor>& probs, int64_t num_tokens) {
  check_probs_dtype("moe_unpermute", rows, probs);
  return UnpermuteFunction::apply(rows, index, probs, num_tokens);
}

at::Tensor unpermute_no_autograd(const at::Tensor& rows, const at::Tensor& index,
                                 const std::optional<at::Tensor>& probs, int64_t num_tokens) {
  check_probs_dtype("moe_unpermute", rows, probs);
  return scatter_add_rows(rows, index, probs, num_tokens);
}

// routing_map [tokens, experts] -> (token of each permuted row, its expert), expert-major.
std::tuple<at::Tensor, at::Tensor> sort_by_expert(const at::Tensor& routing_map,
                                                  std::optional<int64_t> capacity) {
  TORCH_CHECK_VALUE(routing_map.dim() == 2,
                    "moe_sort_by_expert: the routing map must be [num_tokens, num_experts], got "
                    "shape ",
                    routing_map.sizes());
  const int64_t num_tokens = routing_map.size(0);
  const int64_t num_experts = routing_map.size(1);
  const auto by_expert = routing_map.t().ne(0).contiguous();  // [experts, tokens]
  if (!capacity.has_value()) {
    const auto pairs = by_expert.nonzero();  // (expert, token), expert-major, in token order
    return {pairs.select(1, 1).contiguous(), pairs.select(1, 0).contiguous()};
  }
  TORCH_CHECK_VALUE(*capacity >= 0, "moe_sort_by_expert: expected a capacity >= 0, got ",
                    *capacity);
  const int64_t kept = std::min(*capacity, num_tokens);
  // Routed tokens first, each group in token order (a stable sort of the descending mask).
  const auto order = std::get<1>(by_expert.to(at::kChar).sort(/*stable=*/true, /*dim=*/-1,
                                                              /*descending=*/true));
  auto indices = order.narrow(1, 0, kept).reshape({-1});
  auto experts =
      at::arange(num_experts, routing_map.options().dtype(at::kLong)).repeat_interleave(kept);
  return {indices, experts};
}

// --- the grouped GEMM -------------------------------------------------------------------------

std::vector<int64_t> group_sizes(const at::Tensor& a, const at::Tensor& b,
                                 const at::Tensor& batch_sizes, bool trans_b) {
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 3, "gmm: expected a [tokens, k] and b ",
                    trans_b ? "[experts, n, k]" : "[experts, k, n]", ", got shapes ", a.sizes(),
                    " and ", b.sizes());
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type() && a.device() == b.device(), "gmm: a (",
                    a.scalar_type(), " on ", a.device(), ") and b (", b.scalar_type(), " on ",
                    b.device(), ") must share dtype and device");
  TORCH_CHECK_VALUE(batch_sizes.dim() == 1 && batch_sizes.device().is_cpu() &&
                        !at::isFloatingType(batch_sizes.scalar_type()),
                    "gmm: batch_sizes must be a 1-D integer CPU tensor, got a ",
                    batch_sizes.scalar_type(), " tensor of shape ", batch_sizes.sizes(), " on ",
                    batch_sizes.device());
  TORCH_CHECK_VALUE(batch_sizes.numel() == b.size(0), "gmm: batch_sizes has ", batch_sizes.numel(),
                    " entries, but b has ", b.size(0), " experts");
  const int64_t k = trans_b ? b.size(2) : b.size(1);
  TORCH_CHECK_VALUE(a.size(1) == k, "gmm: a has ", a.size(1), " columns, but b",
                    trans_b ? " (trans_b)" : "", " has an inner size of ", k);
  const auto counts = batch_sizes.to(at::kLong).contiguous();
  const int64_t* c = counts.const_data_ptr<int64_t>();
  std::vector<int64_t> sizes(c, c + counts.numel());
  int64_t total = 0;
  for (size_t e = 0; e < sizes.size(); ++e) {
    TORCH_CHECK_VALUE(sizes[e] >= 0, "gmm: batch_sizes[", e, "] is ", sizes[e],
                      "; expected a count >= 0");
    total += sizes[e];
  }
  TORCH_CHECK_VALUE(total == a.size(0), "gmm: batch_sizes ", c10::IntArrayRef(sizes), " sum to ",
                    total, ", but a has ", a.size(0), " rows");
  return sizes;
}

at::Tensor expert_matrix(const at::Tensor& b, int64_t e, bool trans_b) {
  return trans_b ? b.select(0, e).t() : b.select(0, e);
}

at::Tensor grouped_gemm_forward(const at::Tensor& a, const at::Tensor& b,
                                const at::Tensor& batch_sizes, bool trans_b) {
  const auto sizes = group_sizes(a, b, batch_sizes, trans_b);
  const int64_t n = trans_b ? b.size(1) : b.size(2);
  auto out = at::empty({a.size(0), n}, a.options());
  int64_t start = 0;
  for (size_t e = 0; e < sizes.size(); ++e) {
    if (sizes[e] > 0) {
      auto rows = out.narrow(0, start, sizes[e]);
      at::mm_out(rows, a.narrow(0, start, sizes[e]), expert_matrix(b, e, trans_b));
    }
    start += sizes[e];
  }
  return out;
}

// (grad_a, grad_b): per expert, grad_a's rows = grad @ b_e^T and grad_b[e] = a_e^T @ grad (its
// transpose with trans_b); an expert without rows gets a zero gradient.
std::tuple<at::Tensor, at::Tensor> grouped_gemm_backward(const at::Tensor& grad,
                                                         const at::Tensor& a, const at::Tensor& b,
                                                         const at::Tensor& batch_sizes,
                                                         bool trans_b) {
  const auto sizes = group_sizes(a, b, batch_sizes, trans_b);
  const int64_t n = trans_b ? b.size(1) : b.size(2);
  TORCH_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == a.size(0) && grad.size(1) == n,
                    "gmm backward: expected a gradient of shape [", a.size(0), ", ", n, "], got ",
                    grad.sizes());
  auto grad_a = at::empty(a.sizes(), a.options());
  auto grad_b = at::zeros(b.sizes(), b.options());
  int64_t start = 0;
  for (size_t e = 0; e < sizes.size(); ++e) {
    if (sizes[e] > 0) {
      const auto g = grad.narrow(0, start, sizes[e]);
      const auto x = a.narrow(0, start, sizes[e]);
      auto ga = grad_a.narrow(0, start, sizes[e]);
      at::mm_out(ga, g, expert_matrix(b, e, trans_b).t());
      auto gb = grad_b.select(0, e);
      if (trans_b) {
        at::mm_out(gb, g.t(), x);
      } else {
        at::mm_out(gb, x.t(), g);
      }
    }
    start += sizes[e];
  }
  return {grad_a, grad_b};
}

using GemmBackwardFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&, const at::Tensor&,
                                                          bool);
using GemmFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);

struct GroupedGemmFunction : public Function<GroupedGemmFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& batch_sizes, bool trans_b) {
    ctx->save_for_backward({a, b, batch_sizes});
    ctx->saved_data["trans_b"] = trans_b;
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<GemmFn>("grouped_gemm");
    return op.call(a, b, batch_sizes, trans_b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(4);
    if (!grads[0].defined()) return result;
    const auto saved = ctx->get_saved_variables();
    static const auto op = typed_op<GemmBackwardFn>("grouped_gemm_backward");
    auto [grad_a, grad_b] =
        op.call(grads[0], saved[0], saved[1], saved[2], ctx->saved_data["trans_b"].toBool());
    if (ctx->needs_input_grad(0)) result[0] = grad_a;
    if (ctx->needs_input_grad(1)) result[1] = grad_b;
    return result;
  }
};

at::Tensor grouped_gemm_autograd(const at::Tensor& a, const at::Tensor& b,
                                 const at::Tensor& batch_sizes, bool trans_b) {
  TORCH_CHECK_VALUE(a.defined() && b.defined() && batch_sizes.defined(),
                    "gmm: expected tensors, got an undefined tensor");
  return GroupedGemmFunction::apply(a, b, batch_sizes, trans_b);
}

struct AuxLossScalerFunction : public Function<AuxLossScalerFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& output,
                            const at::Tensor& aux_loss, const at::Tensor& scale) {
    ctx->save_for_backward({aux_loss});
    // Not saved for backward: an in-place update of the scale before the backward is its purpose.
    ctx->saved_data["scale"] = scale;
    return output;  // the Function turns a returned input into a view of it carrying this node
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor aux_loss = ctx->get_saved_variables()[0];
    const at::Tensor scale = ctx->saved_data["scale"].toTensor();
    return {grads[0], at::ones_like(aux_loss) * scale.to(aux_loss.device(), aux_loss.scalar_type()),
            at::Tensor()};
  }
};

void check_aux_loss_args(const at::Tensor& output, const at::Tensor& aux_loss,
                         const at::Tensor& scale) {
  TORCH_CHECK_VALUE(output.defined() && aux_loss.defined() && scale.defined(),
                    "moe_aux_loss_scaler: expected three tensors, got an undefined one");
  TORCH_CHECK_VALUE(scale.numel() == 1,
                    "moe_aux_loss_scaler: the scale must hold one number, got shape ",
                    scale.sizes());
}

at::Tensor aux_loss_scaler_autograd(const at::Tensor& output, const at::Tensor& aux_loss,
                                    const at::Tensor& scale) {
  check_aux_loss_args(output, aux_loss, scale);
  return AuxLossScalerFunction::apply(output, aux_loss, scale);
}

at::Tensor aux_loss_scaler_forward(const at::Tensor& output, const at::Tensor& aux_loss,
                                   const at::Tensor& scale) {
  check_aux_loss_args(output, aux_loss, scale);
  return output.alias();
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl("moe_aux_loss_scaler", &aux_loss_scaler_forward);
  m.impl("moe_permute", &permute_no_autograd);
  m.impl("moe_unpermute", &unpermute_no_autograd);
  m.impl("moe_sort_by_expert", &sort_by_expert);
  m.impl("grouped_gemm", &grouped_gemm_forward);
  m.impl("grouped_gemm_backward", &grouped_gemm_backward);
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) {
  m.impl("moe_aux_loss_scaler", &aux_loss_scaler_autograd);
  m.impl("moe_permute", &permute_autograd);
  m.impl("moe_unpermute", &unpermute_autograd);
  m.impl("grouped_gemm", &grouped_gemm_autograd);
}

}  // namespace megatron_ext
