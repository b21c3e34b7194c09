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

// Key of the elements whose 64-bit index has high word `hi` (constant over 2^32 elements, so
// loops compute it once per block).
BRAID_HOST_DEVICE inline uint32_t rng_word_key(RngKey k, uint32_t hi) { return mix32(hi ^ k.hi) ^ k.lo; }

// Uniform in [0, 1) with 24 random bits (every value exactly representable in float32) for the
// element whose index has low word `lo`, under the key of its high word: one hash round per
// element (two 32-bit multiplies), which is what stochastic rounding costs on the CPU.
BRAID_HOST_DEVICE inline float uniform01_word(uint32_t word_key, uint32_t lo) {
  return static_cast<float>(mix32(lo ^ word_key) >> 8) * (1.0f / 16777216.0f);
}
BRAID_HOST_DEVICE inline float uniform01(RngKey k, uint64_t index) {
  return uniform01_word(rng_word_key(k, static_cast<uint32_t>(index >> 32)), static_cast<uint32_t>(index));
}

}  // namespace braid
