// Attention over a sequence split across the context-parallel (cp) group, as one autograd node: the
// communication of the attention op family. Which blocks of work exist is ops/attention_plan.h
// (the block rule: causal triangle, window band, packed segments, the load-balanced chunks); a
// block is computed by ops/attention_blocks.h (SDPA's log-sum-exp kernels) and merged by its
// log-sum-exp. Here: which keys and values a rank holds when, and where the gradients go.
//
// Layout: query [b, heads, s, d], key [b, groups, s, d] and value [b, groups, s, dv] (``heads /
// groups`` consecutive query heads share a key/value head), ``s`` this rank's tokens; the output
// is [b, heads, s, dv]. The global row of cp·s tokens is one sequence, or with ``cu_seqlens``
// (boundaries [0, .., cp·s] on the global row) packed sequences that never attend to each other.
// Under a causal mask, and always for packed rows, every sequence is cut into 2·cp chunks and rank
// r holds chunks r and 2·cp−1−r of each, in sequence order (Megatron's and TransformerEngine's
// load-balanced layout); without a mask one sequence may be split any way. ``window`` w (with the
// causal mask): a query sees the w keys ending at itself. ``sinks`` [heads]: one more logit per
// head in every row's softmax, applied after the merge (it only rescales the output); its gradient
// is this rank's part, summed over the cp group by the data-parallel gradient reduction (as every
// parameter's under cp).
//
// cp_comm_type:
//   p2p         the ring. K/V (query-group heads, never expanded) rotate rank r → r+1; the next
//               step's send/recv is in flight while the current step computes. At step i rank r
//               holds the K/V of rank r − i and computes the blocks the rule gives for its pieces
//               against those (none above the causal diagonal, none outside a window: such steps
//               only pass K/V on). The backward rotates K/V and the accumulating dK/dV the other
//               way (r → r−1); after cp steps each accumulator is one hop from its owner.
//
// Memory of the ring, in units of one local [b, heads, s, d] tensor (MHA): besides the inputs,
// the output and the gradients (what attention without cp holds too), it holds the K/V block in
// flight and the one it computes with (2 + 2), and in the backward one dK/dV accumulator (2):
// K and V travel as they are (not packed into one tensor, a copy), the accumulator arrives
// before the step that adds to it and leaves after (so one is held, not one arriving and one
// leaving), and a step's gradients are computed a few key/value groups at a time and added at
// once (their kernels' outputs and workspace are a fraction of a unit), so the peak per rank
// falls about as 1/cp.
//   all_gather  K/V all-gathered once (no overlap) and put in sequence order; each local piece
//               attends to its sequence's keys by the rule; the backward reduce-scatters dK/dV.
//   a2a         Ulysses: an all-to-all turns [b, heads, s, ·] into [b, heads / cp, cp·s, ·] (the
//               whole row, in order), one attention, and the all-to-all back; heads and groups
//               must divide by cp. The log-sum-exp it returns is [b, heads / cp, cp·s].
//
// The public op is an autograd node over ``_forward`` (output and log-sum-exp) and ``_backward``;
// both communicate, both have fake kernels (megatron_ext/_ops.py), so the op traces as opaque
// calls. Arguments are checked on every rank before any communication.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "comm/functional.h"
#include "comm/process_group.h"
#include "ops/attention_blocks.h"
#include "ops/attention_plan.h"
#include "ops/dispatch.h"
#include "torch_compat.h"

namespace megatron_ext {
namespace {

using attention::acc_type;
using attention::Accumulator;
using attention::Block;
using attention::Layout;
using attention::Piece;
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

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The boundaries of the packed sequences, read on the host (empty for fake tensors, whose values
// no one knows).
std::vector<int64_t> boundaries(const at::Tensor& cu_seqlens) {
  if (!comm::is_plain(cu_seqlens)) return {};
  const auto values = cu_seqlens.to(at::kCPU, at::kLong).contiguous();
  return {values.data_ptr<int64_t>(), values.data_ptr<int64_t>() + values.numel()};
}

// Every argument, checked the same on every rank (they are the same there) before anything is
// communicated. ``bounds``: the packed sequences' boundaries when known.
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::string& group, int64_t size, int64_t rank, bool is_causal,
                  CommType type, std::optional<int64_t> window,
                  const std::optional<at::Tensor>& sinks,
                  const std::optional<at::Tensor>& cu_seqlens, const std::vector<int64_t>& bounds) {
  TORCH_CHECK_VALUE(q.defined() && k.defined() && v.defined(), kOp,
                    ": expected query, key and value tensors, got an undefined one");
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kOp,
                    ": expected query [b, heads, s, d], key [b, groups, s, d] and value [b, "
                    "groups, s, dv], got shapes ",
                    q.sym_sizes(), ", ", k.sym_sizes(), ", ", v.sym_sizes());
  TORCH_CHECK_VALUE(k.sym_sizes().slice(0, 3) == v.sym_sizes().slice(0, 3), kOp, ": key ",
                    k.sym_sizes(), " and value ", v.sym_sizes(),
                    " must agree in batch, heads and sequence");
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
  if (window.has_value()) {
    TORCH_CHECK_VALUE(*window >= 1, kOp,
                      ": window must be a positive integer (the keys a query sees, itself "
                      "included), got ",
                      *window);
    TORCH_CHECK_VALUE(is_causal, kOp, ": a window of ", *window,
                      " keys needs the causal mask (is_causal=True): it is the band of keys "
                      "ending at each query");
  }
  if (has(sinks)) {
    TORCH_CHECK_VALUE(sinks->dim() == 1 && sinks->sym_size(0) == q.sym_size(1) &&
                          at::isFloatingType(sinks->scalar_type()) && sinks->device() == q.device(),
                      kOp, ": sinks must be one floating logit per query head, [", q.sym_size(1),
                      "] on the query's device, got ", sinks->scalar_type(), " ",
                      sinks->sym_sizes(), " on ", sinks->device());
  }
  const bool packed = has(cu_seqlens);
  if (packed) {
    TORCH_CHECK_VALUE(cu_seqlens->dim() == 1 && cu_seqlens->sym_size(0) >= 2 &&
                          at::isIntegralType(cu_seqlens->scalar_type(), false),
                      kOp,
                      ": cu_seqlens must be the integer boundaries of the packed sequences, [0, "
                      "..., total], got ",
                      cu_seqlens->scalar_type(), " ", cu_seqlens->sym_sizes());
  }
  if (!bounds.empty()) {
    const int64_t total = q.size(2) * size;
    bool increasing = bounds.front() == 0;
    for (size_t i = 1; i < bounds.size(); ++i) increasing = increasing && bounds[i] > bounds[i - 1];
    TORCH_CHECK_VALUE(increasing && bounds.back() == total, kOp,
                      ": cu_seqlens must increase strictly from 0 to the packed row's length ",
                      total, " (", q.size(2), " tokens per rank x ", size, " ranks), got ",
                      c10::IntArrayRef(bounds));
    if (size > 1) {
      for (size_t i = 1; i < bounds.size(); ++i) {
        TORCH_CHECK_VALUE((bounds[i] - bounds[i - 1]) % (2 * size) == 0, kOp, ": sequence ", i - 1,
                          " of the packed row has ", bounds[i] - bounds[i - 1],
                          " tokens; under context parallelism each sequence is cut into 2*cp = ",
                          2 * size, " chunks, so its length (padded) must divide by ", 2 * size);
      }
    }
  }
  if (size > 1 && is_causal && !packed) {
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

// One call's arguments, checked, with the layout of the packed row.
struct Call {
  std::string group;
  int64_t cp, rank;
  bool causal;
  CommType type;
  int64_t window;  // 0: none
  double scale;
  Layout layout;

  Call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::string_view group_name,
       int64_t size, int64_t group_rank, bool is_causal, c10::string_view comm,
       std::optional<double> scale_arg, std::optional<int64_t> window_arg,
       const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& cu_seqlens)
      : group(group_name), cp(size), rank(group_rank), causal(is_causal), type(comm_type(comm)) {
    const auto bounds = has(cu_seqlens) ? boundaries(*cu_seqlens) : std::vector<int64_t>{};
    check_inputs(q, k, v, group, cp, rank, causal, type, window_arg, sinks, cu_seqlens, bounds);
    window = window_arg.value_or(0);
    scale = scale_arg.has_value() ? *scale_arg : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    layout.bounds = bounds.empty() ? std::vector<int64_t>{0, cp * q.size(2)} : bounds;
    layout.cp = cp;
    layout.chunked = cp > 1 && (causal || has(cu_seqlens));
  }

  std::vector<Block> plan(const std::vector<Piece>& queries, const std::vector<Piece>& keys) const {
    return attention::plan(queries, keys, causal, window);
  }

  // For each position of the global row, the row of the rank-major concatenation holding it; and
  // for each row of the concatenation, its position. Undefined when they are the same order.
  at::Tensor to_sequence_order(const at::Tensor& like) const {
    if (!layout.chunked) return {};
    const auto positions = layout.positions_of_rank_rows();
    std::vector<int64_t> order(positions.size());
    for (size_t row = 0; row < positions.size(); ++row) {
      order[static_cast<size_t>(positions[row])] = static_cast<int64_t>(row);
    }
    return at::tensor(order, like.options().dtype(at::kLong));
  }
  at::Tensor to_rank_order(const at::Tensor& like) const {
    if (!layout.chunked) return {};
    return at::tensor(layout.positions_of_rank_rows(), like.options().dtype(at::kLong));
  }
};

// Tensors [b, n_i, s, w_i] as one [lead, s, b, Σ n_i·w_i / lead] tensor (one copy), each one's
// heads split in ``lead`` blocks: the layout whose dim-0 slices the collectives move.
at::Tensor pack(const std::vector<at::Tensor>& xs, int64_t lead) {
  const auto& first = xs.front();
  const int64_t b = first.size(0), s = first.size(2);
  int64_t width = 0;
  for (const auto& x : xs) width += x.size(1) / lead * x.size(3);
  auto out = at::empty({lead, s, b, width}, first.options());
  int64_t offset = 0;
  for (const auto& x : xs) {
    const int64_t n = x.size(1) / lead, w = x.size(3);
    out.narrow(3, offset, n * w)
        .view({lead, s, b, n, w})
        .copy_(x.unflatten(1, {lead, n}).permute({1, 3, 0, 2, 4}));
    offset += n * w;
  }
  return out;
}

// The inverse of ``pack`` for rows [R, b, Σ n_i·w_i]: views [b, n_i, R, w_i].
std::vector<at::Tensor> unpack(const at::Tensor& rows, const std::vector<at::Tensor>& like) {
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (const auto& x : like) {
    const int64_t n = x.size(1), w = x.size(3);
    out.push_back(rows.narrow(2, offset, n * w)
                      .view({rows.size(0), rows.size(1), n, w})
                      .permute({1, 2, 0, 3}));
    offset += n * w;
  }
  return out;
}

at::Tensor reorder_rows(const at::Tensor& rows, const at::Tensor& order) {
  return order.defined() ? rows.index_select(0, order) : rows;
}

// Ulysses: [b, h_i, s, w_i] tensors (this rank's rows) to [b, h_i / cp, cp·s, w_i] (the whole row
// in sequence order, heads block ``rank``), in one all-to-all.
std::vector<at::Tensor> heads_to_sequence(const std::vector<at::Tensor>& xs, const Call& call) {
  const int64_t cp = call.cp, s = xs.front().size(2), b = xs.front().size(0);
  auto received = comm::wait(comm::start_all_to_all_dim0(pack(xs, cp), {}, {}, cp, call.group,
                                                         kOp));  // [cp (source), s, b, F]
  auto rows = reorder_rows(received.view({cp * s, b, -1}), call.to_sequence_order(received));
  std::vector<at::Tensor> shapes;
  for (const auto& x : xs) shapes.push_back(x.narrow(1, 0, x.size(1) / cp));
  return unpack(rows, shapes);
}

// The inverse: [b, h_i, cp·s, w_i] back to [b, h_i · cp, s, w_i] (this rank's rows).
std::vector<at::Tensor> sequence_to_heads(const std::vector<at::Tensor>& xs, const Call& call) {
  const int64_t cp = call.cp, s = xs.front().size(2) / cp, b = xs.front().size(0);
  auto rows = pack(xs, 1).view({cp * s, b, -1});
  rows = reorder_rows(rows, call.to_rank_order(rows));
  auto received = comm::wait(comm::start_all_to_all_dim0(rows.view({cp, s, b, -1}).contiguous(), {},
                                                         {}, cp, call.group, kOp));
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (const auto& x : xs) {
    const int64_t n = x.size(1), w = x.size(3);
    out.push_back(received.narrow(3, offset, n * w)
                      .view({cp, s, b, n, w})
                      .permute({2, 0, 3, 1, 4})
                      .reshape({b, cp * n, s, w}));
    offset += n * w;
  }
  return out;
}

// Keys and values gathered from every rank, in sequence order: [b, groups, cp·s, d], [.., dv].
std::vector<at::Tensor> gather_keys_values(const at::Tensor& k, const at::Tensor& v,
                                           const Call& call) {
  const auto packed = pack({k, v}, 1).view({k.size(2), k.size(0), -1});
  auto gathered = comm::wait(comm::start_all_gather_dim0(packed, call.cp, call.group, kOp));
  return unpack(reorder_rows(gathered, call.to_sequence_order(gathered)), {k, v});
}

// The gradients of gathered keys and values summed over the ranks, this rank's rows.
std::vector<at::Tensor> scatter_key_value_grads(const at::Tensor& dk, const at::Tensor& dv,
                                                const Call& call) {
  auto rows = pack({dk, dv}, 1).view({dk.size(2), dk.size(0), -1});
  rows = reorder_rows(rows, call.to_rank_order(rows));
  auto mine = comm::wait(comm::start_reduce_scatter_dim0(rows, call.cp, call.group, kOp));
  return unpack(mine, {dk.narrow(2, 0, 1), dv.narrow(2, 0, 1)});
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

// Key/value groups per call in the ring's backward: about a quarter of them (a divisor), so the
// kernels' gradients and workspace are a fraction of a local tensor.
int64_t groups_per_call(int64_t groups) {
  for (int64_t calls = std::min<int64_t>(4, groups); calls > 1; --calls) {
    if (groups % calls == 0) return groups / calls;
  }
  return groups;
}

// The heads of ``sinks`` this rank's attention computes (a2a: its block of heads).
at::Tensor local_sinks(const at::Tensor& sinks, const Call& call) {
  if (call.type != CommType::kA2A || call.cp == 1) return sinks;
  const int64_t per = sinks.size(0) / call.cp;
  return sinks.narrow(0, call.rank * per, per);
}

std::tuple<at::Tensor, at::Tensor> forward_impl(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    c10::string_view group_name, int64_t cp, int64_t rank, bool is_causal,
    c10::string_view cp_comm_type, std::optional<double> scale_arg,
    std::optional<int64_t> window_arg, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& cu_seqlens) {
  const Call call(query, key, value, group_name, cp, rank, is_causal, cp_comm_type, scale_arg,
                  window_arg, sinks, cu_seqlens);
  const auto q = query.contiguous();
  const auto finish = [&](Accumulator& acc) {
    if (has(sinks)) attention::apply_sinks(acc, local_sinks(*sinks, call));
    return acc.out().to(q.scalar_type()).contiguous();
  };
  if (cp == 1 || call.type == CommType::kA2A) {
    auto seq =
        cp == 1 ? std::vector<at::Tensor>{q, key, value} : heads_to_sequence({q, key, value}, call);
    for (auto& t : seq) t = t.contiguous();
    const auto whole = call.layout.whole();
    Accumulator acc(seq[0], value.size(3));
    attention::forward_blocks(seq[0], seq[1], seq[2], call.plan(whole, whole), call.scale, acc);
    auto out = finish(acc);
    if (cp > 1) out = sequence_to_heads({out}, call)[0];
    return {out.contiguous(), acc.lse().contiguous()};
  }
  const auto mine = call.layout.rank_pieces(rank);
  Accumulator acc(q, value.size(3));
  if (call.type == CommType::kAllGather) {
    const auto kv = gather_keys_values(key, value, call);
    attention::forward_blocks(q, kv[0], kv[1], call.plan(mine, call.layout.whole()), call.scale,
                              acc);
  } else {
    const auto pg = comm::resolve(call.group);
    const int next = static_cast<int>((rank + 1) % cp),
              prev = static_cast<int>((rank + cp - 1) % cp);
    KeyValue held{key.contiguous(), value.contiguous()};
    for (int64_t i = 0; i < cp; ++i) {
      std::optional<KeyValueExchange> ex;
      if (i + 1 < cp) ex = start_exchange(*pg, held, next, prev, kKvTag);
      const int64_t src = (rank - i + cp) % cp;
      attention::forward_blocks(q, held.k, held.v, call.plan(mine, call.layout.rank_pieces(src)),
                                call.scale, acc);
      if (ex) held = ex->wait();
    }
  }
  return {finish(acc), acc.lse().contiguous()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_impl(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
    c10::string_view group_name, int64_t cp, int64_t rank, bool is_causal,
    c10::string_view cp_comm_type, std::optional<double> scale_arg,
    std::optional<int64_t> window_arg, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& cu_seqlens) {
  const Call call(query, key, value, group_name, cp, rank, is_causal, cp_comm_type, scale_arg,
                  window_arg, sinks, cu_seqlens);
  const auto q = query.contiguous();
  const auto dout = grad_out.contiguous();
  const auto dtype = q.scalar_type();
  const auto acc = q.options().dtype(acc_type(q));
  at::Tensor dsinks = has(sinks) ? at::zeros_like(*sinks) : at::empty({0}, acc);
  if (cp == 1 || call.type == CommType::kA2A) {
    auto seq = cp == 1 ? std::vector<at::Tensor>{q, key, value, out, dout}
                       : heads_to_sequence({q, key, value, out, dout}, call);
    for (auto& t : seq) t = t.contiguous();
    at::Tensor dq, dk, dv;  // made by the blocks (one block's own, at cp 1 causal)
    const auto whole = call.layout.whole();
    attention::backward_blocks(seq[4], seq[0], seq[1], seq[2], seq[3], lse, call.plan(whole, whole),
                               call.scale, dq, dk, dv);
    for (auto [grad, like] : {std::pair{&dq, &seq[0]}, {&dk, &seq[1]}, {&dv, &seq[2]}}) {
      if (!grad->defined()) *grad = at::zeros(like->sizes(), acc);
    }
    if (has(sinks)) {
      local_sinks(dsinks, call)
          .copy_(attention::sink_grad(seq[4], seq[3], lse, local_sinks(*sinks, call)));
    }
    std::vector<at::Tensor> grads{dq.to(dtype), dk.to(dtype), dv.to(dtype)};
    dq.reset(), dk.reset(), dv.reset();  // the grads hold them now
    if (cp > 1) grads = sequence_to_heads(grads, call);
    // Contiguous, as the fake kernel says (a compiled graph checks the strides); one at a time, so
    // a kernel's own layout is freed before the next copy.
    for (auto& grad : grads) grad = grad.contiguous();
    return {grads[0], grads[1], grads[2], dsinks};
  }
  if (has(sinks)) dsinks = attention::sink_grad(dout, out, lse, *sinks);
  const auto mine = call.layout.rank_pieces(rank);
  auto dq = at::zeros(q.sizes(), acc);
  if (call.type == CommType::kAllGather) {
    const auto kv = gather_keys_values(key, value, call);
    auto dk = at::zeros(kv[0].sizes(), acc), dv = at::zeros(kv[1].sizes(), acc);
    attention::backward_blocks(dout, q, kv[0], kv[1], out, lse,
                               call.plan(mine, call.layout.whole()), call.scale, dq, dk, dv);
    const auto grads = scatter_key_value_grads(dk, dv, call);
    return {dq.to(dtype), grads[0].to(dtype).contiguous(), grads[1].to(dtype).contiguous(), dsinks};
  }
  const auto pg = comm::resolve(call.group);
  const int next = static_cast<int>((rank + 1) % cp), prev = static_cast<int>((rank + cp - 1) % cp);
  const int64_t groups = key.size(1), per_group = q.size(1) / groups;
  const int64_t step = groups_per_call(groups);
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
    const auto blocks = call.plan(mine, call.layout.rank_pieces(src));
    // A few key/value groups (and their query heads) per call.
    for (int64_t g = 0; g < groups && !blocks.empty(); g += step) {
      const auto heads = [&](const at::Tensor& t) {
        return t.narrow(1, g * per_group, step * per_group);
      };
      const auto kv_heads = [&](const at::Tensor& t) { return t.narrow(1, g, step); };
      auto dq_part = heads(dq), dk_part = kv_heads(dkv.k), dv_part = kv_heads(dkv.v);
      attention::backward_blocks(heads(dout), heads(q), kv_heads(held.k), kv_heads(held.v),
                                 heads(out), heads(lse), blocks, call.scale, dq_part, dk_part,
                                 dv_part);
    }
    grads_in_flight = start_exchange(*pg, dkv, prev, next, kGradKvTag);
    dkv = {};  // the exchange holds it until sent
    if (ex) held = ex->wait();
  }
  auto dkv = grads_in_flight->wait();
  return {dq.to(dtype), dkv.k.to(dtype), dkv.v.to(dtype), dsinks};
}

using ForwardFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, c10::string_view, int64_t,
                                                     int64_t, bool, c10::string_view,
                                                     std::optional<double>, std::optional<int64_t>,
                                                     const std::optional<at::Tensor>&,
                                                     const std::optional<at::Tensor>&);
using BackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, c10::string_view, int64_t, int64_t, bool, c10::string_view,
    std::optional<double>, std::optional<int64_t>, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&);

std::optional<at::Tensor> optional_tensor(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

struct ContextParallelAttentionFunction : public Function<ContextParallelAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const std::string& group, int64_t cp, int64_t rank,
                            bool is_causal, const std::string& comm, std::optional<double> scale,
                            std::optional<int64_t> window, const std::optional<at::Tensor>& sinks,
                            const std::optional<at::Tensor>& cu_seqlens) {
    static const auto op = typed_op<ForwardFn>("context_parallel_attention_forward");
    ctx->saved_data["group"] = group;
    ctx->saved_data["cp"] = cp;
    ctx->saved_data["rank"] = rank;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window"] = window;
    if (has(cu_seqlens)) ctx->saved_data["cu_seqlens"] = *cu_seqlens;
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] =
        op.call(q, k, v, group, cp, rank, is_causal, comm, scale, window, sinks, cu_seqlens);
    ctx->save_for_backward({q, k, v, out, lse, has(sinks) ? *sinks : at::Tensor()});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BackwardFn>("context_parallel_attention_backward");
    const auto saved = ctx->get_saved_variables();
    variable_list result(12);
    if (!grads[0].defined()) return result;
    const auto scale = ctx->saved_data["scale"];
    const auto window = ctx->saved_data["window"];
    const auto packed = ctx->saved_data.find("cu_seqlens");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv, dsinks] = op.call(
        grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
        ctx->saved_data["group"].toStringRef(), ctx->saved_data["cp"].toInt(),
        ctx->saved_data["rank"].toInt(), ctx->saved_data["is_causal"].toBool(),
        ctx->saved_data["comm"].toStringRef(),
        scale.isNone() ? std::nullopt : std::optional<double>(scale.toDouble()),
        window.isNone() ? std::nullopt : std::optional<int64_t>(window.toInt()),
        optional_tensor(saved[5]),
        packed == ctx->saved_data.end() ? std::nullopt
                                        : std::optional<at::Tensor>(packed->second.toTensor()));
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    if (saved[5].defined()) result[10] = dsinks;
    return result;
  }
};

at::Tensor attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              c10::string_view group, int64_t cp, int64_t rank, bool is_causal,
                              c10::string_view comm, std::optional<double> scale,
                              std::optional<int64_t> window, const std::optional<at::Tensor>& sinks,
                              const std::optional<at::Tensor>& cu_seqlens) {
  // Checked here too, so a traced call (on fake tensors) raises the op's own errors; the values
  // of cu_seqlens are checked where they are read, in the forward.
  check_inputs(q, k, v, std::string(group), cp, rank, is_causal, comm_type(comm), window, sinks,
               cu_seqlens, {});
  return ContextParallelAttentionFunction::apply(q, k, v, std::string(group), cp, rank, is_causal,
                                                 std::string(comm), scale, window, sinks,
                                                 cu_seqlens);
}

at::Tensor attention_no_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 c10::string_view group, int64_t cp, int64_t rank, bool is_causal,
                                 c10::string_view comm, std::optional<double> scale,
                                 std::optional<int64_t> window,
                                 const std::optional<at::Tensor>& sinks,
                                 const std::optional<at::Tensor>& cu_seqlens) {
  return std::get<0>(
      forward_impl(q, k, v, group, cp, rank, is_causal, comm, scale, window, sinks, cu_seqlens));
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
