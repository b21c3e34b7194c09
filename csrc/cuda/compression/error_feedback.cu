// CUDA error-feedback update: residual = in + residual - sent (non-finite results kept as 0, as
// on the CPU), one grid-stride pass.
#include "compression_cuda.h"
#include "device_math.cuh"

namespace braid {
namespace cuda {
namespace {

template <class T>
__global__ void error_feedback_kernel(const T* __restrict__ in, float* __restrict__ residual,
                                      const float* __restrict__ sent, size_t count) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float x = __fadd_rn(load_f32(in, i), residual[i]);
    residual[i] = sent != nullptr ? finite_or_zero(__fsub_rn(x, sent[i])) : x;
  }
}

template <class T>
cudaError_t launch(const void* in, float* residual, const float* sent, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  error_feedback_kernel<T><<<grid_for(count), kThreads, 0, stream>>>(static_cast<const T*>(in), residual, sent, count);
  return cudaGetLastError();
}

}  // namespace

cudaError_t error_feedback_update(DType dtype, const void* in, float* residual, const float* sent, size_t count,
                                  cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: return launch<float>(in, residual, sent, count, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16>(in, residual, sent, count, stream);
    case DType::kFloat16: return launch<__half>(in, residual, sent, count, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace braid
