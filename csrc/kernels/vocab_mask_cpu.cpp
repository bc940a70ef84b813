#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "kernels/vocab_mask.h"
#include "kernels/vocab_mask_checks.h"

namespace megatron_ext {
namespace {

std::tuple<at::Tensor, at::Tensor> vocab_range_mask_cpu(const at::Tensor& ids, int64_t first,
                                                        int64_t last) {
  check_vocab_range_mask_args(ids, first, last);
  auto input = ids.contiguous().to(at::kLong);
  auto local = at::empty_like(input);
  auto outside = at::empty(input.sizes(), input.options().dtype(at::kBool));
  const int64_t* in = input.const_data_ptr<int64_t>();
  int64_t* out = local.mutable_data_ptr<int64_t>();
  bool* mask = outside.mutable_data_ptr<bool>();
  at::parallel_for(0, input.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      kernels::vocab_mask_one(in[i], first, last, out + i, mask + i);
    }
  });
  return {local, outside};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CPU, m) { m.impl("vocab_range_mask", &vocab_range_mask_cpu); }

}  // namespace megatron_ext
