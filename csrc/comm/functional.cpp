#include "comm/functional.h"

#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/python_variable.h>

#include <pybind11/pybind11.h>

#include "comm/process_group.h"
#include "torch_compat.h"

namespace megatron_ext::comm {
namespace {

// The ``_c10d_functional`` schemas take ``Any group_name``, which has no unboxed C++ type to name
// in ``typed<>``: these ops are called boxed.
c10::OperatorHandle functional_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor call(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

std::string error_text(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e))
    return error->what_without_backtrace();
  return e.what();
}

// The message of megatron_ext.comm_errors.failure_message, the one writer of these messages; the
// bare facts where Python cannot be asked.
std::string failure_message(const std::string& what, const std::string& group_name,
                            const at::Tensor& tensor, const std::string& error, bool waiting) {
  if (Py_IsInitialized()) {
    pybind11::gil_scoped_acquire gil;
    try {
      auto errors = pybind11::module_::import("megatron_ext.comm_errors");
      auto write = errors.attr("_failure_message_of_group_name");
      pybind11::object py_tensor = pybind11::none();
      if (tensor.defined())
        py_tensor = pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(tensor));
      return write(what, group_name, py_tensor, error, waiting).cast<std::string>();
    } catch (const std::exception&) {  // the Python error is dropped here, under the GIL
    }
  }
  return what + " over process group '" + group_name + "' failed: " + error;
}

// A collective failed when started (``waiting`` false: the backend refused it) or waited on.
[[noreturn]] void fail(const std::string& what, const std::string& group_name,
                       const at::Tensor& tensor, const std::exception& e, bool waiting) {
  C10_THROW_ERROR(DistBackendError,
                  failure_message(what, group_name, tensor, error_text(e), waiting));
}

std::string operation(const char* kind, const std::string& where) {
  return where.empty() ? std::string(kind) : std::string(kind) + " in " + where;
}

template <typename Fn>
Pending started(const char* kind, const at::Tensor& input, const std::string& group_name,
                const std::string& where, Fn&& fn) {
  Pending pending;
  try {
    pending = fn();
  } catch (const std::exception& e) {
    if (!is_plain(input)) throw;  // a tracer's own error (a graph break, a guard) passes unchanged
    fail(operation(kind, where), group_name, input, e, /*waiting=*/false);
  }
  if (!pending.input.defined()) pending.input = input;
  pending.what = operation(kind, where);
  pending.group_name = group_name;
  return pending;
}

// Hides the collectives on real tensors from Python dispatch modes (opcheck's schema checker): a
// mode sees the region, not c10d's internal ops.
c10::impl::ExcludeDispatchKeyGuard hide_from_modes() {
  return c10::impl::ExcludeDispatchKeyGuard(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
}

const char* reduce_op_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      return "sum";
    case c10d::ReduceOp::MAX:
      return "max";
    default:
      TORCH_CHECK(false, "comm: unsupported reduce op ", static_cast<int>(op));
  }
}

c10::intrusive_ptr<c10d::Work> all_reduce_async_(const at::Tensor& tensor, c10d::ProcessGroup& pg,
                                                 c10d::ReduceOp::RedOpType op) {
  TORCH_CHECK(tensor.is_contiguous(), "comm: an all-reduce in place needs a contiguous tensor");
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(op);
  return pg.allreduce(tensors, opts);
}

// A sum over two CPU ranks into a new tensor, without first copying the input: each rank sends
// its tensor to the other, receives the other's into the output and adds its own. One round
// moves the whole tensor each way, as much as the ring's two rounds of half, with no copy before.
// Both ranks compute the same two-operand sum, so they agree bitwise. Only from kExchangeBytes
// on: below, a copy costs next to nothing, and gloo's point-to-point wake-ups make a small
// exchange slower than its all-reduce when the ranks share cores with other work.
constexpr int kExchangeTag = 0x4d45;
constexpr int64_t kExchangeBytes = int64_t{1} << 20;

bool exchanges(const at::Tensor& input, const c10d::ProcessGroup& pg) {
  const auto t = input.scalar_type();
  return pg.getSize() == 2 && input.device().is_cpu() &&
         input.numel() * input.element_size() >= kExchangeBytes &&
         (at::isFloatingType(t) || at::isIntegralType(t, /*includeBool=*/false));
}

Pending start_exchange_sum(const at::Tensor& input, c10d::ProcessGroup& pg) {
  auto mine = input.contiguous();
  auto out = at::empty(mine.sizes(), mine.options());
  const int peer = 1 - pg.getRank();
  std::vector<at::Tensor> from{out}, to{mine};
  auto recv = pg.recv(from, peer, kExchangeTag);
  auto send = pg.send(to, peer, kExchangeTag);
  return {out, recv, send, mine};
}

}  // namespace

bool is_plain(const at::Tensor& x) {
  constexpr auto kWrapped =
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                           c10::DispatchKey::Functionalize});
  return !x.key_set().has_any(kWrapped) && !x.is_meta();
}

Pending start_all_reduce(const at::Tensor& input, const std::string& group_name,
                         const std::string& where, c10d::ReduceOp::RedOpType op) {
  return started("all-reduce", input, group_name, where, [&]() -> Pending {
    if (is_plain(input)) {
      auto hidden = hide_from_modes();
      const auto pg = resolve(group_name);
      if (op == c10d::ReduceOp::SUM && exchanges(input, *pg)) return start_exchange_sum(input, *pg);
      auto out = input.clone(at::MemoryFormat::Contiguous);
      auto work = all_reduce_async_(out, *pg, op);
      return {out, work};
    }
    static const auto all_reduce = functional_op("_c10d_functional::all_reduce");
    return {call(all_reduce, {input, std::string(reduce_op_name(op)), group_name}), nullptr};
  });
}

Pending start_all_reduce_owned(at::Tensor owned, const std::string& group_name,
                               const std::string& where) {
  // One reference: the caller moved its only handle in, so nobody else can see the change.
  const bool stealable = is_plain(owned) && owned.is_contiguous() && !owned.is_view() &&
                         owned.use_count() == 1 && owned.storage().use_count() == 1;
  if (!stealable) return start_all_reduce(owned, group_name, where);
  return start_all_reduce_inplace(owned, group_name, where);
}

Pending start_all_reduce_inplace(const at::Tensor& tensor, const std::string& group_name,
                                 const std::string& where) {
  return started("all-reduce", tensor, group_name, where, [&]() -> Pending {
    if (is_plain(tensor)) {
      auto hidden = hide_from_modes();
      auto work = all_reduce_async_(tensor, *resolve(group_name), c10d::ReduceOp::SUM);
      return {tensor, work};
    }
    static const auto all_reduce_ = functional_op("_c10d_functional::all_reduce_");
    return {call(all_reduce_, {tensor, std::string("sum"), group_name}), nullptr};
  });
}

Pending start_all_gather_dim0(const at::Tensor& input, int64_t group_size,
                              const std::string& group_name, const std::string& where) {
  return started("all-gather", input, group_name, where, [&]() -> Pending {
    auto local = input.contiguous();
    if (is_plain(input)) {
      auto hidden = hide_from_modes();
      auto sizes = local.sizes().vec();
      sizes[0] *= group_size;
      auto gathered = at::empty(sizes, local.options());
      const auto pg = resolve(group_name);
#if MEGATRON_EXT_TORCH_2_13
      auto work = pg->all_gather_single(gathered, local);
#else
      auto work = pg->_allgather_base(gathered, local);
#endif
      return {gathered, work};
    }
    static const auto all_gather = functional_op("_c10d_functional::all_gather_into_tensor");
    return {call(all_gather, {local, group_size, group_name}), nullptr};
  });
}

Pending start_reduce_scatter_dim0(const at::Tensor& input, int64_t group_size,
                                  const std::string& group_name, const std::string& where) {
  return started("reduce-scatter", input, group_name, where, [&]() -> Pending {
    auto stacked = input.contiguous();
    if (is_plain(input)) {
      auto hidden = hide_from_modes();
      auto sizes = stacked.sizes().vec();
      sizes[0] /= group_size;
      auto out = at::empty(sizes, stacked.options());
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      const auto pg = resolve(group_name);
#if MEGATRON_EXT_TORCH_2_13
      auto work = pg->reduce_scatter_single(out, stacked, opts);
#else
      auto work = pg->_reduce_scatter_base(out, stacked, opts);
#endif
      return {out, work};
    }
    static const auto reduce_scatter = functional_op("_c10d_functional::reduce_scatter_tensor");
    return {call(reduce_scatter, {stacked, std::string("sum"), group_size, group_name}), nullptr};
  });
}

Pending start_all_to_all_dim0(const at::Tensor& input,
                              const std::vector<int64_t>& output_split_sizes,
                              const std::vector<int64_t>& input_split_sizes, int64_t group_size,
                              const std::string& group_name, const std::string& where) {
  return started("all-to-all", input, group_name, where, [&]() -> Pending {
    auto local = input.contiguous();
    std::vector<int64_t> out_splits = output_split_sizes;
    std::vector<int64_t> in_splits = input_split_sizes;
    const int64_t chunk = local.size(0) / group_size;
    if (out_splits.empty()) out_splits.assign(group_size, chunk);
    if (in_splits.empty()) in_splits.assign(group_size, chunk);
    if (is_plain(input)) {
      auto hidden = hide_from_modes();
      auto sizes = local.sizes().vec();
      sizes[0] = 0;
      for (const int64_t s : out_splits) sizes[0] += s;
      auto out = at::empty(sizes, local.options());
      const auto pg = resolve(group_name);
#if MEGATRON_EXT_TORCH_2_13
      auto work = pg->all_to_all_single(out, local, out_splits, in_splits);
#else
      auto work = pg->alltoall_base(out, local, out_splits, in_splits);
#endif
      return {out, work};
    }
    static const auto all_to_all = functional_op("_c10d_functional::all_to_all_single");
    return {call(all_to_all, {local, out_splits, in_splits, group_name}), nullptr};
  });
}

at::Tensor wait(Pending pending) {
  try {
    if (pending.work) {
      auto hidden = hide_from_modes();
      pending.work->wait();
      if (pending.send) {
        pending.send->wait();
        pending.tensor.add_(pending.input);
      }
      // A new handle on the result: the backend may still hold the tensor for a moment after the
      // wait, and a gradient somebody else references is one AccumulateGrad copies.
      return pending.tensor.variable_data();
    }
    static const auto wait_tensor = functional_op("_c10d_functional::wait_tensor");
    return call(wait_tensor, {pending.tensor});
  } catch (const std::exception& e) {
    if (!pending.work) throw;
    fail(pending.what, pending.group_name, pending.input, e, /*waiting=*/true);
  }
}

}  // namespace megatron_ext::comm
