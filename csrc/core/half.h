// float32 <-> bfloat16 / float16 conversions shared by the reduction and compression kernels.
#pragma once

#include <cstdint>
#include <cstring>

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

// Element wrappers so that templates can tell the two 16-bit formats apart.
struct BF16 {
  uint16_t bits;
};
struct F16 {
  _Float16 value;
};

// Loads any floating element type as float32 (the accumulator of every compression kernel).
inline float load_f32(float x) { return x; }
inline float load_f32(BF16 x) { return bf16_to_f32(x.bits); }
inline float load_f32(F16 x) { return static_cast<float>(x.value); }

// Stores a float32 into an element type, rounding to nearest even.
template <class T> T store_from_f32(float x);
template <> inline float store_from_f32<float>(float x) { return x; }
template <> inline BF16 store_from_f32<BF16>(float x) { return BF16{f32_to_bf16(x)}; }
template <> inline F16 store_from_f32<F16>(float x) { return F16{static_cast<_Float16>(x)}; }

}  // namespace braid
