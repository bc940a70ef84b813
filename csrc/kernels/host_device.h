#pragma once
// Marks functions shared by the CPU loops and the CUDA kernels.
#if defined(__CUDACC__)
#define MEGATRON_EXT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MEGATRON_EXT_HOST_DEVICE inline
#endif
