// CPU kernels of the token permutation for the experts: gathering rows by index (scaled by the
// router probabilities when given), adding rows back into their tokens, and the per-row dot
// product that is the probabilities' gradient. The row arithmetic is kernels/moe_permute.h's.
// The sums into tokens are split over columns between threads, each adding the rows in their
// order: the result does not depend on the number of threads.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "kernels/moe_permute.h"
#include "kernels/moe_permute_checks.h"

namespace megatron_ext {
namespace {

int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

void check_index_values(const char* op, const at::Tensor& index, int64_t num_rows) {
  const int64_t* idx = index.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i) check_moe_index_value(op, i, idx[i], num_rows);
}

std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->contiguous();
}

at::Tensor gather_rows_cpu(const at::Tensor& input, const at::Tensor& index,
                           const std::optional<at::Tensor>& scale) {
  constexpr const char* kName = "moe_gather_rows";
  check_moe_rows(kName, input, index, scale, index.numel());
  const auto src = input.contiguous();
  const auto idx = index.contiguous();
  const auto s = contiguous(scale);
  const int64_t cols = src.size(1);
  const int64_t m = idx.numel();
  check_index_values(kName, idx, src.size(0));
  auto out = at::empty({m, cols}, src.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), kName, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    const scalar_t* p = s.has_value() ? s->const_data_ptr<scalar_t>() : nullptr;
    const int64_t* rows = idx.const_data_ptr<int64_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, m, row_grain(cols), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const acc_t factor = p != nullptr ? static_cast<acc_t>(p[i]) : acc_t(1);
        kernels::moe_gather_row<scalar_t, acc_t>(x + rows[i] * cols, o + i * cols, factor, 0, cols,
                                                 1);
      }
    });
  });
  return out;
}

at::Tensor scatter_add_rows_cpu(const at::Tensor& input, const at::Tensor& index,
                                const std::optional<at::Tensor>& scale, int64_t num_rows) {
  constexpr const char* kName = "moe_scatter_add_rows";
  check_moe_rows(kName, input, index, scale, input.size(0));
  check_moe_num_rows(kName, num_rows);
  const auto src = input.contiguous();
  const auto idx = index.contiguous();
  const auto s = contiguous(scale);
  const int64_t cols = src.size(1);
  const int64_t m = idx.numel();
  check_index_values(kName, idx, num_rows);
  auto acc = at::zeros({num_rows, cols}, src.options().dtype(at::toOpMathType(src.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), kName, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    const scalar_t* p = s.has_value() ? s->const_data_ptr<scalar_t>() : nullptr;
    const int64_t* rows = idx.const_data_ptr<int64_t>();
    acc_t* a = acc.mutable_data_ptr<acc_t>();
    const int64_t grain = std::max<int64_t>(16, 32768 / std::max<int64_t>(m, 1));
    at::parallel_for(0, cols, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = 0; i < m; ++i) {
        const acc_t factor = p != nullptr ? static_cast<acc_t>(p[i]) : acc_t(1);
        acc_t* row = a + rows[i] * cols;
        for (int64_t h = begin; h < end; ++h) {
          row[h] += kernels::moe_scatter_term<scalar_t, acc_t>(x + i * cols, factor, h);
        }
      }
    });
  });
  return acc.to(src.scalar_type());
}

at::Tensor gathered_row_dot_cpu(const at::Tensor& grad, const at::Tensor& index,
                                const at::Tensor& input) {
  constexpr const char* kName = "moe_gathered_row_dot";
  check_moe_rows(kName, input, index, std::nullopt, input.size(0));
  check_moe_rows(kName, grad, index, std::nullopt, index.numel());
  TORCH_CHECK_VALUE(grad.size(1) == input.size(1) && grad.scalar_type() == input.scalar_type(),
                    kName, ": the gradient (", grad.scalar_type(), ", shape ", grad.sizes(),
                    ") and the rows (", input.scalar_type(), ", shape ", input.sizes(),
                    ") must agree in dtype and hidden size");
  const auto g = grad.contiguous();
  const auto src = input.contiguous();
  const auto idx = index.contiguous();
  const int64_t cols = src.size(1);
  const int64_t m = idx.numel();
  check_index_values(kName, idx, g.size(0));
  auto out = at::empty({m}, src.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), kName, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    const int64_t* rows = idx.const_data_ptr<int64_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, m, row_grain(cols), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        o[i] = static_cast<scalar_t>(
            kernels::moe_row_dot<scalar_t, acc_t>(gp + rows[i] * cols, x + i * cols, 0, cols, 1));
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CPU, m) {
  m.impl("moe_gather_rows", &gather_rows_cpu);
  m.impl("moe_scatter_add_rows", &scatter_add_rows_cpu);
  m.impl("moe_gathered_row_dot", &gathered_row_dot_cpu);
}

}  // namespace megatron_ext
