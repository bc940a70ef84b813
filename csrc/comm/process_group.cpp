#include "comm/process_group.h"

#include <ATen/WrapDimUtils.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

namespace megatron_ext::comm {

c10::intrusive_ptr<c10d::ProcessGroup> resolve(const std::string& group_name) {
  return c10d::resolve_process_group(group_name);
}

int64_t group_size(const std::string& group_name) { return resolve(group_name)->getSize(); }

int64_t group_rank(const std::string& group_name) { return resolve(group_name)->getRank(); }

void check_divisible(const at::Tensor& input, int64_t dim, int64_t world_size, const char* what) {
  TORCH_CHECK_VALUE(input.dim() > 0, what,
                    ": expected a tensor with at least one dimension, got a scalar");
  const int64_t d = at::maybe_wrap_dim(dim, input.dim());
  // Symbolic sizes under torch.compile's dynamic shapes: the check becomes a guard.
  const c10::SymInt size = input.sym_size(d);
  TORCH_CHECK_VALUE(size % world_size == 0, what, ": dimension ", d, " of the input has size ",
                    size, ", which is not divisible by the group size ", world_size,
                    " (input shape ", input.sym_sizes(), ")");
}

}  // namespace megatron_ext::comm
