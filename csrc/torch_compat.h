#pragma once
// C++ APIs of torch that changed between the releases this project builds against (2.11 and
// newer): the version test is defined here, once; the two renamed ProcessGroup calls branch on it
// where they are made (comm/process_group.cpp), the Node pointer type below.
#include <c10/util/intrusive_ptr.h>
#include <torch/version.h>

#include <memory>
#include <utility>

// torch 2.13 holds autograd Nodes in c10::intrusive_ptr (before: std::shared_ptr), and renamed
// ProcessGroup::_allgather_base / _reduce_scatter_base to all_gather_single /
// reduce_scatter_single, deprecating the old names.
#define MEGATRON_EXT_TORCH_2_13 \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13))

namespace megatron_ext {

// A new autograd Node of type NodeT, in the pointer type this torch's autograd holds Nodes in.
template <typename NodeT, typename... Args>
auto make_autograd_node(Args&&... args) {
#if MEGATRON_EXT_TORCH_2_13
  return c10::make_intrusive<NodeT>(std::forward<Args>(args)...);
#else
  return std::make_shared<NodeT>(std::forward<Args>(args)...);
#endif
}

}  // namespace megatron_ext
