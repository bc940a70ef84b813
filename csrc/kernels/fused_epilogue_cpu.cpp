// CPU twins of the fused epilogue kernels: the same per-element arithmetic as the CUDA kernels
// (kernels/fused_epilogue.h), in parallel loops.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "kernels/fused_epilogue.h"
#include "kernels/fused_epilogue_checks.h"

namespace megatron_ext {
namespace {

using namespace kernels;

constexpr int64_t kGrain = 4096;

at::Tensor bias_gelu_forward_cpu(const at::Tensor& input, const at::Tensor& bias, bool tanh_form) {
  check_bias_gelu_args("bias_gelu_forward", input, bias);
  const auto x = input.contiguous();
  const auto b = bias.contiguous();
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  const int64_t h = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_forward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const scalar_t* bp = b.const_data_ptr<scalar_t>();
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const acc_t v = static_cast<acc_t>(xp[i]) + static_cast<acc_t>(bp[i % h]);
            op[i] = static_cast<scalar_t>(gelu<acc_t>(v, tanh_form));
          }
        });
      });
  return out;
}

at::Tensor bias_gelu_backward_cpu(const at::Tensor& grad_output, const at::Tensor& input,
                                  const at::Tensor& bias, bool tanh_form) {
  check_bias_gelu_args("bias_gelu_backward", input, bias);
  check_same_tensor_layout("bias_gelu_backward", "grad_output", grad_output, input);
  const auto g = grad_output.contiguous();
  const auto x = input.contiguous();
  const auto b = bias.contiguous();
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  const int64_t h = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* gp = g.const_data_ptr<scalar_t>();
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const scalar_t* bp = b.const_data_ptr<scalar_t>();
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const acc_t v = static_cast<acc_t>(xp[i]) + static_cast<acc_t>(bp[i % h]);
            op[i] =
                static_cast<scalar_t>(static_cast<acc_t>(gp[i]) * gelu_grad<acc_t>(v, tanh_form));
          }
        });
      });
  return out;
}

at::Tensor bias_dropout_add_forward_cpu(const at::Tensor& input,
                                        const std::optional<at::Tensor>& bias,
                                        const at::Tensor& residual, double prob, int64_t seed,
                                        int64_t offset) {
  check_bias_dropout_add_args("bias_dropout_add_forward", input, bias, residual, prob);
  const bool has_bias = bias.has_value() && bias->defined();
  const auto x = input.contiguous();
  const auto r = residual.contiguous();
  const auto b = has_bias ? bias->contiguous() : at::Tensor();
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  const int64_t h = x.size(-1);
  const float keep_prob = static_cast<float>(1.0 - prob);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "bias_dropout_add_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const acc_t scale = dropout_scale<acc_t>(prob);
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const scalar_t* rp = r.const_data_ptr<scalar_t>();
        const scalar_t* bp = has_bias ? b.const_data_ptr<scalar_t>() : nullptr;
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(
            0, dropout_groups(n), kGrain / kDropoutGroup, [&](int64_t begin, int64_t end) {
              for (int64_t group = begin; group < end; ++group) {
                const Philox4 bits =
                    philox4x32_10(static_cast<uint64_t>(seed),
                                  static_cast<uint64_t>(offset) + static_cast<uint64_t>(group));
                for (int64_t lane = 0; lane < kDropoutGroup; ++lane) {
                  const int64_t i = group * kDropoutGroup + lane;
                  if (i >= n) break;
                  const acc_t bias_value = bp ? static_cast<acc_t>(bp[i % h]) : acc_t(0);
                  op[i] = static_cast<scalar_t>(bias_dropout_add<acc_t>(
                      static_cast<acc_t>(xp[i]), bias_value, static_cast<acc_t>(rp[i]),
                      dropout_keep(bits, lane, keep_prob), scale));
                }
              }
            });
      });
  return out;
}

at::Tensor dropout_backward_cpu(const at::Tensor& grad_output, double prob, int64_t seed,
                                int64_t offset) {
  TORCH_CHECK_VALUE(at::isFloatingType(grad_output.scalar_type()),
                    "dropout_backward: grad_output must be a floating tensor, got ",
                    grad_output.scalar_type());
  check_dropout_prob("dropout_backward", prob);
  const auto g = grad_output.contiguous();
  auto out = at::empty_like(g);
  const int64_t n = g.numel();
  const float keep_prob = static_cast<float>(1.0 - prob);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, g.scalar_type(), "dropout_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const acc_t scale = dropout_scale<acc_t>(prob);
        const scalar_t* gp = g.const_data_ptr<scalar_t>();
        scalar_t* op = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(
            0, dropout_groups(n), kGrain / kDropoutGroup, [&](int64_t begin, int64_t end) {
              for (int64_t group = begin; group < end; ++group) {
                const Philox4 bits =
                    philox4x32_10(static_cast<uint64_t>(seed),
                                  static_cast<uint64_t>(offset) + static_cast<uint64_t>(group));
                for (int64_t lane = 0; lane < kDropoutGroup; ++lane) {
                  const int64_t i = group * kDropoutGroup + lane;
                  if (i >= n) break;
                  op[i] = static_cast<scalar_t>(dropout_grad<acc_t>(
                      static_cast<acc_t>(gp[i]), dropout_keep(bits, lane, keep_prob), scale));
                }
              }
            });
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CPU, m) {
  m.impl("bias_gelu_forward", &bias_gelu_forward_cpu);
  m.impl("bias_gelu_backward", &bias_gelu_backward_cpu);
  m.impl("bias_dropout_add_forward", &bias_dropout_add_forward_cpu);
  m.impl("dropout_backward", &dropout_backward_cpu);
}

}  // namespace megatron_ext
