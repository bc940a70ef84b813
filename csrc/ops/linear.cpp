// The linear of the column-parallel layer with its input-gradient collective overlapped with the
// weight-gradient GEMM.
//
//   forward:  x = all_gather_dim0(input) under sequence parallelism, else input
//             output = x @ weight^T + bias
//   backward: grad_input = grad_output @ weight
//             start all-reduce(grad_input)            when allreduce_dgrad
//             start reduce-scatter_dim0(grad_input)   when sequence_parallel
//             grad_weight = grad_output^T @ x  (added into main_grad instead when one is
//                                               given) while it runs
//             grad_bias = sum of grad_output over all leading dims
//             wait for the collective
//
// Under sequence parallelism the gathered input is not saved: backward gathers it again, started
// before the input-gradient GEMM so the two overlap (memory over time, as Megatron does).
//
// The collectives are started, then waited on (comm/functional.h): c10d work in eager mode, so
// the overlap holds, and PyTorch's functional collective ops when traced by torch.compile.
// Under autocast the forward casts as Megatron's custom_fwd does (the GEMM runs in the autocast
// dtype) and the backward reuses the cast tensors, as custom_bwd's restored autocast state would.
// Gradient-accumulation fusion: the caller hands over the weight's ``main_grad`` with the forward
// (the buffer the weight has then receives the gradient, as in Megatron-core) and says what the
// weight's gradient is to be: none, or a placeholder (empty or zeros) so that the weight's
// post-accumulate hook fires for a DistributedDataParallel. The backward touches no Python object.
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "comm/functional.h"
#include "comm/process_group.h"
#include "ops/weight_grad.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr const char* kOp = "linear_with_grad_accumulation_and_async_allreduce";
// Where the backward's collectives run, for a failure's message.
constexpr const char* kBackward =
    "the backward of linear_with_grad_accumulation_and_async_allreduce (its input, gathered again)";
constexpr const char* kInputGrad =
    "the backward of linear_with_grad_accumulation_and_async_allreduce (the input gradient)";

// What the fused backward hands to autograd as the weight's gradient.
enum WeightGradPlaceholder : int64_t { kNone = 0, kEmpty = 1, kZeros = 2 };

void check_args(const at::Tensor& input, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& main_grad,
                int64_t wgrad_placeholder, bool allreduce_dgrad, bool sequence_parallel,
                int64_t group_size) {
  TORCH_CHECK_VALUE(input.defined() && weight.defined(), kOp, ": input and weight must be tensors");
  TORCH_CHECK_VALUE(weight.dim() == 2, kOp, ": weight must be 2-D [output, input], got shape ",
                    weight.sym_sizes());
  // Sizes may be symbolic under torch.compile's dynamic shapes: each check becomes a guard.
  TORCH_CHECK_VALUE(input.dim() >= 1 && input.sym_size(-1) == weight.sym_size(1), kOp,
                    ": the last dim of the input (shape ", input.sym_sizes(),
                    ") must equal the input size of the weight (shape ", weight.sym_sizes(), ")");
  TORCH_CHECK_VALUE(!sequence_parallel || input.dim() >= 2, kOp,
                    ": sequence parallelism needs an input with a sequence dim first, got shape ",
                    input.sym_sizes());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), kOp,
                      ": bias must have shape [", weight.sym_size(0), "], got ", bias->sym_sizes());
  }
  TORCH_CHECK_VALUE(!(allreduce_dgrad && sequence_parallel), kOp,
                    ": allreduce_dgrad and sequence_parallel are exclusive (sequence parallelism "
                    "reduce-scatters the input gradient instead of all-reducing it)");
  TORCH_CHECK_VALUE(group_size >= 1, kOp, ": group_size must be positive, got ", group_size);
  if (main_grad.has_value() && main_grad->defined()) {
    TORCH_CHECK_VALUE(at::isFloatingType(main_grad->scalar_type()) &&
                          main_grad->sym_sizes() == weight.sym_sizes(),
                      kOp, ": main_grad must be a floating tensor of the weight's shape ",
                      weight.sym_sizes(), ", got ", main_grad->scalar_type(), " of shape ",
                      main_grad->sym_sizes());
  }
  TORCH_CHECK_VALUE(wgrad_placeholder >= kNone && wgrad_placeholder <= kZeros, kOp,
                    ": wgrad_placeholder must be 0 (none), 1 (empty) or 2 (zeros), got ",
                    wgrad_placeholder);
}

// The forward of every backend: gathers the sequence shards, then the GEMM.
at::Tensor forward_impl(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, bool sequence_parallel,
                        const std::string& group, int64_t group_size) {
  at::Tensor total_input = input;
  if (sequence_parallel && group_size > 1) {
    total_input = comm::wait(comm::start_all_gather_dim0(input, group_size, group,
                                                         std::string("the forward of ") + kOp));
  }
  return at::linear(total_input, weight, bias);
}

at::Tensor linear_forward(const at::Tensor& input, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& main_grad, int64_t wgrad_placeholder,
                          bool allreduce_dgrad, bool sequence_parallel, c10::string_view group_name,
                          int64_t group_size) {
  check_args(input, weight, bias, main_grad, wgrad_placeholder, allreduce_dgrad, sequence_parallel,
             group_size);
  return forward_impl(input, weight, bias, sequence_parallel, std::string(group_name), group_size);
}

// Casts a floating tensor (not float64) to the autocast dtype when autocast is on for its device,
// as autocast does for a GEMM's arguments. Not through autocast's cache: this runs in the
// Function's forward without grad mode, and a cached cast made there would carry no gradient.
at::Tensor autocast_gemm_arg(const at::Tensor& t) {
  const auto device = t.device().type();
  if ((device != at::kCPU && device != at::kCUDA) || !at::autocast::is_autocast_enabled(device) ||
      !at::isFloatingType(t.scalar_type()) || t.scalar_type() == at::kDouble) {
    return t;
  }
  return t.to(at::autocast::get_autocast_dtype(device));
}

struct LinearAsyncFunction : public Function<LinearAsyncFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& main_grad, int64_t wgrad_placeholder,
                            bool allreduce_dgrad, bool sequence_parallel, const std::string& group,
                            int64_t group_size) {
    const auto gemm_input = autocast_gemm_arg(input);
    const auto gemm_weight = autocast_gemm_arg(weight);
    std::optional<at::Tensor> gemm_bias;
    if (bias.has_value() && bias->defined()) gemm_bias = autocast_gemm_arg(*bias);
    ctx->save_for_backward({gemm_input, gemm_weight});
    // Kept outside save_for_backward: the backward adds into it, and the same buffer may serve
    // several calls (a weight used twice) whose version checks would then fail.
    const bool fusion = main_grad.has_value() && main_grad->defined();
    if (fusion) ctx->saved_data["main_grad"] = *main_grad;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["fusion"] = fusion;
    ctx->saved_data["wgrad_placeholder"] = wgrad_placeholder;
    ctx->saved_data["weight_dtype"] = weight.scalar_type();  // the GEMM's copy may be cast
    ctx->saved_data["allreduce_dgrad"] = allreduce_dgrad;
    ctx->saved_data["sequence_parallel"] = sequence_parallel;
    ctx->saved_data["group"] = group;
    ctx->saved_data["group_size"] = group_size;
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_impl(gemm_input, gemm_weight, gemm_bias, sequence_parallel, group, group_size);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), kOp,
                ": double backward (create_graph=True) is not supported");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const bool fusion = ctx->saved_data["fusion"].toBool();
    const std::string group = ctx->saved_data["group"].toStringRef();
    const int64_t group_size = ctx->saved_data["group_size"].toInt();
    const bool distributed = group_size > 1;
    const bool allreduce_dgrad = ctx->saved_data["allreduce_dgrad"].toBool() && distributed;
    const bool sequence_parallel = ctx->saved_data["sequence_parallel"].toBool() && distributed;
    const at::Tensor grad_output = grads[0];
    variable_list result(9);
    if (!grad_output.defined()) return result;

    const bool need_input_grad = ctx->needs_input_grad(0);
    // A backward that asks for the input gradient alone (the zero-bubble schedules' input half)
    // leaves the weight gradient, main_grad accumulation included, to the weight half.
    const bool need_weight_grad = ctx->needs_input_grad(1);
    at::Tensor total_input = input;
    std::optional<comm::Pending> gather;
    if (sequence_parallel && need_weight_grad) {
      gather = comm::start_all_gather_dim0(input, group_size, group, kBackward);
    }

    at::Tensor grad_input;
    std::optional<comm::Pending> dgrad;
    if (need_input_grad) {
      grad_input = at::matmul(grad_output, weight);
      if (allreduce_dgrad) {
        dgrad = comm::start_all_reduce_owned(std::move(grad_input), group, kInputGrad);
      } else if (sequence_parallel) {
        dgrad = comm::start_reduce_scatter_dim0(grad_input, group_size, group, kInputGrad);
      }
    }

    // Weight and bias gradients are computed while the input-gradient collective runs.
    if (gather) total_input = comm::wait(std::move(*gather));
    const auto grad_output_2d = grad_output.reshape_symint({-1, grad_output.sym_size(-1)});
    if (need_weight_grad) {
      const auto input_2d = total_input.reshape_symint({-1, total_input.sym_size(-1)});
      if (fusion) {
        auto main_grad = ctx->saved_data["main_grad"].toTensor();
        accumulate_weight_grad_(main_grad, grad_output_2d, input_2d);
        const auto placeholder = ctx->saved_data["wgrad_placeholder"].toInt();
        const auto options = weight.options().dtype(ctx->saved_data["weight_dtype"].toScalarType());
        if (placeholder == kZeros) result[1] = at::zeros(weight.sizes(), options);
        if (placeholder == kEmpty) result[1] = at::empty(weight.sizes(), options);
      } else {
        result[1] = grad_output_2d.t().mm(input_2d);
      }
    }
    if (has_bias && ctx->needs_input_grad(2)) result[2] = grad_output_2d.sum(0);

    if (dgrad) grad_input = comm::wait(std::move(*dgrad));
    result[0] = grad_input;
    return result;
  }
};

at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& main_grad, int64_t wgrad_placeholder,
                           bool allreduce_dgrad, bool sequence_parallel,
                           c10::string_view group_name, int64_t group_size) {
  // Every rank checks its arguments before any collective, so bad input raises instead of hanging.
  check_args(input, weight, bias, main_grad, wgrad_placeholder, allreduce_dgrad, sequence_parallel,
             group_size);
  const std::string group(group_name);
  const int64_t actual = comm::is_plain(input) ? comm::group_size(group) : group_size;
  TORCH_CHECK_VALUE(actual == group_size, kOp, ": process group '", group, "' has size ", actual,
                    " but the call passed group_size ", group_size);
  return LinearAsyncFunction::apply(input, weight, bias, main_grad, wgrad_placeholder,
                                    allreduce_dgrad, sequence_parallel, group, group_size);
}

}  // namespace

// The schema is in registration.cpp.
TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl(kOp, TORCH_FN(linear_forward));
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) { m.impl(kOp, TORCH_FN(linear_autograd)); }

}  // namespace megatron_ext
