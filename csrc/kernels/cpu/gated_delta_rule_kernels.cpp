// CPU loops of the gated delta rule. This file is compiled as is (baseline instruction set,
// namespace DEFAULT) and again by setup.py with CPU_CAPABILITY=AVX2 and AVX512 and the matching -m
// flags, as ATen compiles its kernels: the header's chunk functions run on one thread each, their
// inner loops (rows of the chunk's products) vectorised by the compiler for that instruction set.
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif

#include <vector>

#include "kernels/cpu/gated_delta_rule_kernels.h"
#include "kernels/cpu/vec_convert.h"
#include "kernels/gated_delta_rule.h"

namespace megatron_ext::kernels::CPU_CAPABILITY {
namespace {

template <typename scalar_t>
GdrArgs<scalar_t, acc_type<scalar_t>> args_of(const GdrProblem& p) {
  using acc_t = acc_type<scalar_t>;
  return {static_cast<const scalar_t*>(p.q),
          static_cast<const scalar_t*>(p.k),
          static_cast<const scalar_t*>(p.v),
          static_cast<const acc_t*>(p.g),
          static_cast<const acc_t*>(p.beta),
          static_cast<const acc_t*>(p.init),
          p.seg_start,
          p.seg_end,
          p.chunk_base,
          p.segments,
          p.packed,
          p.batch,
          p.length,
          p.heads,
          p.dk,
          p.dv,
          p.chunk,
          p.chunks,
          p.l2norm,
          static_cast<acc_t>(p.scale)};
}

// Task (b, s, h) of index t.
struct Task {
  int64_t b, s, h;
};

Task task_of(const GdrProblem& p, int64_t t) {
  return {t / (p.segments * p.heads), (t / p.heads) % p.segments, t % p.heads};
}

template <typename scalar_t>
void forward_tasks(const GdrProblem& p, int64_t begin, int64_t end, void* out, void* final_state,
                   void* chunk_states) {
  using acc_t = acc_type<scalar_t>;
  const auto a = args_of<scalar_t>(p);
  std::vector<acc_t> buffer(gdr_work_size(p.chunk, p.dk, p.dv));
  const auto w = gdr_work_at(buffer.data(), p.chunk, p.dk, p.dv);
  const GdrSerialTeam team;
  for (int64_t t = begin; t < end; ++t) {
    const Task k = task_of(p, t);
    gdr_forward_segment(team, a, w, k.b, k.s, k.h, static_cast<scalar_t*>(out),
                        static_cast<acc_t*>(final_state), static_cast<acc_t*>(chunk_states));
  }
}

template <typename scalar_t>
void backward_tasks(const GdrProblem& p, const void* grad_out, const void* grad_final,
                    const void* chunk_states, int64_t begin, int64_t end, void* dq, void* dk,
                    void* dv, void* dg, void* dbeta, void* dinit) {
  using acc_t = acc_type<scalar_t>;
  const auto a = args_of<scalar_t>(p);
  std::vector<acc_t> buffer(gdr_work_size(p.chunk, p.dk, p.dv));
  const auto w = gdr_work_at(buffer.data(), p.chunk, p.dk, p.dv);
  const GdrSerialTeam team;
  const GdrGrads<scalar_t, acc_t> gr{static_cast<const scalar_t*>(grad_out),
                                     static_cast<scalar_t*>(dq),
                                     static_cast<scalar_t*>(dk),
                                     static_cast<scalar_t*>(dv),
                                     static_cast<acc_t*>(dg),
                                     static_cast<acc_t*>(dbeta)};
  for (int64_t t = begin; t < end; ++t) {
    const Task k = task_of(p, t);
    gdr_backward_segment(team, a, w, gr, k.b, k.s, k.h, static_cast<const acc_t*>(grad_final),
                         static_cast<const acc_t*>(chunk_states), static_cast<acc_t*>(dinit));
  }
}

void forward(FusionDtype dtype, const GdrProblem& p, int64_t begin, int64_t end, void* out,
             void* final_state, void* chunk_states) {
  MEGATRON_EXT_FUSION_DISPATCH(dtype, forward_tasks, p, begin, end, out, final_state, chunk_states)
}

void backward(FusionDtype dtype, const GdrProblem& p, const void* grad_out, const void* grad_final,
              const void* chunk_states, int64_t begin, int64_t end, void* dq, void* dk, void* dv,
              void* dg, void* dbeta, void* dinit) {
  MEGATRON_EXT_FUSION_DISPATCH(dtype, backward_tasks, p, grad_out, grad_final, chunk_states, begin,
                               end, dq, dk, dv, dg, dbeta, dinit)
}

}  // namespace

const GatedDeltaRuleCpuKernels gated_delta_rule_cpu_kernels{&forward, &backward};

}  // namespace megatron_ext::kernels::CPU_CAPABILITY
