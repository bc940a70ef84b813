// The linear of the column-parallel layer with its input-gradient collective overlapped with the
// weight-gradient GEMM.
//
//   forward:  x = all_gather_dim0(input) under sequence parallelism, else input
//             output = x @ weight^T + bias
//   backward: grad_input = grad_output @ weight
//             start all-reduce(grad_input)            when allreduce_dgrad
//             start reduce-scatter_dim0(grad_input)   when sequence_parallel
//             grad_weight = grad_output^T @ x  (added into main_grad instead when
//                                               gradient_accumulation_fusion) while it runs
//             grad_bias = sum of grad_output over all leading dims
//             wait for the collective
//
// Under sequence parallelism the gathered input is not saved: backward gathers it again, started
// before the input-gradient GEMM so the two overlap (memory over time, as Megatron does).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "comm/process_group.h"
#include "ops/weight_grad.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr const char* kOp = "linear_with_grad_accumulation_and_async_allreduce";

void check_args(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                const std::optional<at::Tensor>& main_grad, bool gradient_accumulation_fusion,
                bool allreduce_dgrad, bool sequence_parallel) {
  TORCH_CHECK_VALUE(input.defined() && weight.defined(), kOp, ": input and weight must be tensors");
  TORCH_CHECK_VALUE(weight.dim() == 2, kOp, ": weight must be 2-D [output, input], got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(input.dim() >= 1 && input.size(-1) == weight.size(1), kOp,
                    ": the last dim of the input (shape ", input.sizes(),
                    ") must equal the input size of the weight (shape ", weight.sizes(), ")");
  TORCH_CHECK_VALUE(!sequence_parallel || input.dim() >= 2, kOp,
                    ": sequence parallelism needs an input with a sequence dim first, got shape ",
                    input.sizes());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), kOp,
                      ": bias must have shape [", weight.size(0), "], got ", bias->sizes());
  }
  TORCH_CHECK_VALUE(!(allreduce_dgrad && sequence_parallel), kOp,
                    ": allreduce_dgrad and sequence_parallel are exclusive (sequence parallelism "
                    "reduce-scatters the input gradient instead of all-reducing it)");
  if (gradient_accumulation_fusion) {
    TORCH_CHECK_VALUE(main_grad.has_value() && main_grad->defined(), kOp,
                      ": gradient_accumulation_fusion needs the weight's main_grad buffer");
    TORCH_CHECK_VALUE(main_grad->sizes() == weight.sizes(), kOp, ": main_grad has shape ",
                      main_grad->sizes(), " but the weight has shape ", weight.sizes());
    TORCH_CHECK_VALUE(at::isFloatingType(main_grad->scalar_type()), kOp,
                      ": main_grad must be a floating tensor, got ", main_grad->scalar_type());
  }
}

// The forward below autograd, for every backend.
at::Tensor linear_forward(const at::Tensor& input, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& main_grad,
                          bool gradient_accumulation_fusion, bool allreduce_dgrad,
                          bool sequence_parallel, c10::string_view group_name) {
  check_args(input, weight, bias, main_grad, gradient_accumulation_fusion, allreduce_dgrad,
             sequence_parallel);
  const std::string group(group_name);
  at::Tensor total_input = input;
  if (sequence_parallel && comm::group_size(group) > 1) {
    auto [gathered, work] = comm::all_gather_first_dim_async(input, group);
    work->wait();
    total_input = gathered;
  }
  return at::linear(total_input, weight, bias);
}

using LinearOp = c10::TypedOperatorHandle<at::Tensor(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, bool, bool, bool, c10::string_view)>;

const LinearOp& linear_op() {
  static const LinearOp op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow((std::string("megatron_ext::") + kOp).c_str(), "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, bool, bool, bool, c10::string_view)>();
  return op;
}

struct LinearAsyncFunction : public Function<LinearAsyncFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& main_grad,
                            bool gradient_accumulation_fusion, bool allreduce_dgrad,
                            bool sequence_parallel, const std::string& group) {
    ctx->save_for_backward({input, weight});
    // Held outside save_for_backward: main_grad is updated in place by other micro-batches'
    // backward passes between this forward and its backward, which a version check would reject.
    if (gradient_accumulation_fusion) ctx->saved_data["main_grad"] = *main_grad;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["fusion"] = gradient_accumulation_fusion;
    ctx->saved_data["allreduce_dgrad"] = allreduce_dgrad;
    ctx->saved_data["sequence_parallel"] = sequence_parallel;
    ctx->saved_data["group"] = group;
    at::AutoDispatchBelowADInplaceOrView guard;
    return linear_op().call(input, weight, bias, main_grad, gradient_accumulation_fusion,
                            allreduce_dgrad, sequence_parallel, group);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const bool fusion = ctx->saved_data["fusion"].toBool();
    const std::string group = ctx->saved_data["group"].toStringRef();
    const bool distributed = comm::group_size(group) > 1;
    const bool allreduce_dgrad = ctx->saved_data["allreduce_dgrad"].toBool() && distributed;
    const bool sequence_parallel = ctx->saved_data["sequence_parallel"].toBool() && distributed;
    const at::Tensor grad_output = grads[0];
    variable_list result(8);
    if (!grad_output.defined()) return result;

    const bool need_input_grad = ctx->needs_input_grad(0);
    const bool need_weight_grad = ctx->needs_input_grad(1) || fusion;
    at::Tensor total_input = input;
    c10::intrusive_ptr<c10d::Work> gather_work;
    if (sequence_parallel && need_weight_grad) {
      std::tie(total_input, gather_work) = comm::all_gather_first_dim_async(input, group);
    }

    at::Tensor grad_input;
    c10::intrusive_ptr<c10d::Work> dgrad_work;
    if (need_input_grad) {
      grad_input = at::matmul(grad_output, weight).contiguous();
      if (allreduce_dgrad) {
        dgrad_work = comm::all_reduce_async_(grad_input, group);
      } else if (sequence_parallel) {
        auto full = grad_input;
        grad_input = at::empty(input.sizes(), full.options());
        dgrad_work = comm::reduce_scatter_first_dim_async(grad_input, full, group);
      }
    }

    // Weight and bias gradients are computed while the input-gradient collective runs.
    if (gather_work) gather_work->wait();
    const int64_t out_features = grad_output.size(-1);
    const auto grad_output_2d = grad_output.reshape({-1, out_features});
    if (need_weight_grad) {
      const auto input_2d = total_input.reshape({-1, total_input.size(-1)});
      if (fusion) {
        auto main_grad = ctx->saved_data["main_grad"].toTensor();
        accumulate_weight_grad_(main_grad, grad_output_2d, input_2d);
      } else {
        result[1] = grad_output_2d.t().mm(input_2d);
      }
    }
    if (has_bias && ctx->needs_input_grad(2)) result[2] = grad_output_2d.sum(0);

    if (dgrad_work) dgrad_work->wait();
    result[0] = grad_input;
    return result;
  }
};

at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& main_grad,
                           bool gradient_accumulation_fusion, bool allreduce_dgrad,
                           bool sequence_parallel, c10::string_view group_name) {
  // Every rank checks its arguments before any collective, so bad input raises instead of hanging.
  check_args(input, weight, bias, main_grad, gradient_accumulation_fusion, allreduce_dgrad,
             sequence_parallel);
  return LinearAsyncFunction::apply(input, weight, bias, main_grad, gradient_accumulation_fusion,
                                    allreduce_dgrad, sequence_parallel, std::string(group_name));
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl(kOp, &linear_forward);
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) { m.impl(kOp, &linear_autograd); }

}  // namespace megatron_ext
