// Block quantization to int8 / int4 with one float32 scale per block, the wire format of the
// quantized all-reduce.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../dtype.h"

namespace braid {

// Buffer layout of `count` quantized elements: the values (int8: one byte each; int4: two per
// byte, element 2i in the low nibble, stored as q + 8), padded to 4 bytes, then one float32
// scale per block (absmax / qmax, qmax = 127 or 7). Values dequantize to q * scale.
struct QuantFormat {
  int bits;      // 8 or 4
  size_t block;  // elements per scale; even for int4, so blocks start on byte boundaries
  size_t value_bytes(size_t count) const { return bits == 8 ? count : (count + 1) / 2; }
  size_t scales_offset(size_t count) const { return (value_bytes(count) + 3) & ~size_t(3); }
  size_t blocks(size_t count) const { return (count + block - 1) / block; }
  size_t bytes(size_t count) const { return scales_offset(count) + 4 * blocks(count); }
  int qmax() const { return bits == 8 ? 127 : 7; }
};

// Largest block the kernels accept (a block is held in a stack buffer of float32).
constexpr size_t kMaxQuantBlock = 8192;

// Quantizes `count` elements of `in` (float32, bfloat16 or float16) as `nchunks` chunks of
// `chunk` elements, each laid out as fmt.bytes(chunk) bytes of `out`, one after the other; the
// elements past `count` (up to nchunks * chunk >= count) are encoded as zeros. Chunks are what
// the quantized all-reduce sends to each rank; a single chunk of `count` is the plain layout.
//  - residual: optional float32 error-feedback state (`count` floats). When given, x = in +
//    residual is quantized and residual becomes x - dequantize(q) in the same pass.
//  - stochastic: q = floor(x / scale + u) with u uniform in [0, 1) drawn from (seed, element
//    index), unbiased; otherwise round to nearest even. Element i has index index_base + i.
void quantize(QuantFormat fmt, DType dtype, const void* in, float* residual, size_t count, size_t chunk,
              size_t nchunks, bool stochastic, uint64_t seed, uint64_t index_base, uint8_t* out);

// Inverse of quantize's layout: writes q * scale of the first `count` elements into `out` of
// `dtype` (float32, bfloat16, float16).
void dequantize(QuantFormat fmt, const uint8_t* in, size_t count, size_t chunk, DType dtype, void* out);

// acc[i] += q * scale: the reduction step of the quantized all-reduce, in float32.
void dequantize_accumulate(QuantFormat fmt, const uint8_t* in, size_t count, float* acc);

}  // namespace braid
