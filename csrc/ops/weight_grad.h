#pragma once
#include <ATen/core/Tensor.h>

namespace megatron_ext {

// main_grad += grad_output_2d^T @ input_2d: the weight-gradient GEMM of gradient-accumulation
// fusion. On CUDA with an fp32 main_grad and bf16/fp16 operands it is one cuBLAS GEMM reading the
// 16-bit operands and accumulating into main_grad in fp32 (no fp32 copies of the operands).
void accumulate_weight_grad_(at::Tensor& main_grad, const at::Tensor& grad_output_2d,
                             const at::Tensor& input_2d);

}  // namespace megatron_ext
