// CUDA block quantization: one warp per quantization block (a warp takes several when there are
// more than the grid holds): its absmax reduced with warp shuffles, then each value rounded
// (nearest or stochastic from the same counter-based stream as the CPU) and packed. Dequantizing:
// one thread block per quantization block.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../../core/compression/counter_rng.h"
#include "compression_cuda.h"
#include "device_math.cuh"

namespace braid {
namespace cuda {
namespace {

// Layout of one chunk, computed on the host from QuantFormat.
struct Layout {
  size_t chunk;             // elements per chunk
  size_t blocks_per_chunk;  // scales per chunk
  size_t chunk_bytes;       // fmt.bytes(chunk)
  size_t value_bytes;       // fmt.value_bytes(chunk)
  size_t scales_offset;     // fmt.scales_offset(chunk)
  size_t block;
  int bits;
  float qmax;
};

Layout layout_of(QuantFormat fmt, size_t chunk) {
  return Layout{chunk, fmt.blocks(chunk), fmt.bytes(chunk), fmt.value_bytes(chunk), fmt.scales_offset(chunk),
                fmt.block, fmt.bits, static_cast<float>(fmt.qmax())};
}

// Thread blocks launched for `n` quantization blocks: the kernels loop over the rest (a grid is at
// most 2^31 - 1 blocks wide, and tiny quantization blocks on a large tensor can need more).
constexpr size_t kMaxGrid = size_t(1) << 20;
unsigned grid_of(size_t n) { return static_cast<unsigned>(n < kMaxGrid ? n : kMaxGrid); }

// Quantization: one warp per quantization block, kQuantizeWarps warps per thread block. A warp
// needs no shared memory and no block-wide barrier: its lanes take the block's absmax with
// shuffles, then round what they read again (from L1: the warp has just read it).
constexpr unsigned kQuantizeWarps = 8;

// x as quantized: the input plus its error-feedback residual, when there is one.
template <class T>
__device__ __forceinline__ float with_residual(const T* in, const float* residual, size_t i) {
  return residual != nullptr ? __fadd_rn(load_f32(in, i), residual[i]) : load_f32(in, i);
}

// Element i of the block rounded (nearest, or stochastic from the CPU's counter-based stream) and
// clamped; its residual, when kept, becomes what the rounding lost.
template <class T>
__device__ __forceinline__ float quantize_one(const T* in, float* residual, size_t i, float inv, float scale,
                                              float qmax, bool stochastic, RngKey key, uint64_t index_base) {
  const float x = with_residual(in, residual, i);
  const float v = __fmul_rn(x, inv);
  float q = stochastic ? floorf(__fadd_rn(v, uniform01(key, index_base + i))) : rintf(v);
  q = fminf(qmax, fmaxf(-qmax, q));
  if (residual != nullptr) residual[i] = finite_or_zero(__fsub_rn(x, __fmul_rn(q, scale)));
  return q;
}

template <class T>
__global__ void quantize_kernel(Layout L, size_t nblocks, const T* __restrict__ in, float* __restrict__ residual,
                                size_t count, bool stochastic, RngKey key, uint64_t index_base,
                                uint8_t* __restrict__ out) {
  const unsigned lane = threadIdx.x & 31;
  const size_t warps = static_cast<size_t>(gridDim.x) * (blockDim.x / 32);
  for (size_t g = blockIdx.x * static_cast<size_t>(blockDim.x / 32) + threadIdx.x / 32; g < nblocks; g += warps) {
    const size_t j = g / L.blocks_per_chunk, b = g % L.blocks_per_chunk;
    const size_t first = j * L.chunk + b * L.block;  // element index of the block's first element
    const size_t mb = min(L.block, L.chunk - b * L.block);
    const size_t m = first < count ? min(mb, count - first) : 0;
    // The largest magnitude compared as bit patterns, as the CPU does, so that a NaN in the block
    // is the maximum (fmaxf would skip it, and the NaN would then be encoded as -qmax instead of
    // spoiling its block as it does on the CPU).
    unsigned amax = 0;
    for (size_t k = lane; k < m; k += 32)
      amax = max(amax, __float_as_uint(fabsf(with_residual(in, residual, first + k))));
    for (int o = 16; o > 0; o >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float a = __uint_as_float(amax);
    float scale = __fdiv_rn(a, L.qmax);
    float inv = a > 0.0f ? __fdiv_rn(L.qmax, a) : 0.0f;
    if (inv > FLT_MAX) {  // a block below ~1e-37 is sent as zeros, as on the CPU
      inv = 0.0f;
      scale = 0.0f;
    }
    uint8_t* o = out + j * L.chunk_bytes;
    if (lane == 0) reinterpret_cast<float*>(o + L.scales_offset)[b] = scale;
    if (b == 0 && lane < L.scales_offset - L.value_bytes) o[L.value_bytes + lane] = 0;  // padding
    // Past the tensor's end (k >= m) a block's values are zeros.
    if (L.bits == 8) {
      int8_t* vals = reinterpret_cast<int8_t*>(o) + b * L.block;
      for (size_t k = lane; k < mb; k += 32) {
        const float q = k < m ? quantize_one(in, residual, first + k, inv, scale, L.qmax, stochastic, key, index_base)
                              : 0.0f;
        vals[k] = static_cast<int8_t>(q);
      }
    } else {  // int4: a lane packs the two values of a byte
      uint8_t* vals = o + b * L.block / 2;
      for (size_t p = lane; p < (mb + 1) / 2; p += 32) {
        const size_t k = 2 * p;
        const float lo = k < m ? quantize_one(in, residual, first + k, inv, scale, L.qmax, stochastic, key, index_base)
                               : 0.0f;
        const float hi = k + 1 < m ? quantize_one(in, residual, first + k + 1, inv, scale, L.qmax, stochastic, key,
                                                  index_base)
                                   : 0.0f;
        vals[p] = static_cast<uint8_t>((static_cast<int>(lo) + 8) | ((static_cast<int>(hi) + 8) << 4));
      }
    }
  }
}

// One thread block per quantization block (several each past kMaxGrid); `Accumulate` chooses
// between writing and accumulating.
template <class T, bool Accumulate>
__global__ void dequantize_kernel(Layout L, size_t nblocks, const uint8_t* __restrict__ in, size_t count,
                                  T* __restrict__ out) {
  for (size_t g = blockIdx.x; g < nblocks; g += gridDim.x) {
    const size_t j = g / L.blocks_per_chunk, b = g % L.blocks_per_chunk;
    const size_t first = j * L.chunk + b * L.block;
    if (first >= count) continue;
    const size_t m = min(min(L.block, L.chunk - b * L.block), count - first);
    const uint8_t* src = in + j * L.chunk_bytes;
    const float scale = reinterpret_cast<const float*>(src + L.scales_offset)[b];
    for (size_t k = threadIdx.x; k < m; k += blockDim.x) {
      const size_t e = b * L.block + k;
      float q;
      if (L.bits == 8) {
        q = static_cast<float>(reinterpret_cast<const int8_t*>(src)[e]);
      } else {
        const uint8_t byte = src[e / 2];
        q = static_cast<float>(static_cast<int>((e & 1) ? (byte >> 4) : (byte & 15)) - 8);
      }
      const float v = __fmul_rn(q, scale);
      if constexpr (Accumulate) {
        out[first + k] = __fadd_rn(out[first + k], v);
      } else {
        out[first + k] = store_f32<T>(v);
      }
    }
  }
}

int threads_for(size_t block) { return block >= 256 ? 256 : (block >= 64 ? 64 : 32); }

template <class T>
cudaError_t launch_quantize(QuantFormat fmt, const void* in, float* residual, size_t count, size_t chunk,
                            size_t nchunks, bool stochastic, uint64_t seed, uint64_t index_base, uint8_t* out,
                            cudaStream_t stream) {
  const Layout L = layout_of(fmt, chunk);
  const size_t grid = nchunks * L.blocks_per_chunk;
  if (grid == 0) return cudaSuccess;
  quantize_kernel<T><<<grid_of((grid + kQuantizeWarps - 1) / kQuantizeWarps), 32 * kQuantizeWarps, 0, stream>>>(
      L, grid, static_cast<const T*>(in), residual, count, stochastic, rng_key(seed), index_base, out);
  return cudaGetLastError();
}

template <class T, bool Accumulate>
cudaError_t launch_dequantize(QuantFormat fmt, const uint8_t* in, size_t count, size_t chunk, void* out,
                              cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const Layout L = layout_of(fmt, chunk);
  const size_t grid = ((count + chunk - 1) / chunk) * L.blocks_per_chunk;
  dequantize_kernel<T, Accumulate><<<grid_of(grid), threads_for(fmt.block), 0, stream>>>(
      L, grid, in, count, static_cast<T*>(out));
  return cudaGetLastError();
}

}  // namespace

cudaError_t quantize(QuantFormat fmt, DType dtype, const void* in, float* residual, size_t count, size_t chunk,
                     size_t nchunks, bool stochastic, uint64_t seed, uint64_t index_base, uint8_t* out,
                     cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return launch_quantize<float>(fmt, in, residual, count, chunk, nchunks, stochastic, seed, index_base, out, stream);
    case DType::kBFloat16:
      return launch_quantize<__nv_bfloat16>(fmt, in, residual, count, chunk, nchunks, stochastic, seed, index_base,
                                            out, stream);
    case DType::kFloat16:
      return launch_quantize<__half>(fmt, in, residual, count, chunk, nchunks, stochastic, seed, index_base, out,
                                     stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t dequantize(QuantFormat fmt, const uint8_t* in, size_t count, size_t chunk, DType dtype, void* out,
                       cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: return launch_dequantize<float, false>(fmt, in, count, chunk, out, stream);
    case DType::kBFloat16: return launch_dequantize<__nv_bfloat16, false>(fmt, in, count, chunk, out, stream);
    case DType::kFloat16: return launch_dequantize<__half, false>(fmt, in, count, chunk, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t dequantize_accumulate(QuantFormat fmt, const uint8_t* in, size_t count, float* acc, cudaStream_t stream) {
  return launch_dequantize<float, true>(fmt, in, count, count, acc, stream);
}

}  // namespace cuda
}  // namespace braid
