// Top-k sparsification: selection of the k largest magnitudes as (float32 value, int32 index)
// pairs, and the scatter-add that sums such pairs back into a dense float32 buffer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../dtype.h"

namespace braid {

// How top_k_select found its threshold (reported so tests and benchmarks see both paths).
enum class TopKPath : int {
  kSampled = 0,  // a threshold estimated from a sample kept between k and kMaxOverselect * k
  kExact = 1,    // the sample missed by a wide margin: exact selection over every element
};

// Selects exactly min(k, count) elements of `in` (float32, bfloat16 or float16) with the largest
// magnitudes; writes their values as float32 and their indices in ascending order. Ties at the
// threshold go to the lower index, so the result is a function of the input alone.
TopKPath top_k_select(DType dtype, const void* in, size_t count, size_t k, float* values, int32_t* indices);

// acc[indices[i]] += values[i] for i in 0..k-1, in that order.
void scatter_add(float* acc, const int32_t* indices, const float* values, size_t k);

}  // namespace braid
