// Element loads/stores and explicitly rounded arithmetic shared by the CUDA compression kernels.
// nvcc contracts a * b + c into an FMA by default; the _rn intrinsics keep every operation
// rounded as on the CPU (built with -ffp-contract=off), so both produce the same bits.
#pragma once

#include <cfloat>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace braid {
namespace cuda {

__device__ __forceinline__ float load_f32(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float load_f32(const __nv_bfloat16* p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float load_f32(const __half* p, size_t i) { return __half2float(p[i]); }

template <class T> __device__ __forceinline__ T store_f32(float x);
template <> __device__ __forceinline__ float store_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 store_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half store_f32<__half>(float x) { return __float2half_rn(x); }

// Threads per block of the element-wise kernels and grid size for `n` elements: the grid is
// capped, so every element-wise kernel must loop with stride() (a grid-stride loop).
constexpr int kThreads = 256;
inline unsigned grid_for(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 * 8 ? (blocks == 0 ? 1 : blocks) : 65535 * 8);
}

// A residual entry as kept: non-finite values become 0 (see the CPU's finite_or_zero).
__device__ __forceinline__ float finite_or_zero(float d) { return fabsf(d) <= FLT_MAX ? d : 0.0f; }

__device__ __forceinline__ size_t stride() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

}  // namespace cuda
}  // namespace braid
