// Block int8 / int4 quantization kernels: each block is loaded as float32 into L1, its absmax found
// with an integer max over the magnitude bits, then rounded and packed in simple loops the
// compiler vectorizes.
#include "quantize.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "../half.h"
#include "counter_rng.h"
#include "error_feedback.h"

namespace braid {
namespace {

// Magnitude ordering of non-NaN floats equals the ordering of their bits without the sign: an
// integer max reduction, which vectorizes (a float max reduction needs -ffast-math).
inline uint32_t magnitude_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u & 0x7FFFFFFFu;
}

inline float from_bits(uint32_t u) {
  float a;
  std::memcpy(&a, &u, 4);
  return a;
}

// Loads the block's inputs (plus the residual, with error feedback) as float32 into x and returns
// their absmax, in one pass.
template <class T>
inline float load_block(const T* __restrict src, const float* __restrict r, size_t m, float* __restrict x) {
  uint32_t best = 0;
  if (r != nullptr) {
    for (size_t k = 0; k < m; ++k) {
      x[k] = load_f32(src[k]) + r[k];
      best = std::max(best, magnitude_bits(x[k]));
    }
  } else {
    for (size_t k = 0; k < m; ++k) {
      x[k] = load_f32(src[k]);
      best = std::max(best, magnitude_bits(x[k]));
    }
  }
  return from_bits(best);
}

// Rounds the loaded block x[0, m) to integers t in [-qmax, qmax] and, in the same pass, stores
// t + bias as a byte (int8: the two's complement byte; int4: the nibble value t + 8) and, with
// error feedback, the residual x - t * scale. `dither` (stochastic rounding) holds each
// element's 16-bit uniform; null rounds to nearest even.
template <bool kResidual>
inline void round_block(const float* __restrict x, const uint16_t* __restrict dither, size_t m, float inv, float scale,
                        int32_t iqmax, int32_t bias, uint8_t* __restrict qb, float* __restrict r) {
  const float qmax = static_cast<float>(iqmax);
  if (dither != nullptr) {
    for (size_t j = 0; j < m; ++j) {
      // floor(y) is exact; one vroundps (the build has -fno-trapping-math). |y| <= qmax + 1.
      const float y = x[j] * inv + static_cast<float>(dither[j]) * (1.0f / 65536.0f);
      const float v = std::min(qmax, std::max(-qmax, std::floor(y)));
      qb[j] = static_cast<uint8_t>(static_cast<int32_t>(v) + bias);
      if (kResidual) r[j] = finite_or_zero(x[j] - v * scale);
    }
  } else {
    for (size_t j = 0; j < m; ++j) {
      // Round to nearest even (the default mode); one vroundps under -fno-trapping-math.
      const float v = std::min(qmax, std::max(-qmax, std::nearbyint(x[j] * inv)));
      qb[j] = static_cast<uint8_t>(static_cast<int32_t>(v) + bias);
      if (kResidual) r[j] = finite_or_zero(x[j] - v * scale);
    }
  }
}

// The 16-bit uniforms of elements first .. first + m - 1, in element order. Pair p's hash holds
// the even element's uniform in its low half and the odd one's in its high half: the pair hashes
// come from one vectorized loop and are read as halves (little-endian), with the odd element
// that may open the block and the even one that may close it drawn singly.
inline void block_dither(RngKey key, uint64_t first, size_t m, uint16_t* halves) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "halves assume little-endian pair hashes");
  if (m == 0) return;
  size_t k = 0;
  auto single = [&](uint64_t index) {
    const uint64_t pair = index >> 1;
    const uint32_t h = pair_hash(rng_word_key(key, static_cast<uint32_t>(pair >> 32)), static_cast<uint32_t>(pair));
    return static_cast<uint16_t>((index & 1) ? h >> 16 : h & 0xFFFFu);
  };
  if ((first & 1) != 0) halves[k++] = single(first);
  // Whole pairs: pair p has low index word lo0 + p; past a 2^32 boundary its high word is one more.
  const uint64_t pair0 = (first + k) >> 1;
  const uint32_t lo0 = static_cast<uint32_t>(pair0), hi0 = static_cast<uint32_t>(pair0 >> 32);
  const uint32_t key_here = rng_word_key(key, hi0), key_next = rng_word_key(key, hi0 + 1);
  const size_t pairs = (m - k) / 2;
  uint16_t* __restrict dst = halves + k;
  // The pairs before the low word wraps use key_here, the rest key_next: two loops without a
  // per-pair select (the wrap happens at most once per block, past 2^33 elements).
  const uint64_t before_wrap = (uint64_t{1} << 32) - lo0;
  const size_t unwrapped = pairs < before_wrap ? pairs : static_cast<size_t>(before_wrap);
  for (size_t p = 0; p < unwrapped; ++p) {
    const uint32_t h = pair_hash(key_here, lo0 + static_cast<uint32_t>(p));
    std::memcpy(dst + 2 * p, &h, sizeof h);
  }
  for (size_t p = unwrapped; p < pairs; ++p) {
    const uint32_t h = pair_hash(key_next, lo0 + static_cast<uint32_t>(p));
    std::memcpy(dst + 2 * p, &h, sizeof h);
  }
  if (k + 2 * pairs < m) halves[m - 1] = single(first + m - 1);
}

// Scratch of one block, in L1.
struct BlockScratch {
  alignas(64) float x[kMaxQuantBlock];
  alignas(64) uint16_t halves[kMaxQuantBlock];
  alignas(64) uint8_t biased[kMaxQuantBlock + 2];  // int4: biased values before packing
};

// One block of mb elements (m of them valid, the rest encoded as zeros) at element `first` of
// the stream. kM > 0 is the common case of a whole block of a default size, known at compile
// time (m == mb == kM, even `first`): loops without remainders or trip-count checks.
template <size_t kM, class T>
inline void quantize_block(QuantFormat fmt, const T* in, float* residual, size_t m_arg, size_t mb_arg,
                           bool stochastic, RngKey key, uint64_t first, uint8_t* values, float* scale_out,
                           BlockScratch& s) {
  const size_t m = kM ? kM : m_arg, mb = kM ? kM : mb_arg;
  const bool int8 = fmt.bits == 8;
  const int32_t iqmax = fmt.qmax();
  const float qmax = static_cast<float>(iqmax);
  const float amax = load_block(in, residual, m, s.x);
  float scale = amax / qmax;
  float inv = amax > 0.0f ? qmax / amax : 0.0f;
  if (inv > FLT_MAX) {
    // amax below qmax / FLT_MAX (~1e-37): inv overflows, and x * inf would round a 0 to NaN (then
    // -qmax). Such a block is sent as zeros (scale 0); error feedback keeps its values.
    inv = 0.0f;
    scale = 0.0f;
  }
  *scale_out = scale;
  const uint16_t* dither = nullptr;
  if (stochastic) {
    block_dither(key, first, m, s.halves);
    dither = s.halves;
  }
  // int8 values go straight to the payload; int4 ones wait in the scratch for packing.
  uint8_t* qb = int8 ? values : s.biased;
  const int32_t bias = int8 ? 0 : 8;
  if (residual != nullptr)
    round_block<true>(s.x, dither, m, inv, scale, iqmax, bias, qb, residual);
  else
    round_block<false>(s.x, dither, m, inv, scale, iqmax, bias, qb, nullptr);
  if (int8) {
    if (m < mb) std::memset(qb + m, 0, mb - m);  // elements past `valid` encode as zeros
    return;
  }
  for (size_t k = m; k < mb + 1; ++k) s.biased[k] = 8;  // zeros, and the spare nibble of an odd block
  // Two biased bytes (a, b) < 16 read as w = a | b << 8: w | w >> 4 has a | b << 4 in its low byte.
  const size_t pairs = (mb + 1) / 2;
  for (size_t k = 0; k < pairs; ++k) {
    uint16_t w;
    std::memcpy(&w, s.biased + 2 * k, 2);
    values[k] = static_cast<uint8_t>(w | (w >> 4));
  }
}

// One chunk: `valid` elements of `in` quantized into the layout of `capacity` elements; the
// elements from `valid` on are encoded as zeros (scale 0 for blocks that hold none).
template <class T>
void quantize_chunk(QuantFormat fmt, const T* in, float* residual, size_t valid, size_t capacity, bool stochastic,
                    RngKey key, uint64_t index_base, uint8_t* out) {
  BlockScratch scratch;
  float* scales = reinterpret_cast<float*>(out + fmt.scales_offset(capacity));
  // The alignment padding is part of the payload: zero it so payloads are a function of the input.
  std::memset(out + fmt.value_bytes(capacity), 0, fmt.scales_offset(capacity) - fmt.value_bytes(capacity));
  for (size_t b = 0, base = 0; base < capacity; ++b, base += fmt.block) {
    const size_t mb = std::min(fmt.block, capacity - base);
    const size_t m = valid > base ? std::min(mb, valid - base) : 0;
    const uint64_t first = index_base + base;
    float* r = residual != nullptr ? residual + base : nullptr;
    uint8_t* values = out + (fmt.bits == 8 ? base : base / 2);
    const bool whole = m == mb && (!stochastic || (first & 1) == 0);
    if (whole && m == 256)
      quantize_block<256>(fmt, in + base, r, m, mb, stochastic, key, first, values, scales + b, scratch);
    else if (whole && m == 128)
      quantize_block<128>(fmt, in + base, r, m, mb, stochastic, key, first, values, scales + b, scratch);
    else
      quantize_block<0>(fmt, in + base, r, m, mb, stochastic, key, first, values, scales + b, scratch);
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
