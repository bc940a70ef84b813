#include "ops/attention_blocks.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/_flash_attention_backward.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/logaddexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

namespace megatron_ext::attention {

at::ScalarType acc_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

enum class Kernel { kCpuFlash, kCudaFlash, kCudaEfficient, kScores };

Kernel kernel_for(const at::Tensor& q) {
  if (q.is_cpu()) return Kernel::kCpuFlash;
  if (q.is_cuda() && (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16)) {
    return Kernel::kCudaFlash;
  }
  if (q.is_cuda() && q.scalar_type() == at::kFloat) return Kernel::kCudaEfficient;
  return Kernel::kScores;
}

// The head dim a flash kernel computes with (query and value padded to it); 0: no padding.
int64_t padded_dim(Kernel kernel, int64_t d, int64_t dv) {
  if (kernel == Kernel::kCpuFlash) return std::max(d, dv);
  if (kernel == Kernel::kCudaFlash) return (std::max(d, dv) + 7) / 8 * 8;
  return 0;
}

at::Tensor pad_last(const at::Tensor& t, int64_t to) {
  if (to == 0 || t.size(-1) == to) return t;
  return at::constant_pad_nd(t, {0, to - t.size(-1)}, 0.0);
}

// The key/value heads repeated for their query heads (the kernels but CUDA's flash take equal
// head counts), and a gradient over the repeated heads summed back to the groups.
at::Tensor expand_groups(const at::Tensor& kv, int64_t heads) {
  if (kv.size(1) == heads) return kv;
  return kv.repeat_interleave(heads / kv.size(1), 1);
}

at::Tensor reduce_groups(const at::Tensor& grad, int64_t groups) {
  const int64_t heads = grad.size(1);
  if (groups == heads) return grad;
  auto sizes = grad.sizes().vec();
  sizes[1] = groups;
  sizes.insert(sizes.begin() + 2, heads / groups);
  return grad.reshape(sizes).sum(2);
}

// A band block's mask [q_len, k_len] (0 where a row sees the key, −inf elsewhere), made once per
// shape and band in a call. The memory-efficient kernel reads its bias rows at 16-element
// alignment, so there each row is padded to it (the pad is never read).
class Masks {
 public:
  Masks(at::TensorOptions options, bool aligned) : options_(options), aligned_(aligned) {}

  const at::Tensor& get(const Block& b) {
    auto& mask = cache_[{b.q_len, b.k_len, b.lo, b.hi}];
    if (mask.defined()) return mask;
    const auto index = options_.dtype(at::kLong);
    const auto offset =
        at::arange(b.k_len, index).unsqueeze(0) - at::arange(b.q_len, index).unsqueeze(1);
    const auto hidden = (offset < b.lo).logical_or_(offset > b.hi);
    const int64_t width = aligned_ ? (b.k_len + 15) / 16 * 16 : b.k_len;
    mask = at::zeros({b.q_len, width}, options_).narrow(1, 0, b.k_len);
    mask.masked_fill_(hidden, -kInf);
    return mask;
  }

 private:
  at::TensorOptions options_;
  bool aligned_;
  std::map<std::array<int64_t, 4>, at::Tensor> cache_;
};

// CUDA flash's window for a block: the keys row i sees lie within [left, right] of the
// bottom-right-aligned diagonal j = i + k_len − q_len (−1: unbounded). Tight blocks always fit.
std::pair<int64_t, int64_t> flash_window(const Block& b) {
  const int64_t shift = b.k_len - b.q_len;
  if (b.mask == Mask::kNone) return {-1, -1};
  const int64_t left = b.lo <= -(b.q_len - 1) ? -1 : shift - b.lo;
  const int64_t right = b.hi >= b.k_len - 1 ? -1 : b.hi - shift;
  TORCH_INTERNAL_ASSERT(left >= -1 && right >= -1, "attention block is not tight");
  return {left, right};
}

// One call's operands as its kernel takes them: CUDA flash [b, s, heads or groups, P] (its own
// layout, groups as they are), the others [b, heads, s, P or d] with the groups repeated.
struct Operands {
  Kernel kernel;
  int64_t seq_dim, d, dv, pad, groups;
  double scale;
  at::Tensor q, k, v;
  Masks masks;

  Operands(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double s)
      : kernel(kernel_for(query)),
        seq_dim(kernel == Kernel::kCudaFlash ? 1 : 2),
        d(query.size(3)),
        dv(value.size(3)),
        pad(padded_dim(kernel, d, dv)),
        groups(key.size(1)),
        scale(s),
        masks(query.options().dtype(kernel == Kernel::kScores ? acc_type(query)
                                                              : query.scalar_type()),
              kernel == Kernel::kCudaEfficient) {
    q = layout(pad_last(query, pad));
    k = layout(pad_last(expand(key, query.size(1)), pad));
    v = layout(pad_last(expand(value, query.size(1)), pad));
  }

  at::Tensor expand(const at::Tensor& kv, int64_t heads) const {
    return kernel == Kernel::kCudaFlash ? kv : expand_groups(kv, heads);
  }
  // A tensor of query rows ([b, heads, s, ·]) in the kernel's layout.
  at::Tensor layout(const at::Tensor& t) const {
    return kernel == Kernel::kCudaFlash ? t.transpose(1, 2) : t;
  }
  at::Tensor rows(const at::Tensor& t, int64_t start, int64_t len) const {
    return t.narrow(seq_dim, start, len);
  }
  // A kernel's result for query rows back as [b, heads, len, width].
  at::Tensor standard(const at::Tensor& t, int64_t width) const {
    const auto x = kernel == Kernel::kCudaFlash ? t.transpose(1, 2) : t;
    return x.size(3) == width ? x : x.narrow(3, 0, width);
  }
  // A kernel's key/value gradient back as [b, groups, len, width].
  at::Tensor standard_kv(const at::Tensor& t, int64_t width) const {
    const auto x = kernel == Kernel::kCudaFlash ? t.transpose(1, 2) : reduce_groups(t, groups);
    return x.size(3) == width ? x : x.narrow(3, 0, width);
  }
};

at::Tensor scores_of(Operands& op, const at::Tensor& q, const at::Tensor& k, const Block& b) {
  auto scores = (at::matmul(q, k.transpose(-1, -2)) * op.scale).to(acc_type(q));
  if (b.mask != Mask::kNone) scores.add_(op.masks.get(b));
  return scores;
}

std::pair<at::Tensor, at::Tensor> forward_one(Operands& op, const Block& b) {
  const auto q = op.rows(op.q, b.q_row, b.q_len);
  const auto k = op.rows(op.k, b.k_row, b.k_len);
  const auto v = op.rows(op.v, b.k_row, b.k_len);
  switch (op.kernel) {
    case Kernel::kCpuFlash: {
      std::optional<at::Tensor> mask;
      if (b.mask == Mask::kBand) mask = op.masks.get(b);
      auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
          q, k, v, 0.0, b.mask == Mask::kCausal, mask, op.scale);
      return {op.standard(out, op.dv), lse.to(acc_type(q))};
    }
    case Kernel::kCudaFlash: {
      const auto [left, right] = flash_window(b);
      auto result =
          at::_flash_attention_forward(q, k, v, std::nullopt, std::nullopt, b.q_len, b.k_len, 0.0,
                                       false, false, std::optional<double>(op.scale), left, right);
      return {op.standard(std::get<0>(result), op.dv), std::get<1>(result)};
    }
    case Kernel::kCudaEfficient: {
      std::optional<at::Tensor> bias;
      if (b.mask == Mask::kBand) bias = op.masks.get(b).expand({q.size(0), q.size(1), -1, -1});
      auto result = at::_scaled_dot_product_efficient_attention(q, k, v, bias, true, 0.0,
                                                                b.mask == Mask::kCausal, op.scale);
      // The kernel pads the log-sum-exp's last dim to a multiple of 32.
      return {std::get<0>(result), std::get<1>(result).narrow(2, 0, b.q_len)};
    }
    case Kernel::kScores:
      break;
  }
  const auto scores = scores_of(op, q, k, b);
  auto lse = scores.logsumexp(-1);
  auto out = at::matmul((scores - lse.unsqueeze(-1)).exp().to(q.scalar_type()), v);
  return {out, lse};
}

// The gradients of one block: dq [b, heads, len, d], dk [b, groups, len, d], dv [b, groups, len,
// dv]. ``dout`` and ``out`` are in the kernel's layout, ``lse`` [b, heads, s].
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_one(Operands& op, const at::Tensor& dout,
                                                            const at::Tensor& out,
                                                            const at::Tensor& lse, const Block& b) {
  const auto q = op.rows(op.q, b.q_row, b.q_len);
  const auto k = op.rows(op.k, b.k_row, b.k_len);
  const auto v = op.rows(op.v, b.k_row, b.k_len);
  const auto g = op.rows(dout, b.q_row, b.q_len).contiguous();
  const auto o = op.rows(out, b.q_row, b.q_len).contiguous();
  const auto l = lse.narrow(2, b.q_row, b.q_len);
  at::Tensor dq, dk, dv;
  switch (op.kernel) {
    case Kernel::kCpuFlash: {
      std::optional<at::Tensor> mask;
      if (b.mask == Mask::kBand) mask = op.masks.get(b);
      std::tie(dq, dk, dv) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          g, q, k, v, o, l.contiguous(), 0.0, b.mask == Mask::kCausal, mask, op.scale);
      break;
    }
    case Kernel::kCudaFlash: {
      const auto [left, right] = flash_window(b);
      const auto rng = at::empty({2}, q.options().dtype(at::kUInt64));
      const auto unused = at::empty({}, q.options().dtype(at::kUInt64));
      std::tie(dq, dk, dv) = at::_flash_attention_backward(
          g, q, k, v, o, l.to(at::kFloat).contiguous(), at::Tensor(), at::Tensor(), b.q_len,
          b.k_len, 0.0, false, rng, unused, std::optional<double>(op.scale), left, right);
      break;
    }
    case Kernel::kCudaEfficient: {
      at::Tensor bias;
      if (b.mask == Mask::kBand) bias = op.masks.get(b).expand({q.size(0), q.size(1), -1, -1});
      const int64_t padded = (b.q_len + 31) / 32 * 32;
      const auto lse_padded = at::constant_pad_nd(l, {0, padded - b.q_len}, 0.0).contiguous();
      const auto none = at::empty({0}, q.options().dtype(at::kLong));
      std::tie(dq, dk, dv, std::ignore) = at::_scaled_dot_product_efficient_attention_backward(
          g, q, k, v, bias, o, lse_padded, none, none, 0.0, {true, true, true, false},
          b.mask == Mask::kCausal, op.scale);
      break;
    }
    case Kernel::kScores: {
      const auto probs = (scores_of(op, q, k, b) - l.unsqueeze(-1)).exp().to(q.scalar_type());
      const auto delta = (g * o).sum(-1, true);
      const auto dscores = probs * (at::matmul(g, v.transpose(-1, -2)) - delta) * op.scale;
      dq = at::matmul(dscores, k);
      dk = at::matmul(dscores.transpose(-1, -2), q);
      dv = at::matmul(probs.transpose(-1, -2), g);
      break;
    }
  }
  return {op.standard(dq, op.d), op.standard_kv(dk, op.d), op.standard_kv(dv, op.dv)};
}

// CUDA flash blocks of b = 1 that share a window, in one variable-length call: their query rows
// and key rows gathered one after another (a view when they already are).
struct Varlen {
  std::vector<int32_t> cu_q{0}, cu_k{0};
  int64_t max_q = 0, max_k = 0;

  explicit Varlen(const std::vector<Block>& group) {
    for (const Block& b : group) {
      cu_q.push_back(cu_q.back() + static_cast<int32_t>(b.q_len));
      cu_k.push_back(cu_k.back() + static_cast<int32_t>(b.k_len));
      max_q = std::max(max_q, b.q_len);
      max_k = std::max(max_k, b.k_len);
    }
  }

  // [total, heads, ·] rows of a [1, s, heads, ·] tensor; keys: the blocks' key rows.
  static at::Tensor gather(const at::Tensor& t, const std::vector<Block>& group, bool keys) {
    const auto x = t.select(0, 0);
    std::vector<at::Tensor> parts;
    int64_t next = -1;
    bool adjacent = true;
    for (const Block& b : group) {
      const int64_t row = keys ? b.k_row : b.q_row, len = keys ? b.k_len : b.q_len;
      adjacent = adjacent && (next < 0 || row == next);
      next = row + len;
      parts.push_back(x.narrow(0, row, len));
    }
    if (adjacent) {
      const int64_t first = keys ? group.front().k_row : group.front().q_row;
      return x.narrow(0, first, next - first);
    }
    return at::cat(parts, 0);
  }

  at::Tensor cu(const std::vector<int32_t>& values, const at::Tensor& like) const {
    return at::tensor(values, at::TensorOptions().dtype(at::kInt)).to(like.device());
  }
};

// Blocks in runs of one CUDA flash window (in plan order), each run of two or more one call.
std::vector<std::vector<Block>> varlen_groups(const Operands& op,
                                              const std::vector<Block>& blocks) {
  std::map<std::pair<int64_t, int64_t>, std::vector<Block>> by_window;
  std::vector<std::vector<Block>> groups;
  if (op.kernel != Kernel::kCudaFlash || op.q.size(0) != 1) {
    for (const Block& b : blocks) groups.push_back({b});
    return groups;
  }
  for (const Block& b : blocks) by_window[flash_window(b)].push_back(b);
  for (auto& [window, group] : by_window) groups.push_back(std::move(group));
  return groups;
}

}  // namespace

Accumulator::Accumulator(const at::Tensor& q, int64_t dv)
    : options_(q.options().dtype(acc_type(q))), shape_{q.size(0), q.size(1), q.size(2), dv} {}

void Accumulator::allocate() {
  if (out_.defined()) return;
  out_ = at::zeros(shape_, options_);
  lse_ = at::full({shape_[0], shape_[1], shape_[2]}, -kInf, options_);
}

const at::Tensor& Accumulator::out() {
  allocate();
  return out_;
}

const at::Tensor& Accumulator::lse() {
  allocate();
  return lse_;
}

void Accumulator::merge(const at::Tensor& block_out, const at::Tensor& block_lse, int64_t row,
                        int64_t len) {
  if (!out_.defined() && row == 0 && len == shape_[2]) {
    out_ = block_out.to(options_.dtype());
    lse_ = block_lse.to(options_.dtype());
    return;
  }
  allocate();
  auto o = out_.narrow(2, row, len);
  auto l = lse_.narrow(2, row, len);
  const auto merged = at::logaddexp(l, block_lse);
  o.mul_((l - merged).exp().unsqueeze(-1));
  auto part = block_out.to(out_.scalar_type());
  part.mul_((block_lse - merged).exp().unsqueeze(-1));
  o.add_(part);
  l.copy_(merged);
}

void forward_blocks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::vector<Block>& blocks, double scale, Accumulator& acc) {
  if (blocks.empty()) return;
  Operands op(q, k, v, scale);
  for (const auto& group : varlen_groups(op, blocks)) {
    if (group.size() == 1) {
      const Block& b = group.front();
      auto [out, lse] = forward_one(op, b);
      acc.merge(out, lse, b.q_row, b.q_len);
      continue;
    }
    const Varlen varlen(group);
    const auto [left, right] = flash_window(group.front());
    auto result = at::_flash_attention_forward(
        Varlen::gather(op.q, group, false), Varlen::gather(op.k, group, true),
        Varlen::gather(op.v, group, true), varlen.cu(varlen.cu_q, q), varlen.cu(varlen.cu_k, q),
        varlen.max_q, varlen.max_k, 0.0, false, false, std::optional<double>(scale), left, right);
    const auto& out = std::get<0>(result);  // [total, heads, P]
    const auto& lse = std::get<1>(result);  // [heads, total]
    for (size_t i = 0; i < group.size(); ++i) {
      const Block& b = group[i];
      const auto rows = out.narrow(0, varlen.cu_q[i], b.q_len).transpose(0, 1).unsqueeze(0);
      acc.merge(rows.narrow(3, 0, op.dv), lse.narrow(1, varlen.cu_q[i], b.q_len).unsqueeze(0),
                b.q_row, b.q_len);
    }
  }
}

void backward_blocks(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                     const std::vector<Block>& blocks, double scale, at::Tensor& dq, at::Tensor& dk,
                     at::Tensor& dv) {
  if (blocks.empty()) return;
  Operands op(q, k, v, scale);
  const auto g = op.layout(pad_last(dout, op.pad));
  const auto o = op.layout(pad_last(out, op.pad));
  const auto acc = q.options().dtype(acc_type(q));
  // An undefined gradient takes a block's over all its rows as it is, else starts from zeros.
  const auto add_to = [&](at::Tensor& grad, const at::Tensor& part, const at::Tensor& like,
                          int64_t start, int64_t len) {
    if (!grad.defined()) {
      if (start == 0 && len == like.size(2)) {
        grad = part.to(acc_type(q));
        return;
      }
      grad = at::zeros({like.size(0), like.size(1), like.size(2), part.size(3)}, acc);
    }
    grad.narrow(2, start, len).add_(part);
  };
  auto add = [&](const Block& b, const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& gv) {
    add_to(dq, gq, q, b.q_row, b.q_len);
    add_to(dk, gk, k, b.k_row, b.k_len);
    add_to(dv, gv, v, b.k_row, b.k_len);
  };
  for (const auto& group : varlen_groups(op, blocks)) {
    if (group.size() == 1) {
      auto [gq, gk, gv] = backward_one(op, g, o, lse, group.front());
      add(group.front(), gq, gk, gv);
      continue;
    }
    const Varlen varlen(group);
    const auto [left, right] = flash_window(group.front());
    std::vector<at::Tensor> lse_rows;
    for (const Block& b : group) lse_rows.push_back(lse.select(0, 0).narrow(1, b.q_row, b.q_len));
    const auto rng = at::empty({2}, q.options().dtype(at::kUInt64));
    const auto unused = at::empty({}, q.options().dtype(at::kUInt64));
    auto [gq, gk, gv] = at::_flash_attention_backward(
        Varlen::gather(g, group, false).contiguous(), Varlen::gather(op.q, group, false),
        Varlen::gather(op.k, group, true), Varlen::gather(op.v, group, true),
        Varlen::gather(o, group, false).contiguous(),
        at::cat(lse_rows, 1).to(at::kFloat).contiguous(), varlen.cu(varlen.cu_q, q),
        varlen.cu(varlen.cu_k, q), varlen.max_q, varlen.max_k, 0.0, false, rng, unused,
        std::optional<double>(scale), left, right);
    for (size_t i = 0; i < group.size(); ++i) {
      const Block& b = group[i];
      const auto view = [&](const at::Tensor& t, int32_t start, int64_t len, int64_t width) {
        return t.narrow(0, start, len).transpose(0, 1).unsqueeze(0).narrow(3, 0, width);
      };
      add(b, view(gq, varlen.cu_q[i], b.q_len, op.d), view(gk, varlen.cu_k[i], b.k_len, op.d),
          view(gv, varlen.cu_k[i], b.k_len, op.dv));
    }
  }
}

void apply_sinks(Accumulator& acc, const at::Tensor& sinks) {
  const auto& lse = acc.lse();
  const auto sink = sinks.to(lse.scalar_type()).view({1, -1, 1});
  const auto merged = at::logaddexp(lse, sink);
  acc.out().mul_((lse - merged).exp().unsqueeze(-1));
  lse.copy_(merged);
}

at::Tensor sink_grad(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                     const at::Tensor& sinks) {
  const auto acc = lse.scalar_type();
  const auto delta = (dout.to(acc) * out.to(acc)).sum(-1);
  const auto weight = (sinks.to(acc).view({1, -1, 1}) - lse).exp();
  return (weight * delta).sum({0, 2}).neg().to(sinks.scalar_type());
}

}  // namespace megatron_ext::attention
