// CUDA top-k: the same sampled threshold as the CPU (same sample positions), candidates above it
// compacted in index order on the device, and the final trim to exactly k on the host, where the
// few candidates are cheap to order. When the sample misleads, the exact CPU selection runs on a
// host copy: that path is rare and keeps both devices choosing the same elements.
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <algorithm>
#include <vector>

#include "compression_cuda.h"
#include "device_math.cuh"

namespace braid {
namespace cuda {
namespace {

template <class T>
__global__ void sample_kernel(const T* __restrict__ in, size_t stride, float* __restrict__ out) {
  const size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (j < kTopKSample) out[j] = fabsf(load_f32(in, top_k_sample_index(j, stride)));
}

// Magnitude bits at least thr: the CPU's order, in which a NaN is above every number.
template <class T>
struct AtLeast {
  const T* in;
  uint32_t thr;
  __device__ bool operator()(int32_t i) const {
    return __float_as_uint(fabsf(load_f32(in, static_cast<size_t>(i)))) >= thr;
  }
};

template <class T>
__global__ void gather_kernel(const T* __restrict__ in, const int32_t* __restrict__ idx, size_t n,
                              float* __restrict__ mags) {
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < n; j += stride())
    mags[j] = fabsf(load_f32(in, static_cast<size_t>(idx[j])));
}

template <class T>
__global__ void values_kernel(const T* __restrict__ in, const int32_t* __restrict__ idx, size_t k,
                              float* __restrict__ values) {
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < k; j += stride())
    values[j] = load_f32(in, static_cast<size_t>(idx[j]));
}

__global__ void scatter_add_kernel(float* __restrict__ acc, const int32_t* __restrict__ idx,
                                   const float* __restrict__ values, size_t k) {
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < k; j += stride())
    acc[idx[j]] = __fadd_rn(acc[idx[j]], values[j]);
}

// Device memory for the duration of one selection.
class DeviceBuffer {
 public:
  DeviceBuffer(size_t bytes, cudaStream_t s) : stream_(s) { err_ = cudaMallocAsync(&ptr_, bytes ? bytes : 1, s); }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class P> P* as() const { return static_cast<P*>(ptr_); }
  cudaError_t error() const { return err_; }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
  cudaError_t err_;
};

#define BRAID_CUDA_TRY(expr)            \
  do {                                  \
    const cudaError_t e_ = (expr);      \
    if (e_ != cudaSuccess) return e_;   \
  } while (0)

// The exact path: the CPU selection on a host copy of the input.
template <class T>
cudaError_t exact_on_host(DType dtype, const T* in, size_t count, size_t k, float* values, int32_t* indices,
                          cudaStream_t stream) {
  std::vector<unsigned char> host(count * sizeof(T));
  BRAID_CUDA_TRY(cudaMemcpyAsync(host.data(), in, host.size(), cudaMemcpyDeviceToHost, stream));
  BRAID_CUDA_TRY(cudaStreamSynchronize(stream));
  std::vector<float> v(k);
  std::vector<int32_t> idx(k);
  top_k_select(dtype, host.data(), count, k, v.data(), idx.data());
  BRAID_CUDA_TRY(cudaMemcpyAsync(values, v.data(), k * sizeof(float), cudaMemcpyHostToDevice, stream));
  BRAID_CUDA_TRY(cudaMemcpyAsync(indices, idx.data(), k * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  return cudaStreamSynchronize(stream);
}

template <class T>
cudaError_t select_typed(DType dtype, const T* in, size_t count, size_t k, float* values, int32_t* indices,
                         TopKPath* path, cudaStream_t stream) {
  *path = TopKPath::kExact;
  size_t rank = 0, stride = 0;
  if (!top_k_sampled(count, k, &rank, &stride)) return exact_on_host(dtype, in, count, k, values, indices, stream);

  // Threshold: the same order statistic of the same sample as the CPU.
  DeviceBuffer sample(kTopKSample * sizeof(float), stream);
  BRAID_CUDA_TRY(sample.error());
  sample_kernel<T><<<static_cast<unsigned>((kTopKSample + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      in, stride, sample.as<float>());
  // Read back as bit patterns (fabsf cleared the signs) and ordered as the CPU orders its sample.
  std::vector<uint32_t> bits(kTopKSample);
  BRAID_CUDA_TRY(cudaMemcpyAsync(bits.data(), sample.as<float>(), bits.size() * sizeof(uint32_t),
                                 cudaMemcpyDeviceToHost, stream));
  BRAID_CUDA_TRY(cudaStreamSynchronize(stream));
  std::nth_element(bits.begin(), bits.begin() + rank, bits.end(), std::greater<uint32_t>());

  // Candidates (indices with |x| >= threshold) compacted in index order.
  const size_t cap = kTopKMaxOverselect * k;
  DeviceBuffer cand(count * sizeof(int32_t), stream);
  DeviceBuffer num(sizeof(int), stream);
  BRAID_CUDA_TRY(cand.error());
  BRAID_CUDA_TRY(num.error());
  thrust::counting_iterator<int32_t> ids(0);
  const AtLeast<T> pred{in, bits[rank]};
  size_t temp_bytes = 0;
  BRAID_CUDA_TRY(cub::DeviceSelect::If(nullptr, temp_bytes, ids, cand.as<int32_t>(), num.as<int>(),
                                       static_cast<int>(count), pred, stream));
  DeviceBuffer temp(temp_bytes, stream);
  BRAID_CUDA_TRY(temp.error());
  BRAID_CUDA_TRY(cub::DeviceSelect::If(temp.as<void>(), temp_bytes, ids, cand.as<int32_t>(), num.as<int>(),
                                       static_cast<int>(count), pred, stream));
  int selected = 0;
  BRAID_CUDA_TRY(cudaMemcpyAsync(&selected, num.as<int>(), sizeof(int), cudaMemcpyDeviceToHost, stream));
  BRAID_CUDA_TRY(cudaStreamSynchronize(stream));
  const size_t c = static_cast<size_t>(selected);
  if (c < k || c > cap) return exact_on_host(dtype, in, count, k, values, indices, stream);

  // Trim on the host: order the c candidates as the CPU does and keep k.
  DeviceBuffer mags(c * sizeof(float), stream);
  BRAID_CUDA_TRY(mags.error());
  gather_kernel<T><<<grid_for(c), kThreads, 0, stream>>>(in, cand.as<int32_t>(), c, mags.as<float>());
  std::vector<int32_t> hi(c);
  std::vector<float> hm(c);
  BRAID_CUDA_TRY(cudaMemcpyAsync(hi.data(), cand.as<int32_t>(), c * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  BRAID_CUDA_TRY(cudaMemcpyAsync(hm.data(), mags.as<float>(), c * sizeof(float), cudaMemcpyDeviceToHost, stream));
  BRAID_CUDA_TRY(cudaStreamSynchronize(stream));
  std::vector<int32_t> keep(k);
  std::vector<float> kept_mags(k);
  top_k_trim(hm.data(), hi.data(), c, k, kept_mags.data(), keep.data());
  BRAID_CUDA_TRY(cudaMemcpyAsync(indices, keep.data(), k * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  values_kernel<T><<<grid_for(k), kThreads, 0, stream>>>(in, indices, k, values);
  BRAID_CUDA_TRY(cudaGetLastError());
  *path = TopKPath::kSampled;
  return cudaStreamSynchronize(stream);  // `keep` must outlive the copy
}

}  // namespace

cudaError_t top_k_select(DType dtype, const void* in, size_t count, size_t k, float* values, int32_t* indices,
                         TopKPath* path, cudaStream_t stream) {
  k = std::min(k, count);
  *path = TopKPath::kExact;
  if (k == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return select_typed(dtype, static_cast<const float*>(in), count, k, values, indices, path, stream);
    case DType::kBFloat16:
      return select_typed(dtype, static_cast<const __nv_bfloat16*>(in), count, k, values, indices, path, stream);
    case DType::kFloat16:
      return select_typed(dtype, static_cast<const __half*>(in), count, k, values, indices, path, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t scatter_add(float* acc, const int32_t* indices, const float* values, size_t k, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  scatter_add_kernel<<<grid_for(k), kThreads, 0, stream>>>(acc, indices, values, k);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace braid
