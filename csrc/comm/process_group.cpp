#include "comm/process_group.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "torch_compat.h"

namespace megatron_ext::comm {

c10::intrusive_ptr<c10d::ProcessGroup> resolve(const std::string& group_name) {
  return c10d::resolve_process_group(group_name);
}

namespace {

// Runs a blocking collective; a backend failure (a dtype gloo cannot reduce, a lost peer) is
// rethrown with the operation, dtype, device, group and backend named.
template <typename Fn>
at::Tensor collective(const char* what, const at::Tensor& input, const std::string& group_name,
                      Fn&& fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, what, " of a ", input.scalar_type(), " tensor on ", input.device(),
                " over process group '", group_name, "' (backend ",
                resolve(group_name)->getBackendName(), ") failed: ", e.what_without_backtrace());
  }
}

}  // namespace

int64_t group_size(const std::string& group_name) { return resolve(group_name)->getSize(); }

int64_t group_rank(const std::string& group_name) { return resolve(group_name)->getRank(); }

void check_divisible(const at::Tensor& input, int64_t dim, int64_t world_size, const char* what) {
  TORCH_CHECK_VALUE(input.dim() > 0, what, ": expected a tensor with at least one dimension, got a scalar");
  const int64_t d = at::maybe_wrap_dim(dim, input.dim());
  // Symbolic sizes under torch.compile's dynamic shapes: the check becomes a guard.
  const c10::SymInt size = input.sym_size(d);
  TORCH_CHECK_VALUE(size % world_size == 0, what, ": dimension ", d,
                    " of the input has size ", size, ", which is not divisible by the group size ",
                    world_size, " (input shape ", input.sym_sizes(), ")");
}

at::Tensor all_reduce(const at::Tensor& input, const std::string& group_name,
                      c10d::ReduceOp::RedOpType op) {
  return collective("all-reduce", input, group_name, [&] {
    auto result = input.clone(at::MemoryFormat::Contiguous);
    all_reduce_async_(result, group_name, op)->wait();
    return result;
  });
}

c10::intrusive_ptr<c10d::Work> all_reduce_async_(at::Tensor& tensor, const std::string& group_name,
                                                 c10d::ReduceOp::RedOpType op) {
  TORCH_CHECK(tensor.is_contiguous(), "all_reduce_async_: the tensor must be contiguous");
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(op);
  return resolve(group_name)->allreduce(tensors, opts);
}

std::pair<at::Tensor, c10::intrusive_ptr<c10d::Work>> all_gather_first_dim_async(
    const at::Tensor& input, const std::string& group_name) {
  auto group = resolve(group_name);
  auto local = input.contiguous();
  auto sizes = local.sizes().vec();
  sizes[0] *= group->getSize();
  auto gathered = at::empty(sizes, local.options());
#if MEGATRON_EXT_TORCH_2_13
  auto work = group->all_gather_single(gathered, local);
#else
  auto work = group->_allgather_base(gathered, local);
#endif
  return {gathered, work};
}

at::Tensor all_gather(const at::Tensor& input, int64_t dim, const std::string& group_name) {
  TORCH_CHECK_VALUE(input.dim() > 0, "all_gather: expected a tensor with at least one dimension");
  const int64_t d = at::maybe_wrap_dim(dim, input.dim());
  auto gathered = collective("all-gather", input, group_name, [&] {
    auto [out, work] = all_gather_first_dim_async(input, group_name);
    work->wait();
    return out;
  });
  if (d == 0) return gathered;
  return at::cat(gathered.chunk(group_size(group_name), 0), d);
}

c10::intrusive_ptr<c10d::Work> reduce_scatter_first_dim_async(at::Tensor& output, at::Tensor& input,
                                                              const std::string& group_name) {
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
#if MEGATRON_EXT_TORCH_2_13
  return resolve(group_name)->reduce_scatter_single(output, input, opts);
#else
  return resolve(group_name)->_reduce_scatter_base(output, input, opts);
#endif
}

at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, const std::string& group_name) {
  const int64_t world = group_size(group_name);
  check_divisible(input, dim, world, "reduce_scatter");
  const int64_t d = at::maybe_wrap_dim(dim, input.dim());
  // Chunks of ``dim`` laid out one after another along dim 0, the layout reduce_scatter reads.
  auto stacked = d == 0 ? input.contiguous() : at::cat(input.chunk(world, d), 0).contiguous();
  auto sizes = stacked.sizes().vec();
  sizes[0] /= world;
  return collective("reduce-scatter", input, group_name, [&] {
    auto chunk = at::empty(sizes, stacked.options());
    reduce_scatter_first_dim_async(chunk, stacked, group_name)->wait();
    return chunk;
  });
}

at::Tensor split(const at::Tensor& input, int64_t dim, const std::string& group_name) {
  auto group = resolve(group_name);
  const int64_t world = group->getSize();
  check_divisible(input, dim, world, "split");
  // A copy even when the chunk is already contiguous: the result must not alias the input.
  return input.chunk(world, dim)[group->getRank()].clone(at::MemoryFormat::Contiguous);
}

}  // namespace megatron_ext::comm
