// float32 <-> bfloat16 / float16 conversions shared by the reduction and compression kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define BRAID_F16C 1
#endif

namespace braid {

// bfloat16 <-> float32 with torch's rounding (nearest even, NaN -> 0x7FC0).
inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : static_cast<uint16_t>(rounded);
}

// float16 <-> float32 in integer and float32 arithmetic with selects instead of branches, so
// that loops over them vectorize on any x86 level (given -fno-trapping-math, which lets the
// compiler evaluate both arms of a select). _Float16 casts compile to one scalar vcvtph2ps /
// vcvtps2ph, or a libgcc call, per element and kept every float16 loop scalar. Same results as
// torch's conversions, except that every NaN becomes 0x7E00 (torch keeps a NaN's sign).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;  // exponent and mantissa
  // Subnormals are em units of 2^-24: exact in float32, and normal there.
  const float sub = static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f;
  uint32_t sub_bits;
  std::memcpy(&sub_bits, &sub, 4);
  uint32_t u = (em << 13) + ((127u - 15u) << 23);        // normal: exponent rebiased
  u = em >= 0x7C00u ? (em << 13) | 0x7F800000u : u;       // infinity, NaN (payload kept)
  u = sign | (em < 0x0400u ? sub_bits : u);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal results (|f| >= 2^-14): rebias, then round the 13 dropped bits to nearest even; a
  // carry moves into the exponent as it should.
  const uint32_t normal = (a - ((127u - 15u) << 23) + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  // Subnormal results: adding 0.5, whose float32 ulp is 2^-24 (the float16 subnormal unit), lets
  // the FPU round |f| to that grid (nearest even); the bits above 0.5's count the units.
  float shifted;
  std::memcpy(&shifted, &a, 4);
  shifted += 0.5f;
  uint32_t units;
  std::memcpy(&units, &shifted, 4);
  units -= 0x3F000000u;
  uint32_t h = a >= 0x477FF000u ? 0x7C00u                     // 65520 and up round to infinity
               : a >= 0x38800000u ? normal : units;
  h = a > 0x7F800000u ? 0x7E00u : sign | h;                    // NaN, whatever its sign
  return static_cast<uint16_t>(h);
}

// Whole arrays, eight elements per instruction with F16C where the target has it (the reduction
// kernels convert a block at a time through these); the same bits as the scalar functions,
// NaN -> 0x7E00 included.
inline void f16_to_f32_n(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
#ifdef BRAID_F16C
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
inline void f32_to_f16_n(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
#ifdef BRAID_F16C
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));  // converts to 0x7E00
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(src + i);
    v = _mm256_blendv_ps(v, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

// Element wrappers so that templates can tell the two 16-bit formats apart.
struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

// Arrays of either 16-bit format (T = BF16 or F16), as raw bits, to and from float32: float16
// through the F16C paths above.
template <class T> void widen_n(const uint16_t* src, float* dst, size_t n) {
  if constexpr (std::is_same_v<T, BF16>) {
    for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
  } else {
    f16_to_f32_n(src, dst, n);
  }
}
template <class T> void narrow_n(const float* src, uint16_t* dst, size_t n) {
  if constexpr (std::is_same_v<T, BF16>) {
    for (size_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  } else {
    f32_to_f16_n(src, dst, n);
  }
}

// Loads any floating element type as float32 (the accumulator of every compression kernel).
inline float load_f32(float x) { return x; }
inline float load_f32(BF16 x) { return bf16_to_f32(x.bits); }
inline float load_f32(F16 x) { return f16_to_f32(x.bits); }

// Stores a float32 into an element type, rounding to nearest even.
template <class T> T store_from_f32(float x);
template <> inline float store_from_f32<float>(float x) { return x; }
template <> inline BF16 store_from_f32<BF16>(float x) { return BF16{f32_to_bf16(x)}; }
template <> inline F16 store_from_f32<F16>(float x) { return F16{f32_to_f16(x)}; }

}  // namespace braid
