// The all-to-all along dim 0 of expert parallelism: rank r sends ``input_split_sizes[s]`` rows to
// each rank s and receives ``output_split_sizes[s]`` rows from each (equal chunks when a list is
// not given). The counts are the caller's (the token dispatcher exchanges them first). The
// Autograd kernel is a C++ node whose backward is the reverse all-to-all (the two lists swapped);
// under create_graph=True the backward calls the op with autograd, so it is differentiable twice.
// Every rank checks its arguments before communicating, so bad input raises instead of hanging;
// a failed exchange is reported as the other collectives' are (comm/functional.h).
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "comm/functional.h"
#include "comm/process_group.h"
#include "ops/dispatch.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr const char* kName = "all_to_all";

using AllToAllFn = at::Tensor(const at::Tensor&, at::OptionalIntArrayRef, at::OptionalIntArrayRef,
                              c10::string_view, int64_t, int64_t);

void check_splits(const char* what, at::OptionalIntArrayRef sizes, int64_t group_size) {
  if (!sizes.has_value()) return;
  bool ok = static_cast<int64_t>(sizes->size()) == group_size;
  for (const int64_t s : *sizes) ok = ok && s >= 0;
  TORCH_CHECK_VALUE(ok, kName, ": ", what, " must list ", group_size,
                    " non-negative sizes (one per rank of the group), got ", *sizes);
}

void check_args(const at::Tensor& x, at::OptionalIntArrayRef output_split_sizes,
                at::OptionalIntArrayRef input_split_sizes, const std::string& group, int64_t size,
                int64_t rank) {
  TORCH_CHECK_VALUE(x.defined(), kName, ": expected a tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(x.dim() > 0, kName,
                    ": expected a tensor with at least one dimension, got a scalar");
  TORCH_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, kName,
                    ": expected 0 <= rank < group_size, got rank ", rank, " and group_size ", size);
  check_splits("output_split_sizes", output_split_sizes, size);
  check_splits("input_split_sizes", input_split_sizes, size);
  if (input_split_sizes.has_value()) {
    int64_t total = 0;
    for (const int64_t s : *input_split_sizes) total += s;
    TORCH_CHECK_VALUE(total == x.size(0), kName, ": input_split_sizes ", *input_split_sizes,
                      " sum to ", total, ", but the input has ", x.size(0), " rows");
  }
  if (!output_split_sizes.has_value() || !input_split_sizes.has_value()) {
    TORCH_CHECK_VALUE(x.size(0) % size == 0, kName, ": the first dim (", x.size(0),
                      ") is not divisible by the group size (", size,
                      "); pass output_split_sizes and input_split_sizes for uneven splits");
  }
  if (!comm::is_plain(x)) return;  // a traced call may name a group this process does not hold
  const auto pg = comm::resolve(group);
  TORCH_CHECK_VALUE(pg->getSize() == size && pg->getRank() == rank, kName, ": process group '",
                    group, "' has size ", pg->getSize(), " and this process's rank in it is ",
                    pg->getRank(), ", but the call passed group_size ", size, " and rank ", rank);
}

std::vector<int64_t> as_vector(at::OptionalIntArrayRef sizes) {
  return sizes.has_value() ? sizes->vec() : std::vector<int64_t>();
}

at::Tensor run(const at::Tensor& x, const std::vector<int64_t>& output_split_sizes,
               const std::vector<int64_t>& input_split_sizes, const std::string& group,
               int64_t size, const std::string& where) {
  if (size == 1) return x.alias();
  return comm::wait(
      comm::start_all_to_all_dim0(x, output_split_sizes, input_split_sizes, size, group, where));
}

at::OptionalIntArrayRef optional_ref(const std::vector<int64_t>& sizes) {
  return sizes.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(sizes);
}

struct AllToAllFunction : public Function<AllToAllFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const std::vector<int64_t>& output_split_sizes,
                            const std::vector<int64_t>& input_split_sizes, const std::string& group,
                            int64_t size, int64_t rank) {
    ctx->saved_data["output_split_sizes"] = output_split_sizes;
    ctx->saved_data["input_split_sizes"] = input_split_sizes;
    ctx->saved_data["group"] = group;
    ctx->saved_data["size"] = size;
    ctx->saved_data["rank"] = rank;
    at::AutoDispatchBelowADInplaceOrView guard;
    return run(x, output_split_sizes, input_split_sizes, group, size, "the forward of all_to_all");
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(6);
    if (!grads[0].defined()) return result;
    // The reverse exchange: what this rank received goes back to where it came from.
    const auto sent = ctx->saved_data["input_split_sizes"].toIntVector();
    const auto received = ctx->saved_data["output_split_sizes"].toIntVector();
    const auto group = ctx->saved_data["group"].toStringRef();
    const int64_t size = ctx->saved_data["size"].toInt();
    const int64_t rank = ctx->saved_data["rank"].toInt();
    if (at::GradMode::is_enabled()) {
      static const auto op = typed_op<AllToAllFn>(kName);
      result[0] = op.call(grads[0], optional_ref(sent), optional_ref(received), group, size, rank);
    } else {
      at::AutoDispatchBelowADInplaceOrView guard;
      result[0] = run(grads[0], sent, received, group, size, "the backward of all_to_all");
    }
    return result;
  }
};

at::Tensor all_to_all_autograd(const at::Tensor& x, at::OptionalIntArrayRef output_split_sizes,
                               at::OptionalIntArrayRef input_split_sizes,
                               c10::string_view group_name, int64_t size, int64_t rank) {
  const std::string group(group_name);
  check_args(x, output_split_sizes, input_split_sizes, group, size, rank);
  if (size == 1) return x.alias();  // no communication; the view's backward passes the gradient
  return AllToAllFunction::apply(x, as_vector(output_split_sizes), as_vector(input_split_sizes),
                                 group, size, rank);
}

at::Tensor all_to_all_forward(const at::Tensor& x, at::OptionalIntArrayRef output_split_sizes,
                              at::OptionalIntArrayRef input_split_sizes,
                              c10::string_view group_name, int64_t size, int64_t rank) {
  const std::string group(group_name);
  check_args(x, output_split_sizes, input_split_sizes, group, size, rank);
  return run(x, as_vector(output_split_sizes), as_vector(input_split_sizes), group, size,
             "the forward of all_to_all");
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl(kName, &all_to_all_forward);
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) { m.impl(kName, &all_to_all_autograd); }

}  // namespace megatron_ext
