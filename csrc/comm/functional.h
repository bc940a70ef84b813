#pragma once
// The one collective layer of the C++ ops: a collective is started, then waited on. It runs
// eagerly on c10d and traces under torch.compile. On plain tensors a collective is started on the
// process group and its Work waited on later. On tensors a tracer wraps (fake, functional), the
// same collective is issued as PyTorch's functional collective op (``_c10d_functional``) plus
// ``wait_tensor``, which the graph records (they have fake kernels and inductor lowerings), where a
// direct c10d call could not be traced.
//
// A failure, when a collective is started or waited on (a dtype the backend cannot move, a peer
// that died or stopped answering), is raised as c10::DistBackendError
// (torch.distributed.DistBackendError in Python) with the message megatron_ext.comm_errors writes:
// the collective, ``where`` it ran, the tensor, the group (description and global ranks), this
// rank, the ranks it was waiting for and the backend's own message.
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <string>
#include <vector>

namespace megatron_ext::comm {

// True for a tensor no Python subclass or functionalization wraps: eager code.
bool is_plain(const at::Tensor& x);

// A started collective: its output, and the work to wait on (null when traced). A two-rank sum
// is an exchange: ``work`` receives the peer's tensor into ``tensor`` while ``send`` sends
// ``input``, this rank's own, which ``wait`` then adds. ``what`` and ``group_name`` name the
// collective in a failure's message, ``input`` is the tensor it describes.
struct Pending {
  at::Tensor tensor;
  c10::intrusive_ptr<c10d::Work> work;
  c10::intrusive_ptr<c10d::Work> send = {};
  at::Tensor input = {};
  std::string what = {};
  std::string group_name = {};
};

// ``where`` completes the operation's name in a failure's message: "all-reduce in <where>".

// Sum (or ``op``) over the group into a new contiguous tensor; the input is left as it was.
Pending start_all_reduce(const at::Tensor& input, const std::string& group_name,
                         const std::string& where,
                         c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM);
// Sum over the group in place when ``owned`` is a plain, contiguous tensor nobody else references
// (a gradient autograd handed over), else into a new tensor.
Pending start_all_reduce_owned(at::Tensor owned, const std::string& group_name,
                               const std::string& where);
// Sum over the group in place on ``tensor``, a contiguous buffer the caller owns.
Pending start_all_reduce_inplace(const at::Tensor& tensor, const std::string& group_name,
                                 const std::string& where);
// Every rank's ``input`` concatenated along dim 0.
Pending start_all_gather_dim0(const at::Tensor& input, int64_t group_size,
                              const std::string& group_name, const std::string& where);
// The sum over the group, this rank's dim-0 chunk.
Pending start_reduce_scatter_dim0(const at::Tensor& input, int64_t group_size,
                                  const std::string& group_name, const std::string& where);
// Rows of ``input`` sent to each rank along dim 0, ``input_split_sizes[r]`` of them to rank r,
// and ``output_split_sizes[r]`` rows received from rank r, laid one after another (both empty:
// equal chunks of the input's dim 0).
Pending start_all_to_all_dim0(const at::Tensor& input,
                              const std::vector<int64_t>& output_split_sizes,
                              const std::vector<int64_t>& input_split_sizes, int64_t group_size,
                              const std::string& group_name, const std::string& where);
// Blocks until the collective has finished and returns its output.
at::Tensor wait(Pending pending);

}  // namespace megatron_ext::comm
