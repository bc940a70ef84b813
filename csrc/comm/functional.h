#pragma once
// Collectives that run eagerly on c10d and trace under torch.compile. On plain tensors a collective
// is started on the process group and its Work waited on later. On tensors a tracer wraps (fake,
// functional), the same collective is issued as PyTorch's functional collective op
// (``_c10d_functional``) plus ``wait_tensor``, which the graph records (they have fake kernels and
// inductor lowerings), where a direct c10d call could not be traced.
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <string>

namespace megatron_ext::comm {

// True for a tensor no Python subclass or functionalization wraps: eager code.
bool is_plain(const at::Tensor& x);

// A started collective: its output, and the work to wait on (null when traced). A two-rank sum
// is an exchange: ``work`` receives the peer's tensor into ``tensor`` while ``send`` sends
// ``addend``, this rank's own, which ``wait`` then adds.
struct Pending {
  at::Tensor tensor;
  c10::intrusive_ptr<c10d::Work> work;
  c10::intrusive_ptr<c10d::Work> send = {};
  at::Tensor addend = {};
};

// Sum over the group into a new contiguous tensor; the input is left as it was.
Pending start_all_reduce(const at::Tensor& input, const std::string& group_name);
// Sum over the group in place when ``owned`` is a plain, contiguous tensor nobody else references
// (a gradient autograd handed over), else into a new tensor.
Pending start_all_reduce_owned(at::Tensor owned, const std::string& group_name);
// Every rank's ``input`` concatenated along dim 0.
Pending start_all_gather_dim0(const at::Tensor& input, int64_t group_size,
                              const std::string& group_name);
// The sum over the group, this rank's dim-0 chunk.
Pending start_reduce_scatter_dim0(const at::Tensor& input, int64_t group_size,
                                  const std::string& group_name);
// Blocks until the collective has finished and returns its output; a failure is reported as
// ``what`` over ``group_name``.
at::Tensor wait(Pending pending, const char* what, const std::string& group_name);

}  // namespace megatron_ext::comm
