// CPU implementations of the Mamba-2 SSD scan kernel ops: argument checks, the segments of the
// rows, threading with at::parallel_for over the (segment, head) tasks, the run-time choice of the
// instruction-set variant of the loops (kernels/cpu/mamba_ssd_kernels.cpp), and the sums of the
// per-task gradients: those of A, D and dt_bias summed per task and then over the tasks in a fixed
// order, those of B and C per head and then over the heads of a group, so the result does not
// depend on the number of threads.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/mamba_ssd.h"
#include "kernels/cpu/mamba_ssd_kernels.h"
#include "kernels/cpu_capability.h"
#include "kernels/mamba_ssd_checks.h"

namespace megatron_ext {
namespace {

using kernels::SsdArgs;
using kernels::SsdGrads;
using kernels::SsdSegment;
using OptionalTensor = std::optional<at::Tensor>;

const kernels::MambaSsdCpuKernels& cpu_kernels() {
  switch (kernels::cpu_capability()) {
#ifdef MEGATRON_EXT_CPU_AVX512
    case kernels::CpuCapability::kAvx512:
      return kernels::AVX512::mamba_ssd_cpu_kernels;
#endif
#ifdef MEGATRON_EXT_CPU_AVX2
    case kernels::CpuCapability::kAvx2:
      return kernels::AVX2::mamba_ssd_cpu_kernels;
#endif
    default:
      return kernels::DEFAULT::mamba_ssd_cpu_kernels;
  }
}

at::Tensor acc_or_undefined(const OptionalTensor& t, at::ScalarType acc) {
  return has_tensor(t) ? t->to(acc).contiguous() : at::Tensor();
}

SsdArgs ssd_args(const char* op, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                 const at::Tensor& B, const at::Tensor& C, int64_t chunk_size,
                 const OptionalTensor& D, const OptionalTensor& z, const OptionalTensor& dt_bias,
                 const OptionalTensor& initial_states, const OptionalTensor& cu_seqlens,
                 bool dt_softplus, double dt_min, std::optional<double> dt_max) {
  check_mamba_chunk_scan_args(op, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
                              cu_seqlens, dt_min, dt_max);
  SsdArgs a;
  const auto acc = fusion_acc_type(x.scalar_type());
  a.x = x.contiguous();
  a.dt = dt.contiguous();
  a.B = B.contiguous();
  a.C = C.contiguous();
  a.z = has_tensor(z) ? z->contiguous() : at::Tensor();
  a.A = A.to(acc).contiguous();
  a.D = acc_or_undefined(D, acc);
  a.dt_bias = acc_or_undefined(dt_bias, acc);
  a.init = acc_or_undefined(initial_states, acc);
  a.segments = ssd_segments(op, x, cu_seqlens, chunk_size, &a.total_chunks);
  a.length = x.size(1);
  a.heads = x.size(2);
  a.headdim = x.size(3);
  a.groups = B.size(2);
  a.dstate = B.size(3);
  a.chunk = chunk_size;
  a.state_rows = ssd_state_rows(x, cu_seqlens);
  a.softplus = dt_softplus;
  a.lo = dt_min;
  a.hi = dt_max.value_or(INFINITY);
  return a;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mamba_chunk_scan_forward_cpu(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
    const at::Tensor& C, int64_t chunk_size, const OptionalTensor& D, const OptionalTensor& z,
    const OptionalTensor& dt_bias, const OptionalTensor& initial_states,
    const OptionalTensor& cu_seqlens, bool dt_softplus, double dt_min,
    std::optional<double> dt_max) {
  const auto a = ssd_args("mamba_chunk_scan_forward", x, dt, A, B, C, chunk_size, D, z, dt_bias,
                          initial_states, cu_seqlens, dt_softplus, dt_min, dt_max);
  const auto acc_opts = x.options().dtype(fusion_acc_type(x.scalar_type()));
  auto y = at::empty(a.x.sizes(), a.x.options());
  auto final_states = at::empty({a.state_rows, a.heads, a.headdim, a.dstate}, acc_opts);
  auto chunk_states = at::empty({a.total_chunks, a.heads, a.headdim, a.dstate}, acc_opts);
  const int64_t tasks = static_cast<int64_t>(a.segments.size()) * a.heads;
  const auto& k = cpu_kernels();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    // The worker threads do not inherit the caller's dispatch state; the buffers' matrix
    // products need no autograd.
    at::AutoDispatchBelowADInplaceOrView guard;
    k.forward(a, begin, end, y, final_states, chunk_states);
  });
  return {y, final_states, chunk_states};
}

SsdGradients mamba_chunk_scan_backward_cpu(
    const at::Tensor& grad_y, const OptionalTensor& grad_final_states, const at::Tensor& x,
    const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
    int64_t chunk_size, const OptionalTensor& D, const OptionalTensor& z,
    const OptionalTensor& dt_bias, const OptionalTensor& initial_states,
    const OptionalTensor& cu_seqlens, bool dt_softplus, double dt_min, std::optional<double> dt_max,
    const at::Tensor& chunk_states) {
  const char* op = "mamba_chunk_scan_backward";
  const auto a = ssd_args(op, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, cu_seqlens,
                          dt_softplus, dt_min, dt_max);
  check_mamba_chunk_scan_backward_args(op, grad_y, grad_final_states, x, a.state_rows,
                                       a.total_chunks, B.size(3), chunk_states);
  const auto acc = fusion_acc_type(x.scalar_type());
  const auto acc_opts = x.options().dtype(acc);
  const auto gy = grad_y.contiguous();
  const auto gfinal =
      has_tensor(grad_final_states) ? grad_final_states->to(acc).contiguous() : at::Tensor();
  const auto states = chunk_states.to(acc).contiguous();
  const int64_t H = a.heads, P = a.headdim, N = a.dstate;
  auto gx = at::empty(a.x.sizes(), a.x.options());
  auto gdt = at::empty(a.dt.sizes(), a.dt.options());
  auto gz = a.z.defined() ? at::empty(a.z.sizes(), a.z.options()) : at::empty({0}, a.x.options());
  auto gBh = at::empty({x.size(0), a.length, H, N}, acc_opts);
  auto gCh = at::empty({x.size(0), a.length, H, N}, acc_opts);
  auto ginit = at::zeros({a.state_rows, H, P, N}, acc_opts);
  const int64_t segments = static_cast<int64_t>(a.segments.size());
  auto part = at::empty({segments, H, P + 2}, acc_opts);
  const SsdGrads g{gy, gfinal, states, gx, gdt, gBh, gCh, gz, ginit, part};
  const auto& k = cpu_kernels();
  at::parallel_for(0, segments * H, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView guard;
    k.backward(a, begin, end, g);
  });
  return ssd_gradients(x, dt, gx, gdt, gz, A, B, C, D, dt_bias, initial_states, gBh, gCh, ginit,
                       part);
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CPU, m) {
  m.impl("mamba_chunk_scan_forward", &mamba_chunk_scan_forward_cpu);
  m.impl("mamba_chunk_scan_backward", &mamba_chunk_scan_backward_cpu);
}

}  // namespace megatron_ext
