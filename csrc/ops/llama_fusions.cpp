// Autograd of the RMSNorm, rotary embedding and SwiGLU ops: each public op is one C++ node over
// the ``_forward`` / ``_backward`` CPU and CUDA kernels of kernels/llama_fusions*.
//
// RMSNorm saves its input and the per-row rstd (float32 for 16-bit inputs); rotary embedding saves
// only the cos and sin tables (it is linear in its input, so the gradient is the transposed
// rotation of the output's gradient); SwiGLU (and its gated sigmoid variants: alpha, linear
// offset, clamp) saves its input and recomputes the activation in backward.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/sin.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "ops/dispatch.h"
#include "kernels/llama_fusions_checks.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_op(const at::Tensor& input,
                                                       const at::Tensor& weight, double eps) {
  static const auto op =
      typed_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double)>(
          "rms_norm_forward");
  return op.call(input, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_op(const at::Tensor& grad,
                                                        const at::Tensor& input,
                                                        const at::Tensor& weight,
                                                        const at::Tensor& rstd) {
  static const auto op = typed_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "rms_norm_backward");
  return op.call(grad, input, weight, rstd);
}

using RotaryKernel = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);

at::Tensor rotary_forward_op(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin,
                             bool interleaved) {
  static const auto op = typed_op<RotaryKernel>("rotary_pos_emb_forward");
  return op.call(t, cos, sin, interleaved);
}

at::Tensor rotary_backward_op(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                              bool interleaved) {
  static const auto op = typed_op<RotaryKernel>("rotary_pos_emb_backward");
  return op.call(grad, cos, sin, interleaved);
}

// The gated sigmoid unit's settings as the ops take them: alpha, linear_offset, clamp_value.
struct GluArgs {
  double alpha;
  double linear_offset;
  std::optional<double> clamp_value;
};

at::Tensor swiglu_forward_op(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                             const GluArgs& glu) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, double, double,
                          std::optional<double>)>("swiglu_forward");
  return op.call(input, bias, glu.alpha, glu.linear_offset, glu.clamp_value);
}

at::Tensor swiglu_backward_op(const at::Tensor& grad, const at::Tensor& input,
                              const std::optional<at::Tensor>& bias, const GluArgs& glu) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                          double, double, std::optional<double>)>("swiglu_backward");
  return op.call(grad, input, bias, glu.alpha, glu.linear_offset, glu.clamp_value);
}

// cos(freqs) and sin(freqs) as [s, d_rot] tables in ``dtype``: computed in freqs' dtype, then cast,
// as Megatron-core's unfused rotary embedding does.
std::pair<at::Tensor, at::Tensor> rotary_tables(const at::Tensor& freqs, at::ScalarType dtype) {
  const auto angles = freqs.reshape({freqs.size(0), freqs.size(3)});
  return {at::cos(angles).to(dtype), at::sin(angles).to(dtype)};
}

struct RmsNormFunction : public Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rstd] = rms_norm_forward_op(input, weight, eps);
    ctx->save_for_backward({input, weight, rstd});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(3);
    if (!grads[0].defined()) return result;
    const auto saved = ctx->get_saved_variables();
    auto [grad_input, grad_weight] = rms_norm_backward_op(grads[0], saved[0], saved[1], saved[2]);
    if (ctx->needs_input_grad(0)) result[0] = grad_input;
    if (ctx->needs_input_grad(1)) result[1] = grad_weight;
    return result;
  }
};

struct RotaryFunction : public Function<RotaryFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, const at::Tensor& freqs,
                            bool interleaved) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [cos, sin] = rotary_tables(freqs, t.scalar_type());
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["interleaved"] = interleaved;
    return rotary_forward_op(t, cos, sin, interleaved);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(3);  // freqs gets no gradient
    if (!grads[0].defined() || !ctx->needs_input_grad(0)) return result;
    const auto saved = ctx->get_saved_variables();
    result[0] =
        rotary_backward_op(grads[0], saved[0], saved[1], ctx->saved_data["interleaved"].toBool());
    return result;
  }
};

struct SwigluFunction : public Function<SwigluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const std::optional<at::Tensor>& bias, double alpha,
                            double linear_offset, std::optional<double> clamp_value) {
    ctx->save_for_backward({input, bias.value_or(at::Tensor())});
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["linear_offset"] = linear_offset;
    ctx->saved_data["clamp_value"] = clamp_value;
    at::AutoDispatchBelowADInplaceOrView guard;
    return swiglu_forward_op(input, bias, {alpha, linear_offset, clamp_value});
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(5);  // alpha, linear_offset and clamp_value get none
    if (!grads[0].defined()) return result;
    const auto saved = ctx->get_saved_variables();
    const std::optional<at::Tensor> bias =
        saved[1].defined() ? std::optional<at::Tensor>(saved[1]) : std::nullopt;
    const auto& clamp = ctx->saved_data["clamp_value"];
    const GluArgs glu{ctx->saved_data["alpha"].toDouble(),
                      ctx->saved_data["linear_offset"].toDouble(),
                      clamp.isNone() ? std::nullopt : std::optional<double>(clamp.toDouble())};
    const auto grad_input = swiglu_backward_op(grads[0], saved[0], bias, glu);
    // The bias gradient: the sum over every dim but the last.
    if (bias.has_value() && ctx->needs_input_grad(1)) {
      result[1] = grad_input.reshape({-1, grad_input.size(-1)}).sum(0);
    }
    result[0] = grad_input;
    return result;
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_rms_norm_args("rms_norm", input, weight, eps);
  return RmsNormFunction::apply(input, weight, eps);
}

at::Tensor rms_norm_no_autograd(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_rms_norm_args("rms_norm", input, weight, eps);
  return std::get<0>(rms_norm_forward_op(input, weight, eps));
}

at::Tensor rotary_autograd(const at::Tensor& t, const at::Tensor& freqs, bool interleaved) {
  check_rotary_freqs("rotary_pos_emb", t, freqs);
  return RotaryFunction::apply(t, freqs, interleaved);
}

at::Tensor rotary_no_autograd(const at::Tensor& t, const at::Tensor& freqs, bool interleaved) {
  check_rotary_freqs("rotary_pos_emb", t, freqs);
  auto [cos, sin] = rotary_tables(freqs, t.scalar_type());
  return rotary_forward_op(t, cos, sin, interleaved);
}

at::Tensor swiglu_autograd(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                           double alpha, double linear_offset, std::optional<double> clamp_value) {
  check_swiglu_args("swiglu", input, bias);
  glu_params("swiglu", alpha, linear_offset, clamp_value);
  return SwigluFunction::apply(input, bias, alpha, linear_offset, clamp_value);
}

at::Tensor swiglu_no_autograd(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                              double alpha, double linear_offset,
                              std::optional<double> clamp_value) {
  check_swiglu_args("swiglu", input, bias);
  glu_params("swiglu", alpha, linear_offset, clamp_value);
  return swiglu_forward_op(input, bias, {alpha, linear_offset, clamp_value});
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl("rms_norm", &rms_norm_no_autograd);
  m.impl("rotary_pos_emb", &rotary_no_autograd);
  m.impl("swiglu", &swiglu_no_autograd);
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) {
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("rotary_pos_emb", &rotary_autograd);
  m.impl("swiglu", &swiglu_autograd);
}

}  // namespace megatron_ext
