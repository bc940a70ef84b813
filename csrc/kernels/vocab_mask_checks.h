#pragma once
// Argument checks of vocab_range_mask, shared by its CPU and CUDA kernels.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

namespace megatron_ext {

inline void check_vocab_range_mask_args(const at::Tensor& ids, int64_t first, int64_t last) {
  TORCH_CHECK_VALUE(!at::isFloatingType(ids.scalar_type()) &&
                        !at::isComplexType(ids.scalar_type()) && ids.scalar_type() != at::kBool,
                    "vocab_range_mask: token ids must be an integer tensor, got ",
                    ids.scalar_type());
  TORCH_CHECK_VALUE(0 <= first && first <= last,
                    "vocab_range_mask: expected 0 <= first <= last, got [", first, ", ", last, ")");
}

// Blocks of a grid-stride launch over ``n`` elements: at most ``max_blocks``, and ``n`` must leave
// room for the loop's index arithmetic (i + blocks * threads) in int64.
inline unsigned int grid_stride_blocks(int64_t n, int threads, int64_t max_blocks) {
  TORCH_CHECK(n >= 0 && n <= std::numeric_limits<int64_t>::max() - max_blocks * threads,
              "vocab_range_mask: ", n, " elements are more than one launch can index");
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, max_blocks);
  TORCH_CHECK(blocks <= std::numeric_limits<unsigned int>::max(), "grid of ", blocks, " blocks");
  return static_cast<unsigned int>(blocks);
}

}  // namespace megatron_ext
