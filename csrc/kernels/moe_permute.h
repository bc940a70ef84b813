#pragma once
// The row arithmetic of the token permutation for the experts, shared by the CPU loops and the
// CUDA kernels (kernels/moe_permute_cpu.cpp, kernels/moe_permute_cuda.cu). A permuted row ``i``
// belongs to the token ``index[i]``; ``scale[i]`` is its router probability (1 without one).
// Each function handles the columns begin, begin + step, ... < cols of one row: the CPU calls it
// with a range of columns and step 1, a CUDA thread with its lane and the number of lanes.
// Products and sums are taken in ``acc_t`` (float for 16-bit types), as ATen's opmath does.
#include <cstdint>

#include "kernels/host_device.h"

namespace megatron_ext::kernels {

// out_row[h] = src_row[h] * scale: a permuted row read from its token (or, in the backward of
// the unpermutation, a token's gradient read back into its permuted row).
template <typename scalar_t, typename acc_t>
MEGATRON_EXT_HOST_DEVICE void moe_gather_row(const scalar_t* src_row, scalar_t* out_row,
                                             acc_t scale, int64_t begin, int64_t cols,
                                             int64_t step) {
  for (int64_t h = begin; h < cols; h += step) {
    out_row[h] = static_cast<scalar_t>(static_cast<acc_t>(src_row[h]) * scale);
  }
}

// The term a permuted row adds to its token's row: src_row[h] * scale.
template <typename scalar_t, typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t moe_scatter_term(const scalar_t* src_row, acc_t scale, int64_t h) {
  return static_cast<acc_t>(src_row[h]) * scale;
}

// The part over columns begin, begin + step, ... of the dot product of a token's gradient row
// and a permuted row: the gradient of that row's router probability.
template <typename scalar_t, typename acc_t>
MEGATRON_EXT_HOST_DEVICE acc_t moe_row_dot(const scalar_t* grad_row, const scalar_t* row,
                                           int64_t begin, int64_t cols, int64_t step) {
  acc_t sum = acc_t(0);
  for (int64_t h = begin; h < cols; h += step) {
    sum += static_cast<acc_t>(grad_row[h]) * static_cast<acc_t>(row[h]);
  }
  return sum;
}

}  // namespace megatron_ext::kernels
