#pragma once
// Conversions between 16-bit values and float a vector at a time, for the CPU kernel files that
// are compiled once per instruction set (kernels/cpu_capability.h): the functions live in that
// compilation's CPU_CAPABILITY namespace, so each instruction set has its own.
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

namespace megatron_ext::kernels::CPU_CAPABILITY {

// The accumulation type: double for double, float for float and the 16-bit types.
template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Converts n 16-bit values to float.
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  using VecS = at::vec::Vectorized<scalar_t>;
  constexpr int64_t L = VecS::size();
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    auto [lo, hi] = at::vec::convert_to_float<scalar_t>(VecS::loadu(src + j));
    lo.store(dst + j);
    hi.store(dst + j + L / 2);
  }
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

// Rounds n floats to a 16-bit type.
template <typename scalar_t>
inline void from_float(const float* src, scalar_t* dst, int64_t n) {
  using VecF = at::vec::Vectorized<float>;
  constexpr int64_t L = at::vec::Vectorized<scalar_t>::size();
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    at::vec::convert_from_float<scalar_t>(VecF::loadu(src + j), VecF::loadu(src + j + L / 2))
        .store(dst + j);
  }
  for (; j < n; ++j) dst[j] = static_cast<scalar_t>(src[j]);
}

}  // namespace megatron_ext::kernels::CPU_CAPABILITY
