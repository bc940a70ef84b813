// The conjugate communication regions of tensor and sequence parallelism as autograd nodes.
//
//   region                                       forward                 backward
//   copy_to_tensor_model_parallel_region         identity                all-reduce
//   reduce_from_tensor_model_parallel_region     all-reduce              identity
//   scatter_to_tensor_model_parallel_region      split last dim          all-gather last dim
//   gather_from_tensor_model_parallel_region     all-gather last dim     split last dim
//   scatter_to_sequence_parallel_region          split first dim         all-gather first dim
//   gather_from_sequence_parallel_region         all-gather first dim    reduce-scatter first dim
//                                                                        (split if the output grad
//                                                                        is not tensor-parallel)
//   reduce_scatter_to_sequence_parallel_region   reduce-scatter 1st dim  all-gather first dim
//   all_gather_last_dim_from_tensor_parallel_... all-gather last dim     reduce-scatter last dim
//   reduce_scatter_last_dim_to_tensor_parallel_. reduce-scatter last dim all-gather last dim
//
// Each op's forward is registered for every backend (CompositeExplicitAutograd: c10d picks gloo or
// NCCL from the device); its Autograd kernel wraps that forward in a torch::autograd::Function
// whose backward is the conjugate collective. A group of one rank passes tensors through.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "comm/process_group.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr int64_t kFirst = 0;
constexpr int64_t kLast = -1;

enum class Collective { kIdentity, kAllReduce, kSplit, kAllGather, kReduceScatter };

at::Tensor run(Collective c, const at::Tensor& x, int64_t dim, const std::string& group) {
  switch (c) {
    case Collective::kIdentity:
      return x;
    case Collective::kAllReduce:
      return comm::all_reduce(x, group);
    case Collective::kSplit:
      return comm::split(x, dim, group);
    case Collective::kAllGather:
      return comm::all_gather(x, dim, group);
    case Collective::kReduceScatter:
      return comm::reduce_scatter(x, dim, group);
  }
  TORCH_CHECK(false, "unreachable");
}

void check_tensor(const at::Tensor& x, const char* op) {
  TORCH_CHECK_VALUE(x.defined(), op, ": expected a tensor, got an undefined tensor");
}

// Forward and backward of one region, the dim they act on.
struct Region {
  const char* name;
  Collective forward;
  Collective backward;
  int64_t dim;
};

constexpr Region kCopy{"copy_to_tensor_model_parallel_region", Collective::kIdentity,
                       Collective::kAllReduce, kLast};
constexpr Region kReduce{"reduce_from_tensor_model_parallel_region", Collective::kAllReduce,
                         Collective::kIdentity, kLast};
constexpr Region kScatter{"scatter_to_tensor_model_parallel_region", Collective::kSplit,
                          Collective::kAllGather, kLast};
constexpr Region kGather{"gather_from_tensor_model_parallel_region", Collective::kAllGather,
                         Collective::kSplit, kLast};
constexpr Region kScatterSeq{"scatter_to_sequence_parallel_region", Collective::kSplit,
                             Collective::kAllGather, kFirst};
constexpr Region kGatherSeq{"gather_from_sequence_parallel_region", Collective::kAllGather,
                            Collective::kReduceScatter, kFirst};
constexpr Region kGatherSeqSplitGrad{"gather_from_sequence_parallel_region", Collective::kAllGather,
                                     Collective::kSplit, kFirst};
constexpr Region kReduceScatterSeq{"reduce_scatter_to_sequence_parallel_region",
                                   Collective::kReduceScatter, Collective::kAllGather, kFirst};
constexpr Region kAllGatherLast{"all_gather_last_dim_from_tensor_parallel_region",
                                Collective::kAllGather, Collective::kReduceScatter, kLast};
constexpr Region kReduceScatterLast{"reduce_scatter_last_dim_to_tensor_parallel_region",
                                    Collective::kReduceScatter, Collective::kAllGather, kLast};

// The collective of a region's forward, below autograd: what the backend kernels run.
at::Tensor forward_collective(const Region& r, const at::Tensor& x, const std::string& group) {
  check_tensor(x, r.name);
  if (r.forward == Collective::kIdentity) return x.alias();
  if (comm::group_size(group) == 1) return x.clone();
  return run(r.forward, x, r.dim, group);
}

// Calls a region's op below autograd through the dispatcher, so fake and meta tensors take the
// op's fake kernel rather than a collective.
using Redispatch = at::Tensor (*)(const at::Tensor&, const std::string&);

struct RegionFunction : public Function<RegionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Region* region,
                            const std::string& group, Redispatch below) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["region"] = reinterpret_cast<int64_t>(region);
    at::AutoDispatchBelowADInplaceOrView guard;
    return below(x, group);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* region = reinterpret_cast<const Region*>(ctx->saved_data["region"].toInt());
    const auto group = ctx->saved_data["group"].toStringRef();
    at::Tensor grad = grads[0];
    if (grad.defined()) grad = run(region->backward, grad, region->dim, group);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor apply_region(const Region& r, const at::Tensor& x, const std::string& group,
                        Redispatch below) {
  check_tensor(x, r.name);
  const int64_t world = comm::group_size(group);
  if (world == 1) return x;
  if (r.forward != Collective::kIdentity && r.forward != Collective::kAllReduce) {
    comm::check_divisible(x, r.dim, world, r.name);
  }
  return RegionFunction::apply(x, &r, group, below);
}

using RegionOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, c10::string_view)>;

RegionOp find_region_op(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string("megatron_ext::") + name).c_str(), "")
      .typed<at::Tensor(const at::Tensor&, c10::string_view)>();
}

#define MEGATRON_EXT_REGION(fn, region)                                                  \
  at::Tensor fn##_forward(const at::Tensor& x, c10::string_view group) {                 \
    return forward_collective(region, x, std::string(group));                           \
  }                                                                                       \
  at::Tensor fn##_below(const at::Tensor& x, const std::string& group) {                 \
    static const RegionOp op = find_region_op(region.name);                              \
    return op.call(x, group);                                                             \
  }                                                                                       \
  at::Tensor fn##_autograd(const at::Tensor& x, c10::string_view group) {                \
    return apply_region(region, x, std::string(group), &fn##_below);                     \
  }

MEGATRON_EXT_REGION(copy, kCopy)
MEGATRON_EXT_REGION(reduce, kReduce)
MEGATRON_EXT_REGION(scatter, kScatter)
MEGATRON_EXT_REGION(gather, kGather)
MEGATRON_EXT_REGION(scatter_seq, kScatterSeq)
MEGATRON_EXT_REGION(reduce_scatter_seq, kReduceScatterSeq)
MEGATRON_EXT_REGION(all_gather_last, kAllGatherLast)
MEGATRON_EXT_REGION(reduce_scatter_last, kReduceScatterLast)
#undef MEGATRON_EXT_REGION

using GatherSeqOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, bool, c10::string_view)>;

template <bool kTensorParallelOutputGrad>
at::Tensor gather_seq_below(const at::Tensor& x, const std::string& group) {
  static const GatherSeqOp op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("megatron_ext::gather_from_sequence_parallel_region", "")
          .typed<at::Tensor(const at::Tensor&, bool, c10::string_view)>();
  return op.call(x, kTensorParallelOutputGrad, group);
}

at::Tensor gather_seq_forward(const at::Tensor& x, bool tensor_parallel_output_grad,
                              c10::string_view group) {
  return forward_collective(tensor_parallel_output_grad ? kGatherSeq : kGatherSeqSplitGrad, x,
                            std::string(group));
}

at::Tensor gather_seq_autograd(const at::Tensor& x, bool tensor_parallel_output_grad,
                               c10::string_view group) {
  if (tensor_parallel_output_grad) {
    return apply_region(kGatherSeq, x, std::string(group), &gather_seq_below<true>);
  }
  return apply_region(kGatherSeqSplitGrad, x, std::string(group), &gather_seq_below<false>);
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl("copy_to_tensor_model_parallel_region", &copy_forward);
  m.impl("reduce_from_tensor_model_parallel_region", &reduce_forward);
  m.impl("scatter_to_tensor_model_parallel_region", &scatter_forward);
  m.impl("gather_from_tensor_model_parallel_region", &gather_forward);
  m.impl("scatter_to_sequence_parallel_region", &scatter_seq_forward);
  m.impl("gather_from_sequence_parallel_region", &gather_seq_forward);
  m.impl("reduce_scatter_to_sequence_parallel_region", &reduce_scatter_seq_forward);
  m.impl("all_gather_last_dim_from_tensor_parallel_region", &all_gather_last_forward);
  m.impl("reduce_scatter_last_dim_to_tensor_parallel_region", &reduce_scatter_last_forward);
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) {
  m.impl("copy_to_tensor_model_parallel_region", &copy_autograd);
  m.impl("reduce_from_tensor_model_parallel_region", &reduce_autograd);
  m.impl("scatter_to_tensor_model_parallel_region", &scatter_autograd);
  m.impl("gather_from_tensor_model_parallel_region", &gather_autograd);
  m.impl("scatter_to_sequence_parallel_region", &scatter_seq_autograd);
  m.impl("gather_from_sequence_parallel_region", &gather_seq_autograd);
  m.impl("reduce_scatter_to_sequence_parallel_region", &reduce_scatter_seq_autograd);
  m.impl("all_gather_last_dim_from_tensor_parallel_region", &all_gather_last_autograd);
  m.impl("reduce_scatter_last_dim_to_tensor_parallel_region", &reduce_scatter_last_autograd);
}

}  // namespace megatron_ext
