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

// Largest block the kernels accept (a block is staged in a stack buffer of float32).
constexpr size_t kMaxQuantBlock = 8192;

// Quantizes `count` elements of `in` (float32, bfloat16 or float16) into `out` (fmt.bytes(count)).
//  - residual: optional float32 error-feedback state. When given, x = in + residual is quantized
//    and residual becomes x - dequantize(q) in the same pass.
//  - stochastic: q = floor(x / scale + u) with u uniform in [0, 1) from (seed, index_base + i),
//    unbiased; otherwise round to nearest even.
void quantize(QuantFormat fmt, DType dtype, const void* in, float* residual, size_t count, bool stochastic,
              uint64_t seed, uint64_t index_base, uint8_t* out);

// Writes q * scale for every element into `out` of `dtype` (float32, bfloat16, float16).
void dequantize(QuantFormat fmt, const uint8_t* in, size_t count, DType dtype, void* out);

// acc[i] += q * scale: the reduction step of the quantized all-reduce, in float32.
void dequantize_accumulate(QuantFormat fmt, const uint8_t* in, size_t count, float* acc);

}  // namespace braid
