// Top-k sparsification: selection of the k largest magnitudes as (float32 value, int32 index)
// pairs, and the scatter-add that sums such pairs back into a dense float32 buffer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../dtype.h"
#include "counter_rng.h"

namespace braid {

// How top_k_select found its threshold (reported so tests and benchmarks see both paths).
enum class TopKPath : int {
  kSampled = 0,  // a threshold estimated from a sample kept between k and kMaxOverselect * k
  kExact = 1,    // the sample missed by a wide margin: exact selection over every element
};

// The pieces of the selection that the CUDA version shares, so both pick the same elements.
// Sample size: the k-th largest of 16384 draws estimates a 1% quantile within about 8% (its
// relative standard error is about 1/sqrt(k_sample) = 1/sqrt(164)), so a threshold aimed at
// 1.25 k keeps at least k candidates except on rare samples.
constexpr size_t kTopKSample = 16384;
// More candidates than this many times k means the threshold was far too low: exact path.
constexpr size_t kTopKMaxOverselect = 4;

// Whether the sampled threshold is tried for (count, k); if so `sample_rank` receives the order
// statistic of the sample (0 = largest) used as the threshold and `stride` the sampling stride.
bool top_k_sampled(size_t count, size_t k, size_t* sample_rank, size_t* stride);
// Input index of sample j: one draw per stride, at a hashed offset inside it, so periodic
// structure in the gradient is not aliased.
BRAID_HOST_DEVICE inline size_t top_k_sample_index(size_t j, size_t stride) {
  return j * stride + mix32(static_cast<uint32_t>(j)) % stride;
}

// Of c candidates (values[j], indices[j]), in ascending index order, writes the k = min(k, c)
// with the largest magnitudes (ties at the k-th magnitude go to the lower index) to out_values /
// out_indices, still in index order. Only the magnitudes of `values` matter for the choice.
void top_k_trim(const float* values, const int32_t* indices, size_t c, size_t k, float* out_values,
                int32_t* out_indices);

// Selects exactly min(k, count) elements of `in` (float32, bfloat16 or float16) with the largest
// magnitudes; writes their values as float32 and their indices in ascending order. Ties at the
// threshold go to the lower index, so the result is a function of the input alone. Magnitudes
// are ordered as their bit patterns with the sign cleared: a NaN counts as larger than any number
// (as torch.topk has it), whichever path runs.
TopKPath top_k_select(DType dtype, const void* in, size_t count, size_t k, float* values, int32_t* indices);

// acc[indices[i]] += values[i] for i in 0..k-1, in that order.
void scatter_add(float* acc, const int32_t* indices, const float* values, size_t k);

}  // namespace braid
