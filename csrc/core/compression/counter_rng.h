// Counter-based uniform random numbers for stochastic rounding: a pure function of (seed, element
// index), so results are reproducible from the seed and do not depend on how work is split.
#pragma once

#include <cstdint>

// Callable from CUDA kernels too (csrc/cuda/compression), so both draw the same numbers.
#ifdef __CUDACC__
#define BRAID_HOST_DEVICE __host__ __device__
#else
#define BRAID_HOST_DEVICE
#endif

namespace braid {

// A 32-bit integer finalizer with low bias (xor-shift / multiply rounds); all operations are
// 32-bit, so the loops that call it vectorize (vpmulld) where a 64-bit hash would not.
BRAID_HOST_DEVICE inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// Keys of a stream, derived once per call from the 64-bit seed.
struct RngKey {
  uint32_t lo;
  uint32_t hi;
};
BRAID_HOST_DEVICE inline RngKey rng_key(uint64_t seed) {
  return RngKey{mix32(static_cast<uint32_t>(seed) ^ 0x9e3779b9U), mix32(static_cast<uint32_t>(seed >> 32) ^ 0x85ebca6bU)};
}

// Elements 2p and 2p + 1 share one 32-bit hash of the pair index p: the low 16 bits make the
// uniform of the even element, the high 16 bits that of the odd one. Half a hash round (one
// 32-bit multiply) per element is what stochastic rounding costs on the CPU; 16 bits of dither
// leave a rounding bias below 2^-16 of a quantization step.

// Key of the pairs whose 64-bit index has high word `hi` (constant over 2^32 pairs, so loops
// compute it once per block).
BRAID_HOST_DEVICE inline uint32_t rng_word_key(RngKey k, uint32_t hi) { return mix32(hi ^ k.hi) ^ k.lo; }

// The hash of the pair whose index has low word `lo`, under the key of its high word.
BRAID_HOST_DEVICE inline uint32_t pair_hash(uint32_t word_key, uint32_t lo) { return mix32(lo ^ word_key); }

// The two uniforms in [0, 1) of a pair hash (every value exactly representable in float32).
BRAID_HOST_DEVICE inline float uniform_even(uint32_t h) { return static_cast<float>(h & 0xFFFFu) * (1.0f / 65536.0f); }
BRAID_HOST_DEVICE inline float uniform_odd(uint32_t h) { return static_cast<float>(h >> 16) * (1.0f / 65536.0f); }

// The uniform of the element at 64-bit `index`.
BRAID_HOST_DEVICE inline float uniform01(RngKey k, uint64_t index) {
  const uint64_t pair = index >> 1;
  const uint32_t h = pair_hash(rng_word_key(k, static_cast<uint32_t>(pair >> 32)), static_cast<uint32_t>(pair));
  return (index & 1) ? uniform_odd(h) : uniform_even(h);
}

}  // namespace braid
