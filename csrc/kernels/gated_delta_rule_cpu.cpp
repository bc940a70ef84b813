// CPU implementations of the gated delta rule kernel ops: argument checks, the segments and
// chunks of the rows, threading with at::parallel_for over the (batch row, segment, head) tasks,
// and the run-time choice of the instruction-set variant of the loops
// (kernels/cpu/gated_delta_rule_kernels.cpp).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "kernels/cpu/fusion_dtype.h"
#include "kernels/cpu/gated_delta_rule_kernels.h"
#include "kernels/cpu_capability.h"
#include "kernels/gated_delta_rule_checks.h"

namespace megatron_ext {
namespace {

const kernels::GatedDeltaRuleCpuKernels& cpu_kernels() {
  switch (kernels::cpu_capability()) {
#ifdef MEGATRON_EXT_CPU_AVX512
    case kernels::CpuCapability::kAvx512:
      return kernels::AVX512::gated_delta_rule_cpu_kernels;
#endif
#ifdef MEGATRON_EXT_CPU_AVX2
    case kernels::CpuCapability::kAvx2:
      return kernels::AVX2::gated_delta_rule_cpu_kernels;
#endif
    default:
      return kernels::DEFAULT::gated_delta_rule_cpu_kernels;
  }
}

// The inputs of both kernels: contiguous, g, beta and the initial states in the accumulation
// dtype, the rows' segments and chunks.
struct GdrInputs {
  at::Tensor q, k, v, g, beta, init;
  GdrLayout layout;
  kernels::GdrProblem problem;
  int64_t tasks;
};

GdrInputs gdr_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g, const at::Tensor& beta, double scale,
                     const std::optional<at::Tensor>& initial_state,
                     const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm,
                     int64_t chunk_size) {
  check_gated_delta_rule_args(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size);
  GdrInputs in;
  const auto acc = fusion_acc_type(q.scalar_type());
  in.q = q.contiguous();
  in.k = k.contiguous();
  in.v = v.contiguous();
  in.g = g.to(acc).contiguous();
  in.beta = beta.to(acc).contiguous();
  in.init = has_tensor(initial_state) ? initial_state->to(acc).contiguous() : at::Tensor();
  in.layout = gdr_layout(op, cu_seqlens, q.size(1), chunk_size);
  const auto& l = in.layout;
  const int64_t segments = static_cast<int64_t>(l.start.size());
  in.problem = {in.q.const_data_ptr(),
                in.k.const_data_ptr(),
                in.v.const_data_ptr(),
                in.g.const_data_ptr(),
                in.beta.const_data_ptr(),
                in.init.defined() ? in.init.const_data_ptr() : nullptr,
                l.start.data(),
                l.end.data(),
                l.chunk_base.data(),
                segments,
                has_tensor(cu_seqlens),
                q.size(0),
                q.size(1),
                q.size(2),
                q.size(3),
                v.size(3),
                chunk_size,
                l.chunks,
                use_qk_l2norm,
                scale};
  in.tasks = q.size(0) * segments * q.size(2);
  return in;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_delta_rule_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
    const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm, int64_t chunk_size) {
  const auto in = gdr_inputs("gated_delta_rule_forward", q, k, v, g, beta, scale, initial_state,
                             cu_seqlens, use_qk_l2norm, chunk_size);
  const auto acc = in.q.options().dtype(fusion_acc_type(q.scalar_type()));
  const auto& p = in.problem;
  auto out = at::empty(in.v.sizes(), in.v.options());
  auto final_state = at::empty({gdr_state_rows(q, cu_seqlens), p.heads, p.dk, p.dv}, acc);
  auto chunk_states = at::empty({p.batch, p.heads, p.chunks, p.dk, p.dv}, acc);
  const auto& kern = cpu_kernels();
  const auto dtype = fusion_dtype(in.q.scalar_type());
  at::parallel_for(0, in.tasks, 1, [&](int64_t begin, int64_t end) {
    kern.forward(dtype, p, begin, end, out.mutable_data_ptr(), final_state.mutable_data_ptr(),
                 chunk_states.mutable_data_ptr());
  });
  return {out, final_state, chunk_states};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
gated_delta_rule_backward_cpu(const at::Tensor& grad_output,
                              const std::optional<at::Tensor>& grad_final_state,
                              const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta, double scale,
                              const std::optional<at::Tensor>& initial_state,
                              const std::optional<at::Tensor>& cu_seqlens,
                              const at::Tensor& chunk_states, bool use_qk_l2norm,
                              int64_t chunk_size) {
  const auto in = gdr_inputs("gated_delta_rule_backward", q, k, v, g, beta, scale, initial_state,
                             cu_seqlens, use_qk_l2norm, chunk_size);
  const int64_t rows = gdr_state_rows(q, cu_seqlens);
  check_gated_delta_rule_backward_args(grad_output, grad_final_state, q, v, chunk_states, rows,
                                       in.layout.chunks);
  const auto acc = fusion_acc_type(q.scalar_type());
  const auto go = grad_output.contiguous();
  const auto gf =
      has_tensor(grad_final_state) ? grad_final_state->to(acc).contiguous() : at::Tensor();
  const auto states = chunk_states.contiguous();
  auto dq = at::empty(in.q.sizes(), in.q.options());
  auto dk = at::empty(in.k.sizes(), in.k.options());
  auto dv = at::empty(in.v.sizes(), in.v.options());
  auto dg = at::empty(in.g.sizes(), in.g.options());
  auto dbeta = at::empty(in.beta.sizes(), in.beta.options());
  auto dinit = in.init.defined() ? at::empty(in.init.sizes(), in.init.options())
                                 : at::empty({0}, in.g.options());
  const auto& kern = cpu_kernels();
  const auto dtype = fusion_dtype(in.q.scalar_type());
  at::parallel_for(0, in.tasks, 1, [&](int64_t begin, int64_t end) {
    kern.backward(dtype, in.problem, go.const_data_ptr(),
                  gf.defined() ? gf.const_data_ptr() : nullptr, states.const_data_ptr(), begin, end,
                  dq.mutable_data_ptr(), dk.mutable_data_ptr(), dv.mutable_data_ptr(),
                  dg.mutable_data_ptr(), dbeta.mutable_data_ptr(),
                  in.init.defined() ? dinit.mutable_data_ptr() : nullptr);
  });
  return {dq,
          dk,
          dv,
          dg.to(g.scalar_type()),
          dbeta.to(beta.scalar_type()),
          in.init.defined() ? dinit.to(initial_state->scalar_type()) : dinit};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CPU, m) {
  m.impl("gated_delta_rule_forward", &gated_delta_rule_forward_cpu);
  m.impl("gated_delta_rule_backward", &gated_delta_rule_backward_cpu);
}

}  // namespace megatron_ext
