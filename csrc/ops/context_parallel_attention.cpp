// Attention over a sequence split across the context-parallel (cp) group, as one autograd node.
//
// Layout: query [b, heads, s, d], key and value [b, groups, s, d] (``heads / groups`` consecutive
// query heads share one key/value head), ``s`` this rank's tokens. For a causal mask the sequence
// is in Megatron's load-balanced layout: cut into 2·cp chunks of c = s / 2 tokens, rank r holds
// chunks r and 2·cp−1−r, in that order, so every rank does the same causal work. Without the mask
// the order of the tokens does not matter.
//
// Each block of work is one call of SDPA's kernels that return the log-sum-exp (the CPU flash
// kernel; on CUDA flash for 16-bit inputs, memory-efficient for float32, and the block's scores for
// float64, which neither kernel takes), and partial outputs merge by their log-sum-exp in float32
// (float64 for float64 inputs). The backward of a block is the kernel's backward given the merged
// output and log-sum-exp, so no block is recomputed in the forward's terms. No [s, s] scores.
//
// cp_comm_type:
//   p2p         the ring. K/V (query-group heads, never expanded) rotate rank r → r+1; the next
//               block's send/recv is in flight while the current block computes. At step i rank
//               r holds the K/V of rank src = r − i: step 0 is causal over the local 2 chunks
//               (the local order is increasing, so the plain causal mask is right); for src < r
//               all local queries see src's first chunk only; for src > r only the local second
//               chunk sees both of src's chunks; the rest lies above the diagonal and is skipped.
//               The backward rotates K/V and the accumulating dK/dV the other way (r → r−1);
//               after cp steps each accumulator is one hop from its owner.
//
// Memory of the ring, in units of one local [b, heads, s, d] tensor (MHA): besides the inputs,
// the output and the gradients (what attention without cp holds too), it holds the K/V block in
// flight and the one it computes with (2 + 2), and in the backward one dK/dV accumulator (2):
// K and V travel as they are (not packed into one tensor, a copy), the accumulator arrives
// before the block that adds to it and leaves after (so one is held, not one arriving and one
// leaving), and a block's gradients are computed a few key/value groups at a time and added at
// once (their kernels' outputs and workspace are a fraction of a unit), so the peak per rank
// falls about as 1/cp.
//   all_gather  K/V all-gathered once (no overlap); each local chunk at position p attends the
//               chunks before it (one block) and its own (causal); the backward reduce-scatters
//               dK/dV.
//   a2a         Ulysses: an all-to-all turns [b, heads, s, d] into [b, heads / cp, cp·s, d] (the
//               whole sequence, in order), one attention, and the all-to-all back; heads and
//               groups must divide by cp. The log-sum-exp it returns is [b, heads / cp, cp·s].
//
// The public op is an autograd node over ``_forward`` (output and log-sum-exp) and ``_backward``;
// both communicate, both have fake kernels (megatron_ext/_ops.py), so the op traces as opaque
// calls. Arguments are checked on every rank before any communication.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/logaddexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "comm/functional.h"
#include "comm/process_group.h"
#include "ops/dispatch.h"
#include "torch_compat.h"

namespace megatron_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr const char* kOp = "context_parallel_attention";
// Keys use the tag, values the tag + 2.
constexpr int kKvTag = 0x4350;
constexpr int kGradKvTag = 0x4351;

enum class CommType { kP2P, kAllGather, kA2A };

CommType comm_type(c10::string_view name) {
  if (name == "p2p") return CommType::kP2P;
  if (name == "all_gather") return CommType::kAllGather;
  if (name == "a2a") return CommType::kA2A;
  TORCH_CHECK_VALUE(false, kOp, ": cp_comm_type must be 'p2p', 'all_gather' or 'a2a', got '",
                    std::string(name), "'");
}

// Hides the collectives from Python dispatch modes (opcheck's schema checker): a mode sees this
// op, not c10d's internal ones.
c10::impl::ExcludeDispatchKeyGuard hide_from_modes() {
  return c10::impl::ExcludeDispatchKeyGuard(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::string& group, int64_t size, int64_t rank, bool is_causal,
                  CommType type) {
  TORCH_CHECK_VALUE(q.defined() && k.defined() && v.defined(), kOp,
                    ": expected query, key and value tensors, got an undefined one");
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kOp,
                    ": expected query [b, heads, s, d] and key, value [b, groups, s, d], got "
                    "shapes ",
                    q.sym_sizes(), ", ", k.sym_sizes(), ", ", v.sym_sizes());
  TORCH_CHECK_VALUE(k.sym_sizes() == v.sym_sizes(), kOp,
                    ": key and value shapes differ: ", k.sym_sizes(), " and ", v.sym_sizes());
  TORCH_CHECK_VALUE(q.sym_size(0) == k.sym_size(0) && q.sym_size(2) == k.sym_size(2) &&
                        q.sym_size(3) == k.sym_size(3),
                    kOp, ": query ", q.sym_sizes(), " and key ", k.sym_sizes(),
                    " must agree in batch, sequence and head dims");
  TORCH_CHECK_VALUE(q.sym_size(1) % k.sym_size(1) == 0, kOp, ": the query heads (", q.sym_size(1),
                    ") must be a multiple of the key/value heads (", k.sym_size(1), ")");
  TORCH_CHECK_VALUE(at::isFloatingType(q.scalar_type()) && q.scalar_type() == k.scalar_type() &&
                        q.scalar_type() == v.scalar_type(),
                    kOp, ": query, key and value must share one floating dtype, got ",
                    q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK_VALUE(q.device() == k.device() && q.device() == v.device(), kOp,
                    ": query, key and value must be on one device");
  TORCH_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, kOp,
                    ": expected 0 <= group_rank < group_size, got rank ", rank, " and size ", size);
  if (size > 1 && is_causal) {
    TORCH_CHECK_VALUE(q.sym_size(2) % 2 == 0, kOp, ": a causal mask over a sequence split ", size,
                      " ways needs 2 chunks per rank (Megatron's load-balanced layout, chunks r "
                      "and 2*cp-1-r), but this rank holds ",
                      q.sym_size(2),
                      " tokens, an odd number; the sequence length must be "
                      "divisible by 2*cp = ",
                      2 * size);
  }
  if (size > 1 && type == CommType::kA2A) {
    TORCH_CHECK_VALUE(q.sym_size(1) % size == 0 && k.sym_size(1) % size == 0, kOp,
                      ": cp_comm_type 'a2a' splits the heads over the ", size,
                      " context-parallel ranks, but there are ", q.sym_size(1), " query heads and ",
                      k.sym_size(1), " key/value heads (both must divide by ", size, ")");
  }
  if (!comm::is_plain(q) || size == 1) return;
  const auto pg = comm::resolve(group);
  TORCH_CHECK_VALUE(pg->getSize() == size && pg->getRank() == rank, kOp, ": process group '", group,
                    "' has size ", pg->getSize(), " and this process's rank in it is ",
                    pg->getRank(), ", but the call passed group_size ", size, " and group_rank ",
                    rank);
}

at::ScalarType acc_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The key/value heads repeated for their query heads (a view when there is nothing to repeat),
// and a gradient over the repeated heads summed back to the groups.
at::Tensor expand_groups(const at::Tensor& kv, int64_t heads) {
  const int64_t groups = kv.size(1);
  if (groups == heads) return kv;
  return kv.repeat_interleave(heads / groups, 1);
}

at::Tensor reduce_groups(const at::Tensor& grad, int64_t groups) {
  const int64_t heads = grad.size(1);
  if (groups == heads) return grad;
  auto sizes = grad.sizes().vec();
  sizes[1] = groups;
  sizes.insert(sizes.begin() + 2, heads / groups);
  return grad.reshape(sizes).sum(2);
}

struct Block {
  at::Tensor out;  // [b, heads, sq, d], the inputs' dtype
  at::Tensor lse;  // [b, heads, sq], acc_type
};

bool cuda_flash(const at::Tensor& q) {
  return q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16;
}

// The block's scores [b, heads, sq, sk] (one block, not the sequence), masked causally.
at::Tensor block_scores(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  auto scores = at::matmul(q, k.transpose(-1, -2)) * scale;
  if (causal) {
    auto mask = at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu(1);
    scores.masked_fill_(mask, -std::numeric_limits<double>::infinity());
  }
  return scores;
}

// softmax(q k^T * scale, causal) v of one block and its log-sum-exp; key and value in groups.
Block block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                    double scale) {
  const auto kx = expand_groups(k, q.size(1));
  const auto vx = expand_groups(v, q.size(1));
  if (q.is_cpu()) {
    auto [out, lse] =
        at::_scaled_dot_product_flash_attention_for_cpu(q, kx, vx, 0.0, causal, {}, scale);
    return {out, lse.to(acc_type(q)).contiguous()};
  }
  if (q.is_cuda() && cuda_flash(q)) {
    auto result = at::_scaled_dot_product_flash_attention(q, kx, vx, 0.0, causal, false, scale);
    return {std::get<0>(result), std::get<1>(result).contiguous()};
  }
  if (q.is_cuda() && q.scalar_type() == at::kFloat) {
    auto result =
        at::_scaled_dot_product_efficient_attention(q, kx, vx, {}, true, 0.0, causal, scale);
    // The kernel pads the log-sum-exp's last dim to a multiple of 32.
    return {std::get<0>(result), std::get<1>(result).narrow(2, 0, q.size(2)).contiguous()};
  }
  auto scores = block_scores(q, kx, causal, scale).to(acc_type(q));
  auto lse = scores.logsumexp(-1);
  auto out = at::matmul((scores - lse.unsqueeze(-1)).exp().to(q.scalar_type()), vx);
  return {out, lse};
}

// The gradients of one block given the merged output and log-sum-exp of its query rows; the
// key/value gradients in groups.
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, bool causal, double scale) {
  const int64_t groups = k.size(1);
  const auto kx = expand_groups(k, q.size(1));
  const auto vx = expand_groups(v, q.size(1));
  at::Tensor dq, dk, dv;
  if (q.is_cpu()) {
    std::tie(dq, dk, dv) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.contiguous(), q, kx, vx, out.contiguous(), lse.contiguous(), 0.0, causal, {},
        scale);
  } else if (q.is_cuda() && cuda_flash(q)) {
    const auto none = at::empty({0}, q.options().dtype(at::kLong));
    std::tie(dq, dk, dv) = at::_scaled_dot_product_flash_attention_backward(
        grad_out.contiguous(), q, kx, vx, out.contiguous(), lse.to(at::kFloat).contiguous(),
        at::Tensor(), at::Tensor(), q.size(2), k.size(2), 0.0, causal, none, none, scale);
  } else if (q.is_cuda() && q.scalar_type() == at::kFloat) {
    const int64_t padded = (q.size(2) + 31) / 32 * 32;
    const auto lse_padded = at::constant_pad_nd(lse, {0, padded - q.size(2)}, 0.0).contiguous();
    const auto none = at::empty({0}, q.options().dtype(at::kLong));
    auto result = at::_scaled_dot_product_efficient_attention_backward(
        grad_out.contiguous(), q, kx, vx, at::Tensor(), out.contiguous(), lse_padded, none, none,
        0.0, {true, true, true, false}, causal, scale);
    dq = std::get<0>(result);
    dk = std::get<1>(result);
    dv = std::get<2>(result);
  } else {
    const auto probs = (block_scores(q, kx, causal, scale).to(acc_type(q)) - lse.unsqueeze(-1))
                           .exp()
                           .to(q.scalar_type());
    const auto delta = (grad_out * out).sum(-1, true);
    const auto dprobs = at::matmul(grad_out, vx.transpose(-1, -2));
    const auto dscores = probs * (dprobs - delta) * scale;
    dq = at::matmul(dscores, kx);
    dk = at::matmul(dscores.transpose(-1, -2), q);
    dv = at::matmul(probs.transpose(-1, -2), grad_out);
  }
  return {dq, reduce_groups(dk, groups), reduce_groups(dv, groups)};
}

// Adds a block's partial result for the query rows [start, start + len) into the running output
// ``out`` (acc_type) and log-sum-exp ``lse``; the block's output is scaled in place (no
// temporary of its size).
void merge(at::Tensor& out, at::Tensor& lse, Block block, int64_t start, int64_t len) {
  auto o = out.narrow(2, start, len);
  auto l = lse.narrow(2, start, len);
  const auto merged = at::logaddexp(l, block.lse);
  o.mul_((l - merged).exp().unsqueeze(-1));
  auto part = block.out.to(out.scalar_type());
  part.mul_((block.lse - merged).exp().unsqueeze(-1));
  o.add_(part);
  l.copy_(merged);
}

// One step of a ring: ``send`` goes to ``to`` while a tensor like it arrives from ``from``.
struct Exchange {
  at::Tensor received;
  c10::intrusive_ptr<c10d::Work> recv, send;
  at::Tensor sent;

  at::Tensor wait() {
    auto hidden = hide_from_modes();
    recv->wait();
    send->wait();
    return received;
  }
};

Exchange start_exchange(c10d::ProcessGroup& pg, const at::Tensor& send, int to, int from, int tag) {
  auto hidden = hide_from_modes();
  Exchange ex;
  ex.sent = send.contiguous();
  ex.received = at::empty_like(ex.sent);
  std::vector<at::Tensor> in{ex.received}, out{ex.sent};
  ex.recv = pg.recv(in, from, tag);
  ex.send = pg.send(out, to, tag);
  return ex;
}

// Keys and values (or their gradients) as two tensors: packing them into one would be a copy.
struct KeyValue {
  at::Tensor k, v;
};

// One ring step of a key/value pair, each tensor its own message.
struct KeyValueExchange {
  Exchange k, v;

  KeyValue wait() { return {k.wait(), v.wait()}; }
};

KeyValueExchange start_exchange(c10d::ProcessGroup& pg, const KeyValue& send, int to, int from,
                                int tag) {
  return {start_exchange(pg, send.k, to, from, tag), start_exchange(pg, send.v, to, from, tag + 2)};
}

// Key/value groups per block call in the ring's backward: about a quarter of them (a divisor),
// so the kernels' gradients and workspace are a fraction of a local tensor.
int64_t groups_per_call(int64_t groups) {
  for (int64_t calls = std::min<int64_t>(4, groups); calls > 1; --calls) {
    if (groups % calls == 0) return groups / calls;
  }
  return groups;
}

// The all-to-all of equal dim-0 slices.
at::Tensor all_to_all_dim0(const at::Tensor& input, const std::string& group) {
  auto hidden = hide_from_modes();
  auto in = input.contiguous();
  auto out = at::empty_like(in);
  std::vector<int64_t> splits;
  const auto pg = comm::resolve(group);
#if MEGATRON_EXT_TORCH_2_13
  pg->all_to_all_single(out, in, splits, splits)->wait();
#else
  pg->alltoall_base(out, in, splits, splits)->wait();
#endif
  return out;
}

// Ulysses: tensors [b, h_i, s, d] (rank layout) to [b, h_i / cp, cp·s, d] (whole sequence, in
// order), in one all-to-all; ``to_sequence`` false goes back.
at::Tensor natural_order(int64_t cp, const at::Tensor& like) {
  // Position of each chunk of the rank layout (ranks in order, chunks r and 2cp-1-r).
  std::vector<int64_t> chunks;
  for (int64_t r = 0; r < cp; ++r) {
    chunks.push_back(r);
    chunks.push_back(2 * cp - 1 - r);
  }
  return at::tensor(chunks, like.options().dtype(at::kLong));
}

std::vector<at::Tensor> heads_to_sequence(const std::vector<at::Tensor>& xs,
                                          const std::string& group, int64_t cp, bool causal) {
  std::vector<at::Tensor> parts;
  std::vector<int64_t> heads;
  for (const auto& x : xs) {
    heads.push_back(x.size(1) / cp);
    parts.push_back(x.unflatten(1, {cp, x.size(1) / cp}));  // [b, cp, h/cp, s, d]
  }
  auto packed = at::cat(parts, 2).movedim(1, 0);   // [cp, b, H/cp, s, d]
  auto received = all_to_all_dim0(packed, group);  // [cp (source), b, H/cp, s, d]
  const int64_t b = received.size(1), hh = received.size(2), s = received.size(3);
  const int64_t d = received.size(4);
  at::Tensor seq;
  if (causal) {
    // [cp, b, hh, 2, c, d] -> chunks in rank layout -> natural order.
    auto chunked = received.view({cp, b, hh, 2, s / 2, d}).permute({1, 2, 0, 3, 4, 5});
    chunked = chunked.reshape({b, hh, 2 * cp, s / 2, d});
    auto order = at::argsort(natural_order(cp, received));
    seq = chunked.index_select(2, order).reshape({b, hh, cp * s, d});
  } else {
    seq = received.permute({1, 2, 0, 3, 4}).reshape({b, hh, cp * s, d});
  }
  return seq.split(heads, 1);
}

std::vector<at::Tensor> sequence_to_heads(const std::vector<at::Tensor>& xs,
                                          const std::string& group, int64_t cp, bool causal) {
  std::vector<int64_t> heads;
  for (const auto& x : xs) heads.push_back(x.size(1) * cp);
  auto seq = at::cat(xs, 1);  // [b, hh, cp*s, d]
  const int64_t b = seq.size(0), hh = seq.size(1), s = seq.size(2) / cp, d = seq.size(3);
  at::Tensor packed;
  if (causal) {
    auto chunked = seq.view({b, hh, 2 * cp, s / 2, d}).index_select(2, natural_order(cp, seq));
    packed = chunked.view({b, hh, cp, s, d}).permute({2, 0, 1, 3, 4});
  } else {
    packed = seq.view({b, hh, cp, s, d}).permute({2, 0, 1, 3, 4});
  }
  auto received = all_to_all_dim0(packed, group);  // [cp (head block), b, hh, s, d]
  std::vector<at::Tensor> result;
  int64_t first = 0;
  for (int64_t h : heads) {
    const int64_t per = h / cp;
    result.push_back(received.narrow(2, first, per).permute({1, 0, 2, 3, 4}).reshape({b, h, s, d}));
    first += per;
  }
  return result;
}

// The 2·cp chunks of the whole sequence in order, from the all-gathered [cp, 2(k, v), b, g, s, d].
at::Tensor gathered_in_order(const at::Tensor& gathered, int64_t cp) {
  const int64_t c = gathered.size(4) / 2;
  std::vector<at::Tensor> chunks;
  for (int64_t j = 0; j < 2 * cp; ++j) {
    chunks.push_back(j < cp ? gathered[j].narrow(3, 0, c)
                            : gathered[2 * cp - 1 - j].narrow(3, c, c));
  }
  return at::cat(chunks, 3);  // [2, b, g, 2cp*c, d]
}

// The inverse: a [2, b, g, 2cp*c, d] tensor as [cp, 2, b, g, 2c, d], rank r's chunks in its slot.
at::Tensor in_rank_layout(const at::Tensor& whole, int64_t cp) {
  const int64_t c = whole.size(3) / (2 * cp);
  std::vector<at::Tensor> ranks;
  for (int64_t r = 0; r < cp; ++r) {
    ranks.push_back(
        at::cat({whole.narrow(3, r * c, c), whole.narrow(3, (2 * cp - 1 - r) * c, c)}, 3));
  }
  return at::stack(ranks);
}

double scale_of(const at::Tensor& q, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
}

std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& query, const at::Tensor& key,
                                                const at::Tensor& value,
                                                c10::string_view group_name, int64_t cp,
                                                int64_t rank, bool is_causal,
                                                c10::string_view cp_comm_type,
                                                std::optional<double> scale_arg) {
  const std::string group(group_name);
  const CommType type = comm_type(cp_comm_type);
  check_inputs(query, key, value, group, cp, rank, is_causal, type);
  const double scale = scale_of(query, scale_arg);
  const auto q = query.contiguous();
  if (cp == 1) {
    auto block = block_forward(q, key.contiguous(), value.contiguous(), is_causal, scale);
    return {block.out.contiguous(), block.lse};
  }
  if (type == CommType::kA2A) {
    auto seq = heads_to_sequence({q, key, value}, group, cp, is_causal);
    auto block = block_forward(seq[0].contiguous(), seq[1].contiguous(), seq[2].contiguous(),
                               is_causal, scale);
    auto out = sequence_to_heads({block.out}, group, cp, is_causal)[0];
    return {out.contiguous(), block.lse};
  }
  const int64_t s = q.size(2), c = s / 2;
  at::Tensor out, lse;
  auto add = [&](const Block& block, int64_t start, int64_t len) {
    if (!out.defined()) {
      out = at::zeros(q.sizes(), q.options().dtype(acc_type(q)));
      lse = at::full(q.sizes().slice(0, 3), -std::numeric_limits<double>::infinity(),
                     q.options().dtype(acc_type(q)));
    }
    merge(out, lse, block, start, len);
  };
  if (type == CommType::kAllGather) {
    const auto kv = at::stack({key, value});  // [2, b, g, s, d]
    auto gathered = comm::wait(comm::start_all_gather_dim0(kv, cp, group, kOp));
    auto whole = gathered_in_order(gathered.view({cp, 2, kv.size(1), kv.size(2), s, kv.size(4)}),
                                   cp);  // [2, b, g, cp*s, d]
    if (!is_causal) {
      add(block_forward(q, whole[0], whole[1], false, scale), 0, s);
    } else {
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t p = half == 0 ? rank : 2 * cp - 1 - rank;
        const auto qh = q.narrow(2, half * c, c);
        if (p > 0)
          add(block_forward(qh, whole[0].narrow(2, 0, p * c), whole[1].narrow(2, 0, p * c), false,
                            scale),
              half * c, c);
        add(block_forward(qh, whole[0].narrow(2, p * c, c), whole[1].narrow(2, p * c, c), true,
                          scale),
            half * c, c);
      }
    }
  } else {
    const auto pg = comm::resolve(group);
    const int next = static_cast<int>((rank + 1) % cp),
              prev = static_cast<int>((rank + cp - 1) % cp);
    KeyValue held{key.contiguous(), value.contiguous()};
    for (int64_t i = 0; i < cp; ++i) {
      std::optional<KeyValueExchange> ex;
      if (i + 1 < cp) ex = start_exchange(*pg, held, next, prev, kKvTag);
      const int64_t src = (rank - i + cp) % cp;
      const auto &k = held.k, &v = held.v;
      if (i == 0 || !is_causal) {
        add(block_forward(q, k, v, is_causal, scale), 0, s);
      } else if (src < rank) {
        add(block_forward(q, k.narrow(2, 0, c), v.narrow(2, 0, c), false, scale), 0, s);
      } else {
        add(block_forward(q.narrow(2, c, c), k, v, false, scale), c, c);
      }
      if (ex) held = ex->wait();
    }
  }
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_impl(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
    c10::string_view group_name, int64_t cp, int64_t rank, bool is_causal,
    c10::string_view cp_comm_type, std::optional<double> scale_arg) {
  const std::string group(group_name);
  const CommType type = comm_type(cp_comm_type);
  check_inputs(query, key, value, group, cp, rank, is_causal, type);
  const double scale = scale_of(query, scale_arg);
  const auto q = query.contiguous();
  const auto dout = grad_out.contiguous();
  if (cp == 1) {
    return block_backward(dout, q, key.contiguous(), value.contiguous(), out, lse, is_causal,
                          scale);
  }
  if (type == CommType::kA2A) {
    auto seq = heads_to_sequence({q, key, value, out, dout}, group, cp, is_causal);
    auto [dq, dk, dv] =
        block_backward(seq[4].contiguous(), seq[0].contiguous(), seq[1].contiguous(),
                       seq[2].contiguous(), seq[3].contiguous(), lse, is_causal, scale);
    auto grads = sequence_to_heads({dq, dk, dv}, group, cp, is_causal);
    return {grads[0].contiguous(), grads[1].contiguous(), grads[2].contiguous()};
  }
  const int64_t s = q.size(2), c = s / 2;
  const auto acc = q.options().dtype(acc_type(q));
  auto dq = at::zeros(q.sizes(), acc);
  // The gradients of query rows [qs, qs + len) against key/value rows [ks, ks + klen) of ``kv``,
  // added to dq and ``dkv``, a few key/value groups (and their query heads) per call.
  auto add = [&](const KeyValue& kv, KeyValue& dkv, int64_t qs, int64_t len, int64_t ks,
                 int64_t klen, bool causal) {
    const int64_t groups = kv.k.size(1), per_group = q.size(1) / groups;
    const int64_t step = groups_per_call(groups);
    for (int64_t g = 0; g < groups; g += step) {
      const auto rows = [&](const at::Tensor& t, int64_t heads_per_group) {
        return t.narrow(1, g * heads_per_group, step * heads_per_group).narrow(2, qs, len);
      };
      const auto keys = [&](const at::Tensor& t) {
        return t.narrow(1, g, step).narrow(2, ks, klen);
      };
      auto [gq, gk, gv] =
          block_backward(rows(dout, per_group), rows(q, per_group).contiguous(), keys(kv.k),
                         keys(kv.v), rows(out, per_group), rows(lse, per_group), causal, scale);
      rows(dq, per_group).add_(gq);
      keys(dkv.k).add_(gk);
      keys(dkv.v).add_(gv);
    }
  };
  if (type == CommType::kAllGather) {
    const auto kv = at::stack({key, value});  // [2, b, g, s, d]
    auto gathered = comm::wait(comm::start_all_gather_dim0(kv, cp, group, kOp));
    auto whole =
        gathered_in_order(gathered.view({cp, 2, kv.size(1), kv.size(2), s, kv.size(4)}), cp);
    auto dwhole = at::zeros(whole.sizes(), acc);
    const KeyValue all{whole[0], whole[1]};
    KeyValue dall{dwhole[0], dwhole[1]};
    if (!is_causal) {
      add(all, dall, 0, s, 0, whole.size(3), false);
    } else {
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t p = half == 0 ? rank : 2 * cp - 1 - rank;
        if (p > 0) add(all, dall, half * c, c, 0, p * c, false);
        add(all, dall, half * c, c, p * c, c, true);
      }
    }
    auto mine =
        comm::wait(comm::start_reduce_scatter_dim0(in_rank_layout(dwhole, cp), cp, group, kOp))[0];
    return {dq.to(q.scalar_type()), mine[0].to(q.scalar_type()), mine[1].to(q.scalar_type())};
  }
  const auto pg = comm::resolve(group);
  const int next = static_cast<int>((rank + 1) % cp), prev = static_cast<int>((rank + cp - 1) % cp);
  KeyValue held{key.contiguous(), value.contiguous()};
  // The dK/dV accumulator of the K/V held: arrives from the next rank (the ranks after it added
  // their parts), gets this rank's part, leaves for the previous rank.
  std::optional<KeyValueExchange> grads_in_flight;
  for (int64_t i = 0; i < cp; ++i) {
    std::optional<KeyValueExchange> ex;
    if (i + 1 < cp) ex = start_exchange(*pg, held, prev, next, kKvTag);
    const int64_t src = (rank + i) % cp;
    KeyValue dkv = grads_in_flight
                       ? grads_in_flight->wait()
                       : KeyValue{at::zeros(held.k.sizes(), acc), at::zeros(held.v.sizes(), acc)};
    grads_in_flight.reset();
    if (i == 0 || !is_causal) {
      add(held, dkv, 0, s, 0, s, is_causal);
    } else if (src < rank) {
      add(held, dkv, 0, s, 0, c, false);
    } else {
      add(held, dkv, c, c, 0, s, false);
    }
    grads_in_flight = start_exchange(*pg, dkv, prev, next, kGradKvTag);
    dkv = {};  // the exchange holds it until sent
    if (ex) held = ex->wait();
  }
  auto dkv = grads_in_flight->wait();
  return {dq.to(q.scalar_type()), dkv.k.to(q.scalar_type()), dkv.v.to(q.scalar_type())};
}

using ForwardFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, c10::string_view, int64_t,
                                                     int64_t, bool, c10::string_view,
                                                     std::optional<double>);
using BackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, c10::string_view, int64_t, int64_t, bool, c10::string_view,
    std::optional<double>);

struct ContextParallelAttentionFunction : public Function<ContextParallelAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const std::string& group, int64_t cp, int64_t rank,
                            bool is_causal, const std::string& comm, std::optional<double> scale) {
    static const auto op = typed_op<ForwardFn>("context_parallel_attention_forward");
    ctx->saved_data["group"] = group;
    ctx->saved_data["cp"] = cp;
    ctx->saved_data["rank"] = rank;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["scale"] = scale;
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = op.call(q, k, v, group, cp, rank, is_causal, comm, scale);
    ctx->save_for_backward({q, k, v, out, lse});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BackwardFn>("context_parallel_attention_backward");
    const auto saved = ctx->get_saved_variables();
    variable_list result(9);
    if (!grads[0].defined()) return result;
    const auto scale = ctx->saved_data["scale"];
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv] =
        op.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                ctx->saved_data["group"].toStringRef(), ctx->saved_data["cp"].toInt(),
                ctx->saved_data["rank"].toInt(), ctx->saved_data["is_causal"].toBool(),
                ctx->saved_data["comm"].toStringRef(),
                scale.isNone() ? std::nullopt : std::optional<double>(scale.toDouble()));
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    return result;
  }
};

at::Tensor attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              c10::string_view group, int64_t cp, int64_t rank, bool is_causal,
                              c10::string_view comm, std::optional<double> scale) {
  // Checked here too, so a traced call (on fake tensors) raises the op's own errors.
  check_inputs(q, k, v, std::string(group), cp, rank, is_causal, comm_type(comm));
  return ContextParallelAttentionFunction::apply(q, k, v, std::string(group), cp, rank, is_causal,
                                                 std::string(comm), scale);
}

at::Tensor attention_no_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 c10::string_view group, int64_t cp, int64_t rank, bool is_causal,
                                 c10::string_view comm, std::optional<double> scale) {
  return std::get<0>(forward_impl(q, k, v, group, cp, rank, is_causal, comm, scale));
}

}  // namespace

// The schemas are in registration.cpp.
TORCH_LIBRARY_IMPL(megatron_ext, CompositeExplicitAutograd, m) {
  m.impl("context_parallel_attention", TORCH_FN(attention_no_autograd));
  m.impl("context_parallel_attention_forward", TORCH_FN(forward_impl));
  m.impl("context_parallel_attention_backward", TORCH_FN(backward_impl));
}

TORCH_LIBRARY_IMPL(megatron_ext, Autograd, m) {
  m.impl("context_parallel_attention", TORCH_FN(attention_autograd));
}

}  // namespace megatron_ext
