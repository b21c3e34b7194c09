// CUDA top-k: the same sampled threshold as the CPU (same sample positions), candidates above it
// compacted in index order, and the trim to exactly k, all on the device: the order statistics
// (the sample's threshold, the k-th largest candidate magnitude) come from two 16-bit radix
// histogram passes each, and the trim keeps what is above the k-th magnitude plus its
// lowest-index ties, as the CPU's top_k_trim does. The host reads one number, the candidate
// count, which decides the path. When the sample misleads, the exact CPU selection runs on a
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

// Magnitudes are compared as the bits of |x|, the CPU's order, in which a NaN is above every number.
template <class T>
__device__ __forceinline__ uint32_t magnitude_bits(const T* in, size_t i) {
  return __float_as_uint(fabsf(load_f32(in, i)));
}

// An order statistic in progress on the device: find it, in a histogram of the high 16 bits, then
// of the low 16 bits of the values in the bin found. `need` starts as the statistic's rank from
// the top (1: the largest) and ends as the number of values equal to `bits` that rank at or above
// it; `limit` is set by the trim (the index of the last tie kept).
struct RankState {
  uint32_t high;
  uint32_t bits;
  uint32_t need;
  int32_t limit;
};

constexpr unsigned kRadixBins = 1u << 16;
constexpr unsigned kFindThreads = 1024;  // the single block that walks the histogram

__global__ void rank_init_kernel(RankState* st, uint32_t need) {
  st->high = 0;
  st->bits = 0;
  st->need = need;
  st->limit = -1;
}

// The bits of a sample that sample_kernel already took the magnitudes of.
struct SampleBits {
  const float* sample;
  __device__ uint32_t operator()(size_t j) const { return __float_as_uint(sample[j]); }
};

// The magnitude bits of the candidates (indices into the input).
template <class T>
struct CandidateBits {
  const T* in;
  const int32_t* cand;
  __device__ uint32_t operator()(size_t j) const { return magnitude_bits(in, static_cast<size_t>(cand[j])); }
};

// Pass 0 counts every value by its high half; pass 1 counts the low halves of the values whose
// high half is the one pass 0 found.
template <class Bits>
__global__ void radix_histogram_kernel(Bits bits, size_t n, const RankState* __restrict__ st, int pass,
                                       uint32_t* __restrict__ hist) {
  const uint32_t high = pass == 0 ? 0 : st->high;
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < n; j += stride()) {
    const uint32_t u = bits(j);
    if (pass == 0) atomicAdd(&hist[u >> 16], 1u);
    else if ((u >> 16) == high) atomicAdd(&hist[u & 0xffffu], 1u);
  }
}

// One block of kFindThreads: thread t sums the t-th run of bins from the top, then thread 0 walks
// the runs and the bins of the run that holds the statistic, leaving in `need` how many of the
// bin's values are still to be taken.
__global__ void radix_find_kernel(const uint32_t* __restrict__ hist, RankState* st, int pass) {
  constexpr unsigned per = kRadixBins / kFindThreads;
  __shared__ uint32_t run[kFindThreads];
  const unsigned top = kRadixBins - per * threadIdx.x;  // this thread's bins: [top - per, top)
  uint32_t sum = 0;
  for (unsigned b = top - per; b < top; ++b) sum += hist[b];
  run[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x != 0) return;
  uint32_t need = st->need;
  unsigned r = 0;
  while (r + 1 < kFindThreads && run[r] < need) need -= run[r++];
  unsigned b = kRadixBins - per * r - 1;
  while (b > kRadixBins - per * (r + 1) && hist[b] < need) need -= hist[b--];
  if (pass == 0) {
    st->high = b;
  } else {
    st->bits = (st->high << 16) | b;
  }
  st->need = need;
}

// The statistic of `n` values given by `bits`, into st->bits (and st->need): two histogram passes.
template <class Bits>
cudaError_t radix_select(Bits bits, size_t n, uint32_t rank_from_top, RankState* st, uint32_t* hist,
                         cudaStream_t stream) {
  rank_init_kernel<<<1, 1, 0, stream>>>(st, rank_from_top);
  for (int pass = 0; pass < 2; ++pass) {
    const cudaError_t e = cudaMemsetAsync(hist, 0, kRadixBins * sizeof(uint32_t), stream);
    if (e != cudaSuccess) return e;
    radix_histogram_kernel<Bits><<<grid_for(n), kThreads, 0, stream>>>(bits, n, st, pass, hist);
    radix_find_kernel<<<1, kFindThreads, 0, stream>>>(hist, st, pass);
  }
  return cudaGetLastError();
}

template <class T>
__global__ void sample_kernel(const T* __restrict__ in, size_t stride, float* __restrict__ out) {
  const size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (j < kTopKSample) out[j] = fabsf(load_f32(in, top_k_sample_index(j, stride)));
}

// Magnitude at least the sampled threshold (read on the device).
template <class T>
struct AtLeast {
  const T* in;
  const RankState* thr;
  __device__ bool operator()(int32_t i) const { return magnitude_bits(in, static_cast<size_t>(i)) >= thr->bits; }
};

// Magnitude equal to the k-th largest: the ties, in index order.
template <class T>
struct EqualTo {
  const T* in;
  const RankState* kth;
  __device__ bool operator()(int32_t i) const { return magnitude_bits(in, static_cast<size_t>(i)) == kth->bits; }
};

// What the trim keeps: above the k-th magnitude, or equal to it at an index up to the last tie kept.
template <class T>
struct Kept {
  const T* in;
  const RankState* kth;
  __device__ bool operator()(int32_t i) const {
    const uint32_t u = magnitude_bits(in, static_cast<size_t>(i));
    return u > kth->bits || (u == kth->bits && i <= kth->limit);
  }
};

// The index of the last tie kept: the need-th tie in index order.
__global__ void last_tie_kernel(const int32_t* __restrict__ ties, RankState* st) { st->limit = ties[st->need - 1]; }

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

// Temporary storage of cub::DeviceSelect::If over `n` items, for the largest of the calls below.
template <class In, class Pred>
cudaError_t select_bytes(In in, int32_t* out, int* num, size_t n, Pred pred, size_t* bytes, cudaStream_t stream) {
  size_t b = 0;
  const cudaError_t e = cub::DeviceSelect::If(nullptr, b, in, out, num, static_cast<int>(n), pred, stream);
  *bytes = std::max(*bytes, b);
  return e;
}

template <class T>
cudaError_t select_typed(DType dtype, const T* in, size_t count, size_t k, float* values, int32_t* indices,
                         TopKPath* path, cudaStream_t stream) {
  *path = TopKPath::kExact;
  size_t rank = 0, stride = 0;
  if (!top_k_sampled(count, k, &rank, &stride)) return exact_on_host(dtype, in, count, k, values, indices, stream);

  DeviceBuffer state(2 * sizeof(RankState), stream);
  DeviceBuffer hist(kRadixBins * sizeof(uint32_t), stream);
  DeviceBuffer sample(kTopKSample * sizeof(float), stream);
  DeviceBuffer cand(count * sizeof(int32_t), stream);
  DeviceBuffer num(sizeof(int), stream);
  for (const DeviceBuffer* b : {&state, &hist, &sample, &cand, &num}) BRAID_CUDA_TRY(b->error());
  RankState* thr = state.as<RankState>();
  RankState* kth = thr + 1;

  // Threshold: the same order statistic of the same sample as the CPU (rank counts from 0).
  sample_kernel<T><<<static_cast<unsigned>((kTopKSample + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      in, stride, sample.as<float>());
  BRAID_CUDA_TRY(radix_select(SampleBits{sample.as<float>()}, kTopKSample, static_cast<uint32_t>(rank + 1), thr,
                              hist.as<uint32_t>(), stream));

  // Candidates (indices with |x| >= threshold) compacted in index order; their count decides the path.
  thrust::counting_iterator<int32_t> ids(0);
  const AtLeast<T> at_least{in, thr};
  const EqualTo<T> equal{in, kth};
  const Kept<T> kept{in, kth};
  size_t temp_bytes = 0;
  BRAID_CUDA_TRY(select_bytes(ids, cand.as<int32_t>(), num.as<int>(), count, at_least, &temp_bytes, stream));
  // (The ties' buffer is sized once the candidates are counted; the query needs only the types.)
  BRAID_CUDA_TRY(select_bytes(cand.as<int32_t>(), indices, num.as<int>(), count, equal, &temp_bytes, stream));
  BRAID_CUDA_TRY(select_bytes(cand.as<int32_t>(), indices, num.as<int>(), count, kept, &temp_bytes, stream));
  DeviceBuffer temp(temp_bytes, stream);
  BRAID_CUDA_TRY(temp.error());
  BRAID_CUDA_TRY(cub::DeviceSelect::If(temp.as<void>(), temp_bytes, ids, cand.as<int32_t>(), num.as<int>(),
                                       static_cast<int>(count), at_least, stream));
  int selected = 0;
  BRAID_CUDA_TRY(cudaMemcpyAsync(&selected, num.as<int>(), sizeof(int), cudaMemcpyDeviceToHost, stream));
  BRAID_CUDA_TRY(cudaStreamSynchronize(stream));
  const size_t c = static_cast<size_t>(selected);
  if (c < k || c > kTopKMaxOverselect * k) return exact_on_host(dtype, in, count, k, values, indices, stream);

  if (c == k) {
    BRAID_CUDA_TRY(cudaMemcpyAsync(indices, cand.as<int32_t>(), k * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream));
  } else {
    // The trim: the k-th largest candidate magnitude, its ties in index order, the last tie kept,
    // then everything kept, in index order, straight into `indices` (exactly k of them).
    DeviceBuffer ties(c * sizeof(int32_t), stream);
    BRAID_CUDA_TRY(ties.error());
    BRAID_CUDA_TRY(radix_select(CandidateBits<T>{in, cand.as<int32_t>()}, c, static_cast<uint32_t>(k), kth,
                                hist.as<uint32_t>(), stream));
    BRAID_CUDA_TRY(cub::DeviceSelect::If(temp.as<void>(), temp_bytes, cand.as<int32_t>(), ties.as<int32_t>(),
                                         num.as<int>(), static_cast<int>(c), equal, stream));
    last_tie_kernel<<<1, 1, 0, stream>>>(ties.as<int32_t>(), kth);
    BRAID_CUDA_TRY(cub::DeviceSelect::If(temp.as<void>(), temp_bytes, cand.as<int32_t>(), indices, num.as<int>(),
                                         static_cast<int>(c), kept, stream));
  }
  values_kernel<T><<<grid_for(k), kThreads, 0, stream>>>(in, indices, k, values);
  BRAID_CUDA_TRY(cudaGetLastError());
  *path = TopKPath::kSampled;
  return cudaSuccess;
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
