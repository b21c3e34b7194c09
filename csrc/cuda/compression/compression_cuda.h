// CUDA launchers of the compression kernels: raw device pointers and a cudaStream_t, no torch.
// Same formats, random streams and rounding as the CPU kernels (csrc/core/compression), so a
// payload quantized on either side decodes to the same bits on the other.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../core/compression/quantize.h"
#include "../../core/compression/top_k.h"
#include "../../core/dtype.h"

namespace braid {
namespace cuda {

// As braid::quantize / dequantize / dequantize_accumulate / error_feedback_update, on `stream`.
cudaError_t quantize(QuantFormat fmt, DType dtype, const void* in, float* residual, size_t count, size_t chunk,
                     size_t nchunks, bool stochastic, uint64_t seed, uint64_t index_base, uint8_t* out,
                     cudaStream_t stream);
cudaError_t dequantize(QuantFormat fmt, const uint8_t* in, size_t count, size_t chunk, DType dtype, void* out,
                       cudaStream_t stream);
cudaError_t dequantize_accumulate(QuantFormat fmt, const uint8_t* in, size_t count, float* acc, cudaStream_t stream);
cudaError_t error_feedback_update(DType dtype, const void* in, float* residual, const float* sent, size_t count,
                                  cudaStream_t stream);

// As braid::top_k_select, and selecting the same elements. Waits once for `stream`: the host reads
// the candidate count, which decides the path (the rare exact path then runs on the host and
// synchronizes again); the sampled path's results are ready in `stream` order when it returns.
cudaError_t top_k_select(DType dtype, const void* in, size_t count, size_t k, float* values, int32_t* indices,
                         TopKPath* path, cudaStream_t stream);
// acc[indices[i]] += values[i]; indices of one call must be distinct (as top_k_select's are),
// so each element is written by one thread and the result does not depend on scheduling.
cudaError_t scatter_add(float* acc, const int32_t* indices, const float* values, size_t k, cudaStream_t stream);

}  // namespace cuda
}  // namespace braid
