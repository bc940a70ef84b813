// Autograd of the Mamba-2 SSD scan: ``mamba_chunk_scan`` is one C++ node over the
// ``mamba_chunk_scan_forward`` / ``mamba_chunk_scan_backward`` CPU and CUDA kernels
// (kernels/mamba_ssd*). It saves its inputs and the states at the chunk boundaries (not the
// outputs or any per-token state); the backward recomputes a chunk's products from them and
// returns the gradients of every tensor input at once, the final states' gradient included.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "kernels/mamba_ssd_checks.h"
#include "ops/dispatch.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

using OptionalTensor = std::optional<at::Tensor>;
using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensors9 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, at::Tensor, at::Tensor>;

Tensors3 forward_op(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                    const at::Tensor& B, const at::Tensor& C, int64_t chunk_size,
                    const OptionalTensor& D, const OptionalTensor& z, const OptionalTensor& dt_bias,
                    const OptionalTensor& initial_states, const OptionalTensor& cu_seqlens,
                    bool dt_softplus, double dt_min, std::optional<double> dt_max) {
  static const auto op =
      typed_op<Tensors3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, int64_t, const OptionalTensor&, const OptionalTensor&,
                        const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, bool,
                        double, std::optional<double>)>("mamba_chunk_scan_forward");
  return op.call(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, cu_seqlens, dt_softplus,
                 dt_min, dt_max);
}

Tensors9 backward_op(const at::Tensor& grad_y, const OptionalTensor& grad_final,
                     const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                     const at::Tensor& B, const at::Tensor& C, int64_t chunk_size,
                     const OptionalTensor& D, const OptionalTensor& z,
                     const OptionalTensor& dt_bias, const OptionalTensor& initial_states,
                     const OptionalTensor& cu_seqlens, bool dt_softplus, double dt_min,
                     std::optional<double> dt_max, const at::Tensor& chunk_states) {
  static const auto op = typed_op<Tensors9(
      const at::Tensor&, const OptionalTensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const OptionalTensor&,
      const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,
      bool, double, std::optional<double>, const at::Tensor&)>("mamba_chunk_scan_backward");
  return op.call(grad_y, grad_final, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
                 cu_seqlens, dt_softplus, dt_min, dt_max, chunk_states);
}

OptionalTensor optional_of(const at::Tensor& t) {
  return t.defined() ? OptionalTensor(t) : std::nullopt;
}

struct MambaChunkScanFunction : public Function<MambaChunkScanFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& dt,
                               const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                               int64_t chunk_size, const OptionalTensor& D, const OptionalTensor& z,
                               const OptionalTensor& dt_bias, const OptionalTensor& initial_states,
                               const OptionalTensor& cu_seqlens, bool dt_softplus, double dt_min,
                               std::optional<double> dt_max) {
    at::Tensor y, final_states, chunk_states;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, final_states, chunk_states) =
          forward_op(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, cu_seqlens,
                     dt_softplus, dt_min, dt_max);
    }
    ctx->save_for_backward({x, dt, A, B, C, D.value_or(at::Tensor()), z.value_or(at::Tensor()),
                            dt_bias.value_or(at::Tensor()), initial_states.value_or(at::Tensor()),
                            cu_seqlens.value_or(at::Tensor()), chunk_states});
    ctx->saved_data["chunk_size"] = chunk_size;
    ctx->saved_data["dt_softplus"] = dt_softplus;
    ctx->saved_data["dt_min"] = dt_min;
    ctx->saved_data["dt_max"] = dt_max.has_value() ? c10::IValue(*dt_max) : c10::IValue();
    return {y, final_states};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(14);  // chunk_size, cu_seqlens and the scalars get none
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    if (!grads[0].defined() && !grads[1].defined()) return result;
    const auto grad_y = grads[0].defined() ? grads[0] : at::zeros(x.sizes(), x.options());
    const auto dt_max_value = ctx->saved_data["dt_max"];
    const std::optional<double> dt_max =
        dt_max_value.isNone() ? std::nullopt : std::optional<double>(dt_max_value.toDouble());
    const auto D = optional_of(saved[5]), z = optional_of(saved[6]),
               dt_bias = optional_of(saved[7]), init = optional_of(saved[8]),
               cu = optional_of(saved[9]);
    auto [gx, gdt, gA, gB, gC, gD, gz, gbias, ginit] =
        backward_op(grad_y, optional_of(grads[1]), x, saved[1], saved[2], saved[3], saved[4],
                    ctx->saved_data["chunk_size"].toInt(), D, z, dt_bias, init, cu,
                    ctx->saved_data["dt_softplus"].toBool(), ctx->saved_data["dt_min"].toDouble(),
                    dt_max, saved[10]);
    // needs_input_grad counts the tensors given: an absent optional has no edge.
    size_t edge = 0;
    auto take = [&](size_t slot, bool present, const at::Tensor& grad) {
      if (!present) return;
      if (ctx->needs_input_grad(edge)) result[slot] = grad;
      ++edge;
    };
    take(0, true, gx);
    take(1, true, gdt);
    take(2, true, gA);
    take(3, true, gB);
    take(4, true, gC);
    take(6, D.has_value(), gD);
    take(7, z.has_value(), gz);
    take(8, dt_bias.has_value(), gbias);
    take(9, init.has_value(), ginit);
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor> mamba_chunk_scan_autograd(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, int64_t chunk_size, const OptionalTensor& D, const OptionalTensor& z,
    const OptionalTensor& dt_bias, const OptionalTensor& initial_states,
    const OptionalTensor& cu_seqlens, bool dt_softplus, double dt_min,
    std::optional<double> dt_max) {
  check_mamba_chunk_scan_args("mamba_chunk_scan", x, dt, A, B, C, chunk_size, D, z, dt_bias,
                              initial_states, cu_seqlens, dt_min, dt_max);
  const auto out =
      MambaChunkScanFunction::apply(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
                                    cu_seqlens, dt_softplus, dt_min, dt_max);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor> mamba_chunk_scan_no_autograd(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, int64_t chunk_size, const OptionalTensor& D, const OptionalTensor& z,
    const OptionalTensor& dt_bias, const OptionalTensor& initial_states,
    const OptionalTensor& cu_seqlens, bool dt_softplus, double dt_min,
    std::optional<double> dt_max) {
  check_mamba_chunk_scan_args("mamba_chunk_scan", x, dt, A, B, C, chunk_size, D, z, dt_bias,
                              initial_states, cu_seqlens, dt_min, dt_max);
  auto [y, final_states, chunk_states] =
      forward_op(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, cu_seqlens, dt_softplus,
                 dt_min, dt_max);
  return {y, final_states};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl("mamba_chunk_scan", &mamba_chunk_scan_no_autograd);
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) {
  m.impl("mamba_chunk_scan", &mamba_chunk_scan_autograd);
}

}  // namespace megatron_ext
