// Autograd of the gated delta rule: ``chunk_gated_delta_rule`` is one C++ node over the
// ``gated_delta_rule_forward`` / ``gated_delta_rule_backward`` CPU and CUDA kernels
// (kernels/gated_delta_rule*). It saves its inputs and the state entering each chunk (not the
// per-token states); the backward recomputes each chunk from its entering state and returns the
// gradients of q, k, v, g, beta and the initial state at once.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "kernels/gated_delta_rule_checks.h"
#include "ops/dispatch.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

using OptionalTensor = std::optional<at::Tensor>;
using ForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using BackwardResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

ForwardResult gdr_forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta, double scale,
                             const OptionalTensor& initial_state, const OptionalTensor& cu_seqlens,
                             bool use_qk_l2norm, int64_t chunk_size) {
  static const auto op =
      typed_op<ForwardResult(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double, const OptionalTensor&,
                             const OptionalTensor&, bool, int64_t)>("gated_delta_rule_forward");
  return op.call(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size);
}

BackwardResult gdr_backward_op(const at::Tensor& grad, const OptionalTensor& grad_final,
                               const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta, double scale,
                               const OptionalTensor& initial_state,
                               const OptionalTensor& cu_seqlens, const at::Tensor& chunk_states,
                               bool use_qk_l2norm, int64_t chunk_size) {
  static const auto op = typed_op<BackwardResult(
      const at::Tensor&, const OptionalTensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const OptionalTensor&,
      const OptionalTensor&, const at::Tensor&, bool, int64_t)>("gated_delta_rule_backward");
  return op.call(grad, grad_final, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_states,
                 use_qk_l2norm, chunk_size);
}

OptionalTensor optional_of(const at::Tensor& t) {
  return t.defined() ? OptionalTensor(t) : std::nullopt;
}

// K^{-1/2} unless given.
double scale_of(const at::Tensor& q, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// Without output_final_state, the second output is an empty tensor (None in the Python wrapper).
at::Tensor final_or_empty(const at::Tensor& final_state, bool output_final_state) {
  return output_final_state ? final_state : at::empty({0}, final_state.options());
}

struct GatedDeltaRuleFunction : public Function<GatedDeltaRuleFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                               double scale, const OptionalTensor& initial_state,
                               bool output_final_state, const OptionalTensor& cu_seqlens,
                               bool use_qk_l2norm, int64_t chunk_size) {
    at::Tensor out, final_state, chunk_states;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out, final_state, chunk_states) = gdr_forward_op(
          q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size);
    }
    ctx->save_for_backward({q, k, v, g, beta, initial_state.value_or(at::Tensor()),
                            cu_seqlens.value_or(at::Tensor()), chunk_states});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["output_final_state"] = output_final_state;
    ctx->saved_data["use_qk_l2norm"] = use_qk_l2norm;
    ctx->saved_data["chunk_size"] = chunk_size;
    auto last = final_or_empty(final_state, output_final_state);
    if (!output_final_state) ctx->mark_non_differentiable({last});
    return {out, last};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(11);  // scale, the flags, cu_seqlens and chunk_size get none
    const auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto& v = saved[2];
    const bool output_final_state = ctx->saved_data["output_final_state"].toBool();
    const OptionalTensor grad_final =
        output_final_state && grads[1].defined() ? OptionalTensor(grads[1]) : std::nullopt;
    if (!grads[0].defined() && !grad_final.has_value()) return result;
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros(v.sizes(), v.options());
    const auto initial_state = optional_of(saved[5]);
    auto [dq, dk, dv, dg, dbeta, dinit] = gdr_backward_op(
        grad_out, grad_final, q, saved[1], v, saved[3], saved[4],
        ctx->saved_data["scale"].toDouble(), initial_state, optional_of(saved[6]), saved[7],
        ctx->saved_data["use_qk_l2norm"].toBool(), ctx->saved_data["chunk_size"].toInt());
    // needs_input_grad counts the tensors given: an absent optional has no edge.
    const at::Tensor all[] = {dq, dk, dv, dg, dbeta};
    for (size_t i = 0; i < 5; ++i) {
      if (ctx->needs_input_grad(i)) result[i] = all[i];
    }
    if (initial_state.has_value() && ctx->needs_input_grad(5)) result[6] = dinit;
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor> chunk_gated_delta_rule_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, std::optional<double> scale, const OptionalTensor& initial_state,
    bool output_final_state, const OptionalTensor& cu_seqlens, bool use_qk_l2norm,
    int64_t chunk_size) {
  const double s = scale_of(q, scale);
  check_gated_delta_rule_args("chunk_gated_delta_rule", q, k, v, g, beta, s, initial_state,
                              cu_seqlens, chunk_size);
  auto outs = GatedDeltaRuleFunction::apply(q, k, v, g, beta, s, initial_state, output_final_state,
                                            cu_seqlens, use_qk_l2norm, chunk_size);
  return {outs[0], outs[1]};
}

std::tuple<at::Tensor, at::Tensor> chunk_gated_delta_rule_no_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, std::optional<double> scale, const OptionalTensor& initial_state,
    bool output_final_state, const OptionalTensor& cu_seqlens, bool use_qk_l2norm,
    int64_t chunk_size) {
  const double s = scale_of(q, scale);
  check_gated_delta_rule_args("chunk_gated_delta_rule", q, k, v, g, beta, s, initial_state,
                              cu_seqlens, chunk_size);
  auto [out, final_state, chunk_states] =
      gdr_forward_op(q, k, v, g, beta, s, initial_state, cu_seqlens, use_qk_l2norm, chunk_size);
  return {out, final_or_empty(final_state, output_final_state)};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl("chunk_gated_delta_rule", &chunk_gated_delta_rule_no_autograd);
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) {
  m.impl("chunk_gated_delta_rule", &chunk_gated_delta_rule_autograd);
}

}  // namespace megatron_ext
