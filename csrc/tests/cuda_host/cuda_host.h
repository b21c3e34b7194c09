// Host emulation of the CUDA subset csrc/cuda uses, so that its kernels run, and are tested bit
// for bit against the CPU kernels, on a machine without a GPU. Device memory is host memory and
// streams are synchronous. A launch runs the grid's blocks one after another; the threads of a
// block run as cooperative fibers on the calling thread, so __syncthreads() and warp shuffles are
// real synchronization points: a fiber that reaches one waits until every thread of its block (or
// warp) has, and a kernel whose threads do not all reach it fails the launch instead of hanging.
// Launch configurations a GPU refuses (block of more than 1024 threads, dynamic shared memory past
// 48 KiB, an empty or oversized grid) fail as they would there. Only what the kernels use exists:
// 1-D grids and blocks, full-mask 32-lane shuffles, and the runtime calls of csrc/cuda.
//
// The CUDA sources are compiled as C++ after csrc/tests/cuda_host/hostify.py rewrote their launch
// syntax; the fake headers under include/ (cuda_runtime.h, cuda_fp16.h, ...) all lead here.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>

#include "core/half.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// Occupancy hints for the GPU's register allocator: nothing to do here.
#define __launch_bounds__(...)
// A function's static is its block's shared memory: blocks run one at a time.
#define __shared__ static

// ---- runtime types and calls ------------------------------------------------------------------
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// The thread's and block's coordinates, set by the launch for each fiber it resumes.
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

struct CUstream_st;
using cudaStream_t = CUstream_st*;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};

enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
};

// A 16-byte vector, loaded and stored as one access on a GPU (16-byte aligned there too).
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

namespace cuda_host {

// The error of the last launch (cudaGetLastError reads and clears it) and what went wrong.
cudaError_t take_error();
const std::string& last_failure();
void set_error(cudaError_t e, const std::string& why);

// Runs `body` for every thread of every block of the grid (see the file comment). Returns false
// (with the error recorded) for a configuration a GPU refuses or threads that diverge at a barrier.
bool run_grid(dim3 grid, dim3 block, size_t dynamic_shared_bytes, const std::function<void()>& body);

// The launch's dynamic shared memory (`extern __shared__ T name[]`, rewritten by hostify.py).
void* dynamic_shared_memory();
template <class T>
T* dynamic_shared() {
  return static_cast<T*>(dynamic_shared_memory());
}

// Barriers of the running block: the calling fiber waits until every live thread of the block
// (or of its warp) arrives. exchange_in_warp also swaps values: each lane offers `value` and gets
// the value lane `src_lane` offered.
void sync_block();
uint64_t exchange_in_warp(uint64_t value, unsigned src_lane, unsigned mask);

// `kernel<<<grid, block, smem, stream>>>(args...)` becomes launch(grid, block, smem, stream)(kernel, args...).
struct Launch {
  dim3 grid, block;
  size_t shared;
  template <class Kernel, class... Args>
  void operator()(Kernel kernel, Args... args) const {
    run_grid(grid, block, shared, [&] { kernel(args...); });
  }
};
inline Launch launch(dim3 grid, dim3 block, size_t shared = 0, cudaStream_t = nullptr) {
  return Launch{grid, block, shared};
}

}  // namespace cuda_host

inline cudaError_t cudaGetLastError() { return cuda_host::take_error(); }
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated CUDA error"; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t) {
  if (n != 0) std::memcpy(dst, src, n);
  return cudaSuccess;
}
template <class T>
cudaError_t cudaMallocAsync(T** p, size_t n, cudaStream_t) {
  *p = static_cast<T*>(std::malloc(n));
  return *p != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  std::free(p);
  return cudaSuccess;
}
// One emulated device with one SM: the kernels that cap their grid per SM then take their
// grid-stride loops several times already at moderate counts.
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0 || attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = 1;
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t) {
  if (n != 0) std::memset(p, value, n);
  return cudaSuccess;
}

// ---- device functions ------------------------------------------------------------------------
// Explicitly rounded arithmetic: plain IEEE operations, since the emulation is built with
// -ffp-contract=off (nothing fused), as the CPU kernels are.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
using std::max;
using std::min;

inline void __syncthreads() { cuda_host::sync_block(); }
// Blocks run one after another and a block's fibers switch only at barriers: a plain
// read-modify-write is atomic here.
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}

template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffled values are at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  const unsigned lane = threadIdx.x % 32;
  bits = cuda_host::exchange_in_warp(bits, width == 32 ? lane ^ static_cast<unsigned>(lane_mask) : 32, mask);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// ---- 16-bit floats: the bits, converted with braid's own (tested) converters -----------------
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __half2float(__half h) { return braid::f16_to_f32(h.bits); }
inline float __bfloat162float(__nv_bfloat16 h) { return braid::bf16_to_f32(h.bits); }
inline __half __float2half_rn(float f) { return __half{braid::f32_to_f16(f)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{braid::f32_to_bf16(f)}; }
inline __half __ushort_as_half(unsigned short bits) { return __half{bits}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return __nv_bfloat16{bits}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }

// ---- the cub and thrust pieces csrc/cuda uses ------------------------------------------------
namespace thrust {
template <class T>
struct counting_iterator {
  T first;
  explicit counting_iterator(T v) : first(v) {}
  T operator[](size_t i) const { return first + static_cast<T>(i); }
};
}  // namespace thrust

namespace cub {
struct DeviceSelect {
  // Writes the items for which `pred` holds, in order, and their number; with no temporary
  // storage, reports how much it needs (a byte: cub's protocol, not its amount).
  template <class In, class Out, class Num, class Pred>
  static cudaError_t If(void* temp, size_t& temp_bytes, In in, Out out, Num* num_selected, int num_items, Pred pred,
                        cudaStream_t = nullptr) {
    if (temp == nullptr) {
      temp_bytes = 1;
      return cudaSuccess;
    }
    if (num_items < 0) return cudaErrorInvalidValue;
    Num n = 0;
    for (int i = 0; i < num_items; ++i)
      if (pred(in[static_cast<size_t>(i)])) out[n++] = in[static_cast<size_t>(i)];
    *num_selected = n;
    return cudaSuccess;
  }
};
}  // namespace cub
