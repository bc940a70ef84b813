#pragma once
// The one way an op calls another registered op: a typed handle, looked up once per call site.
//
//   static const auto op = megatron_ext::typed_op<decltype(copy_region)>("copy_to_..._region");
//   op.call(x, group_name, group_size);
//
// ``Fn`` is the function type of the op's C++ signature (its schema's types), so a mismatch
// between the schema and the caller fails at the first call with the dispatcher's message.
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>

namespace megatron_ext {

template <typename Fn>
c10::TypedOperatorHandle<Fn> typed_op(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string("megatron_ext::") + name).c_str(), "")
      .template typed<Fn>();
}

}  // namespace megatron_ext
