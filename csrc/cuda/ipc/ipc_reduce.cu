// The CUDA IPC reduction: a grid-stride loop over 16-byte vectors (each thread reduces one vector
// of every source per step, in source order), with scalar elements where the pointers' alignment
// leaves no whole vector. Same operators, order and rounding as reduce_n (csrc/core/reduce.cc).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ipc_reduce.h"

namespace braid {
namespace cuda {
namespace {

// Peer reads cross NVLink with a microsecond or two of latency, so the device needs megabytes of
// loads in flight. ptxas issues a step's loads of every source before combining them (68-73
// registers on sm_90), so a thread has one 16-byte load per source outstanding; at that register
// count an SM of an H100/H200 holds 3 blocks of 256 threads (one of 512), i.e. 96 KB in flight
// per SM for 8 sources. The grid asks for 8 blocks per SM, the 2048 threads an SM can hold, and
// loops over the rest. No shared memory: each thread reduces its own elements.
constexpr unsigned kThreads = 256;
constexpr unsigned kBlocksPerSm = 8;
constexpr size_t kVectorBytes = 16;

// The source pointers by value (kernel parameters live in constant memory, read by every thread).
struct Sources {
  const void* ptr[kMaxIpcRanks];
};

// Element types: Bits as stored, Acc as accumulated (float32 for the half types, as in reduce.cc).
template <class T>
struct Native {
  using Bits = T;
  using Acc = T;
  __device__ __forceinline__ static Acc load(Bits x) { return x; }
  __device__ __forceinline__ static Bits store(Acc x) { return x; }
};
// The 16-bit floats are rounded to nearest even, as reduce_n does; a NaN becomes the one NaN
// reduce_n writes (the GPU's conversions would write 0x7FFF), so both paths agree bit for bit.
struct Float16 {
  using Bits = uint16_t;
  using Acc = float;
  __device__ __forceinline__ static float load(uint16_t x) { return __half2float(__ushort_as_half(x)); }
  __device__ __forceinline__ static uint16_t store(float x) {
    return x != x ? uint16_t(0x7E00) : __half_as_ushort(__float2half_rn(x));
  }
};
struct BFloat16 {
  using Bits = uint16_t;
  using Acc = float;
  __device__ __forceinline__ static float load(uint16_t x) { return __bfloat162float(__ushort_as_bfloat16(x)); }
  __device__ __forceinline__ static uint16_t store(float x) {
    return x != x ? uint16_t(0x7FC0) : __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
};

// reduce.cc's operators: integers wrap (computed in the unsigned type, where wrapping is defined),
// NaN propagates through max and min. No product feeds a sum, so nvcc's FMA contraction cannot
// change a result.
template <class A>
using Wrap = typename std::conditional_t<std::is_integral_v<A>, std::make_unsigned<A>, std::common_type<A>>::type;
struct SumOp {
  template <class A> __device__ __forceinline__ static A apply(A a, A b) { return static_cast<A>(Wrap<A>(a) + Wrap<A>(b)); }
};
struct ProdOp {
  template <class A> __device__ __forceinline__ static A apply(A a, A b) { return static_cast<A>(Wrap<A>(a) * Wrap<A>(b)); }
};
struct MaxOp {
  template <class A> __device__ __forceinline__ static A apply(A a, A b) { return (a >= b || a != a) ? a : b; }
};
struct MinOp {
  template <class A> __device__ __forceinline__ static A apply(A a, A b) { return (a <= b || a != a) ? a : b; }
};
struct BandOp {
  template <class A> __device__ __forceinline__ static A apply(A a, A b) { return static_cast<A>(a & b); }
};
struct BorOp {
  template <class A> __device__ __forceinline__ static A apply(A a, A b) { return static_cast<A>(a | b); }
};
struct BxorOp {
  template <class A> __device__ __forceinline__ static A apply(A a, A b) { return static_cast<A>(a ^ b); }
};

// avg's division: IEEE-rounded for float32 whatever the compile flags (reduce.cc divides in
// float32 for the half types too), truncating for integers, as in C++.
template <class A> __device__ __forceinline__ A divide(A a, A d) { return static_cast<A>(a / d); }
__device__ __forceinline__ float divide(float a, float d) { return __fdiv_rn(a, d); }

// 16 bytes of elements, read and written as one vector access.
template <class Bits>
union Vector {
  uint4 raw;
  Bits e[kVectorBytes / sizeof(Bits)];
};

// Element-wise over [0, count): elements [head, head + nvec * lanes) as vectors (every pointer
// advanced by `head` elements is 16-byte aligned), the `head` elements before them and the tail
// after them as scalars. `divisor` > 1: the sum is divided by it (avg).
template <class E, class Op>
__global__ void __launch_bounds__(kThreads)
    ipc_reduce_kernel(void* dst, Sources srcs, int nsrcs, size_t head, size_t nvec, size_t count, int divisor) {
  using Bits = typename E::Bits;
  using Acc = typename E::Acc;
  constexpr int kLanes = kVectorBytes / sizeof(Bits);
  const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const Acc d = static_cast<Acc>(divisor);
  for (size_t v = first; v < nvec; v += stride) {
    Acc acc[kLanes];
    Vector<Bits> in;
    in.raw = reinterpret_cast<const uint4*>(static_cast<const Bits*>(srcs.ptr[0]) + head)[v];
#pragma unroll
    for (int k = 0; k < kLanes; ++k) acc[k] = E::load(in.e[k]);
    // Unrolled over every possible source: constant indices read the pointers straight from the
    // parameters (a loop to nsrcs would copy them to local memory first), and the loads of
    // several sources can be in flight together. The combining order stays srcs[0], srcs[1], ...
#pragma unroll
    for (int j = 1; j < kMaxIpcRanks; ++j) {
      if (j < nsrcs) {
        in.raw = reinterpret_cast<const uint4*>(static_cast<const Bits*>(srcs.ptr[j]) + head)[v];
#pragma unroll
        for (int k = 0; k < kLanes; ++k) acc[k] = Op::apply(acc[k], E::load(in.e[k]));
      }
    }
    Vector<Bits> out;
#pragma unroll
    for (int k = 0; k < kLanes; ++k) out.e[k] = E::store(divisor > 1 ? divide(acc[k], d) : acc[k]);
    reinterpret_cast<uint4*>(static_cast<Bits*>(dst) + head)[v] = out.raw;
  }
  // Scalars: the head, then the tail from `tail` on (all of [0, count) when head == count).
  const size_t tail = head + nvec * kLanes;
  const size_t scalars = head + (count - tail);
  for (size_t s = first; s < scalars; s += stride) {
    const size_t i = s < head ? s : tail + (s - head);
    Acc acc = E::load(static_cast<const Bits*>(srcs.ptr[0])[i]);
#pragma unroll
    for (int j = 1; j < kMaxIpcRanks; ++j)
      if (j < nsrcs) acc = Op::apply(acc, E::load(static_cast<const Bits*>(srcs.ptr[j])[i]));
    static_cast<Bits*>(dst)[i] = E::store(divisor > 1 ? divide(acc, d) : acc);
  }
}

template <class E, class Op>
cudaError_t launch(void* dst, const Sources& srcs, int nsrcs, size_t count, int divisor, cudaStream_t stream) {
  using Bits = typename E::Bits;
  constexpr size_t kLanes = kVectorBytes / sizeof(Bits);
  // Vectors need every pointer at the same offset from a 16-byte boundary (tensors offset by the
  // same number of elements, as in-place slices are): the elements up to the boundary go first,
  // as scalars. Pointers at different offsets take the scalar loop throughout.
  const uintptr_t offset = reinterpret_cast<uintptr_t>(dst) % kVectorBytes;
  bool vectors = offset % sizeof(Bits) == 0;
  for (int j = 0; j < nsrcs; ++j) vectors = vectors && reinterpret_cast<uintptr_t>(srcs.ptr[j]) % kVectorBytes == offset;
  size_t head = count, nvec = 0;
  if (vectors) {
    head = (kVectorBytes - offset) % kVectorBytes / sizeof(Bits);
    if (head > count) head = count;
    nvec = (count - head) / kLanes;
  }
  const size_t items = nvec + (count - nvec * kLanes);  // what the threads share: vectors and scalars
  int device = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  // Small calls take fewer threads (whole warps), large ones the capped grid.
  const unsigned threads = items >= kThreads ? kThreads : static_cast<unsigned>((items + 31) / 32 * 32);
  const size_t wanted = (items + threads - 1) / threads;
  const size_t cap = static_cast<size_t>(sms) * kBlocksPerSm;
  const unsigned grid = static_cast<unsigned>(wanted < cap ? wanted : cap);
  ipc_reduce_kernel<E, Op><<<grid, threads, 0, stream>>>(dst, srcs, nsrcs, head, nvec, count, divisor);
  return cudaGetLastError();
}

template <class E>
cudaError_t launch_op(ReduceOp op, void* dst, const Sources& srcs, int nsrcs, size_t count, int divisor,
                      cudaStream_t stream) {
  switch (op) {
    case ReduceOp::kSum: return launch<E, SumOp>(dst, srcs, nsrcs, count, 0, stream);
    case ReduceOp::kAvg: return launch<E, SumOp>(dst, srcs, nsrcs, count, divisor, stream);
    case ReduceOp::kProd: return launch<E, ProdOp>(dst, srcs, nsrcs, count, 0, stream);
    case ReduceOp::kMax: return launch<E, MaxOp>(dst, srcs, nsrcs, count, 0, stream);
    case ReduceOp::kMin: return launch<E, MinOp>(dst, srcs, nsrcs, count, 0, stream);
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      if constexpr (std::is_integral_v<typename E::Acc>) {
        if (op == ReduceOp::kBand) return launch<E, BandOp>(dst, srcs, nsrcs, count, 0, stream);
        if (op == ReduceOp::kBor) return launch<E, BorOp>(dst, srcs, nsrcs, count, 0, stream);
        return launch<E, BxorOp>(dst, srcs, nsrcs, count, 0, stream);
      } else {
        return cudaErrorInvalidValue;
      }
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_ipc_reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op,
                              int divisor, cudaStream_t stream) {
  if (nsrcs < 1 || nsrcs > kMaxIpcRanks || !op_supports(op, dtype)) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  Sources s{};
  for (int j = 0; j < nsrcs; ++j) {
    if (srcs[j] == nullptr) return cudaErrorInvalidValue;
    s.ptr[j] = srcs[j];
  }
  if (dst == nullptr) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return launch_op<Native<float>>(op, dst, s, nsrcs, count, divisor, stream);
    case DType::kFloat64: return launch_op<Native<double>>(op, dst, s, nsrcs, count, divisor, stream);
    case DType::kFloat16: return launch_op<Float16>(op, dst, s, nsrcs, count, divisor, stream);
    case DType::kBFloat16: return launch_op<BFloat16>(op, dst, s, nsrcs, count, divisor, stream);
    case DType::kInt32: return launch_op<Native<int32_t>>(op, dst, s, nsrcs, count, divisor, stream);
    case DType::kInt64: return launch_op<Native<int64_t>>(op, dst, s, nsrcs, count, divisor, stream);
    case DType::kUInt8: return launch_op<Native<uint8_t>>(op, dst, s, nsrcs, count, divisor, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace braid
