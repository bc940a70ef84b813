#pragma once
// A process group named by its c10d registry name (``group.group_name`` in Python), and the
// argument check every collective makes first. The collectives themselves are in comm/functional.h.
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>

namespace megatron_ext::comm {

c10::intrusive_ptr<c10d::ProcessGroup> resolve(const std::string& group_name);
int64_t group_size(const std::string& group_name);
int64_t group_rank(const std::string& group_name);

// Raises a ValueError unless ``input.size(dim)`` divides by the group size.
void check_divisible(const at::Tensor& input, int64_t dim, int64_t world_size, const char* what);

}  // namespace megatron_ext::comm
