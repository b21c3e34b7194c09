// The staging pipeline's copy engine on a GPU (core/staging.h): two CUDA streams as lanes, CUDA
// events, pinned host memory. Torch-free: raw pointers, cudaStream_t, cudaEvent_t.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "../../core/staging.h"

namespace braid {
namespace cuda {

class CudaCopyEngine final : public CopyEngine {
 public:
  // Lanes on `to_host` and `to_device`, streams of device `device` that the caller owns and keeps
  // alive for the engine's lifetime (the binding takes them from torch's stream pool). Throws
  // std::runtime_error when the device cannot be selected.
  CudaCopyEngine(int device, cudaStream_t to_host, cudaStream_t to_device);
  ~CudaCopyEngine() override;
  CudaCopyEngine(const CudaCopyEngine&) = delete;
  CudaCopyEngine& operator=(const CudaCopyEngine&) = delete;

  char* prepare(size_t bytes, int events) override;
  void copy(Lane lane, void* dst, const void* src, size_t bytes) override;
  void record(int event, Lane lane) override;
  void wait(Lane lane, int event) override;
  void synchronize(int event) override;
  void drain() noexcept override;

  int device() const { return device_; }
  cudaStream_t stream(Lane lane) const { return streams_[static_cast<int>(lane)]; }

 private:
  int device_;
  cudaStream_t streams_[2];
  char* host_ = nullptr;  // pinned (cudaHostAlloc), host_bytes_ long
  size_t host_bytes_ = 0;
  std::vector<cudaEvent_t> events_;
};

// One event of device `device` (no timing): a stream records it, other streams wait for it.
class CudaEvent {
 public:
  explicit CudaEvent(int device);
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  void record(cudaStream_t stream);
  // Makes `stream` wait, without blocking the caller, for the latest record (none: no wait).
  void block(cudaStream_t stream) const;

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

}  // namespace cuda
}  // namespace braid
