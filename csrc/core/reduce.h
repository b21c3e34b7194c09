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

// Where reduce_n writes its result, and in what form. result() and partial() build the two usual
// forms; the fields can also be set one by one.
struct ReduceDst {
  void* ptr = nullptr;
  // Write the accumulator type (a partial result, reduced further elsewhere) instead of the
  // element type.
  bool acc = false;
  // Apply the last step of the operator (the division of "avg" by `world_size`); partial results
  // skip it.
  bool finalize = false;
  int world_size = 1;
  // A second destination that receives the same values (null: none).
  void* copy = nullptr;
  // Write `ptr` (element type, no `copy`) with non-temporal stores (copy_streaming), for outputs
  // too large to stay in cache.
  bool stream = false;

  // The finished result of a reduction over `world_size` ranks, in the element type.
  static ReduceDst result(void* ptr, int world_size) {
    ReduceDst d;
    d.ptr = ptr;
    d.finalize = true;
    d.world_size = world_size;
    return d;
  }
  // A partial result in the accumulator type.
  static ReduceDst partial(void* ptr) {
    ReduceDst d;
    d.ptr = ptr;
    d.acc = true;
    return d;
  }
  // The same destination, its values also written to `second`.
  ReduceDst with_copy(void* second) const {
    ReduceDst d = *this;
    d.copy = second;
    return d;
  }
  // The same destination, written with non-temporal stores when `on`.
  ReduceDst streamed(bool on) const {
    ReduceDst d = *this;
    d.stream = on;
    return d;
  }
};

// dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... (op) srcs[nsrc-1][i] for i < count, combined in
// exactly this order, so every rank that reduces the same inputs gets the same bits.
// A destination may alias a source at the same offsets (in-place collectives): each block of
// elements is fully read before it is written.
void reduce_n(DType dtype, ReduceOp op, const Operand* srcs, int nsrc, const ReduceDst& dst, size_t count);

}  // namespace braid
