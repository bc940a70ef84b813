// Autograd of the fused epilogue ops: bias + GeLU and bias + dropout + residual add. Their
// forward and backward run the CPU/CUDA kernels of kernels/fused_epilogue*.
//
// The dropout seed is drawn from the device's default generator (the CPU one, or the current CUDA
// device's): the generator the RNG tracker forks and activation checkpointing snapshots, so a
// recomputed forward draws the same mask, and ranks seeded alike draw alike. Backward regenerates
// the mask from the same (seed, offset) rather than storing it.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <mutex>

#ifdef MEGATRON_EXT_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include "ops/dispatch.h"
#include "kernels/fused_epilogue_checks.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

at::Tensor bias_gelu_forward_op(const at::Tensor& input, const at::Tensor& bias, bool tanh_form) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, bool)>("bias_gelu_forward");
  return op.call(input, bias, tanh_form);
}

at::Tensor bias_gelu_backward_op(const at::Tensor& grad, const at::Tensor& input,
                                 const at::Tensor& bias, bool tanh_form) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>(
          "bias_gelu_backward");
  return op.call(grad, input, bias, tanh_form);
}

at::Tensor bias_dropout_add_forward_op(const at::Tensor& input,
                                       const std::optional<at::Tensor>& bias,
                                       const at::Tensor& residual, double prob, int64_t seed,
                                       int64_t offset) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                          double, int64_t, int64_t)>("bias_dropout_add_forward");
  return op.call(input, bias, residual, prob, seed, offset);
}

at::Tensor dropout_backward_op(const at::Tensor& grad, double prob, int64_t seed, int64_t offset) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, double, int64_t, int64_t)>("dropout_backward");
  return op.call(grad, prob, seed, offset);
}

// The bias gradient: the sum over every dim but the last.
at::Tensor sum_to_bias(const at::Tensor& grad) { return grad.reshape({-1, grad.size(-1)}).sum(0); }

// (seed, offset) of the dropout stream for ``numel`` elements, advancing the default generator of
// ``like``'s device past them.
std::pair<int64_t, int64_t> draw_dropout_seed(const at::Tensor& like) {
  if (like.is_cuda()) {
#ifdef MEGATRON_EXT_WITH_CUDA
    const uint64_t groups = static_cast<uint64_t>(dropout_groups(like.numel()));
    auto gen = at::cuda::detail::getDefaultCUDAGenerator(like.device().index());
    std::lock_guard<std::mutex> lock(gen.mutex());
    // The generator's offset counts 32-bit numbers; one Philox counter value gives four, so the
    // kernels' counters for this call are [offset / 4, offset / 4 + groups), exactly what the
    // advance by 4 * groups reserves: torch's own random kernels, which start their counters at
    // (their offset) / 4, never reuse them.
    const auto [seed, offset] = gen.get<at::CUDAGeneratorImpl>()->philox_engine_inputs(4 * groups);
    return {static_cast<int64_t>(seed), static_cast<int64_t>(offset / 4)};
#else
    TORCH_CHECK(false,
                "bias_dropout_add: got a CUDA tensor but megatron_ext was built without CUDA");
#endif
  }
  TORCH_CHECK_VALUE(like.device().is_cpu(),
                    "bias_dropout_add: expected a CPU or CUDA tensor, got one on ", like.device());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return {static_cast<int64_t>(gen.get<at::CPUGeneratorImpl>()->random64()), 0};
}

struct BiasGeluFunction : public Function<BiasGeluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& bias,
                            bool tanh_form) {
    ctx->save_for_backward({input, bias});
    ctx->saved_data["tanh"] = tanh_form;
    at::AutoDispatchBelowADInplaceOrView guard;
    return bias_gelu_forward_op(input, bias, tanh_form);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    variable_list result(3);
    if (!grads[0].defined()) return result;
    const auto grad_input =
        bias_gelu_backward_op(grads[0], saved[0], saved[1], ctx->saved_data["tanh"].toBool());
    if (ctx->needs_input_grad(1)) result[1] = sum_to_bias(grad_input);
    result[0] = grad_input;
    return result;
  }
};

struct BiasDropoutAddFunction : public Function<BiasDropoutAddFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const std::optional<at::Tensor>& bias, const at::Tensor& residual,
                            double prob, bool training) {
    const double p = training ? prob : 0.0;
    const auto [seed, offset] =
        p > 0.0 ? draw_dropout_seed(input) : std::pair<int64_t, int64_t>{0, 0};
    ctx->saved_data["prob"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    at::AutoDispatchBelowADInplaceOrView guard;
    return bias_dropout_add_forward_op(input, bias, residual, p, seed, offset);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(5);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return result;
    const double p = ctx->saved_data["prob"].toDouble();
    const at::Tensor grad_input =
        p > 0.0 ? dropout_backward_op(grad, p, ctx->saved_data["seed"].toInt(),
                                      ctx->saved_data["offset"].toInt())
                : grad;
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(1))
      result[1] = sum_to_bias(grad_input);
    result[0] = grad_input;
    result[2] = grad;
    return result;
  }
};

at::Tensor bias_gelu_autograd(const at::Tensor& input, const at::Tensor& bias,
                              bool approximate_tanh) {
  check_bias_gelu_args("bias_gelu", input, bias);
  return BiasGeluFunction::apply(input, bias, approximate_tanh);
}

at::Tensor bias_gelu_no_autograd(const at::Tensor& input, const at::Tensor& bias,
                                 bool approximate_tanh) {
  return bias_gelu_forward_op(input, bias, approximate_tanh);
}

at::Tensor bias_dropout_add_autograd(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                                     const at::Tensor& residual, double prob, bool training) {
  check_bias_dropout_add_args("bias_dropout_add", input, bias, residual, prob);
  return BiasDropoutAddFunction::apply(input, bias, residual, prob, training);
}

at::Tensor bias_dropout_add_no_autograd(const at::Tensor& input,
                                        const std::optional<at::Tensor>& bias,
                                        const at::Tensor& residual, double prob, bool training) {
  check_bias_dropout_add_args("bias_dropout_add", input, bias, residual, prob);
  const double p = training ? prob : 0.0;
  const auto [seed, offset] =
      p > 0.0 ? draw_dropout_seed(input) : std::pair<int64_t, int64_t>{0, 0};
  return bias_dropout_add_forward_op(input, bias, residual, p, seed, offset);
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl("bias_gelu", &bias_gelu_no_autograd);
  m.impl("bias_dropout_add", &bias_dropout_add_no_autograd);
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) {
  m.impl("bias_gelu", &bias_gelu_autograd);
  m.impl("bias_dropout_add", &bias_dropout_add_autograd);
}

}  // namespace megatron_ext
