// Error feedback: what compression dropped this step is added to the next step's input.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstddef>

#include "../dtype.h"

namespace braid {

// A residual entry as it is kept: non-finite values (an inf or NaN in the gradient, a cast that
// overflowed) become 0. They still reach this step's result, where a loss scaler sees them;
// kept in the residual they would turn every later step of the tensor into NaN (inf - inf).
// Branch-free, so the loops that store residuals still vectorize.
inline float finite_or_zero(float d) { return std::fabs(d) <= FLT_MAX ? d : 0.0f; }

// residual[i] = in[i] + residual[i] - sent[i] in float32 (finite_or_zero), `in` of float32,
// bfloat16 or float16. `sent` (what the receivers will see of in + residual, decompressed) may be
// null: then the residual only accumulates the input (the first half of a top-k step, whose
// selection must see any inf or NaN; the caller zeroes what it sends).
void error_feedback_update(DType dtype, const void* in, float* residual, const float* sent, size_t count);

// The cast compressor in one pass: x = in[i] + residual[i] in float32, out[i] = x rounded to
// nearest even in `out_dtype` (bfloat16 or float16), residual[i] = x - out[i] (exact: what the
// rounding dropped; 0 where that is not finite). `in` is float32, bfloat16 or float16; `residual` may be null (no error
// feedback: out[i] = in[i] rounded). `out` must not overlap `in` or `residual`.
void cast_with_feedback(DType in_dtype, const void* in, float* residual, DType out_dtype, void* out, size_t count);

}  // namespace braid
