// Elementwise reduction kernels for the CPU: a fixed left-to-right order, float32 accumulation for
// half types, loops written so that the compiler vectorizes them.
#pragma once

#include <cstddef>

#include "dtype.h"

namespace braid {

// One input of a reduction. `acc` says the buffer holds the accumulator type (float32 for
// float16/bfloat16, the element type otherwise) rather than the element type: the ring passes
// float32 partial sums between hops so that half types are rounded only once.
struct Operand {
  const void* ptr;
  bool acc;
};

// dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... (op) srcs[nsrc-1][i], combined in exactly this order,
// so every rank that reduces the same inputs gets the same bits.
//  - dst_acc: write the accumulator type (a partial result) instead of the element type.
//  - finalize: apply the last step of the operator (the division of "avg"); partial results skip it.
//  - dst2: optional second destination that receives the same values (may be null).
//  - stream: write `dst` (element type, no dst2) with non-temporal stores (copy_streaming), for
//    outputs too large to stay in cache.
// A destination may alias a source at the same offsets (in-place collectives): each block of
// elements is fully read before it is written.
void reduce_n(DType dtype, ReduceOp op, const Operand* srcs, int nsrc, void* dst, bool dst_acc,
              void* dst2, size_t count, int world_size, bool finalize, bool stream = false);

}  // namespace braid
