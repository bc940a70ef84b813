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

#include <mutex>
#include <string_view>
#include <unordered_map>

#include "comm/process_group.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr int64_t kFirst = 0;
constexpr int64_t kLast = -1;

enum class Collective { kIdentity, kAllReduce, kSplit, kAllGather, kReduceScatter };

// A region: the collective its forward runs along ``dim``, and the region op whose forward is
// this region's backward (nullptr: the gradient passes through). Running the backward through
// that op rather than through c10d directly keeps the backward traceable (the op has a fake
// kernel).
struct Region {
  const char* name;
  Collective forward;
  int64_t dim;
  const char* backward_op;
};

constexpr Region kCopy{"copy_to_tensor_model_parallel_region", Collective::kIdentity, kLast,
                       "reduce_from_tensor_model_parallel_region"};
constexpr Region kReduce{"reduce_from_tensor_model_parallel_region", Collective::kAllReduce, kLast,
                         nullptr};
constexpr Region kScatter{"scatter_to_tensor_model_parallel_region", Collective::kSplit, kLast,
                          "gather_from_tensor_model_parallel_region"};
constexpr Region kGather{"gather_from_tensor_model_parallel_region", Collective::kAllGather, kLast,
                         "scatter_to_tensor_model_parallel_region"};
constexpr Region kScatterSeq{"scatter_to_sequence_parallel_region", Collective::kSplit, kFirst,
                             "gather_from_sequence_parallel_region"};
constexpr Region kGatherSeq{"gather_from_sequence_parallel_region", Collective::kAllGather, kFirst,
                            "reduce_scatter_to_sequence_parallel_region"};
constexpr Region kGatherSeqSplitGrad{"gather_from_sequence_parallel_region",
                                     Collective::kAllGather, kFirst,
                                     "scatter_to_sequence_parallel_region"};
constexpr Region kReduceScatterSeq{"reduce_scatter_to_sequence_parallel_region",
                                   Collective::kReduceScatter, kFirst,
                                   "gather_from_sequence_parallel_region"};
constexpr Region kAllGatherLast{"all_gather_last_dim_from_tensor_parallel_region",
                                Collective::kAllGather, kLast,
                                "reduce_scatter_last_dim_to_tensor_parallel_region"};
constexpr Region kReduceScatterLast{"reduce_scatter_last_dim_to_tensor_parallel_region",
                                    Collective::kReduceScatter, kLast,
                                    "all_gather_last_dim_from_tensor_parallel_region"};

void check_tensor(const at::Tensor& x, const char* op) {
  TORCH_CHECK_VALUE(x.defined(), op, ": expected a tensor, got an undefined tensor");
}

// The collective of a region's forward: what the backend kernel runs. Outputs never alias the
// input (the identity copies), as the schemas promise.
at::Tensor forward_collective(const Region& r, const at::Tensor& x, const std::string& group) {
  check_tensor(x, r.name);
  if (r.forward == Collective::kIdentity || comm::group_size(group) == 1) return x.clone();
  switch (r.forward) {
    case Collective::kAllReduce:
      return comm::all_reduce(x, group);
    case Collective::kSplit:
      return comm::split(x, r.dim, group);
    case Collective::kAllGather:
      return comm::all_gather(x, r.dim, group);
    case Collective::kReduceScatter:
      return comm::reduce_scatter(x, r.dim, group);
    case Collective::kIdentity:
      break;
  }
  TORCH_CHECK(false, "unreachable");
}

using RegionOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, c10::string_view)>;
using GatherSeqOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, bool, c10::string_view)>;

const c10::OperatorHandle& find_op(const char* name) {
  // Handles are stable for the process's lifetime; looked up once per call site.
  static std::mutex mutex;
  static std::unordered_map<std::string, c10::OperatorHandle> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(name);
  if (it == cache.end()) {
    it = cache
             .emplace(name, c10::Dispatcher::singleton().findSchemaOrThrow(
                                (std::string("megatron_ext::") + name).c_str(), ""))
             .first;
  }
  return it->second;
}

// Calls a region op below autograd: fake and meta tensors take its fake kernel, real ones the
// collective.
at::Tensor call_region_op(const char* name, const at::Tensor& x, const std::string& group) {
  at::AutoDispatchBelowADInplaceOrView guard;
  if (std::string_view(name) == kGatherSeq.name) {
    return find_op(name).typed<at::Tensor(const at::Tensor&, bool, c10::string_view)>().call(
        x, true, group);
  }
  return find_op(name).typed<at::Tensor(const at::Tensor&, c10::string_view)>().call(x, group);
}

struct RegionFunction : public Function<RegionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Region* region,
                            const std::string& group) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["region"] = reinterpret_cast<int64_t>(region);
    if (region == &kGatherSeqSplitGrad) {
      // Same forward as kGatherSeq, only the backward differs.
      at::AutoDispatchBelowADInplaceOrView guard;
      return find_op(region->name)
          .typed<at::Tensor(const at::Tensor&, bool, c10::string_view)>()
          .call(x, false, group);
    }
    return call_region_op(region->name, x, group);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* region = reinterpret_cast<const Region*>(ctx->saved_data["region"].toInt());
    const auto group = ctx->saved_data["group"].toStringRef();
    at::Tensor grad = grads[0];
    if (grad.defined() && region->backward_op != nullptr) {
      grad = call_region_op(region->backward_op, grad, group);
    }
    return {grad, at::Tensor(), at::Tensor()};
  }
};

at::Tensor apply_region(const Region& r, const at::Tensor& x, const std::string& group) {
  check_tensor(x, r.name);
  const int64_t world = comm::group_size(group);
  if (world == 1) return x;  // one rank: no communication, no autograd node
  if (r.forward == Collective::kSplit || r.forward == Collective::kReduceScatter) {
    comm::check_divisible(x, r.dim, world, r.name);
  }
  return RegionFunction::apply(x, &r, group);
}

#define MEGATRON_EXT_REGION(fn, region)                                   \
  at::Tensor fn##_forward(const at::Tensor& x, c10::string_view group) {  \
    return forward_collective(region, x, std::string(group));            \
  }                                                                        \
  at::Tensor fn##_autograd(const at::Tensor& x, c10::string_view group) { \
    return apply_region(region, x, std::string(group));                  \
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

at::Tensor gather_seq_forward(const at::Tensor& x, bool tensor_parallel_output_grad,
                              c10::string_view group) {
  return forward_collective(kGatherSeq, x, std::string(group));
}

at::Tensor gather_seq_autograd(const at::Tensor& x, bool tensor_parallel_output_grad,
                               c10::string_view group) {
  return apply_region(tensor_parallel_output_grad ? kGatherSeq : kGatherSeqSplitGrad, x,
                      std::string(group));
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
