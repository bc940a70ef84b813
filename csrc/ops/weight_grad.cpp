#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "ops/weight_grad.h"

#include <ATen/ops/addmm.h>

namespace megatron_ext {

void accumulate_weight_grad_(at::Tensor& main_grad, const at::Tensor& grad_output_2d,
                             const at::Tensor& input_2d) {
  const auto dtype = main_grad.scalar_type();
  const auto operand = input_2d.scalar_type();
  TORCH_CHECK_VALUE(grad_output_2d.scalar_type() == operand,
                    "accumulate_weight_grad_: grad_output dtype ", grad_output_2d.scalar_type(),
                    " differs from the input dtype ", operand);
  if (operand == dtype) {
    main_grad.addmm_(grad_output_2d.t(), input_2d);
    return;
  }
  const bool half_operands = operand == at::kBFloat16 || operand == at::kHalf;
  if (main_grad.is_cuda() && dtype == at::kFloat && half_operands) {
    // aten::addmm.dtype_out: cuBLAS with 16-bit inputs and an fp32 C, beta = 1 into main_grad.
    at::addmm_out(main_grad, main_grad, grad_output_2d.t(), input_2d, at::kFloat);
    return;
  }
  // CPU (and unusual dtype pairs) have no mixed-dtype GEMM: widen the operands.
  main_grad.addmm_(grad_output_2d.t().to(dtype), input_2d.to(dtype));
}

}  // namespace megatron_ext
