#pragma once
// The one block kernel of the attention op family: softmax(q kᵀ · scale, the block's mask) v over
// the rectangles ``attention_plan.h`` makes, through SDPA's kernels that return the log-sum-exp,
// and the log-sum-exp merge of the blocks' partial outputs.
//
// Layout: queries [b, heads, sq, d], keys [b, groups, sk, d], values [b, groups, sk, dv]
// (``heads / groups`` consecutive query heads share a key/value head), outputs [b, heads, sq, dv].
//
// Kernels: on CPUs the flash kernel (``_scaled_dot_product_flash_attention_for_cpu``; a band
// block passes a block-sized additive mask). On CUDA the flash kernel for 16-bit inputs
// (``_flash_attention_forward``, whose bottom-right-aligned window expresses every tight block;
// blocks that share a window go in one variable-length call when b is 1, the packed rows' case),
// the memory-efficient kernel for float32 (a band block passes a block-sized bias), and the
// block's scores for float64, which neither kernel takes. The flash kernels need equal query and
// value head dims (CUDA's also a multiple of 8): they get both padded with zeros, which changes no
// score (the scale is passed) and adds zero columns to the output, sliced off.
#include <ATen/core/Tensor.h>

#include <vector>

#include "ops/attention_plan.h"

namespace megatron_ext::attention {

// float64 for float64 inputs, else float32: the merge's and the gradients' accumulation.
at::ScalarType acc_type(const at::Tensor& t);

// The running output [b, heads, s, dv] and log-sum-exp [b, heads, s] (acc_type) of query rows,
// every row starting with no keys (output 0, log-sum-exp −inf). A first block over every row is
// taken as it is (no zeros to merge into: one block is the whole attention at cp 1).
class Accumulator {
 public:
  Accumulator(const at::Tensor& q, int64_t dv);
  // Adds a block's partial output [b, heads, len, dv] and log-sum-exp of rows [row, row + len).
  void merge(const at::Tensor& out, const at::Tensor& lse, int64_t row, int64_t len);
  const at::Tensor& out();
  const at::Tensor& lse();

 private:
  void allocate();
  at::TensorOptions options_;
  std::vector<int64_t> shape_;
  at::Tensor out_, lse_;
};

// Every block's partial result merged into ``acc``.
void forward_blocks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::vector<Block>& blocks, double scale, Accumulator& acc);

// Every block's gradients, given the merged output and log-sum-exp of the query rows, added into
// ``dq`` [b, heads, sq, d], ``dk`` [b, groups, sk, d] and ``dv`` [b, groups, sk, dv] (acc_type;
// an undefined one is made here: a block's gradient over all its rows as it is, else zeros).
void backward_blocks(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                     const std::vector<Block>& blocks, double scale, at::Tensor& dq, at::Tensor& dk,
                     at::Tensor& dv);

// Attention sinks: one more logit per head in every row's softmax, whose value is zero, so it only
// rescales: out · exp(lse − logaddexp(lse, sink)). ``sinks`` [heads] are the heads of ``acc``.
void apply_sinks(Accumulator& acc, const at::Tensor& sinks);

// The sinks' gradient [heads] (their dtype) over the rows given: −Σ exp(sink − lse) ⟨dout, out⟩,
// with the output and log-sum-exp the sinks were applied to.
at::Tensor sink_grad(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                     const at::Tensor& sinks);

}  // namespace megatron_ext::attention
