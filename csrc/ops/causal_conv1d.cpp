// Autograd of the causal convolution: ``causal_conv1d`` is one C++ node over the
// ``causal_conv1d_forward`` / ``causal_conv1d_backward`` CPU and CUDA kernels
// (kernels/causal_conv1d*). It saves its inputs and recomputes the pre-activation in backward,
// which returns the gradients of x, the weight, the bias and the initial states at once.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "kernels/causal_conv1d_checks.h"
#include "ops/dispatch.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

using OptionalTensor = std::optional<at::Tensor>;

at::Tensor causal_conv1d_forward_op(const at::Tensor& x, const at::Tensor& weight,
                                    const OptionalTensor& bias, const OptionalTensor& cu_seqlens,
                                    const OptionalTensor& initial_states,
                                    c10::string_view activation) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                          const OptionalTensor&, const OptionalTensor&, c10::string_view)>(
          "causal_conv1d_forward");
  return op.call(x, weight, bias, cu_seqlens, initial_states, activation);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_conv1d_backward_op(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
    const OptionalTensor& bias, const OptionalTensor& cu_seqlens,
    const OptionalTensor& initial_states, c10::string_view activation) {
  static const auto op = typed_op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&,
      const OptionalTensor&, const OptionalTensor&, c10::string_view)>("causal_conv1d_backward");
  return op.call(grad, x, weight, bias, cu_seqlens, initial_states, activation);
}

OptionalTensor optional_of(const at::Tensor& t) {
  return t.defined() ? OptionalTensor(t) : std::nullopt;
}

struct CausalConv1dFunction : public Function<CausalConv1dFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptionalTensor& bias, const OptionalTensor& cu_seqlens,
                            const OptionalTensor& initial_states, c10::string_view activation) {
    ctx->save_for_backward({x, weight, bias.value_or(at::Tensor()),
                            cu_seqlens.value_or(at::Tensor()),
                            initial_states.value_or(at::Tensor())});
    ctx->saved_data["activation"] = std::string(activation);
    at::AutoDispatchBelowADInplaceOrView guard;
    return causal_conv1d_forward_op(x, weight, bias, cu_seqlens, initial_states, activation);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(6);  // cu_seqlens and activation get none
    if (!grads[0].defined()) return result;
    const auto saved = ctx->get_saved_variables();
    const auto bias = optional_of(saved[2]);
    const auto initial_states = optional_of(saved[4]);
    auto [grad_x, grad_weight, grad_bias, grad_initial_states] =
        causal_conv1d_backward_op(grads[0], saved[0], saved[1], bias, optional_of(saved[3]),
                                  initial_states, ctx->saved_data["activation"].toStringRef());
    // needs_input_grad counts the tensors given: an absent optional has no edge.
    const size_t init_edge = 2 + (bias.has_value() ? 1 : 0) + (saved[3].defined() ? 1 : 0);
    if (ctx->needs_input_grad(0)) result[0] = grad_x;
    if (ctx->needs_input_grad(1)) result[1] = grad_weight;
    if (bias.has_value() && ctx->needs_input_grad(2)) result[2] = grad_bias;
    if (initial_states.has_value() && ctx->needs_input_grad(init_edge)) {
      result[4] = grad_initial_states;
    }
    return result;
  }
};

at::Tensor causal_conv1d_autograd(const at::Tensor& x, const at::Tensor& weight,
                                  const OptionalTensor& bias, const OptionalTensor& cu_seqlens,
                                  const OptionalTensor& initial_states,
                                  c10::string_view activation) {
  check_causal_conv1d_args("causal_conv1d", x, weight, bias, cu_seqlens, initial_states,
                           activation);
  return CausalConv1dFunction::apply(x, weight, bias, cu_seqlens, initial_states, activation);
}

at::Tensor causal_conv1d_no_autograd(const at::Tensor& x, const at::Tensor& weight,
                                     const OptionalTensor& bias, const OptionalTensor& cu_seqlens,
                                     const OptionalTensor& initial_states,
                                     c10::string_view activation) {
  check_causal_conv1d_args("causal_conv1d", x, weight, bias, cu_seqlens, initial_states,
                           activation);
  return causal_conv1d_forward_op(x, weight, bias, cu_seqlens, initial_states, activation);
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl("causal_conv1d", &causal_conv1d_no_autograd);
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) { m.impl("causal_conv1d", &causal_conv1d_autograd); }

}  // namespace megatron_ext
