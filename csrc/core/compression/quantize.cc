// Block int8 / int4 quantization kernels: each block is staged in float32 in L1, its absmax found
// with an integer max over the magnitude bits, then rounded and packed in simple loops the
// compiler vectorizes.
#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../half.h"
#include "counter_rng.h"

namespace braid {
namespace {

// Round to nearest even for |v| < 2^22: adding 1.5 * 2^23 leaves no fraction bits, and the
// subtraction is exact. Unlike std::rint it vectorizes without -fno-trapping-math. The values
// here are at most qmax (127) in magnitude.
inline float round_even(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

// Magnitude ordering of non-NaN floats equals the ordering of their bits without the sign: an
// integer max reduction, which vectorizes (a float max reduction needs -ffast-math).
inline float block_absmax(const float* x, size_t m) {
  uint32_t best = 0;
  for (size_t k = 0; k < m; ++k) {
    uint32_t u;
    std::memcpy(&u, &x[k], 4);
    best = std::max(best, u & 0x7FFFFFFFu);
  }
  float a;
  std::memcpy(&a, &best, 4);
  return a;
}

// One chunk: `valid` elements of `in` quantized into the layout of `capacity` elements; the
// elements from `valid` on are encoded as zeros (scale 0 for blocks that hold none).
template <class T>
void quantize_chunk(QuantFormat fmt, const T* in, float* residual, size_t valid, size_t capacity, bool stochastic,
                    RngKey key, uint64_t index_base, uint8_t* out) {
  alignas(64) float x[kMaxQuantBlock];
  alignas(64) int32_t q[kMaxQuantBlock + 1];
  const float qmax = static_cast<float>(fmt.qmax());
  const int32_t iqmax = fmt.qmax();
  float* scales = reinterpret_cast<float*>(out + fmt.scales_offset(capacity));
  // The alignment padding is part of the payload: zero it so payloads are a function of the input.
  std::memset(out + fmt.value_bytes(capacity), 0, fmt.scales_offset(capacity) - fmt.value_bytes(capacity));
  for (size_t b = 0, base = 0; base < capacity; ++b, base += fmt.block) {
    const size_t mb = std::min(fmt.block, capacity - base);
    const size_t m = valid > base ? std::min(mb, valid - base) : 0;
    const T* __restrict src = in + base;
    if (residual != nullptr) {
      const float* __restrict r = residual + base;
      for (size_t k = 0; k < m; ++k) x[k] = load_f32(src[k]) + r[k];
    } else {
      for (size_t k = 0; k < m; ++k) x[k] = load_f32(src[k]);
    }
    const float amax = block_absmax(x, m);
    const float scale = amax / qmax;
    const float inv = amax > 0.0f ? qmax / amax : 0.0f;
    scales[b] = scale;
    if (stochastic) {
      // floor(y) by truncation and a correction for negative non-integers: vectorizes where
      // std::floor would not without -fno-trapping-math. |y| <= qmax + 1 fits int32.
      auto round_down = [iqmax](float y) {
        int32_t t = static_cast<int32_t>(y);
        t -= static_cast<float>(t) > y ? 1 : 0;
        return std::min(iqmax, std::max(-iqmax, t));
      };
      const uint64_t first = index_base + base;
      size_t k = 0;
      if (m > 0 && (first & 1) != 0) {  // an odd first element: the second half of its pair
        q[0] = round_down(x[0] * inv + uniform01(key, first));
        k = 1;
      }
      // Whole pairs: pair p has low index word lo0 + p; past a 2^32 boundary its high word is one more.
      const uint64_t pair0 = (first + k) >> 1;
      const uint32_t lo0 = static_cast<uint32_t>(pair0), hi0 = static_cast<uint32_t>(pair0 >> 32);
      const uint32_t key_here = rng_word_key(key, hi0), key_next = rng_word_key(key, hi0 + 1);
      const size_t pairs = (m - k) / 2;
      float* __restrict xs = x + k;
      int32_t* __restrict qs = q + k;
      // The pair hashes first (one vectorized loop), then read as 16-bit halves in element
      // order: on a little-endian host the low half of pair p's hash (the even element's
      // uniform_even) comes first, so element j's dither is halves[j], a unit-stride loop.
      alignas(64) uint32_t hashes[kMaxQuantBlock / 2 + 1];
      alignas(64) uint16_t halves[kMaxQuantBlock + 2];
      for (size_t p = 0; p < pairs; ++p) {
        const uint32_t lo = lo0 + static_cast<uint32_t>(p);
        hashes[p] = pair_hash(lo < lo0 ? key_next : key_here, lo);
      }
      static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "halves[] assumes little-endian hashes");
      std::memcpy(halves, hashes, pairs * sizeof(uint32_t));
      for (size_t j = 0; j < 2 * pairs; ++j)
        qs[j] = round_down(xs[j] * inv + static_cast<float>(halves[j]) * (1.0f / 65536.0f));
      if (k + 2 * pairs < m) q[m - 1] = round_down(x[m - 1] * inv + uniform01(key, first + m - 1));
    } else {
      for (size_t k = 0; k < m; ++k) {
        const float v = round_even(x[k] * inv);
        q[k] = static_cast<int32_t>(std::min(qmax, std::max(-qmax, v)));
      }
    }
    if (residual != nullptr) {
      float* __restrict r = residual + base;
      for (size_t k = 0; k < m; ++k) r[k] = x[k] - static_cast<float>(q[k]) * scale;
    }
    for (size_t k = m; k < mb + 1; ++k) q[k] = 0;  // padding, and the spare nibble of an odd block
    if (fmt.bits == 8) {
      int8_t* __restrict o = reinterpret_cast<int8_t*>(out) + base;
      for (size_t k = 0; k < mb; ++k) o[k] = static_cast<int8_t>(q[k]);
    } else {
      uint8_t* __restrict o = out + base / 2;
      const size_t pairs = (mb + 1) / 2;
      for (size_t k = 0; k < pairs; ++k)
        o[k] = static_cast<uint8_t>((q[2 * k] + 8) | ((q[2 * k + 1] + 8) << 4));
    }
  }
}

template <class T>
void quantize_typed(QuantFormat fmt, const T* in, float* residual, size_t count, size_t chunk, size_t nchunks,
                    bool stochastic, uint64_t seed, uint64_t index_base, uint8_t* out) {
  const RngKey key = rng_key(seed);
  const size_t cb = fmt.bytes(chunk);
  for (size_t j = 0; j < nchunks; ++j) {
    const size_t first = j * chunk;
    const size_t valid = count > first ? std::min(chunk, count - first) : 0;
    quantize_chunk(fmt, in + first, residual != nullptr ? residual + first : nullptr, valid, chunk, stochastic, key,
                   index_base + first, out + j * cb);
  }
}

// Calls fn(block_base, m, scale, values) with the values of the first `valid` elements of a
// chunk laid out for `capacity`, as float32 (q, unscaled).
template <class Fn>
void for_each_block(QuantFormat fmt, const uint8_t* in, size_t valid, size_t capacity, Fn&& fn) {
  alignas(64) float v[kMaxQuantBlock + 1];
  const float* scales = reinterpret_cast<const float*>(in + fmt.scales_offset(capacity));
  for (size_t b = 0, base = 0; base < valid; ++b, base += fmt.block) {
    const size_t m = std::min(fmt.block, valid - base);
    if (fmt.bits == 8) {
      const int8_t* __restrict s = reinterpret_cast<const int8_t*>(in) + base;
      for (size_t k = 0; k < m; ++k) v[k] = static_cast<float>(s[k]);
    } else {
      const uint8_t* __restrict s = in + base / 2;
      const size_t pairs = (m + 1) / 2;
      for (size_t k = 0; k < pairs; ++k) {
        v[2 * k] = static_cast<float>(static_cast<int32_t>(s[k] & 15u) - 8);
        v[2 * k + 1] = static_cast<float>(static_cast<int32_t>(s[k] >> 4) - 8);
      }
    }
    fn(base, m, scales[b], v);
  }
}

template <class T>
void dequantize_typed(QuantFormat fmt, const uint8_t* in, size_t count, size_t chunk, T* out) {
  const size_t cb = fmt.bytes(chunk);
  for (size_t first = 0, j = 0; first < count; first += chunk, ++j) {
    const size_t valid = std::min(chunk, count - first);
    for_each_block(fmt, in + j * cb, valid, chunk, [&](size_t base, size_t m, float scale, const float* v) {
      T* __restrict o = out + first + base;
      for (size_t k = 0; k < m; ++k) o[k] = store_from_f32<T>(v[k] * scale);
    });
  }
}

}  // namespace

void quantize(QuantFormat fmt, DType dtype, const void* in, float* residual, size_t count, size_t chunk,
              size_t nchunks, bool stochastic, uint64_t seed, uint64_t index_base, uint8_t* out) {
  switch (dtype) {
    case DType::kFloat32:
      return quantize_typed(fmt, static_cast<const float*>(in), residual, count, chunk, nchunks, stochastic, seed,
                            index_base, out);
    case DType::kBFloat16:
      return quantize_typed(fmt, static_cast<const BF16*>(in), residual, count, chunk, nchunks, stochastic, seed,
                            index_base, out);
    case DType::kFloat16:
      return quantize_typed(fmt, static_cast<const F16*>(in), residual, count, chunk, nchunks, stochastic, seed,
                            index_base, out);
    default:
      return;  // the binding admits floating types only
  }
}

void dequantize(QuantFormat fmt, const uint8_t* in, size_t count, size_t chunk, DType dtype, void* out) {
  switch (dtype) {
    case DType::kFloat32: return dequantize_typed(fmt, in, count, chunk, static_cast<float*>(out));
    case DType::kBFloat16: return dequantize_typed(fmt, in, count, chunk, static_cast<BF16*>(out));
    case DType::kFloat16: return dequantize_typed(fmt, in, count, chunk, static_cast<F16*>(out));
    default: return;
  }
}

void dequantize_accumulate(QuantFormat fmt, const uint8_t* in, size_t count, float* acc) {
  for_each_block(fmt, in, count, count, [&](size_t base, size_t m, float scale, const float* v) {
    float* __restrict a = acc + base;
    for (size_t k = 0; k < m; ++k) a[k] += v[k] * scale;
  });
}

}  // namespace braid
