// Error feedback: what compression dropped this step is added to the next step's input.
#pragma once

#include <cstddef>

#include "../dtype.h"

namespace braid {

// residual[i] = in[i] + residual[i] - sent[i] in float32, `in` of float32, bfloat16 or float16.
// `sent` (what the receivers will see of in + residual, decompressed) may be null: then the
// residual only accumulates the input (the first half of a top-k step).
void error_feedback_update(DType dtype, const void* in, float* residual, const float* sent, size_t count);

// The cast compressor in one pass: x = in[i] + residual[i] in float32, out[i] = x rounded to
// nearest even in `out_dtype` (bfloat16 or float16), residual[i] = x - out[i] (exact: what the
// rounding dropped). `in` is float32, bfloat16 or float16; `residual` may be null (no error
// feedback: out[i] = in[i] rounded). `out` must not overlap `in` or `residual`.
void cast_with_feedback(DType in_dtype, const void* in, float* residual, DType out_dtype, void* out, size_t count);

}  // namespace braid
