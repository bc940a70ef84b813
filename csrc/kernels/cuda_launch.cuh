// Launch shapes and indexing shared by the CUDA kernels: the block size, grid-stride loop
// indices, grid sizes bounded by the device's multiprocessors, and 16-byte packs of elements.
#pragma once

#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace megatron_ext {
namespace kernels {

constexpr int kThreads = 256;

inline int64_t multiprocessors() {
  return static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
}

// Blocks of kThreads for a grid-stride loop over `work` items: one item per thread, at most
// 8 blocks per multiprocessor.
inline int64_t blocks_for(int64_t work) {
  return std::max<int64_t>(
      1, std::min<int64_t>((work + kThreads - 1) / kThreads, multiprocessors() * 8));
}

// Blocks for kernels whose blocks stride over rows: one row per block, at most 32 blocks per
// multiprocessor.
inline unsigned int row_blocks(int64_t rows) {
  return static_cast<unsigned int>(
      std::max<int64_t>(1, std::min<int64_t>(rows, multiprocessors() * 32)));
}

__device__ __forceinline__ int64_t global_thread() {
  return blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_threads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// V consecutive elements, loaded and stored as one access (aligned to their size).
template <typename scalar_t, int V>
struct alignas(sizeof(scalar_t) * V) Lanes {
  static constexpr int kSize = V;
  scalar_t v[V];
};

// 16 bytes of elements.
template <typename scalar_t>
using Pack = Lanes<scalar_t, 16 / sizeof(scalar_t)>;

// Whether the pack kernels apply: rows a whole number of packs, every tensor 16-byte aligned.
template <typename scalar_t>
bool packs_fit(int64_t h, std::initializer_list<const void*> pointers) {
  if (h % Pack<scalar_t>::kSize != 0) return false;
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// The packs starting at p (16-byte aligned), on the host (a kernel's arguments) or in a kernel.
template <typename scalar_t>
__host__ __device__ __forceinline__ const Pack<scalar_t>* as_packs(const scalar_t* p) {
  return reinterpret_cast<const Pack<scalar_t>*>(p);
}

template <typename scalar_t>
__host__ __device__ __forceinline__ Pack<scalar_t>* as_packs(scalar_t* p) {
  return reinterpret_cast<Pack<scalar_t>*>(p);
}

}  // namespace kernels
}  // namespace megatron_ext
