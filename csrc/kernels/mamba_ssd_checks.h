#pragma once
// Argument checks of the Mamba-2 SSD scan ops, shared by the CPU and CUDA kernels and the autograd
// node (shapes, dtypes, devices: meta-safe), and the segments of the rows (cu_seqlens read on the
// host).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/causal_conv1d_checks.h"
#include "kernels/llama_fusions_checks.h"
#include "kernels/mamba_ssd.h"

namespace megatron_ext {

// The rows of initial and final states: the batch, or the packed sequences.
inline int64_t ssd_state_rows(const at::Tensor& x, const std::optional<at::Tensor>& cu_seqlens) {
  return has_tensor(cu_seqlens) ? cu_seqlens->size(0) - 1 : x.size(0);
}

inline void check_ssd_float(const char* op, const char* name, const at::Tensor& t,
                            const at::Tensor& x) {
  check_fusion_dtype(op, name, t);
  TORCH_CHECK_VALUE(t.device() == x.device(), op, ": ", name, " is on ", t.device(),
                    " but x is on ", x.device());
}

inline void check_mamba_chunk_scan_args(
    const char* op, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
    const at::Tensor& B, const at::Tensor& C, int64_t chunk_size,
    const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
    const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& initial_states,
    const std::optional<at::Tensor>& cu_seqlens, double dt_min, std::optional<double> dt_max) {
  check_fusion_dtype(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() == 4, op, ": x must be [batch, length, heads, headdim], got shape ",
                    x.sizes());
  const int64_t batch = x.size(0), length = x.size(1), heads = x.size(2), headdim = x.size(3);
  TORCH_CHECK_VALUE(chunk_size >= 1, op, ": chunk_size must be >= 1, got ", chunk_size);
  check_ssd_float(op, "dt", dt, x);
  TORCH_CHECK_VALUE(
      dt.dim() == 3 && dt.size(0) == batch && dt.size(1) == length && dt.size(2) == heads, op,
      ": dt must be [", batch, ", ", length, ", ", heads,
      "] (x's batch, length, heads), got shape ", dt.sizes());
  check_ssd_float(op, "A", A, x);
  TORCH_CHECK_VALUE(A.dim() == 1 && A.size(0) == heads, op, ": A must be [", heads,
                    "] (x's heads), got shape ", A.sizes());
  TORCH_CHECK_VALUE(B.dim() == 4 && B.size(0) == batch && B.size(1) == length, op, ": B must be [",
                    batch, ", ", length, ", groups, dstate] (x's batch and length), got shape ",
                    B.sizes());
  const int64_t groups = B.size(2), dstate = B.size(3);
  TORCH_CHECK_VALUE(groups >= 1 && heads % groups == 0, op, ": the heads (", heads,
                    ") must be a multiple of the groups of B (", groups, ")");
  check_like(op, "B", B, x, "x");
  TORCH_CHECK_VALUE(C.sizes() == B.sizes(), op, ": C must have B's shape ", B.sizes(), ", got ",
                    C.sizes());
  check_like(op, "C", C, x, "x");
  if (has_tensor(D)) {
    check_ssd_float(op, "D", *D, x);
    const bool per_head = D->dim() == 1 && D->size(0) == heads;
    const bool per_channel = D->dim() == 2 && D->size(0) == heads && D->size(1) == headdim;
    TORCH_CHECK_VALUE(per_head || per_channel, op, ": D must be [", heads, "] or [", heads, ", ",
                      headdim, "] (x's heads, headdim), got shape ", D->sizes());
  }
  if (has_tensor(z)) {
    TORCH_CHECK_VALUE(z->sizes() == x.sizes(), op, ": z must have x's shape ", x.sizes(), ", got ",
                      z->sizes());
    check_like(op, "z", *z, x, "x");
  }
  if (has_tensor(dt_bias)) {
    check_ssd_float(op, "dt_bias", *dt_bias, x);
    TORCH_CHECK_VALUE(dt_bias->dim() == 1 && dt_bias->size(0) == heads, op, ": dt_bias must be [",
                      heads, "] (x's heads), got shape ", dt_bias->sizes());
  }
  if (has_tensor(cu_seqlens)) {
    const auto dtype = cu_seqlens->scalar_type();
    TORCH_CHECK_VALUE(dtype == at::kInt || dtype == at::kLong, op,
                      ": cu_seqlens must be int32 or int64, got ", dtype);
    TORCH_CHECK_VALUE(cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 2, op,
                      ": cu_seqlens must be [sequences + 1] with at least one sequence, got shape ",
                      cu_seqlens->sizes());
    TORCH_CHECK_VALUE(batch == 1, op,
                      ": packed sequences (cu_seqlens) take x of batch size 1, got shape ",
                      x.sizes());
    TORCH_CHECK_VALUE(cu_seqlens->device() == x.device(), op, ": cu_seqlens is on ",
                      cu_seqlens->device(), " but x is on ", x.device());
  }
  if (has_tensor(initial_states)) {
    check_ssd_float(op, "initial_states", *initial_states, x);
    const int64_t rows = ssd_state_rows(x, cu_seqlens);
    TORCH_CHECK_VALUE(initial_states->dim() == 4 && initial_states->size(0) == rows &&
                          initial_states->size(1) == heads && initial_states->size(2) == headdim &&
                          initial_states->size(3) == dstate,
                      op, ": initial_states must be [", rows, ", ", heads, ", ", headdim, ", ",
                      dstate, "] (", has_tensor(cu_seqlens) ? "sequences" : "batch",
                      ", heads, headdim, dstate), got shape ", initial_states->sizes());
  }
  const double hi = dt_max.value_or(INFINITY);
  TORCH_CHECK_VALUE(dt_min <= hi, op, ": dt_min (", dt_min, ") must be <= dt_max (", hi, ")");
}

inline void check_mamba_chunk_scan_backward_args(const char* op, const at::Tensor& grad_y,
                                                 const std::optional<at::Tensor>& grad_final,
                                                 const at::Tensor& x, int64_t state_rows,
                                                 int64_t total_chunks, int64_t dstate,
                                                 const at::Tensor& chunk_states) {
  TORCH_CHECK_VALUE(grad_y.sizes() == x.sizes(), op, ": grad_y has shape ", grad_y.sizes(),
                    " but x has shape ", x.sizes());
  check_like(op, "grad_y", grad_y, x, "x");
  const std::vector<int64_t> state_shape{state_rows, x.size(2), x.size(3), dstate};
  if (has_tensor(grad_final)) {
    check_ssd_float(op, "grad_final_states", *grad_final, x);
    TORCH_CHECK_VALUE(grad_final->sizes() == at::IntArrayRef(state_shape), op,
                      ": grad_final_states must be ", at::IntArrayRef(state_shape), ", got ",
                      grad_final->sizes());
  }
  check_ssd_float(op, "chunk_states", chunk_states, x);
  const std::vector<int64_t> chunk_shape{total_chunks, x.size(2), x.size(3), dstate};
  TORCH_CHECK_VALUE(chunk_states.sizes() == at::IntArrayRef(chunk_shape), op,
                    ": chunk_states must be ", at::IntArrayRef(chunk_shape),
                    " (the forward's), got ", chunk_states.sizes());
}

// The segments of the scan and the number of chunks they hold: the batch rows, or the packed
// sequences of cu_seqlens (offsets checked: 0 first, the length last, nondecreasing).
inline std::vector<kernels::SsdSegment> ssd_segments(const char* op, const at::Tensor& x,
                                                     const std::optional<at::Tensor>& cu_seqlens,
                                                     int64_t chunk_size, int64_t* total_chunks) {
  std::vector<kernels::SsdSegment> segments;
  int64_t chunks = 0;
  const int64_t length = x.size(1);
  if (has_tensor(cu_seqlens)) {
    const auto offsets = conv_offsets(op, *cu_seqlens, length);
    for (size_t s = 0; s + 1 < offsets.size(); ++s) {
      segments.push_back({0, offsets[s], offsets[s + 1], static_cast<int64_t>(s), chunks});
      chunks += kernels::ssd_chunks(offsets[s + 1] - offsets[s], chunk_size);
    }
  } else {
    for (int64_t b = 0; b < x.size(0); ++b) {
      segments.push_back({b, 0, length, b, chunks});
      chunks += kernels::ssd_chunks(length, chunk_size);
    }
  }
  *total_chunks = chunks;
  return segments;
}

// The backward op's results: the gradients of x, dt, A, B, C, D, z, dt_bias and the initial states.
using SsdGradients = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The gradient of an optional input in its dtype (a copy: the op's outputs never alias), or an
// empty tensor of x's dtype without it.
inline at::Tensor ssd_grad_or_empty(const std::optional<at::Tensor>& t, const at::Tensor& grad,
                                    const at::Tensor& x) {
  return has_tensor(t) ? grad.to(t->scalar_type(), false, true) : at::empty({0}, x.options());
}

// The backward op's results from the kernels' (CPU and CUDA alike): gBh, gCh [B, L, H, N] per
// head, summed here over the heads of each group; part [segments, H, P + 2] per (segment, head)
// task (dA, d(dt_bias), dD per channel), summed over the segments in order; ginit in the
// accumulation dtype; gdt in dt's dtype or the accumulation dtype.
inline SsdGradients ssd_gradients(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& gx,
                                  const at::Tensor& gdt, const at::Tensor& gz, const at::Tensor& A,
                                  const at::Tensor& B, const at::Tensor& C,
                                  const std::optional<at::Tensor>& D,
                                  const std::optional<at::Tensor>& dt_bias,
                                  const std::optional<at::Tensor>& initial_states,
                                  const at::Tensor& gBh, const at::Tensor& gCh,
                                  const at::Tensor& ginit, const at::Tensor& part) {
  const int64_t H = x.size(2), P = x.size(3), G = B.size(2), N = B.size(3);
  const auto sums = part.sum(0);
  auto reduce_heads = [&](const at::Tensor& per_head, const at::Tensor& like) {
    const auto grouped =
        H == G ? per_head : per_head.view({x.size(0), x.size(1), G, H / G, N}).sum(3);
    return grouped.to(like.scalar_type());
  };
  at::Tensor gD;
  if (has_tensor(D)) {
    const auto per_channel = sums.narrow(1, 2, P);
    gD = (D->dim() == 2 ? per_channel : per_channel.sum(1)).to(D->scalar_type(), false, true);
  } else {
    gD = at::empty({0}, x.options());
  }
  return {gx,
          gdt.to(dt.scalar_type()),
          sums.select(1, 0).to(A.scalar_type(), false, true),
          reduce_heads(gBh, B),
          reduce_heads(gCh, C),
          gD,
          gz,
          ssd_grad_or_empty(dt_bias, sums.select(1, 1), x),
          ssd_grad_or_empty(initial_states, ginit, x)};
}

}  // namespace megatron_ext
