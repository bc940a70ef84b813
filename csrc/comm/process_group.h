#pragma once
// Collectives on a process group named by its c10d registry name (``group.group_name`` in
// Python). The backend (gloo on CPU, NCCL on GPU) is chosen by c10d from the tensors' device.
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>

namespace megatron_ext::comm {

c10::intrusive_ptr<c10d::ProcessGroup> resolve(const std::string& group_name);
int64_t group_size(const std::string& group_name);
int64_t group_rank(const std::string& group_name);

// Sum over the group into a new tensor; the input is left as it was.
at::Tensor all_reduce(const at::Tensor& input, const std::string& group_name,
                      c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM);
// Starts a sum over the group in place on ``tensor`` (contiguous) and returns the work to wait on.
c10::intrusive_ptr<c10d::Work> all_reduce_async_(at::Tensor& tensor, const std::string& group_name,
                                                 c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM);
// Concatenation of every rank's ``input`` along ``dim``, in rank order.
at::Tensor all_gather(const at::Tensor& input, int64_t dim, const std::string& group_name);
// Starts gathering ``input`` along dim 0 into a new tensor; the caller waits on the work.
std::pair<at::Tensor, c10::intrusive_ptr<c10d::Work>> all_gather_first_dim_async(
    const at::Tensor& input, const std::string& group_name);
// The sum over the group, split along ``dim``: this rank's chunk.
at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, const std::string& group_name);
// Starts a reduce-scatter along dim 0 of a contiguous tensor into ``output``.
c10::intrusive_ptr<c10d::Work> reduce_scatter_first_dim_async(at::Tensor& output, at::Tensor& input,
                                                              const std::string& group_name);
// This rank's chunk of ``input`` along ``dim`` (a contiguous copy), no communication.
at::Tensor split(const at::Tensor& input, int64_t dim, const std::string& group_name);

// Raises a ValueError unless ``input.size(dim)`` divides by the group size.
void check_divisible(const at::Tensor& input, int64_t dim, int64_t world_size, const char* what);

}  // namespace megatron_ext::comm
