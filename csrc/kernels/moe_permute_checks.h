#pragma once
// Argument checks of the token-permutation kernels (moe_gather_rows, moe_scatter_add_rows,
// moe_gathered_row_dot), shared by their CPU and CUDA kernels and the autograd ops.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

namespace megatron_ext {

// ``rows`` [m, h] and ``index`` [m] (int64, on rows' device) and, when given, ``scale`` [m] of
// rows' dtype.
inline void check_moe_rows(const char* op, const at::Tensor& rows, const at::Tensor& index,
                           const std::optional<at::Tensor>& scale, int64_t index_len) {
  TORCH_CHECK_VALUE(rows.dim() == 2, op, ": expected a 2-D tensor [rows, hidden], got shape ",
                    rows.sizes());
  TORCH_CHECK_VALUE(at::isFloatingType(rows.scalar_type()), op,
                    ": expected a floating-point tensor, got ", rows.scalar_type());
  TORCH_CHECK_VALUE(index.dim() == 1 && index.scalar_type() == at::kLong, op,
                    ": the indices must be a 1-D int64 tensor, got a ", index.scalar_type(),
                    " tensor of shape ", index.sizes());
  TORCH_CHECK_VALUE(index.numel() == index_len, op, ": expected ", index_len,
                    " indices (one per permuted row), got ", index.numel());
  TORCH_CHECK_VALUE(index.device() == rows.device(), op, ": the indices are on ", index.device(),
                    ", the rows on ", rows.device());
  if (scale.has_value()) {
    TORCH_CHECK_VALUE(scale->dim() == 1 && scale->numel() == index_len, op, ": expected ",
                      index_len, " probabilities (one per permuted row), got shape ",
                      scale->sizes());
    TORCH_CHECK_VALUE(scale->scalar_type() == rows.scalar_type(), op, ": the probabilities are ",
                      scale->scalar_type(), ", the rows ", rows.scalar_type());
    TORCH_CHECK_VALUE(scale->device() == rows.device(), op, ": the probabilities are on ",
                      scale->device(), ", the rows on ", rows.device());
  }
}

inline void check_moe_num_rows(const char* op, int64_t num_rows) {
  TORCH_CHECK_VALUE(num_rows >= 0, op, ": expected num_tokens >= 0, got ", num_rows);
}

// An index outside [0, num_rows): named with its position (CPU; the CUDA kernels assert).
inline void check_moe_index_value(const char* op, int64_t i, int64_t value, int64_t num_rows) {
  TORCH_CHECK_INDEX(value >= 0 && value < num_rows, op, ": index ", value, " at position ", i,
                    " is outside [0, ", num_rows, ")");
}

}  // namespace megatron_ext
