// The conjugate communication regions of tensor and sequence parallelism: each op is one row of
// the table below (its name, forward collective and conjugate) and one line in the registration
// block at the end, which declares its schema and registers its kernels.
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
// Schemas carry what the result depends on, as PyTorch's functional collectives do: the group's
// name, its size and this process's rank in it. A compiled graph is cached by what it shows, so
// nothing may depend on the group's hidden state. An output may alias the input (``Tensor(a)``):
// copy_to's forward, every region at group size 1, and a first-dim split of a contiguous input
// return views, as Megatron-core returns its input; nothing ever writes to the input.
//
// The Autograd kernel is the public entry point: a torch::autograd::Function whose forward runs
// the collective below autograd and whose backward runs the conjugate region. Collectives go
// through PyTorch's functional collective ops (comm/functional.h), so the same code is traced by
// torch.compile. The backward calls the conjugate region op with autograd when a graph of the
// backward is being built (create_graph=True), so the regions are differentiable twice.
#include <ATen/WrapDimUtils.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>

#include "comm/functional.h"
#include "comm/process_group.h"
#include "ops/dispatch.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr int64_t kFirst = 0;
constexpr int64_t kLast = -1;

enum class Collective { kIdentity, kAllReduce, kSplit, kAllGather, kReduceScatter };

struct Region {
  const char* name;
  Collective forward;
  int64_t dim;
  // The conjugate region: its forward is this region's backward. Its own backward is what makes
  // the backward graph a valid tensor-parallel program, so gradients of gradients are right.
  const Region* backward;
};

extern const Region kCopy, kReduce, kScatter, kGather, kScatterSeq, kGatherSeq, kGatherSeqSplitGrad,
    kReduceScatterSeq, kAllGatherLast, kReduceScatterLast;

constexpr Region kCopy{"copy_to_tensor_model_parallel_region", Collective::kIdentity, kLast,
                       &kReduce};
constexpr Region kReduce{"reduce_from_tensor_model_parallel_region", Collective::kAllReduce, kLast,
                         &kCopy};
constexpr Region kScatter{"scatter_to_tensor_model_parallel_region", Collective::kSplit, kLast,
                          &kGather};
constexpr Region kGather{"gather_from_tensor_model_parallel_region", Collective::kAllGather, kLast,
                         &kScatter};
// Its input is replicated, so the gradient of its gradient is split, not reduce-scattered.
constexpr Region kScatterSeq{"scatter_to_sequence_parallel_region", Collective::kSplit, kFirst,
                             &kGatherSeqSplitGrad};
constexpr Region kGatherSeq{"gather_from_sequence_parallel_region", Collective::kAllGather, kFirst,
                            &kReduceScatterSeq};
// Same forward as kGatherSeq; its backward keeps this rank's chunk of a replicated gradient.
constexpr Region kGatherSeqSplitGrad{"gather_from_sequence_parallel_region", Collective::kAllGather,
                                     kFirst, &kScatterSeq};
constexpr Region kReduceScatterSeq{"reduce_scatter_to_sequence_parallel_region",
                                   Collective::kReduceScatter, kFirst, &kGatherSeq};
constexpr Region kAllGatherLast{"all_gather_last_dim_from_tensor_parallel_region",
                                Collective::kAllGather, kLast, &kReduceScatterLast};
constexpr Region kReduceScatterLast{"reduce_scatter_last_dim_to_tensor_parallel_region",
                                    Collective::kReduceScatter, kLast, &kAllGatherLast};

using RegionFn = at::Tensor(const at::Tensor&, c10::string_view, int64_t, int64_t);
using GatherSeqFn = at::Tensor(const at::Tensor&, bool, c10::string_view, int64_t, int64_t);

// Every rank checks its arguments before any collective, so bad input raises instead of hanging.
void check_args(const Region& r, const at::Tensor& x, const std::string& group, int64_t size,
                int64_t rank) {
  TORCH_CHECK_VALUE(x.defined(), r.name, ": expected a tensor, got an undefined tensor");
  if (size > 1 && (r.forward == Collective::kSplit || r.forward == Collective::kReduceScatter)) {
    comm::check_divisible(x, r.dim, size, r.name);
  }
  if (size > 1 && r.forward == Collective::kAllGather) {
    TORCH_CHECK_VALUE(x.dim() > 0, r.name,
                      ": expected a tensor with at least one dimension, got a scalar");
  }
  TORCH_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, r.name,
                    ": expected 0 <= rank < group_size, got rank ", rank, " and group_size ", size);
  // Eager calls only: a traced call may name a group this process does not hold.
  if (!comm::is_plain(x)) return;
  const auto pg = comm::resolve(group);
  TORCH_CHECK_VALUE(pg->getSize() == size && pg->getRank() == rank, r.name, ": process group '",
                    group, "' has size ", pg->getSize(), " and this process's rank in it is ",
                    pg->getRank(), ", but the call passed group_size ", size, " and rank ", rank);
}

// A region's forward below autograd. Group size 1 and the identity return a view of the input.
// ``where`` names the pass it runs in, for a failure's message ("the backward of copy_to_...").
at::Tensor run_forward(const Region& r, const at::Tensor& x, const std::string& group, int64_t size,
                       int64_t rank, const std::string& where) {
  if (r.forward == Collective::kIdentity || size == 1) return x.alias();
  const int64_t d = at::maybe_wrap_dim(r.dim, x.dim());
  switch (r.forward) {
    case Collective::kAllReduce:
      return comm::wait(comm::start_all_reduce(x, group, where));
    case Collective::kSplit: {
      const c10::SymInt chunk = x.sym_size(d) / size;
      return x.narrow_symint(d, chunk * rank, chunk).contiguous();
    }
    case Collective::kAllGather: {
      auto gathered = comm::wait(comm::start_all_gather_dim0(x, size, group, where));
      return d == 0 ? gathered : at::cat(gathered.chunk(size, 0), d);
    }
    case Collective::kReduceScatter: {
      // Chunks of ``d`` laid one after another along dim 0, the layout reduce-scatter reads.
      auto stacked = d == 0 ? x : at::cat(x.chunk(size, d), 0);
      return comm::wait(comm::start_reduce_scatter_dim0(stacked, size, group, where));
    }
    case Collective::kIdentity:
      break;
  }
  TORCH_CHECK(false, "unreachable");
}

std::string forward_of(const Region& r) { return std::string("the forward of ") + r.name; }
std::string backward_of(const Region& r) { return std::string("the backward of ") + r.name; }

// The conjugate region with autograd, for a backward that is itself differentiated.
at::Tensor call_with_autograd(const Region& r, const at::Tensor& x, const std::string& group,
                              int64_t size, int64_t rank) {
  if (r.forward == Collective::kAllGather && r.dim == kFirst) {
    static const auto op = typed_op<GatherSeqFn>(kGatherSeq.name);
    return op.call(x, &r == &kGatherSeq, group, size, rank);
  }
  return typed_op<RegionFn>(r.name).call(x, group, size, rank);
}

struct RegionFunction : public Function<RegionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Region* region,
                            const std::string& group, int64_t size, int64_t rank) {
    ctx->saved_data["region"] = reinterpret_cast<int64_t>(region);
    ctx->saved_data["group"] = group;
    ctx->saved_data["size"] = size;
    ctx->saved_data["rank"] = rank;
    // The Function turns a returned input into a view of it carrying this node.
    if (region->forward == Collective::kIdentity) return x;
    at::AutoDispatchBelowADInplaceOrView guard;
    return run_forward(*region, x, group, size, rank, forward_of(*region));
  }

  // ``grads`` by reference: the gradient is then referenced only here and may be reduced in place.
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    const auto* region = reinterpret_cast<const Region*>(ctx->saved_data["region"].toInt());
    const auto group = ctx->saved_data["group"].toStringRef();
    const int64_t size = ctx->saved_data["size"].toInt();
    const int64_t rank = ctx->saved_data["rank"].toInt();
    variable_list result(5);
    if (!grads[0].defined()) return result;
    const Region* conjugate = region->backward;
    if (at::GradMode::is_enabled()) {
      result[0] = call_with_autograd(*conjugate, grads[0], group, size, rank);
    } else if (conjugate->forward == Collective::kIdentity) {
      result[0] = std::move(grads[0]);
    } else if (conjugate->forward == Collective::kAllReduce) {
      at::AutoDispatchBelowADInplaceOrView guard;
      result[0] = comm::wait(
          comm::start_all_reduce_owned(std::move(grads[0]), group, backward_of(*region)));
    } else {
      at::AutoDispatchBelowADInplaceOrView guard;
      result[0] = run_forward(*conjugate, grads[0], group, size, rank, backward_of(*region));
    }
    return result;
  }
};

at::Tensor apply_region(const Region& r, const at::Tensor& x, c10::string_view group_name,
                        int64_t size, int64_t rank) {
  const std::string group(group_name);
  check_args(r, x, group, size, rank);
  if (size == 1) return x.alias();  // no communication; the view's backward passes the gradient
  return RegionFunction::apply(x, &r, group, size, rank);
}

template <const Region& R>
at::Tensor region_autograd(const at::Tensor& x, c10::string_view group, int64_t size,
                           int64_t rank) {
  return apply_region(R, x, group, size, rank);
}

template <const Region& R>
at::Tensor region_forward(const at::Tensor& x, c10::string_view group, int64_t size, int64_t rank) {
  const std::string g(group);
  check_args(R, x, g, size, rank);
  return run_forward(R, x, g, size, rank, forward_of(R));
}

at::Tensor gather_seq_autograd(const at::Tensor& x, bool tensor_parallel_output_grad,
                               c10::string_view group, int64_t size, int64_t rank) {
  return apply_region(tensor_parallel_output_grad ? kGatherSeq : kGatherSeqSplitGrad, x, group,
                      size, rank);
}

at::Tensor gather_seq_forward(const at::Tensor& x, bool, c10::string_view group, int64_t size,
                              int64_t rank) {
  return region_forward<kGatherSeq>(x, group, size, rank);
}

template <const Region& R>
void impl(torch::Library& m, c10::DispatchKey key) {
  if (key == c10::DispatchKey::Autograd) {
    m.impl(R.name, TORCH_FN(region_autograd<R>));
  } else {
    m.impl(R.name, TORCH_FN(region_forward<R>));
  }
}

template <const Region&... Rs>
void impl_all(torch::Library& m, c10::DispatchKey key) {
  (impl<Rs>(m, key), ...);
}

}  // namespace

// The schemas are in registration.cpp.
TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  impl_all<kCopy, kReduce, kScatter, kGather, kScatterSeq, kReduceScatterSeq, kAllGatherLast,
           kReduceScatterLast>(m, c10::DispatchKey::CompositeExplicitAutograd);
  m.impl(kGatherSeq.name, TORCH_FN(gather_seq_forward));
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) {
  impl_all<kCopy, kReduce, kScatter, kGather, kScatterSeq, kReduceScatterSeq, kAllGatherLast,
           kReduceScatterLast>(m, c10::DispatchKey::Autograd);
  m.impl(kGatherSeq.name, TORCH_FN(gather_seq_autograd));
}

}  // namespace megatron_ext
