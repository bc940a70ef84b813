#pragma once
// Run-time choice among the instruction sets the CPU kernels were compiled for, as ATen does for
// its own kernels (ATen/native/DispatchStub): each kernel file is compiled once per instruction
// set into its own ``CPU_CAPABILITY`` namespace, and the best one the running CPU supports is
// called, so the library never executes an instruction the CPU lacks.
#include <string>
#include <vector>

namespace megatron_ext::kernels {

enum class CpuCapability { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

// The capability the kernels use now: the best the CPU supports among those compiled, or the one
// named by MEGATRON_EXT_CPU_CAPABILITY ("default", "avx2", "avx512") when that is set.
CpuCapability cpu_capability();
std::string cpu_capability_name(CpuCapability capability);
// Names of the capabilities compiled into this build and supported by the running CPU.
std::vector<std::string> compiled_cpu_capabilities();
std::vector<std::string> supported_cpu_capabilities();
// Forces a capability (tests compare the variants); ValueError for one the CPU or build lacks.
void set_cpu_capability(const std::string& name);

}  // namespace megatron_ext::kernels
