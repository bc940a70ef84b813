// CUDA kernels of the gated delta rule, the arithmetic of kernels/gated_delta_rule.h (the CPU
// twins run the same functions on one thread). A block of kGdrThreads threads runs a task (a
// batch row's segment and head) a chunk at a time in order, the chunk's phases split over its
// threads and separated by __syncthreads; blocks stride over the tasks. Each block's buffers live
// in a global-memory workspace (gdr_work_size elements per block), so the grid is bounded by the
// multiprocessors.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "kernels/cuda_launch.cuh"
#include "kernels/gated_delta_rule.h"
#include "kernels/gated_delta_rule_checks.h"

namespace megatron_ext {
namespace {

// Two warps: a chunk's rows (64 by default) split evenly over them.
constexpr int kGdrThreads = 64;

struct GdrBlockTeam {
  int64_t rank;
  int64_t size;
  MEGATRON_EXT_HOST_DEVICE void sync() const {
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
  }
};

__device__ __forceinline__ GdrBlockTeam gdr_block_team() {
  return {static_cast<int64_t>(threadIdx.x), static_cast<int64_t>(blockDim.x)};
}

// Task t as (batch row, segment, head).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void gdr_task(const kernels::GdrArgs<scalar_t, acc_t>& a, int64_t t,
                                         int64_t& b, int64_t& s, int64_t& h) {
  b = t / (a.segments * a.heads);
  s = (t / a.heads) % a.segments;
  h = t % a.heads;
}

template <typename scalar_t, typename acc_t>
__global__ void gdr_forward_kernel(kernels::GdrArgs<scalar_t, acc_t> a, int64_t tasks,
                                   acc_t* __restrict__ work, int64_t work_size,
                                   scalar_t* __restrict__ out, acc_t* __restrict__ final_state,
                                   acc_t* __restrict__ chunk_states) {
  const GdrBlockTeam team = gdr_block_team();
  const auto w = kernels::gdr_work_at(work + blockIdx.x * work_size, a.chunk, a.dk, a.dv);
  for (int64_t t = blockIdx.x; t < tasks; t += gridDim.x) {
    int64_t b, s, h;
    gdr_task(a, t, b, s, h);
    kernels::gdr_forward_segment(team, a, w, b, s, h, out, final_state, chunk_states);
  }
}

template <typename scalar_t, typename acc_t>
__global__ void gdr_backward_kernel(kernels::GdrArgs<scalar_t, acc_t> a, int64_t tasks,
                                    acc_t* __restrict__ work, int64_t work_size,
                                    kernels::GdrGrads<scalar_t, acc_t> gr,
                                    const acc_t* __restrict__ grad_final,
                                    const acc_t* __restrict__ chunk_states,
                                    acc_t* __restrict__ grad_init) {
  const GdrBlockTeam team = gdr_block_team();
  const auto w = kernels::gdr_work_at(work + blockIdx.x * work_size, a.chunk, a.dk, a.dv);
  for (int64_t t = blockIdx.x; t < tasks; t += gridDim.x) {
    int64_t b, s, h;
    gdr_task(a, t, b, s, h);
    kernels::gdr_backward_segment(team, a, w, gr, b, s, h, grad_final, chunk_states, grad_init);
  }
}

// The kernels' tensors: contiguous inputs, g, beta and the initial states in the accumulation
// dtype, and the segments' starts, ends and first chunks as one int64 tensor [3, S] on the device.
struct GdrTensors {
  at::Tensor q, k, v, g, beta, init, segments;
  int64_t num_segments, chunks, tasks;
  bool packed;
};

GdrTensors gdr_tensors(const char* op, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                       double scale, const std::optional<at::Tensor>& initial_state,
                       const std::optional<at::Tensor>& cu_seqlens, int64_t chunk_size) {
  check_gated_delta_rule_args(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size);
  GdrTensors t;
  const auto acc = fusion_acc_type(q.scalar_type());
  t.q = q.contiguous();
  t.k = k.contiguous();
  t.v = v.contiguous();
  t.g = g.to(acc).contiguous();
  t.beta = beta.to(acc).contiguous();
  t.init = has_tensor(initial_state) ? initial_state->to(acc).contiguous() : at::Tensor();
  const auto layout = gdr_layout(op, cu_seqlens, q.size(1), chunk_size);
  t.num_segments = static_cast<int64_t>(layout.start.size());
  auto host = at::empty({3, t.num_segments}, q.options().dtype(at::kLong).device(at::kCPU));
  int64_t* p = host.mutable_data_ptr<int64_t>();
  std::copy(layout.start.begin(), layout.start.end(), p);
  std::copy(layout.end.begin(), layout.end.end(), p + t.num_segments);
  std::copy(layout.chunk_base.begin(), layout.chunk_base.end(), p + 2 * t.num_segments);
  t.segments = host.to(q.device());
  t.chunks = layout.chunks;
  t.tasks = q.size(0) * t.num_segments * q.size(2);
  t.packed = has_tensor(cu_seqlens);
  return t;
}

template <typename scalar_t, typename acc_t>
kernels::GdrArgs<scalar_t, acc_t> gdr_args(const GdrTensors& t, double scale, bool l2norm,
                                           int64_t chunk_size) {
  const int64_t* seg = t.segments.const_data_ptr<int64_t>();
  return {t.q.const_data_ptr<scalar_t>(),
          t.k.const_data_ptr<scalar_t>(),
          t.v.const_data_ptr<scalar_t>(),
          t.g.const_data_ptr<acc_t>(),
          t.beta.const_data_ptr<acc_t>(),
          t.init.defined() ? t.init.const_data_ptr<acc_t>() : nullptr,
          seg,
          seg + t.num_segments,
          seg + 2 * t.num_segments,
          t.num_segments,
          t.packed,
          t.q.size(0),
          t.q.size(1),
          t.q.size(2),
          t.q.size(3),
          t.v.size(3),
          chunk_size,
          t.chunks,
          l2norm,
          static_cast<acc_t>(scale)};
}

// Blocks for the tasks, and the workspace they share.
unsigned int gdr_blocks(int64_t tasks) {
  return static_cast<unsigned int>(
      std::max<int64_t>(1, std::min<int64_t>(tasks, kernels::multiprocessors())));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_delta_rule_forward_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
    const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm, int64_t chunk_size) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto t = gdr_tensors("gated_delta_rule_forward", q, k, v, g, beta, scale, initial_state,
                             cu_seqlens, chunk_size);
  const auto acc = t.q.options().dtype(fusion_acc_type(q.scalar_type()));
  const int64_t H = q.size(2), K = q.size(3), V = v.size(3);
  auto out = at::empty(t.v.sizes(), t.v.options());
  auto final_state = at::empty({gdr_state_rows(q, cu_seqlens), H, K, V}, acc);
  auto chunk_states = at::empty({q.size(0), H, t.chunks, K, V}, acc);
  if (t.tasks == 0) return {out, final_state, chunk_states};
  const unsigned int blocks = gdr_blocks(t.tasks);
  const int64_t work_size = kernels::gdr_work_size(chunk_size, K, V);
  auto work = at::empty({static_cast<int64_t>(blocks) * work_size}, acc);
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, t.q.scalar_type(), "gated_delta_rule_forward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        gdr_forward_kernel<scalar_t, acc_t><<<blocks, kGdrThreads, 0, stream>>>(
            gdr_args<scalar_t, acc_t>(t, scale, use_qk_l2norm, chunk_size), t.tasks,
            work.mutable_data_ptr<acc_t>(), work_size, out.mutable_data_ptr<scalar_t>(),
            final_state.mutable_data_ptr<acc_t>(), chunk_states.mutable_data_ptr<acc_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return {out, final_state, chunk_states};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
gated_delta_rule_backward_cuda(const at::Tensor& grad_output,
                               const std::optional<at::Tensor>& grad_final_state,
                               const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta, double scale,
                               const std::optional<at::Tensor>& initial_state,
                               const std::optional<at::Tensor>& cu_seqlens,
                               const at::Tensor& chunk_states, bool use_qk_l2norm,
                               int64_t chunk_size) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto t = gdr_tensors("gated_delta_rule_backward", q, k, v, g, beta, scale, initial_state,
                             cu_seqlens, chunk_size);
  check_gated_delta_rule_backward_args(grad_output, grad_final_state, q, v, chunk_states,
                                       gdr_state_rows(q, cu_seqlens), t.chunks);
  const auto acc = fusion_acc_type(q.scalar_type());
  const auto go = grad_output.contiguous();
  const auto gf =
      has_tensor(grad_final_state) ? grad_final_state->to(acc).contiguous() : at::Tensor();
  const auto states = chunk_states.contiguous();
  auto dq = at::empty(t.q.sizes(), t.q.options());
  auto dk = at::empty(t.k.sizes(), t.k.options());
  auto dv = at::empty(t.v.sizes(), t.v.options());
  auto dg = at::empty(t.g.sizes(), t.g.options());
  auto dbeta = at::empty(t.beta.sizes(), t.beta.options());
  auto dinit = t.init.defined() ? at::empty(t.init.sizes(), t.init.options())
                                : at::empty({0}, t.g.options());
  if (t.tasks > 0) {
    const unsigned int blocks = gdr_blocks(t.tasks);
    const int64_t work_size = kernels::gdr_work_size(chunk_size, q.size(3), v.size(3));
    auto work = at::empty({static_cast<int64_t>(blocks) * work_size}, t.g.options());
    const auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, t.q.scalar_type(), "gated_delta_rule_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const kernels::GdrGrads<scalar_t, acc_t> gr{
              go.const_data_ptr<scalar_t>(),   dq.mutable_data_ptr<scalar_t>(),
              dk.mutable_data_ptr<scalar_t>(), dv.mutable_data_ptr<scalar_t>(),
              dg.mutable_data_ptr<acc_t>(),    dbeta.mutable_data_ptr<acc_t>()};
          gdr_backward_kernel<scalar_t, acc_t><<<blocks, kGdrThreads, 0, stream>>>(
              gdr_args<scalar_t, acc_t>(t, scale, use_qk_l2norm, chunk_size), t.tasks,
              work.mutable_data_ptr<acc_t>(), work_size, gr,
              gf.defined() ? gf.const_data_ptr<acc_t>() : nullptr, states.const_data_ptr<acc_t>(),
              t.init.defined() ? dinit.mutable_data_ptr<acc_t>() : nullptr);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }
  return {dq,
          dk,
          dv,
          dg.to(g.scalar_type()),
          dbeta.to(beta.scalar_type()),
          t.init.defined() ? dinit.to(initial_state->scalar_type()) : dinit};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_ext, CUDA, m) {
  m.impl("gated_delta_rule_forward", &gated_delta_rule_forward_cuda);
  m.impl("gated_delta_rule_backward", &gated_delta_rule_backward_cuda);
}

}  // namespace megatron_ext
