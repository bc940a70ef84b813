#pragma once
// Argument checks of the gated delta rule ops, shared by the CPU and CUDA kernels and the
// autograd node: shapes, dtypes and devices (meta-safe), and the values of cu_seqlens (read on the
// host), with the chunk layout they give.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <vector>

#include "kernels/llama_fusions_checks.h"

namespace megatron_ext {

// The largest chunk the kernels take: a team's buffers hold several chunk x chunk matrices.
constexpr int64_t kGdrMaxChunk = 256;

// The number of state rows: the batch, or the packed sequences.
inline int64_t gdr_state_rows(const at::Tensor& q, const std::optional<at::Tensor>& cu_seqlens) {
  return has_tensor(cu_seqlens) ? cu_seqlens->size(0) - 1 : q.size(0);
}

inline void check_gdr_rate(const char* op, const char* name, const at::Tensor& t,
                           const at::Tensor& q) {
  check_fusion_dtype(op, name, t);
  TORCH_CHECK_VALUE(
      t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == q.size(1) && t.size(2) == q.size(2),
      op, ": ", name, " must be [", q.size(0), ", ", q.size(1), ", ", q.size(2),
      "] (q's batch, length, heads), got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == q.device(), op, ": ", name, " is on ", t.device(),
                    " but q is on ", q.device());
}

inline void check_gated_delta_rule_args(const char* op, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& g,
                                        const at::Tensor& beta, double scale,
                                        const std::optional<at::Tensor>& initial_state,
                                        const std::optional<at::Tensor>& cu_seqlens,
                                        int64_t chunk_size) {
  check_fusion_dtype(op, "q", q);
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(3) > 0, op,
                    ": q must be [batch, length, heads, key dim] with key dim > 0, got shape ",
                    q.sizes());
  TORCH_CHECK_VALUE(k.sizes() == q.sizes(), op, ": k must have q's shape ", q.sizes(), ", got ",
                    k.sizes());
  check_like(op, "k", k, q, "q");
  TORCH_CHECK_VALUE(v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) &&
                        v.size(2) == q.size(2) && v.size(3) > 0,
                    op, ": v must be [", q.size(0), ", ", q.size(1), ", ", q.size(2),
                    ", value dim] (q's batch, length, heads; value dim > 0), got shape ",
                    v.sizes());
  check_like(op, "v", v, q, "q");
  check_gdr_rate(op, "g", g, q);
  check_gdr_rate(op, "beta", beta, q);
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  TORCH_CHECK_VALUE(chunk_size >= 1 && chunk_size <= kGdrMaxChunk, op,
                    ": chunk_size must be in [1, ", kGdrMaxChunk, "], got ", chunk_size);
  if (has_tensor(cu_seqlens)) {
    const auto dtype = cu_seqlens->scalar_type();
    TORCH_CHECK_VALUE(dtype == at::kInt || dtype == at::kLong, op,
                      ": cu_seqlens must be int32 or int64, got ", dtype);
    TORCH_CHECK_VALUE(cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 2, op,
                      ": cu_seqlens must be [sequences + 1] with at least one sequence, got shape ",
                      cu_seqlens->sizes());
    TORCH_CHECK_VALUE(q.size(0) == 1, op,
                      ": packed sequences (cu_seqlens) take q of batch size 1, got shape ",
                      q.sizes());
    TORCH_CHECK_VALUE(cu_seqlens->device() == q.device(), op, ": cu_seqlens is on ",
                      cu_seqlens->device(), " but q is on ", q.device());
  }
  if (has_tensor(initial_state)) {
    const int64_t rows = gdr_state_rows(q, cu_seqlens);
    TORCH_CHECK_VALUE(initial_state->dim() == 4 && initial_state->size(0) == rows &&
                          initial_state->size(1) == q.size(2) &&
                          initial_state->size(2) == q.size(3) &&
                          initial_state->size(3) == v.size(3),
                      op, ": initial_state must be [", rows, ", ", q.size(2), ", ", q.size(3), ", ",
                      v.size(3), "] (", has_tensor(cu_seqlens) ? "sequences" : "batch",
                      ", heads, key dim, value dim), got shape ", initial_state->sizes());
    check_fusion_dtype(op, "initial_state", *initial_state);
    TORCH_CHECK_VALUE(initial_state->device() == q.device(), op, ": initial_state is on ",
                      initial_state->device(), " but q is on ", q.device());
  }
}

// The chunk slots of a row of chunk_states: ceil(T / chunk) + sequences - 1 bounds the chunks of
// any packing of T tokens into that many sequences, so that the shape follows from the shapes of
// the arguments alone (slots past the last chunk are left unwritten).
inline int64_t gdr_chunk_slots(int64_t length, int64_t chunk_size, int64_t segments) {
  return (length + chunk_size - 1) / chunk_size + segments - 1;
}

// The segments of every row and their chunks: cu_seqlens as int64 offsets read on the host and
// checked (0 first, q's length last, nondecreasing; equal neighbours are empty sequences), or one
// segment [0, T); the index of each segment's first chunk and the chunk slots of a row.
struct GdrLayout {
  std::vector<int64_t> start, end, chunk_base;
  int64_t chunks = 0;
};

inline GdrLayout gdr_layout(const char* op, const std::optional<at::Tensor>& cu_seqlens,
                            int64_t length, int64_t chunk_size) {
  GdrLayout l;
  std::vector<int64_t> offsets{0, length};
  if (has_tensor(cu_seqlens)) {
    const auto host = cu_seqlens->to(at::kCPU).to(at::kLong).contiguous();
    const int64_t* p = host.const_data_ptr<int64_t>();
    offsets.assign(p, p + host.numel());
    TORCH_CHECK_VALUE(offsets.front() == 0, op, ": cu_seqlens must start at 0, got ",
                      offsets.front());
    TORCH_CHECK_VALUE(offsets.back() == length, op, ": cu_seqlens must end at q's length ", length,
                      " (dim 1), got ", offsets.back());
    for (size_t s = 1; s < offsets.size(); ++s) {
      TORCH_CHECK_VALUE(offsets[s] >= offsets[s - 1], op,
                        ": cu_seqlens must be nondecreasing, got ", offsets[s - 1], " then ",
                        offsets[s], " at index ", s);
    }
  }
  for (size_t s = 0; s + 1 < offsets.size(); ++s) {
    l.start.push_back(offsets[s]);
    l.end.push_back(offsets[s + 1]);
    l.chunk_base.push_back(l.chunks);
    l.chunks += (offsets[s + 1] - offsets[s] + chunk_size - 1) / chunk_size;
  }
  l.chunks = gdr_chunk_slots(length, chunk_size, static_cast<int64_t>(l.start.size()));
  return l;
}

inline void check_gated_delta_rule_backward_args(const at::Tensor& grad_output,
                                                 const std::optional<at::Tensor>& grad_final,
                                                 const at::Tensor& q, const at::Tensor& v,
                                                 const at::Tensor& chunk_states, int64_t rows,
                                                 int64_t chunks) {
  const char* op = "gated_delta_rule_backward";
  TORCH_CHECK_VALUE(grad_output.sizes() == v.sizes(), op, ": grad_output has shape ",
                    grad_output.sizes(), " but v has shape ", v.sizes());
  check_like(op, "grad_output", grad_output, q, "q");
  const auto acc = fusion_acc_type(q.scalar_type());
  if (has_tensor(grad_final)) {
    TORCH_CHECK_VALUE(grad_final->dim() == 4 && grad_final->size(0) == rows &&
                          grad_final->size(1) == q.size(2) && grad_final->size(2) == q.size(3) &&
                          grad_final->size(3) == v.size(3),
                      op, ": grad_final_state must be [", rows, ", ", q.size(2), ", ", q.size(3),
                      ", ", v.size(3), "], got shape ", grad_final->sizes());
    TORCH_CHECK_VALUE(grad_final->device() == q.device(), op, ": grad_final_state is on ",
                      grad_final->device(), " but q is on ", q.device());
  }
  TORCH_CHECK_VALUE(chunk_states.dim() == 5 && chunk_states.size(0) == q.size(0) &&
                        chunk_states.size(1) == q.size(2) && chunk_states.size(2) == chunks &&
                        chunk_states.size(3) == q.size(3) && chunk_states.size(4) == v.size(3),
                    op, ": chunk_states must be [", q.size(0), ", ", q.size(2), ", ", chunks, ", ",
                    q.size(3), ", ", v.size(3), "], got shape ", chunk_states.sizes());
  TORCH_CHECK_VALUE(chunk_states.scalar_type() == acc && chunk_states.device() == q.device(), op,
                    ": chunk_states must be ", acc, " on ", q.device(), ", got ",
                    chunk_states.scalar_type(), " on ", chunk_states.device());
}

}  // namespace megatron_ext
