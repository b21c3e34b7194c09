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

// Uniform in [0, 1) with 24 random bits (every value exactly representable in float32) for the
// element at 64-bit `index`: two rounds, the high index word folded into the second.
BRAID_HOST_DEVICE inline float uniform01(RngKey k, uint64_t index) {
  const uint32_t a = mix32(static_cast<uint32_t>(index) ^ k.lo);
  const uint32_t b = mix32(a ^ k.hi ^ static_cast<uint32_t>(index >> 32) * 0x27d4eb2fU);
  return static_cast<float>(b >> 8) * (1.0f / 16777216.0f);
}

}  // namespace braid
