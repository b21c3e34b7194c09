// The staging resources of a CUDA device (CUDA builds only): two copy lanes and the copy engine over
// them, used by the Communicator's calls on CUDA tensors and by the c10d backend's.
#pragma once

#ifdef BRAID_WITH_CUDA

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDAStream.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "../core/staging.h"
#include "../cuda/staging/cuda_copy_engine.h"
#include "cuda_ipc.h"

namespace braid {

// What a communicator needs per CUDA device: the lanes' streams (from torch's pool, so that
// torch's tools see them), the copy engine over them and the pipeline's options.
class CudaStager {
 public:
  CudaStager(int device, StagingOptions options)
      : device_(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)),
        to_host_(c10::cuda::getStreamFromPool(false, device_.index())),
        to_device_(c10::cuda::getStreamFromPool(false, device_.index())),
        options_(options) {
    options_.validate();
    engine_ = std::make_shared<cuda::CudaCopyEngine>(device, to_host_.stream(), to_device_.stream());
  }

  const c10::Device& device() const { return device_; }
  const c10::cuda::CUDAStream& lane(Lane l) const { return l == Lane::kToHost ? to_host_ : to_device_; }
  const std::shared_ptr<cuda::CudaCopyEngine>& engine() const { return engine_; }
  const StagingOptions& options() const { return options_; }

 private:
  c10::Device device_;
  c10::cuda::CUDAStream to_host_, to_device_;
  StagingOptions options_;
  std::shared_ptr<cuda::CudaCopyEngine> engine_;
};

// One stager per device, made on its first call with `options` (by default the BRAID_STAGING_*
// variables: every rank reads the same, and the pipeline needs equal options on every rank;
// validated here, std::invalid_argument naming the knob). c10d calls come from any thread: the
// map is guarded.
class CudaStagers {
 public:
  explicit CudaStagers(StagingOptions options = StagingOptions::from_env()) : options_(options) {
    options_.validate();
  }

  std::shared_ptr<CudaStager> get(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = by_device_[device];
    if (s == nullptr) s = std::make_shared<CudaStager>(device, options_);
    return s;
  }

  // The device-to-device path's channels (cuda_ipc.h), beside the staging pipelines.
  CudaIpcChannels& ipc() { return ipc_; }

 private:
  CudaIpcChannels ipc_;
  StagingOptions options_;
  std::mutex mu_;  // guards by_device_
  std::map<c10::DeviceIndex, std::shared_ptr<CudaStager>> by_device_;
};

// The staging pipelines of communicator `c`, kept in c.device_staging(): made at the first call
// that needs them with the BRAID_STAGING_* options unless set_stagers() made them first. The
// Python module's calls and the c10d backend's share them; c10d calls come from any thread, so
// the first making is guarded.
CudaStagers& stagers_of(Communicator& c);
// Replaces the pipelines of `c` with ones of `options` (validated: std::invalid_argument), before
// its first call on CUDA tensors.
void set_stagers(Communicator& c, StagingOptions options);

// One call on CUDA tensors of a stager's device: its requests (pointers into device memory, in
// issue order), every tensor they point into or `finish` touches, and `finish`, which runs after
// the last request's copies back are queued (copies into the caller's tensors, an event).
struct DeviceCall {
  std::vector<Request> requests;
  std::vector<at::Tensor> used;
  std::function<void()> finish;
};

// Submits `call` to the pipeline of `s` as tasks of `comm` (one per request, in issue order),
// ordered after the caller's current stream: both lanes wait for an event recorded there now.
// The tensors in `call.used` are recordStream'ed on both lanes, so the caching allocator cannot
// hand their memory to anyone else before the lanes are done with it, even if the caller drops
// them at once. `finish` runs on the executing thread with the copy-back lane as current stream.
// Returns the last request's work (null when `async` is false: it then returned once done).
std::shared_ptr<Work> submit_device_call(Communicator& comm, const CudaStager& s, DeviceCall call, bool async);

// The future of a staged call whose last request's work is `w`: devices=[the lane's device],
// completed as complete_with does but with `lane` as the current stream, so that it records its
// events there and whoever waits on it or chains on it is ordered after what the lane queued
// before (the copies back). A blocking call (`w` null, already done) gets a completed future, and
// the caller's current stream already waits for it.
c10::intrusive_ptr<c10::ivalue::Future> lane_future(const std::shared_ptr<Work>& w, const c10::cuda::CUDAStream& lane,
                                                    std::vector<at::Tensor> outputs);

}  // namespace braid

#endif  // BRAID_WITH_CUDA
