#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace megatron_ext {

inline void check_vocab_range_mask_args(const at::Tensor& ids, int64_t first, int64_t last) {
  TORCH_CHECK_VALUE(!at::isFloatingType(ids.scalar_type()) && !at::isComplexType(ids.scalar_type()),
                    "vocab_range_mask: token ids must be an integer tensor, got ",
                    ids.scalar_type());
  TORCH_CHECK_VALUE(0 <= first && first <= last, "vocab_range_mask: expected 0 <= first <= last, got [",
                    first, ", ", last, ")");
}

}  // namespace megatron_ext
