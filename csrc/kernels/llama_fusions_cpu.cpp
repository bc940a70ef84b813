// CPU implementations of the RMSNorm, rotary embedding and SwiGLU (gated sigmoid unit) kernel ops:
// argument checks, threading over rows with at::parallel_for, and the run-time choice of the
// instruction-set variant of the row loops (kernels/cpu/llama_fusions_kernels.cpp).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "kernels/cpu/llama_fusions_kernels.h"
#include "kernels/cpu/fusion_dtype.h"
#include "kernels/cpu_capability.h"
#include "kernels/llama_fusions_checks.h"

namespace megatron_ext {
namespace {

using namespace kernels;

// The RMSNorm weight gradient is summed over at most this many blocks of rows, each block's sum
// in its own row of a buffer, then over the blocks in order: the same result whatever the number
// of threads.
constexpr int64_t kWeightGradBlocks = 64;

int64_t row_grain(int64_t row_length) { return std::max<int64_t>(1, 32768 / row_length); }

const LlamaFusionCpuKernels& cpu_kernels() {
  switch (cpu_capability()) {
#ifdef MEGATRON_EXT_CPU_AVX512
    case CpuCapability::kAvx512:
      return AVX512::llama_fusion_cpu_kernels;
#endif
#ifdef MEGATRON_EXT_CPU_AVX2
    case CpuCapability::kAvx2:
      return AVX2::llama_fusion_cpu_kernels;
#endif
    default:
      return DEFAULT::llama_fusion_cpu_kernels;
  }
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cpu(const at::Tensor& input,
                                                        const at::Tensor& weight, double eps) {
  check_rms_norm_args("rms_norm_forward", input, weight, eps);
  const auto x = input.contiguous();
  const auto w = to_acc(weight);
  const int64_t h = x.size(-1);
  const int64_t rows = x.numel() / h;
  auto y = at::empty(x.sizes(), x.options());
  auto rstd = at::empty(x.sizes().slice(0, x.dim() - 1),
                        x.options().dtype(fusion_acc_type(x.scalar_type())));
  const auto& k = cpu_kernels();
  const auto dtype = fusion_dtype(x.scalar_type());
  at::parallel_for(0, rows, row_grain(h), [&](int64_t begin, int64_t end) {
    k.rms_norm_forward(dtype, x.const_data_ptr(), w.const_data_ptr(), eps, h, begin, end,
                       y.mutable_data_ptr(), rstd.mutable_data_ptr());
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_output,
                                                         const at::Tensor& input,
                                                         const at::Tensor& weight,
                                                         const at::Tensor& rstd) {
  check_rms_norm_backward_args(grad_output, input, weight, rstd);
  const auto g = grad_output.contiguous();
  const auto x = input.contiguous();
  const auto w = to_acc(weight);
  const auto r = rstd.contiguous();
  const int64_t h = x.size(-1);
  const int64_t rows = x.numel() / h;
  auto grad_x = at::empty(x.sizes(), x.options());
  const int64_t per_block =
      std::max<int64_t>(1, (rows + kWeightGradBlocks - 1) / kWeightGradBlocks);
  const int64_t blocks = (rows + per_block - 1) / per_block;
  auto partial = at::zeros({std::max<int64_t>(blocks, 1), h}, w.options());
  const auto& k = cpu_kernels();
  const auto dtype = fusion_dtype(x.scalar_type());
  auto* partial_bytes = static_cast<char*>(partial.mutable_data_ptr());
  const int64_t partial_row_bytes = h * partial.element_size();
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t block = first; block < last; ++block) {
      k.rms_norm_backward(dtype, g.const_data_ptr(), x.const_data_ptr(), w.const_data_ptr(),
                          r.const_data_ptr(), h, block * per_block,
                          std::min(rows, (block + 1) * per_block), grad_x.mutable_data_ptr(),
                          partial_bytes + block * partial_row_bytes);
    }
  });
  // Block 0's row accumulates the others, in order, column range by column range.
  AT_DISPATCH_FLOATING_TYPES(partial.scalar_type(), "rms_norm_weight_grad_cpu", [&] {
    auto* p = partial.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, h, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t block = 1; block < blocks; ++block) {
        const scalar_t* src = p + block * h;
        for (int64_t j = begin; j < end; ++j) p[j] += src[j];
      }
    });
  });
  return {grad_x, partial[0].to(weight.scalar_type(), /*non_blocking=*/false, /*copy=*/true)};
}

at::Tensor rotary_cpu(const char* op, const at::Tensor& input, const at::Tensor& cos,
                      const at::Tensor& sin, bool interleaved, bool backward) {
  check_rotary_kernel_args(op, input, cos, sin);
  // The heads may lie anywhere (a view of a fused QKV output); their lanes must be contiguous.
  const auto t = input.stride(3) == 1 ? input : input.contiguous();
  const auto c = cos.contiguous();
  const auto s = sin.contiguous();
  auto out = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  const RotaryLayout layout{t.size(1),   t.size(2),   t.size(3),   c.size(1),
                            t.stride(0), t.stride(1), t.stride(2), interleaved};
  const int64_t heads = t.size(0) * t.size(1) * t.size(2);
  const auto& k = cpu_kernels();
  const auto dtype = fusion_dtype(t.scalar_type());
  at::parallel_for(0, heads, row_grain(t.size(3)), [&](int64_t begin, int64_t end) {
    k.rotary(dtype, t.const_data_ptr(), c.const_data_ptr(), s.const_data_ptr(), layout, backward,
             begin, end, out.mutable_data_ptr());
  });
  return out;
}

at::Tensor rotary_forward_cpu(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin,
                              bool interleaved) {
  return rotary_cpu("rotary_pos_emb_forward", t, cos, sin, interleaved, false);
}

at::Tensor rotary_backward_cpu(const at::Tensor& grad_output, const at::Tensor& cos,
                               const at::Tensor& sin, bool interleaved) {
  return rotary_cpu("rotary_pos_emb_backward", grad_output, cos, sin, interleaved, true);
}

at::Tensor swiglu_forward_cpu(const at::Tensor& input, const std::optional<at::Tensor>& bias,
                              double alpha, double linear_offset,
                              std::optional<double> clamp_value) {
  check_swiglu_args("swiglu_forward", input, bias);
  const GluParams params = glu_params("swiglu_forward", alpha, linear_offset, clamp_value);
  const auto y = input.contiguous();
  const auto b = has_tensor(bias) ? to_acc(*bias) : at::Tensor();
  const int64_t f = y.size(-1) / 2;
  auto sizes = y.sizes().vec();
  sizes.back() = f;
  auto out = at::empty(sizes, y.options());
  if (out.numel() == 0) return out;
  const int64_t rows = out.numel() / f;
  const auto& k = cpu_kernels();
  const auto dtype = fusion_dtype(y.scalar_type());
  at::parallel_for(0, rows, row_grain(f), [&](int64_t begin, int64_t end) {
    k.swiglu_forward(dtype, y.const_data_ptr(), b.defined() ? b.const_data_ptr() : nullptr, f,
                     params, begin, end, out.mutable_data_ptr());
  });
  return out;
}

at::Tensor swiglu_backward_cpu(const at::Tensor& grad_output, const at::Tensor& input,
                               const std::optional<at::Tensor>& bias, double alpha,
                               double linear_offset, std::optional<double> clamp_value) {
  check_swiglu_backward_args(grad_output, input, bias);
  const GluParams params = glu_params("swiglu_backward", alpha, linear_offset, clamp_value);
  const auto g = grad_output.contiguous();
  const auto y = input.contiguous();
  const auto b = has_tensor(bias) ? to_acc(*bias) : at::Tensor();
  auto grad_y = at::empty(y.sizes(), y.options());
  if (grad_y.numel() == 0) return grad_y;
  const int64_t f = y.size(-1) / 2;
  const int64_t rows = g.numel() / f;
  const auto& k = cpu_kernels();
  const auto dtype = fusion_dtype(y.scalar_type());
  at::parallel_for(0, rows, row_grain(f), [&](int64_t begin, int64_t end) {
    k.swiglu_backward(dtype, g.const_data_ptr(), y.const_data_ptr(),
                      b.defined() ? b.const_data_ptr() : nullptr, f, params, begin, end,
                      grad_y.mutable_data_ptr());
  });
  return grad_y;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CPU, m) {
  m.impl("rms_norm_forward", &rms_norm_forward_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
  m.impl("rotary_pos_emb_forward", &rotary_forward_cpu);
  m.impl("rotary_pos_emb_backward", &rotary_backward_cpu);
  m.impl("swiglu_forward", &swiglu_forward_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
}

}  // namespace megatron_ext
