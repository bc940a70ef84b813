#include "comm/functional.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "comm/process_group.h"

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

// A backend failure (a dtype gloo cannot move, a lost peer) is rethrown naming the operation,
// dtype, device, group and backend.
[[noreturn]] void rethrow(const char* what, const at::Tensor& input, const std::string& group_name,
                          const std::exception& e) {
  TORCH_CHECK(false, what, " of a ", input.scalar_type(), " tensor on ", input.device(),
              " over process group '", group_name, "' (backend ",
              resolve(group_name)->getBackendName(), ") failed: ", e.what());
}

template <typename Fn>
Pending guarded(const char* what, const at::Tensor& input, const std::string& group_name, Fn&& fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    rethrow(what, input, group_name, e);
  }
}

// Hides the collectives on real tensors from Python dispatch modes (opcheck's schema checker): a
// mode sees the region, not c10d's internal ops.
c10::impl::ExcludeDispatchKeyGuard hide_from_modes() {
  return c10::impl::ExcludeDispatchKeyGuard(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
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
  constexpr auto kWrapped = c10::DispatchKeySet(
      {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::Functionalize});
  return !x.key_set().has_any(kWrapped) && !x.is_meta();
}

Pending start_all_reduce(const at::Tensor& input, const std::string& group_name) {
  return guarded("all-reduce", input, group_name, [&]() -> Pending {
    if (is_plain(input)) {
      auto hidden = hide_from_modes();
      const auto pg = resolve(group_name);
      if (exchanges(input, *pg)) return start_exchange_sum(input, *pg);
      auto out = input.clone(at::MemoryFormat::Contiguous);
      auto work = all_reduce_async_(out, group_name);
      return {out, work};
    }
    static const auto op = functional_op("_c10d_functional::all_reduce");
    return {call(op, {input, std::string("sum"), group_name}), nullptr};
  });
}

Pending start_all_reduce_owned(at::Tensor owned, const std::string& group_name) {
  // One reference: the caller moved its only handle in, so nobody else can see the change.
  const bool stealable = is_plain(owned) && owned.is_contiguous() && !owned.is_view() &&
                         owned.use_count() == 1 && owned.storage().use_count() == 1;
  if (!stealable) return start_all_reduce(owned, group_name);
  return guarded("all-reduce", owned, group_name, [&]() -> Pending {
    auto hidden = hide_from_modes();
    auto work = all_reduce_async_(owned, group_name);
    return {owned, work};
  });
}

Pending start_all_gather_dim0(const at::Tensor& input, int64_t group_size,
                              const std::string& group_name) {
  return guarded("all-gather", input, group_name, [&]() -> Pending {
    if (is_plain(input)) {
      auto hidden = hide_from_modes();
      auto [out, work] = all_gather_first_dim_async(input, group_name);
      return {out, work};
    }
    static const auto op = functional_op("_c10d_functional::all_gather_into_tensor");
    return {call(op, {input.contiguous(), group_size, group_name}), nullptr};
  });
}

Pending start_reduce_scatter_dim0(const at::Tensor& input, int64_t group_size,
                                  const std::string& group_name) {
  return guarded("reduce-scatter", input, group_name, [&]() -> Pending {
    auto stacked = input.contiguous();
    if (is_plain(input)) {
      auto hidden = hide_from_modes();
      auto sizes = stacked.sizes().vec();
      sizes[0] /= group_size;
      auto out = at::empty(sizes, stacked.options());
      auto work = reduce_scatter_first_dim_async(out, stacked, group_name);
      return {out, work};
    }
    static const auto op = functional_op("_c10d_functional::reduce_scatter_tensor");
    return {call(op, {stacked, std::string("sum"), group_size, group_name}), nullptr};
  });
}

at::Tensor wait(Pending pending, const char* what, const std::string& group_name) {
  try {
    if (pending.work) {
      auto hidden = hide_from_modes();
      pending.work->wait();
      if (pending.send) {
        pending.send->wait();
        pending.tensor.add_(pending.addend);
      }
      // A new handle on the result: the backend may still hold the tensor for a moment after the
      // wait, and a gradient somebody else references is one AccumulateGrad copies.
      return pending.tensor.variable_data();
    }
    static const auto op = functional_op("_c10d_functional::wait_tensor");
    return call(op, {pending.tensor});
  } catch (const c10::Error& e) {
    rethrow(what, pending.tensor, group_name, e);
  }
}

}  // namespace megatron_ext::comm
