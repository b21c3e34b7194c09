// CudaCopyEngine: the staging pipeline's lanes as two CUDA streams (one per copy direction, so that
// the GPU's copy engines run a copy to the host and a copy back at once).
#include "cuda_copy_engine.h"

#include <stdexcept>
#include <string>

#include "../cuda_call.h"

namespace braid {
namespace cuda {
namespace {

constexpr const char* kWho = "braid staging";

void check(cudaError_t e, const std::string& what) { check_call(e, kWho, what); }

// The engine's device current for a scope (cuda_call.h).
class Scope : public DeviceScope {
 public:
  explicit Scope(int device) : DeviceScope(device, kWho) {}
};

}  // namespace

CudaCopyEngine::CudaCopyEngine(int device, cudaStream_t to_host, cudaStream_t to_device)
    : device_(device), streams_{to_host, to_device} {
  Scope scope(device_);
}

CudaCopyEngine::~CudaCopyEngine() {
  // Errors are ignored: at interpreter exit the runtime may already be shutting down.
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  cudaSetDevice(device_);
  for (cudaStream_t s : streams_) cudaStreamSynchronize(s);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  if (host_ != nullptr) cudaFreeHost(host_);
  cudaSetDevice(previous);
}

char* CudaCopyEngine::prepare(size_t bytes, int events) {
  Scope scope(device_);
  if (bytes > host_bytes_) {
    // Queued copies may still use the old memory: both lanes finish first.
    for (cudaStream_t s : streams_) check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    if (host_ != nullptr) check(cudaFreeHost(host_), "cudaFreeHost");
    host_ = nullptr;
    host_bytes_ = 0;
    void* p = nullptr;
    check(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "cudaHostAlloc of the staging buffers");
    host_ = static_cast<char*>(p);
    host_bytes_ = bytes;
  }
  while (static_cast<int>(events_.size()) < events) {
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    events_.push_back(e);
  }
  return host_;
}

void CudaCopyEngine::copy(Lane lane, void* dst, const void* src, size_t bytes) {
  Scope scope(device_);
  const cudaMemcpyKind kind = lane == Lane::kToHost ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  check(cudaMemcpyAsync(dst, src, bytes, kind, stream(lane)), "cudaMemcpyAsync");
}

void CudaCopyEngine::record(int event, Lane lane) {
  Scope scope(device_);
  check(cudaEventRecord(events_.at(static_cast<size_t>(event)), stream(lane)), "cudaEventRecord");
}

void CudaCopyEngine::wait(Lane lane, int event) {
  Scope scope(device_);
  // An event never recorded makes the wait a no-op, as the interface asks.
  check(cudaStreamWaitEvent(stream(lane), events_.at(static_cast<size_t>(event)), 0), "cudaStreamWaitEvent");
}

void CudaCopyEngine::synchronize(int event) {
  Scope scope(device_);
  check(cudaEventSynchronize(events_.at(static_cast<size_t>(event))), "a staging copy");
}

void CudaCopyEngine::drain() noexcept {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  cudaSetDevice(device_);
  for (cudaStream_t s : streams_) cudaStreamSynchronize(s);
  cudaGetLastError();  // clears a non-sticky error; a sticky one stays with the context
  cudaSetDevice(previous);
}

CudaEvent::CudaEvent(int device) : device_(device) {
  Scope scope(device_);
  check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
}

CudaEvent::~CudaEvent() { cudaEventDestroy(event_); }

void CudaEvent::record(cudaStream_t stream) {
  Scope scope(device_);
  check(cudaEventRecord(event_, stream), "cudaEventRecord");
}

void CudaEvent::block(cudaStream_t stream) const {
  Scope scope(device_);
  check(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

}  // namespace cuda
}  // namespace braid
