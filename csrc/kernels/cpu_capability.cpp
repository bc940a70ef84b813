#include "kernels/cpu_capability.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

namespace megatron_ext::kernels {
namespace {

bool compiled(CpuCapability c) {
  switch (c) {
    case CpuCapability::kDefault:
      return true;
#ifdef MEGATRON_EXT_CPU_AVX2
    case CpuCapability::kAvx2:
      return true;
#endif
#ifdef MEGATRON_EXT_CPU_AVX512
    case CpuCapability::kAvx512:
      return true;
#endif
    default:
      return false;
  }
}

bool supported_by_cpu(CpuCapability c) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  switch (c) {
    case CpuCapability::kDefault:
      return true;
    case CpuCapability::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") &&
             __builtin_cpu_supports("bmi2");
    case CpuCapability::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
  }
  return false;
#else
  return c == CpuCapability::kDefault;
#endif
}

bool usable(CpuCapability c) { return compiled(c) && supported_by_cpu(c); }

constexpr CpuCapability kAll[] = {CpuCapability::kDefault, CpuCapability::kAvx2,
                                  CpuCapability::kAvx512};

CpuCapability parse(const std::string& name) {
  for (const auto c : kAll) {
    if (cpu_capability_name(c) == name) return c;
  }
  TORCH_CHECK_VALUE(false, "unknown CPU capability '", name,
                    "'; expected one of default, avx2, avx512");
}

CpuCapability best() {
  if (const char* env = std::getenv("MEGATRON_EXT_CPU_CAPABILITY");
      env != nullptr && *env != '\0') {
    const auto c = parse(env);
    TORCH_CHECK_VALUE(usable(c), "MEGATRON_EXT_CPU_CAPABILITY=", env, " is not ",
                      compiled(c) ? "supported by this CPU" : "compiled into this build");
    return c;
  }
  auto chosen = CpuCapability::kDefault;
  for (const auto c : kAll) {
    if (usable(c)) chosen = c;
  }
  return chosen;
}

std::atomic<int>& current() {
  static std::atomic<int> value{static_cast<int>(best())};
  return value;
}

}  // namespace

CpuCapability cpu_capability() {
  return static_cast<CpuCapability>(current().load(std::memory_order_relaxed));
}

std::string cpu_capability_name(CpuCapability capability) {
  switch (capability) {
    case CpuCapability::kAvx2:
      return "avx2";
    case CpuCapability::kAvx512:
      return "avx512";
    default:
      return "default";
  }
}

std::vector<std::string> compiled_cpu_capabilities() {
  std::vector<std::string> names;
  for (const auto c : kAll) {
    if (compiled(c)) names.push_back(cpu_capability_name(c));
  }
  return names;
}

std::vector<std::string> supported_cpu_capabilities() {
  std::vector<std::string> names;
  for (const auto c : kAll) {
    if (usable(c)) names.push_back(cpu_capability_name(c));
  }
  return names;
}

void set_cpu_capability(const std::string& name) {
  const auto c = parse(name);
  TORCH_CHECK_VALUE(usable(c), "CPU capability '", name, "' is not ",
                    compiled(c) ? "supported by this CPU" : "compiled into this build");
  current().store(static_cast<int>(c), std::memory_order_relaxed);
}

}  // namespace megatron_ext::kernels
